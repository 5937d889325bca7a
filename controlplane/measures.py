"""What the engines' measured steps tell the controller's decisions (issue 49: the step time measured by the agents).

Two figures, both derived from the gossiped windows and the committed tables alone, so every voter holds the
same: the step time a plan's gain is priced at (controlplane.steptime, read at the busiest load of the windows a
decision judges), and what a change's copies cost the steps they overlapped over the cost model's charge
(controlplane.copycost, used only where decision.copy_cost_measured). `window` folds each closed window in and
returns the decision knobs with both figures set; `committed` registers each committed change. No IO, no clock.
"""

from __future__ import annotations

from dataclasses import replace

from controlplane.copycost import MODELLED, CopyCostEstimator, CopySlowdown
from controlplane.cost import change_cost
from controlplane.events import WindowClosed
from controlplane.monitor import ReplayBuffer
from controlplane.params import DecisionParams
from controlplane.steptime import StepTime, StepTimeEstimator, StepTimeSource
from controlplane.table import RoutingTable
from controlplane.verify import verify_windows

CONTROL_WINDOWS = 4  # the judged windows whose steps are a change's control (controlplane.copycost)


class Measures:
    def __init__(self, params: DecisionParams) -> None:
        # the step time: fitted from the engines' measured steps, params.load_ms until enough are in, or always
        # where the operator set it (load_ms_override)
        self.configured_ms = params.load_ms
        self.copycost = CopyCostEstimator()  # what the copies of the changes committed cost the steps they overlapped
        self.steptime = StepTimeEstimator(copies=self.copycost)
        self.copy_slowdown: CopySlowdown = MODELLED
        self.step_time: StepTime = self.steptime.current(params.load_ms, params.load_ms_override)
        self.judged_windows: tuple[int, ...] = ()  # the windows the step time was read at (their busiest load)

    def committed(self, prev: RoutingTable, t: RoutingTable, kind: str, params: DecisionParams,
                  buf: ReplayBuffer) -> None:
        """A change from `prev` to `t` committed: measure what it costs the steps its copies overlap, against what
        the cost-benefit test charges it (the cost model's figure for the change, over the ranks). A repair is
        not measured: the steps around a rank loss are slowed by the loss itself."""
        self.steptime.know(prev)
        self.steptime.know(t)
        if kind == "repair" or prev.active_ranks != t.active_ranks:
            return
        ranks = max(len(prev.active_ranks), 1)
        cost = change_cost(params.cost_model(ranks), prev, t, buf.tokens_per_step())
        # the control: what the old table's steps took on the windows the decision judged (they share the newest
        # one's mix, so the load the pending steps run), the newest CONTROL_WINDOWS of them
        control = self.steptime.held(self.judged_windows[-CONTROL_WINDOWS:])
        self.copycost.committed(t.version, cost / ranks * 1e3, control)

    def window(self, ev: WindowClosed, head: RoutingTable, buf: ReplayBuffer, params: DecisionParams) -> DecisionParams:
        """Fold a window's measured steps in (each under the table that served it) and return `params` with the
        step time read at the busiest load of the windows a decision judges (those that share the newest one's
        mix: verify.verify_windows) and the copy cost (the same object where neither changed)."""
        self.steptime.observe(ev.window_seq, head, ev.steps, ev.step_us, ev.step_version, ev.span, ev.stride_us)
        judged = verify_windows(buf.window_totals(), params.drift_tv)
        self.judged_windows = tuple(w.seq for w in list(buf.windows)[-judged:]) if judged else ()
        busiest = float(buf.stats(head, last=judged).layer_max.sum(axis=1).mean()) if judged else None
        st = self.step_time = self.steptime.current(self.configured_ms, params.load_ms_override, busiest)
        why = st.why if st.source is not StepTimeSource.DEFAULT or self.steptime.points else ""  # ("": nothing measured)
        cs = self.copy_slowdown = self.copycost.estimate(self.steptime.latest_fit())
        factor = cs.factor if params.copy_cost_measured else 1.0
        said = ("" if not cs.changes else cs.why if params.copy_cost_measured else  # ("": nothing measured)
                f"the model; {cs.why} (not used: decision.copy_cost_measured is off)")
        if (st.load_ms, why, factor, said) == (params.load_ms, params.load_ms_source, params.copy_slowdown,
                                               params.copy_slowdown_source):
            return params
        return replace(params, load_ms=st.load_ms, load_ms_source=why, copy_slowdown=factor, copy_slowdown_source=said)
