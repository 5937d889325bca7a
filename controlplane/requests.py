"""PlanRequest: a decision for someone else to compute (a controller with `defer_plans`, controlplane.controller).

The controller hands one out in its Ready, the caller runs `run()` where it likes (the agent: on a worker
thread, agent.decision.offloop) and hands the Attempt back as PlanReady(request, attempt). `run()` is a pure function
of the request: the head, a snapshot of the replay windows, the knobs and what the kind needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from controlplane.decision import Attempt, rebalance, repair, rollback
from controlplane.errors import ControlPlaneError
from controlplane.monitor import ReplayBuffer
from controlplane.params import DecisionParams
from controlplane.profile import StabilityProfile
from controlplane.restore import fill_restored
from controlplane.table import RoutingTable

KINDS = ("rebalance", "repair", "rollback", "fill")


@dataclass(frozen=True, eq=False)
class PlanRequest:
    """What the controller saw when window `seq` closed (or the event came), and which decision to compute on
    it (`kind`): a rebalance (controlplane.decision.rebalance), the repair of the `lost` ranks (`repair`), the
    rollback to `target`'s placement judged on the `last` windows (`rollback`), or the experts for the `ranks`
    this controller's restore returned in `restore_version` (controlplane.restore.fill_restored; `lost`: the
    ranks lost meanwhile, whose repair comes first)."""

    seq: int
    head: RoutingTable
    buffer: ReplayBuffer  # a snapshot (ReplayBuffer.snapshot): the controller's own takes new windows meanwhile
    params: DecisionParams
    profile: StabilityProfile | None
    cooldown: npt.NDArray[np.bool_]
    trigger: str
    low: bool  # planned under theta on the cost-benefit trigger (a refusal backs it off)
    imbalance: float
    kind: str = "rebalance"  # one of KINDS
    lost: tuple[int, ...] = ()  # repair, fill: the ranks lost, sorted
    target: RoutingTable | None = None  # rollback: the placement to return to (the change's parent)
    last: int | None = None  # rollback: the windows it is judged on
    ranks: tuple[int, ...] = ()  # fill: the ranks restored
    restore_version: int = 0  # fill: the version that restored them

    def __post_init__(self) -> None:
        if self.kind not in KINDS or (self.kind == "rollback") != (self.target is not None):
            raise ControlPlaneError(f"plan request of kind {self.kind!r} with target "
                                    f"{'set' if self.target is not None else 'unset'}: expected one of {KINDS}, "
                                    "a target exactly for a rollback")

    def run(self) -> Attempt:
        if self.kind == "repair":
            return repair(self.head, list(self.lost), self.buffer, self.params)
        if self.kind == "rollback" and self.target is not None:
            return rollback(self.head, self.target, self.buffer, self.params, self.trigger, last=self.last)
        if self.kind == "fill":
            return fill_restored(self.head, self.ranks, self.restore_version, self.lost, self.buffer, self.params,
                                 self.cooldown)
        return rebalance(self.head, self.buffer, self.params, self.profile, self.cooldown, self.trigger)


def stale(req: PlanRequest, head: int, inflight: int | None, paused: bool, observing: bool, lost: tuple[int, ...],
          due: RoutingTable | None) -> str:
    """Why the answer to `req` must not be proposed now ('' if it may), given the controller's head version, its
    proposal in flight (its version), whether it is paused or observing a change, the ranks lost (sorted) and the
    target of the rollback due. A repair, rollback or fill is proposed even while paused (it restores a valid
    table, or undoes a change that realised worse)."""
    if head != req.head.version:
        return f"the head moved to v{head} while it was computed"
    if inflight is not None:
        return f"v{inflight} was proposed meanwhile"
    if req.kind == "rebalance":
        return (f"ranks {list(lost)} were lost meanwhile: their repair comes first" if lost
                else "decisions were paused meanwhile" if paused
                else "a change is under observation" if observing else "")
    if req.kind in ("repair", "fill") and req.lost != lost:
        return f"the lost ranks are {list(lost)} now"
    if req.kind == "rollback" and due is not req.target:
        return "the rollback is no longer due"
    return ""
