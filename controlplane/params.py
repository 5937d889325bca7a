"""The decision core's knobs (`DecisionParams`), each with the measured reason for its default, and what they
derive: the cost-benefit test (`worth`), what the planner sees (`knobs`), the polish copy's price
(`polish_charge`), the cost model. The agent's config carries them (agent.config.DecisionConfig); the
estimate-verify-gate functions that read them are controlplane/decision.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.cost import DEEPSEEK_V3_EXPERT_BYTES, CostModel
from controlplane.errors import ControlPlaneError
from controlplane.planners import PLANNERS, PlanKnobs
from controlplane.table import RoutingTable
from controlplane.topology import Tier
from controlplane.worth import Worth

# where the cost-benefit test is off (load_ms 0) a polish copy has no serving time to be priced in: it is charged
# this many times min_op_gain, the factor tuned at DeepSeek-V3 decode at EP64 before the charge was priced
POLISH_UNPRICED_X = 3.0


class InvalidParams(ControlPlaneError):
    code = "INVALID_PARAMS"


@dataclass(frozen=True)
class DecisionParams:
    """Knobs of the decision core (agent.config.DecisionConfig carries the first seven)."""

    window: int = 50  # W steps per window. A drift is seen a window after it starts, and recovery takes about a
    #                   window, the plugins' agreement and the copies: 100 -> 50 took the mean recovery after a
    #                   drift from 213 to 171 steps on 8 runs the cases are not tuned on (ESFT law->intent 2x8 and
    #                   4x8, intent->law->intent, OLMoE two and three domains, DeepSeek-V3 prefill and decode pairs
    #                   reversed; bench, EPLB boot) and lowered mean step imbalance on 7 of the 8
    theta: float = 1.10  # act when step imbalance exceeds this ... (1.15 left ESFT with lanes in lockstep at
    #                      1.126 after the drift, 0.03 above hindsight for the rest of the segment: bench, 16
    #                      ESFT runs, 15 passed at 1.15, 16 at 1.10 with 0.5-1.5 GB more moved; DeepSeek-V3 decode
    #                      unchanged)
    budget_windows: int = 2  # ... for B consecutive windows
    tau: float = 0.02  # minimum verified relative gain of a rebalance
    rollback_windows: int = 3  # N windows after a change before judging it (rolled back if not better)
    max_ops: int = 512  # moves per plan: a bound, not a size; a plan holds the moves that pay (min_op_gain).
    #                     ESFT intent from static EP needs ~250 over 26 layers (16 free slots each)
    replay_windows: int = 3  # windows kept in the replay buffer
    expert_bytes: int = DEEPSEEK_V3_EXPERT_BYTES
    cost_budget_s: float = 0.1  # seconds of copy cost per active rank (cost.CostModel.budget_s is this times
    #                             the active ranks: copies into different ranks run side by side, overlapping
    #                             serving). 16 ranks: 1.6 s (~1,800 NVLink copies of a 17 MB ESFT expert);
    #                             64 ranks: 6.4 s (~7,000 cross-node DeepSeek-V3 copies)
    band: float = 0.05  # tolerance band below theta that holds the error budget's count
    replica_budget: int | None = None  # extra replicas over all layers; None: what the slots allow
    downtime_steps: float = 1.0
    penalty_s: float = 1e-7
    cooldown_windows: int = 10  # experts of a rolled-back change are left alone this many windows
    plan_block: int = 20  # the planner estimates on totals per block of this many rows (0: per window);
    #                       finer blocks see per-step peaks: on ESFT intent, 20 steps verify 0.050 vs 0.039
    # Each copy of a plan must lower its own layer's objective (sum over replay blocks of the max rank load)
    # by min_op_gain: per layer, so a move's worth does not shrink with the model's depth; and pro rata of the
    # layer's slots, so it scales with the pool: rewriting every slot of a layer must gain `repack_gain` of
    # its objective, each copy repack_gain / (slots in the layer). 0.224: 7e-4 a copy at 64 ranks x 5 slots
    # (DeepSeek-V3 decode), 2.8e-3 at 16 x 5 (ESFT). A fixed 7e-4 moved as many bytes after the ESFT drift as
    # one whole EPLB rearrangement (a re-pack of 25 of 26 layers; bench, 16 runs: 9 moved more than 1/5 of
    # periodic EPLB's bytes, none at 2.8e-3). DeepSeek-V3 decode after a workload shift (bench): 5e-4 ->
    # 1.1645 mean step imbalance for 183 GB from an EPLB boot, 453 GB from a static one; 7e-4 -> 1.1643 /
    # 174 GB and 384 GB; 1e-3 -> 1.1684 / 144 GB; 3e-3 -> 1.2091 / 31 GB. min_op_gain set: that, fixed.
    repack_gain: float = 0.224
    min_op_gain: float | None = None
    fast_theta: float = 1.3  # a window this far above theta spends the whole error budget at once: a drift
    #                          (ESFT intent -> law: 1.06 -> 1.83) is fixed one window after it shows
    # Below fast_theta, a window's layers may still be re-packed or exchanged instead of their greedy moves
    # (which may get only part of the way: each move off the hottest rank raises another to the max, and full
    # ranks need swaps; `planners.widen`) where its block objective is polish_theta above an even split, each
    # copied slot charged its serving time: the fraction of its layer's load it must take off, held over the
    # worth horizon, to repay polish_lam x (1 + worth_margin) times the copy's serving time (`polish_charge`; a
    # layer is 1/L of the step's load_ms). Priced, not per slot of the pool: a fixed 3 x min_op_gain charged a 3-layer
    # model's copy 4-24 times more than its serving time (Mixtral 8 experts on 8 ranks, OLMoE at 4x8 with 3
    # slots: stuck 0.04-0.08 above hindsight for whole segments, their full re-packs paying 4x over the horizon)
    # and DeepSeek-V3 decode's 0.6 times less. polish_lam (bench, EPLB boot, ESFT 2x8 and OLMoE 4x8 3-slot,
    # steady and cold start): 1 -> ESFT cold start 44 GB (hindsight 33.5); 4 -> 35 GB; 8 -> 24 GB, OLMoE steady
    # 1.2034 -> 1.1556 (recovery 2000 -> 171 steps), cold 1.2441 -> 1.2119, ESFT steady 1.0849 -> 1.0760;
    # 16 -> OLMoE cold start unchanged
    polish_theta: float = 1.03
    polish_lam: float = 8.0
    drift_tv: float = 0.05  # plan only on the trailing windows whose expert shares (total variation per
    #                         layer, mean) differ by at most this from the next: steady state differs by
    #                         ~0.001, ESFT intent -> law by 0.35; a plan fitted to the old mix would miss
    retarget: bool = True  # after a large drift, let layers take larger deltas (controlplane.retarget)
    planner: str = "greedy"  # who proposes operations: a name in controlplane.planners.PLANNERS
    # the per-step rows a window carries: every sample_every-th step's counts (elasticmoe.loadcodec; 0: none,
    # one row of the window's mean step). The mean alone hides the per-step spread that sets a step's time:
    # DeepSeek-V3 decode at EP144 (bench, EPLB boot) 1.309 mean step imbalance fed window means, 1.2585 fed
    # every 10th step, 1.2571 fed every step; prefill EP32 from a hierarchical EPLB boot: 1.70 (it never
    # acted), 1.076, 1.081
    sample_every: int = 10
    # cost-benefit (controlplane.worth): milliseconds of an engine step that scale with its busiest rank's
    # load (0: off, the theta trigger and the tau gate alone); a plan must repay its copies (1 + worth_margin)
    # times over horizon_windows windows, and under theta a window is planned on when a perfect plan would
    # gain tau. 12 ms: DeepSeek-V3 decode on H200 at EP64 (bench.engine's model: ~12 of a ~30 ms step).
    # The agents fit it from the engines' measured step times (controlplane.steptime, LoadReport.step_us) once
    # enough are in; load_ms is the figure until then, and always where load_ms_override (an operator set it)
    load_ms: float = 12.0
    load_ms_override: bool = False
    horizon_windows: int = 20
    worth_margin: float = 1.0
    # A rebalance must also hold across the replay beyond its rows' own spread: the one-sided lower confidence
    # bound of its gain over the replayed rows (verify.gain_bound: Student's t at this level) must be above 0,
    # or it is refused as GAIN_NOT_SIGNIFICANT; every voter applies the same bound (agent.decision.voter), so it is not
    # an operator's knob. 0.5: off (the bound is the mean). 0.9: in the bench (EPLB boot), four runs whose lanes
    # start in lockstep (--cold-start: ESFT intent->law at 2x8 and 4x8, at 4x8 with seed 1, law->intent) each
    # regressed on its first plan: replayed gain 0.13-0.20 on 5 rows spread 0.27-0.37, realised -0.05 to -0.17
    # over the next 100 steps. Their bounds at 0.9: -0.03 to -0.06 (refused); at 0.8: +0.01 to +0.06 (none
    # refused). No plan the staggered runs committed (ESFT, OLMoE, Mixtral, DeepSeek-V3 8x8: 13 runs) has a bound
    # under +0.016 even at 0.95: those runs are unchanged
    gain_confidence: float = 0.9
    # where load_ms came from, for explain (controlplane.steptime.StepTime.why; "": configured)
    load_ms_source: str = ""
    # what copies cost the steps they overlap over the cost model's charge (cost / ranks), measured from the
    # installs (controlplane.copycost): 1 until the measure's low end rules out that the copies cost as little as
    # charged, then that low end (never lower: from a cold start the measure read low, several times below 0).
    # copy_cost_measured false: the model's charge always (the measure is only said). On by default: on the
    # bench's held-out table (38 runs) no run reached the rule, and it can only make a change dearer
    copy_slowdown: float = 1.0
    copy_cost_measured: bool = True
    copy_slowdown_source: str = ""  # where copy_slowdown came from, for explain ("": the model as it stands)

    def __post_init__(self) -> None:
        for f in ("window", "budget_windows", "rollback_windows", "max_ops", "replay_windows", "expert_bytes"):
            if getattr(self, f) < 1:
                raise InvalidParams(f"{f}={getattr(self, f)!r}: expected an integer >= 1")
        if not self.theta >= 1.0:
            raise InvalidParams(f"theta={self.theta!r}: expected a ratio >= 1.0")
        if not 0.0 <= self.tau < 1.0:
            raise InvalidParams(f"tau={self.tau!r}: expected a fraction in [0, 1)")
        if not 0.0 <= self.band < self.theta:
            raise InvalidParams(f"band={self.band!r}: expected 0 <= band < theta")
        mog = self.min_op_gain if self.min_op_gain is not None else 0.0
        if self.planner not in PLANNERS:
            raise InvalidParams(f"planner={self.planner!r}: expected one of {sorted(PLANNERS)}")
        if not self.fast_theta >= self.theta or not 0.0 <= mog < 1.0 or not self.drift_tv >= 0.0:
            raise InvalidParams(f"fast_theta={self.fast_theta!r}, min_op_gain={self.min_op_gain!r}, "
                                f"drift_tv={self.drift_tv!r}: expected fast_theta >= theta, min_op_gain in [0, 1), "
                                "drift_tv >= 0")
        if not (self.polish_theta == 0.0 or self.polish_theta >= 1.0) or not self.polish_lam >= 0.0:
            raise InvalidParams(f"polish_theta={self.polish_theta!r}, polish_lam={self.polish_lam!r}: expected "
                                "polish_theta >= 1.0 (0: off) and polish_lam >= 0")
        if self.sample_every < 0:
            raise InvalidParams(f"sample_every={self.sample_every!r}: expected >= 0 (0: no sampled steps)")
        if self.cooldown_windows < 0 or self.plan_block < 0:
            raise InvalidParams(f"cooldown_windows={self.cooldown_windows!r}, plan_block={self.plan_block!r}: "
                                "expected >= 0")
        if not 0.0 <= self.repack_gain < 1000.0:
            raise InvalidParams(f"repack_gain={self.repack_gain!r}: expected a fraction >= 0")
        if not self.load_ms >= 0.0 or self.horizon_windows < 1 or not self.worth_margin >= 0.0:
            raise InvalidParams(f"load_ms={self.load_ms!r}, horizon_windows={self.horizon_windows!r}, worth_margin="
                                f"{self.worth_margin!r}: expected load_ms >= 0, horizon_windows >= 1, worth_margin >= 0")
        if not self.copy_slowdown > 0.0:
            raise InvalidParams(f"copy_slowdown={self.copy_slowdown!r}: expected > 0")
        if not 0.5 <= self.gain_confidence < 1.0:
            raise InvalidParams(f"gain_confidence={self.gain_confidence!r}: expected a confidence level in [0.5, 1) "
                                "(0.5: no bound beyond the mean)")
        self.cost_model()  # validates the cost figures

    def worth(self) -> Worth:
        """The cost-benefit test of a plan (controlplane.worth)."""
        return Worth(self.load_ms, self.horizon_windows * self.window, self.worth_margin, self.tau,
                     self.load_ms_source, self.copy_slowdown, self.copy_slowdown_source)

    def knobs(self, head: RoutingTable) -> PlanKnobs:
        """What the planner sees of these knobs (controlplane.planners)."""
        return PlanKnobs(self.max_ops, self.tau, self.op_gain(head), self.fast_theta, self.retarget, self.polish_theta,
                         self.polish_charge(head) / max(self.op_gain(head), 1e-12), self.load_ms > 0)

    def polish_charge(self, head: RoutingTable) -> float:
        """What a polish copy on `head` must take off its own layer's objective, as a fraction of it: its serving
        time priced as the cost-benefit test prices a plan's (controlplane.worth: a copy over the tier it would
        take, one expert between nodes or over NVLink on one node, spread over the active ranks, which copy side
        by side), times polish_lam x (1 + worth_margin), against what the fraction saves over the horizon (a layer
        is 1/L of the step's `load_ms`). Where the cost-benefit test is off (load_ms 0), POLISH_UNPRICED_X x
        min_op_gain."""
        if self.load_ms <= 0:
            return POLISH_UNPRICED_X * self.op_gain(head)
        topo = head.topology
        tier = Tier.OTHER_NODE if topo.nodes > 1 else Tier.SAME_NODE
        copy_ms = self.copy_slowdown * self.cost_model().transfer_s(topo, tier) * 1e3 / max(len(head.active_ranks), 1)
        saved_ms = self.horizon_windows * self.window * self.load_ms / head.layers  # a whole layer, the horizon
        return self.polish_lam * (1.0 + self.worth_margin) * copy_ms / saved_ms

    def op_gain(self, head: RoutingTable) -> float:
        """What each copy of a plan on `head` must gain, as a fraction of its layer's objective."""
        if self.min_op_gain is not None:
            return self.min_op_gain
        return self.repack_gain / head.topology.slots

    def cost_model(self, ranks: int = 1) -> CostModel:
        """The cost model of a decision on `ranks` active ranks: cost_budget_s is per active rank (copies into
        different ranks run side by side), so one plan may move more experts on a larger cluster."""
        return CostModel(self.expert_bytes, self.cost_budget_s * ranks, self.downtime_steps, self.penalty_s,
                         self.replica_budget)
