"""The decision controller: a state machine driven by events, etcd-raft style.

    ready = controller.step(event)   # WindowClosed | TableCommitted | ProposalFailed | ManualProposal | ...
    persist(ready.persist); controller.advance(); check(ready.install); emit(ready.events)
    send(ready.proposals); run(ready.plans)   # each plan answered by controller.step(PlanReady(...)) (defer_plans)

A Ready holds everything produced since the last `advance()`. The caller performs it whole, in that order (persist
before send; advance before send, so that a proposal that fails at once re-enters on a fresh Ready): in the
agent, agent.decision.pipeline.DecisionPipeline.perform, the one consumer of every Ready, automatic or manual. Invariants: at most one of this controller's proposals
is in flight; nothing is proposed again before the in-flight one is answered by TableCommitted (any table
for its version or later) or ProposalFailed (its version). Priorities when free to propose: repair of lost
ranks, then a due rollback, then a rebalance when the error budget is spent (or, under theta, when a plan
could repay its copies: controlplane.worth). A rebalance is not proposed
while the previous change is still being observed, so that each change is judged on its own: it is judged
after N windows, or as soon as its realised gain over the windows seen reaches tau (kept: nothing left to
wait for, and a drift that goes on can be followed at once). When this controller's own restore of a rank
commits, it proposes experts for the rank at once (controlplane.restore).

A controller built with `defer_plans` does not compute a rebalance, a repair, a rollback or a restored rank's
fill inside `step`: its Ready carries a PlanRequest (controlplane.requests: the head, a snapshot of the replay
windows and the knobs), which the caller runs where it likes (the agent: on a worker thread, so that its event
loop keeps answering probes and votes during a plan that takes a third of a second at DeepSeek-V3 size) and
hands back as PlanReady. Windows that close meanwhile are judged and counted as always, but plan nothing
(PLANNING). The plan is proposed only if the controller is still where it asked from: the same head, nothing in
flight; for a rebalance, not paused and no change under observation; for a repair or a fill, the same lost
ranks; for a rollback, still due. Else it is dropped (STALE_PLAN): the next window plans a rebalance afresh, a
repair or rollback still due is asked for again at once, a fill on the new head (up to FILL_TRIES) unless a
repair comes first. A repair, rollback or fill supersedes a rebalance being computed (its answer is dropped).
Run at once, it decides exactly as `step` would. (An operator's proposal is still computed inside `step`: its
RPC awaits it.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from controlplane.decision import Attempt, Decision, DecisionOutcome, manual, same_ranks
from controlplane.errors import ControlPlaneError, InvalidShape
from controlplane.events import (
    Event,
    ManualProposal,
    PlanReady,
    ProposalFailed,
    RanksLost,
    SetPaused,
    TableCommitted,
    WindowClosed,
)
from controlplane.measures import Measures
from controlplane.monitor import LoadMonitor, WindowReport
from controlplane.ops import EndReason, Lifecycle, OpState, Restore
from controlplane.params import DecisionParams
from controlplane.planner import Refused
from controlplane.profile import StabilityProfile
from controlplane.ready import Explain, OpTransition, ProposalRecord, Ready, Record, Resolution
from controlplane.requests import PlanRequest, stale
from controlplane.restore import FILL_TRIES
from controlplane.steptime import StepTimeSource
from controlplane.table import RoutingTable
from controlplane.verify import verify_decision
from controlplane.worth import WorthTrigger

__all__ = [
    "Controller", "Decision", "DecisionParams", "Event", "Explain", "ManualProposal", "OpTransition", "PlanReady",
    "PlanRequest", "ProposalFailed", "ProposalRecord", "RanksLost", "Ready", "Record", "Refused", "Resolution",
    "SetPaused", "TableCommitted", "WindowClosed", "WindowReport", "verify_decision",
]


@dataclass
class _Observation:
    """A committed change under watch: realised vs counterfactual (its parent) over the next N windows."""

    version: int
    parent: RoutingTable
    # the first window judged: the first that began after the commit. The one open at it ran mostly under the
    # parent, on the load the change was planned on, and would confirm the plan's own estimate. None: not known
    # at the commit (no window reported yet): the first window to close is skipped.
    start: int | None = None
    windows: int = 0
    realised: float = 0.0  # sum over steps of step imbalance under the change
    counterfactual: float = 0.0  # ... under its parent
    life: Lifecycle = field(default_factory=lambda: Lifecycle(OpState.ACTIVE))


class Controller:
    def __init__(self, params: DecisionParams, head: RoutingTable, profile: StabilityProfile | None = None,
                 defer_plans: bool = False) -> None:
        head.validate()
        if profile is not None and profile.shape != (head.layers, head.experts):
            raise InvalidShape(f"profile shape {profile.shape} does not match the table's {(head.layers, head.experts)}")
        self.params, self.head, self.profile = params, head, profile
        self.monitor = LoadMonitor(head.layers, head.experts, params.replay_windows, params.theta, params.band,
                                   params.budget_windows, params.plan_block, params.fast_theta)
        self.worth = WorthTrigger(params.worth(), params.budget_windows, params.band)  # under theta
        self.measures = Measures(params)  # the step time and copy cost, from the engines' measured steps
        self._ready = Ready()
        self._inflight: Decision | None = None
        self.defer_plans = defer_plans
        self._planning: PlanRequest | None = None  # the plan handed out and not yet back (defer_plans)
        self._life = Lifecycle()
        self._observe: _Observation | None = None
        self._rollback_due: _Observation | None = None
        self._waiting_since: int | None = None  # the window a repair or rollback began waiting for its planner
        self._cool_until = np.full((head.layers, head.experts), -1, dtype=np.int64)
        self._lost: set[int] = set()
        self._paused = False
        self._explain: Explain | None = None
        self._imbalance = 1.0
        # this controller's last restore that committed: (its version, the fill attempted for its ranks)
        self.last_fill: tuple[int, Attempt] | None = None
        self._fill_ranks: tuple[int, ...] = ()  # ... its ranks
        self._fill_tries = 0  # fills proposed for that restore (one lost to another table is tried again)

    # ---- interface -------------------------------------------------------------------------
    def step(self, event: Event) -> Ready:
        if isinstance(event, WindowClosed):
            self._on_window(event)
        elif isinstance(event, TableCommitted):
            self._on_commit(event)
        elif isinstance(event, ProposalFailed):
            self._on_failed(event)
        elif isinstance(event, ManualProposal):
            self._on_manual(event)
        elif isinstance(event, RanksLost):
            self._lost |= {int(r) for r in event.ranks if int(r) in self.head.active_ranks}
            self._propose_pending(event.planner)
        elif isinstance(event, PlanReady):
            self._on_plan_ready(event)
        elif isinstance(event, SetPaused):
            self._paused = event.paused
            self._note("", DecisionOutcome.PAUSED if event.paused else DecisionOutcome.RESUMED)
        else:
            raise ControlPlaneError(f"unknown event {type(event).__name__}")
        return self._ready

    def advance(self) -> None:
        self._ready = Ready()

    def last_explain(self) -> Explain | None:
        return self._explain

    @property
    def inflight(self) -> Decision | None:
        return self._inflight

    @property
    def state(self) -> str:
        return ("proposing" if self._inflight else "observing" if self._observe else "planning" if self._planning
                else "idle")

    @property
    def planning(self) -> PlanRequest | None:
        """The plan handed out and not yet back, if any (defer_plans)."""
        return self._planning

    # ---- events ------------------------------------------------------------------------------
    def _on_window(self, ev: WindowClosed) -> None:
        if self.monitor.is_stale(ev.window_seq):
            self._note("", DecisionOutcome.STALE_WINDOW, f"window {ev.window_seq} <= last {self.monitor.last_seq}")
            return
        table = self._inflight.table if self._inflight else self.head
        base = self.head if self._inflight else None
        rep = self.monitor.observe(ev.window_seq, ev.first_step, ev.steps, table, base, ev.span)
        self._imbalance = rep.imbalance
        self._measured(ev)
        self._ready.events.append(rep)
        self._observe_window(ev.window_seq)
        if self._propose_pending(ev.planner, ev.backup):
            return
        p, seq = self.params, ev.window_seq
        count = self.monitor.budget.count
        low = not rep.fired and self.worth.observe(seq, rep.imbalance)  # under theta: cost-benefit
        trig = (f"step imbalance {rep.imbalance:.2f} > fast theta {p.fast_theta:.2f}: the whole budget at once"
                if rep.imbalance > p.fast_theta else
                f"step imbalance {rep.imbalance:.2f} > theta {p.theta:.2f} for {count} windows" if rep.fired else
                f"step imbalance {rep.imbalance:.3f}: a plan could repay its copies (cost-benefit)")
        if not rep.fired and not low:
            code = DecisionOutcome.BELOW_THETA if count == 0 else DecisionOutcome.BUDGET_NOT_SPENT
            wait = self.worth.waiting(seq)
            self._note("", code, f"step imbalance {rep.imbalance:.3f}, theta {p.theta}, budget {count}/{p.budget_windows}"
                       + (f"; cost-benefit backs off {wait} more windows" if wait else ""))
        elif self._inflight is not None:
            self._note(trig, DecisionOutcome.PROPOSAL_IN_FLIGHT, f"v{self._inflight.table.version} ({self._inflight.kind}) awaits its outcome")
        elif self._paused:
            self._note(trig, DecisionOutcome.PAUSED, "decisions are paused by the operator")
        elif self._observe is not None:
            o = self._observe
            self._note(trig, DecisionOutcome.OBSERVING, f"v{o.version} observed {o.windows}/{p.rollback_windows} windows")
        elif self._planning is not None:
            self._note(trig, DecisionOutcome.PLANNING, f"the plan of window {self._planning.seq} is being computed")
        elif ev.planner:
            self._note(trig, DecisionOutcome.NOT_DESIGNATED, f"{ev.planner} plans this window")
        elif self.measures.step_time.source is StepTimeSource.WARMING_UP:  # not judged on a figure nothing measured
            self._note(trig, DecisionOutcome.STEP_TIME_WARMING_UP, f"step time {self.measures.step_time.why}; the error "
                       f"budget holds ({count}/{p.budget_windows})")
        else:
            self.monitor.budget.reset()  # an attempt spends the budget, whatever its outcome
            self._ask(seq, trig, low=low)

    def _on_plan_ready(self, ev: PlanReady) -> None:
        req, a = ev.request, ev.attempt
        if req is not self._planning:
            self._note(req.trigger, DecisionOutcome.STALE_PLAN, f"the plan of window {req.seq} was not asked for now")
            return
        self._planning = None
        o = self._rollback_due
        why = stale(req, self.head.version, self._inflight.table.version if self._inflight is not None else None,
                    self._paused, self._observe is not None, tuple(sorted(self._lost)), o.parent if o else None)
        if why:
            self._note(req.trigger, DecisionOutcome.STALE_PLAN, f"planned on v{req.head.version} at window "
                       f"{req.seq}: {why}")
            if req.kind == "fill":  # on the new head, if it still has tries; else a later rebalance fills them
                self._refill_or_drop(req, why)
            elif req.kind != "rebalance":  # a repair or rollback still due is asked for again at once
                self._propose_pending("")
            return
        if a.outcome == DecisionOutcome.PLANNER_ERROR:  # a defect, logged where it ran: a due repair or
            pass  # rollback stays due, and the next window asks for it again
        elif req.kind == "repair" and a.decision is None:
            self._lost.clear()  # re-reported by membership when it changes
        elif req.kind == "rollback" and o is not None and a.decision is None:
            self._rollback_not_proposed(o, a)
        elif req.kind == "rebalance" and req.low and a.decision is None:
            self.worth.refused(req.seq, req.imbalance)
        if req.kind == "fill":
            self.last_fill = (req.restore_version, a)
        self._attempt(a, a.decision.trigger if a.decision is not None else req.trigger)

    def _refill_or_drop(self, req: PlanRequest, why: str) -> None:
        """A fill that came back stale: asked for again on the new head while it has tries left and nothing
        comes first (a proposal in flight, a repair); else given up, which `emoe restore` reports."""
        if self.head.version != req.head.version and self._inflight is None and not self._lost \
                and self._fill_tries < FILL_TRIES:
            self._fill(req.ranks, req.restore_version, again=True)
        else:
            self.last_fill = (req.restore_version, Attempt(None, DecisionOutcome.STALE_PLAN, why))
            self._propose_pending("")  # a repair that comes first

    def _on_commit(self, ev: TableCommitted) -> None:
        t = ev.table
        if (t.layers, t.experts, t.topology) != (self.head.layers, self.head.experts, self.head.topology):
            raise InvalidShape(f"committed table v{t.version} is {t.layers} x {t.experts} on {t.topology}, "
                               f"expected {self.head.layers} x {self.head.experts} on {self.head.topology}")
        if t.version <= self.head.version:
            self._note("", DecisionOutcome.STALE_COMMIT, f"v{t.version} <= head v{self.head.version}")
            return
        prev, kind = self.head, ev.kind
        d = self._inflight
        restored: tuple[int, ...] = ()
        refill = False
        if d is not None and d.table.version <= t.version:
            ours = d.table.version == t.version and d.table.content_equal(t)
            if ours:
                kind = d.kind
                restored = tuple(sorted(o.rank for o in d.ops if isinstance(o, Restore)))
                self._transition(d, OpState.COMMITTED, "")
                self._transition(d, OpState.ACTIVE, "")
                self._ready.persist.append(Resolution(t.version, DecisionOutcome.COMMITTED, ""))
                self._note(d.trigger, DecisionOutcome.COMMITTED, f"v{t.version} committed", d)
            else:
                self._transition(d, OpState.EXPIRED, EndReason.LOST_TO_OTHER_PROPOSAL)
                self._ready.persist.append(Resolution(d.table.version, DecisionOutcome.LOST, EndReason.LOST_TO_OTHER_PROPOSAL))
                self._note(d.trigger, DecisionOutcome.LOST, f"v{t.version} committed another table", d)
                # our fill lost its version to another table: plan it again on that table (if still needed)
                refill = self.last_fill is not None and self.last_fill[1].decision is d and self._fill_tries < FILL_TRIES
            self._inflight = None
        o = self._observe or self._rollback_due
        if o is not None:
            if same_ranks(t, o.parent):
                o.life = o.life.to(OpState.ROLLED_BACK, EndReason.REALISED_NOT_BETTER)
                self._ready.events.append(OpTransition(o.version, "rebalance", o.life.state, o.life.reason))
                # every expert the rolled-back change touched is left alone for a while: no oscillation
                rows, cols = np.nonzero(o.parent.phy2log != prev.phy2log)
                seq = self.monitor.last_seq if self.monitor.last_seq is not None else 0
                for src in (prev.phy2log, o.parent.phy2log):
                    e = src[rows, cols]
                    self._cool_until[rows[e >= 0], e[e >= 0]] = seq + self.params.cooldown_windows
                kind = "rollback"
            else:
                o.life = o.life.to(OpState.EXPIRED, EndReason.SUPERSEDED)
                self._ready.events.append(OpTransition(o.version, "rebalance", o.life.state, o.life.reason))
            self._observe = self._rollback_due = None
        self._waiting_since = None
        self.head = t
        self.measures.committed(prev, t, kind, self.params, self.monitor.buffer)
        self._ready.install.append(t)
        self._lost &= set(t.active_ranks)
        if kind == "repair":  # a rank loss is a drift of its own: the next window above theta may plan at once
            self.monitor.budget.count = max(self.monitor.budget.count, self.params.budget_windows - 1)
        self.worth.reset()
        if kind == "rebalance" and t.parent == prev.version:
            self._observe = _Observation(t.version, prev, ev.newest_window + 2 if ev.newest_window >= 0 else None)
        if restored:
            self._fill(restored, t.version, again=False)
        elif refill and self.last_fill is not None:
            self._fill(self._fill_ranks, self.last_fill[0], again=True)

    def _fill(self, ranks: tuple[int, ...], restore_version: int, again: bool) -> None:
        """Our restore of `ranks` committed as `restore_version` (or, `again`, the fill we proposed for it lost
        its version to another table): propose experts for them (controlplane.restore.fill_restored)."""
        self._fill_ranks = ranks
        self._fill_tries = self._fill_tries + 1 if again else 1
        seq = self.monitor.last_seq if self.monitor.last_seq is not None else 0
        self._ask(seq, f"restore: ranks {list(ranks)}", "fill", lost=tuple(sorted(self._lost)), ranks=ranks,
                  restore_version=restore_version)

    def _on_failed(self, ev: ProposalFailed) -> None:
        d = self._inflight
        if d is None or d.table.version != ev.version:
            self._note("", DecisionOutcome.STALE_FAILURE, f"no proposal of ours in flight for v{ev.version}")
            return
        self._transition(d, OpState.ABORTED, f"{EndReason.PROPOSAL_FAILED}: {ev.reason}")
        self._ready.persist.append(Resolution(ev.version, DecisionOutcome.FAILED, ev.reason))
        self._note(d.trigger, DecisionOutcome.FAILED, ev.reason, d)
        self._inflight = None

    def _on_manual(self, ev: ManualProposal) -> None:
        if self._inflight is not None:
            self._note("manual", DecisionOutcome.PROPOSAL_IN_FLIGHT, f"v{self._inflight.table.version} awaits its outcome")
            return
        a = manual(self.head, self.monitor.buffer, self.params, tuple(ev.ops), ev.force, ev.why)
        self._attempt(a, a.decision.trigger if a.decision else "manual")

    # ---- proposing ---------------------------------------------------------------------------
    def _propose_pending(self, planner: str, backup: int = 1) -> bool:
        """Repair, then a due rollback, when nothing is in flight; True if one of them was asked for, is being
        computed, or waits.
        Every node sees the same rank loss or due rollback at about the same time, and when all of them propose
        at once their ballots duel (at 64 nodes a rollback landed seconds late this way). So the node whose turn
        it is (`planner` empty) proposes at once. Another waits one window for a repair (it may rest on this
        node's first-hand evidence, its engine's link, which the planner does not have) and `backup` windows
        for a rollback: its place after the planner in the turn order, so that the backups propose one after
        another. Waiting one window and then proposing from every node failed where windows close in bursts
        (after a rolling restart windows 61-63 closed at once and 63 nodes proposed the same rollback); waiting
        for this node's own turn failed where a rolling restart walks the nodes in the turn's order (each
        planner had just restarted without the observation, and the rollback never came, seed 1000261)."""
        if self._inflight is not None or not (self._lost or self._rollback_due):
            return False
        pl = self._planning
        if pl is not None and pl.kind != "rebalance":
            self._note(pl.trigger, DecisionOutcome.PLANNING, f"the {pl.kind} asked for at window {pl.seq} is being computed")
            return True
        seq = self.monitor.last_seq if self.monitor.last_seq is not None else -1
        wait = 1 if self._lost else max(1, backup)
        if planner and (self._waiting_since is None or seq - self._waiting_since < wait):
            if self._waiting_since is None:
                self._waiting_since = seq
            what = "repair" if self._lost else "rollback"
            self._note(what, DecisionOutcome.NOT_DESIGNATED,
                       f"{planner} proposes the {what}; this node waits until window {self._waiting_since + wait} "
                       f"closes")
            return True
        self._waiting_since = None
        # a rebalance being computed is superseded (its answer is dropped as not asked for): these come first
        if self._lost:
            lost = tuple(sorted(self._lost))
            self._ask(seq, f"repair: ranks {list(lost)} lost", "repair", lost=lost)
            return True
        o = self._rollback_due
        if o is not None:
            trig = (f"rollback: realised step imbalance {o.realised / max(o.windows, 1):.3f} not better than "
                    f"{o.counterfactual / max(o.windows, 1):.3f} without v{o.version} over {o.windows} windows")
            self._ask(seq, trig, "rollback", target=o.parent, last=o.windows)
            return True
        return False

    def _ask(self, seq: int, trigger: str, kind: str = "rebalance", low: bool = False, **what: Any) -> None:
        """Ask for a plan of `kind` on the head and the replay windows now (`what`: the fields the kind needs,
        controlplane.requests.PlanRequest): handed out to be computed (defer_plans, on a snapshot of the
        windows), or computed and acted on at once."""
        buf = self.monitor.buffer.snapshot() if self.defer_plans else self.monitor.buffer
        req = PlanRequest(seq, self.head, buf, self.params, self.profile, self._cool_until >= seq, trigger, low,
                          self._imbalance, kind, **what)
        self._planning = req
        if self.defer_plans:
            self._ready.plans.append(req)
        else:
            self._on_plan_ready(PlanReady(req, req.run()))

    def _rollback_not_proposed(self, o: _Observation, a: Attempt) -> None:
        o.life = o.life.to(OpState.DONE, a.outcome)
        self._ready.events.append(OpTransition(o.version, "rebalance", o.life.state, o.life.reason))
        self._rollback_due = None

    def _attempt(self, a: Attempt, trigger: str) -> None:
        d = a.decision
        if d is None:
            self._note(trigger, a.outcome, a.detail, None, a)
            return
        self._inflight = d
        self._life = Lifecycle()
        self._ready.persist.append(ProposalRecord(d.table.version, d.table.parent, d.table.digest, d.kind))
        self._ready.proposals.append(d)
        self._ready.events.append(OpTransition(d.table.version, d.kind, OpState.PROPOSED, ""))
        self._note(trigger, DecisionOutcome.PROPOSED, d.describe(), d, a)

    def _observe_window(self, seq: int) -> None:
        o = self._observe
        if o is None:
            return
        if o.start is None:
            o.start = seq + 1
        if seq < o.start:
            return
        buf = self.monitor.buffer
        real = buf.stats(self.head, last=1).step_imbalance()
        cf = buf.stats(o.parent, base=self.head, last=1).step_imbalance()
        o.windows += 1
        o.realised += float(real.mean())
        o.counterfactual += float(cf.mean())
        confirmed = o.realised <= (1.0 - self.params.tau) * o.counterfactual  # the gain tau asked for is realised
        if o.windows < self.params.rollback_windows and not confirmed:
            return
        self._observe = None
        if o.realised < o.counterfactual:
            o.life = o.life.to(OpState.DONE, EndReason.KEPT)
            self._ready.events.append(OpTransition(o.version, "rebalance", o.life.state, o.life.reason))
        else:
            self._rollback_due = o

    def _measured(self, ev: WindowClosed) -> None:
        """Fold a window's measured steps in, and decide with the step time and copy cost they give."""
        params = self.measures.window(ev, self.head, self.monitor.buffer, self.params)
        if params is not self.params:
            self.params = params
            self.worth.worth = params.worth()

    def _transition(self, d: Decision, state: OpState, reason: str) -> None:
        self._life = self._life.to(state, reason)
        self._ready.events.append(OpTransition(d.table.version, d.kind, state, reason))

    def _note(self, trigger: str, outcome: str, detail: str = "", decision: Decision | None = None,
              a: Attempt | None = None) -> None:
        seq = self.monitor.last_seq if self.monitor.last_seq is not None else -1
        ex = Explain(seq, self.head.version, self._imbalance, trigger, outcome, detail, decision,
                     a.refused if a else (), a.estimated_gain if a else 0.0, a.verified_gain if a else 0.0,
                     a.cost if a else 0.0)
        self._explain = ex
        self._ready.events.append(ex)
