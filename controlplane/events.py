"""The decision controller's input events (controlplane.controller.Controller.step takes one at a time)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from controlplane.ops import Operation
from controlplane.table import RoutingTable

if TYPE_CHECKING:
    from controlplane.decision import Attempt
    from controlplane.requests import PlanRequest


@dataclass(frozen=True)
class WindowClosed:
    """Cluster-wide counts of one window of `span` steps (0: as many as rows): steps uint32 [T, L, E], each row
    one step's counts. Its one caller, agent.decision.pipeline.DecisionPipeline (which the agents and `emoe bench` both
    run), gives the window's sampled steps (elasticmoe.loadcodec: every `sample_every`-th step, summed over the
    nodes as gossip carries them), or, where an engine sends no samples, one row of the window's mean step:
    what the estimate, the replay and the rollback judge see of the per-step spread (tests may give every
    step). `planner`: the node that plans this window when it is another one (this controller observes, and
    keeps its budget spent for when the turn comes to it); empty: this controller plans. `backup`: this node's
    place after the planner in the turn order, the windows a due rollback waits before it proposes it itself.
    `step_us` [T]: the engines' wall time of each of `steps`' rows in microseconds (LoadWindow.step_us, the
    longest over the nodes), from which the controller fits its step time (controlplane.steptime); None: not
    measured (or `steps` is the mean row)."""

    window_seq: int
    first_step: int
    steps: npt.NDArray[np.uint32]
    planner: str = ""
    backup: int = 1
    span: int = 0
    step_us: npt.NDArray[np.uint32] | None = None
    # [T]: the table version each of `steps`' rows ran on (LoadWindow.step_version, the oldest over the nodes);
    # None: not known (engines that do not say, or `step_us` None)
    step_version: npt.NDArray[np.uint32] | None = None
    # [T]: the mean wall time of the steps each of `steps`' rows stands for (itself and those up to the next
    # sampled one: LoadWindow.stride_us, the longest over the nodes); None: not measured (or `step_us` None)
    stride_us: npt.NDArray[np.uint32] | None = None


@dataclass(frozen=True)
class TableCommitted:
    """A table committed by quorum. kind: the committed plan's kind when known ("rebalance", "rollback",
    "manual", "repair"); agent.wire.plan_kind(plan) gives it for a plan from another proposer."""

    table: RoutingTable
    kind: str = "rebalance"
    # the newest window reported when this node learned of the commit (-1: not known): the window open at the
    # commit is the one after it, so the change is judged from the window after that
    newest_window: int = -1


@dataclass(frozen=True)
class ProposalFailed:
    version: int
    reason: str


@dataclass(frozen=True)
class ManualProposal:
    ops: tuple[Operation, ...]
    force: bool = False
    why: str = ""  # who asks, when not an operator (the trigger says so): e.g. a node restoring its own rank


@dataclass(frozen=True)
class RanksLost:
    """Ranks found dead (membership): drain them and re-home their lone experts. `planner`: as in WindowClosed,
    the node whose turn it is when it is another one (that node repairs at once; this one waits a window)."""

    ranks: tuple[int, ...]
    planner: str = ""


@dataclass(frozen=True)
class SetPaused:
    paused: bool


@dataclass(frozen=True)
class PlanReady:
    """What `request.run()` returned (a controller that defers its plans handed the request out in its Ready):
    proposed if the controller is still where it was when it asked (same head, nothing in flight, not paused,
    no change under observation), else dropped as STALE_PLAN."""

    request: PlanRequest
    attempt: Attempt


Event = WindowClosed | TableCommitted | ProposalFailed | ManualProposal | RanksLost | SetPaused | PlanReady


