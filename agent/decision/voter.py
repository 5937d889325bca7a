"""A voter's own check of a proposed table (the commit backend's verifier): the table is valid, and unless an
operator forced it or it repairs lost ranks, this node's own replay of the windows the proposer planned on
agrees with the proposer's gain (within `verify_tolerance`). A rebalance must also pass the proposer's own
significance rule on this node's replay: its gain's lower confidence bound over the replay rows
(`verify.gain_bound` at `DecisionParams.gain_confidence`) above 0, else GAIN_NOT_SIGNIFICANT. The step time a
rebalance was judged with (Plan.load_ms) must be within STEP_TIME_TOLERANCE of the one this node fits from the
same gossiped windows (controlplane.steptime.agrees), where both are fitted: the voters judge with one figure."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from agent.wire import plan_forced, plan_kind
from controlplane.errors import ControlPlaneError
from controlplane.params import DecisionParams
from controlplane.steptime import StepTime, StepTimeSource, agrees
from controlplane.table import RoutingTable
from controlplane.verify import STEP_TIME_DISAGREES, same_mix, verify_decision, verify_windows
from elasticmoe.v1 import consensus_pb2 as cpb

# how far a proposer's step time may be from this node's own fit (relative): both fit the same gossiped windows,
# and differ only where one holds a window the other does not yet (a node that restarted, or lags a window)
STEP_TIME_TOLERANCE = 0.25


class Voter:
    def __init__(self, params: DecisionParams, tolerance: float) -> None:
        self.params, self.tolerance = params, tolerance
        self.own_step_time: Callable[[], StepTime] | None = None  # this node's controller's (agent.decision.pipeline)
        self.replay: list[npt.NDArray[np.uint64]] = []  # the last closed cluster windows' totals, uint64 [L, E]
        self.rows: list[npt.NDArray[np.uint32]] = []  # ... their per-step rows [S, L, E] (pipeline.window_rows)
        self.seqs: list[int] = []  # ... and their window numbers

    def remember(self, seq: int, total: npt.NDArray[np.uint64], rows: npt.NDArray[np.uint32]) -> None:
        """A closed cluster window: its totals and the rows the controller sees of it (the last
        `replay_windows` are kept)."""
        keep = self.params.replay_windows
        self.replay = (self.replay + [total])[-keep:]
        self.rows = (self.rows + [rows])[-keep:]
        self.seqs = (self.seqs + [seq])[-keep:]

    def verify(self, head: RoutingTable, proposed: RoutingTable, plan: cpb.Plan) -> tuple[bool, float, str]:
        """(accept, this node's gain, why)."""
        try:
            proposed.validate()
        except ControlPlaneError as e:
            return False, 0.0, str(e)
        if plan_forced(plan) or plan_kind(plan) == "repair" or not self.replay:
            # forced by an operator, a repair, or nothing to replay yet: validity is the whole check, and the
            # proposer's figure stands (there is no own figure to compare it with)
            return True, plan.verified_gain, "validity only"
        if plan_kind(plan) == "rebalance" and plan.load_ms > 0 and self.own_step_time is not None:
            own = self.own_step_time()
            if own.source in (StepTimeSource.FITTED, StepTimeSource.BOUNDED) and not agrees(plan.load_ms, own, STEP_TIME_TOLERANCE):
                return False, 0.0, (f"{STEP_TIME_DISAGREES}: step time {plan.load_ms:.4g} ms: this node fits {own.load_ms:.4g} ms ({own.why}), "
                                    f"more than {STEP_TIME_TOLERANCE:g} apart")
        replay = self.span(plan.replay_from_step, plan.replay_to_step)
        if replay is None:  # none of the windows the proposer replayed is here: validity is the whole check
            return True, plan.verified_gain, "validity only (replay span not held here)"
        # replay only the windows since the last change of expert mix, as the proposer planned on them
        # a rollback goes back to a parent the cluster committed and verified before: refused only if this
        # node's replay shows it clearly worse (windows differ between nodes while members restart, and a
        # refused rollback leaves in place a change that realised worse)
        rollback = plan_kind(plan) == "rollback"
        floor = -self.tolerance if rollback else max(0.0, min(self.params.tau, plan.verified_gain) - self.tolerance)
        # a rollback is judged on exactly the windows observed since its change, as the controller judged it
        # (decision.rollback): cut at the newest drift, they may be the one window the change was right on
        moving = False
        if not rollback:  # the windows since the newest drift (the last two while the mix still moves), as the
            # proposer verified on them: judged on the windows held here up to the span's end, for the context
            W, hi = self.params.window, plan.replay_to_step
            upto = [r for q, r in zip(self.seqs, self.rows, strict=True) if hi <= plan.replay_from_step or q * W < hi]
            totals = np.stack([r.sum(axis=0, dtype=np.int64) for r in upto])
            keep = verify_windows(totals, self.params.drift_tv)
            moving = keep > same_mix(totals, self.params.drift_tv)  # then the gain must hold across the windows
            replay = replay[max(0, len(replay) - keep):]
        # a rebalance must hold beyond the spread of the replay rows, as its proposer's gate asks
        # (decision.rebalance); an operator's proposal or a restored rank's fill (kind manual) and a rollback
        # are not held to it
        confidence = self.params.gain_confidence if plan_kind(plan) == "rebalance" else 0.5
        ok, gain, reason = verify_decision(head, proposed, np.concatenate(replay, axis=0), floor,
                                           confidence=confidence,
                                           blocks=[len(r) for r in replay] if not rollback and moving else ())
        # a rebalance's gain here must also agree with the proposer's (a rollback's need not: above)
        if ok and not rollback and plan.verified_gain - gain > self.tolerance:
            return False, gain, (f"replay gain {gain:.4f} is below the proposer's {plan.verified_gain:.4f} by more "
                                 f"than verify_tolerance {self.tolerance}")
        return ok, gain, reason

    def span(self, lo: int, hi: int) -> list[npt.NDArray[np.uint32]] | None:
        """The rows of the replay windows whose first step lies in the proposer's span [lo, hi) (the same
        windows its controller verified on), a [S, L, E] array a window; all of them when the plan names no
        span, None when none is held."""
        if hi <= lo:
            return list(self.rows)
        W = self.params.window
        picked = [r for s, r in zip(self.seqs, self.rows, strict=True) if lo <= s * W < hi]
        return picked or None
