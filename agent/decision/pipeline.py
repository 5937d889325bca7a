"""DecisionPipeline: one node's decision path, from a closed cluster window to a proposal at the commit backend.

Controller (controlplane.controller) + the planning turn (agent.consensus.paxos.turn) + the voter's replay
windows (agent.decision.voter) + the Ready loop (persist, advance, install, report, send). No asyncio and no network:
a benchmark or a test drives it with windows and a stand-in backend, exactly as the agent does.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from agent.consensus.core import Outcome
from agent.consensus.paxos import turn
from agent.decision.hooks import Hooks
from agent.decision.voter import Voter
from agent.link.loadpath import Timing
from agent.wire import make_plan, op_to_pb, plan_kind
from controlplane.controller import (
    Controller,
    DecisionParams,
    Event,
    Explain,
    ManualProposal,
    OpTransition,
    PlanReady,
    PlanRequest,
    ProposalFailed,
    Ready,
    Record,
    SetPaused,
    TableCommitted,
    WindowClosed,
)
from controlplane.decision import Attempt, Decision, DecisionOutcome
from controlplane.ops import Operation, describe
from controlplane.profile import StabilityProfile
from controlplane.table import RoutingTable, copied_slots
from controlplane.verify import replay_stats
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import consensus_pb2 as cpb

log = logging.getLogger(__name__)


class Proposals(Protocol):
    """What the pipeline needs of a commit backend (agent.commit.CommitBackend has it): the committed head,
    and `propose`, which commits `table` (version head + 1) or says why not, calling `on_done` exactly once."""

    @property
    def head(self) -> RoutingTable: ...

    def propose(self, table: RoutingTable, plan: cpb.Plan, on_done: Callable[[Outcome], None]) -> None: ...


class Now(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic clock (agent.clock.Clock has it)."""
        ...


class DecisionTelemetry(Protocol):
    """The metrics and spans the pipeline reports (agent.admin.telemetry.Telemetry has them)."""

    def record_imbalance(self, x: float) -> None: ...

    def record_transition(self, kind: str, state: str) -> None: ...

    def record_version(self, v: int) -> None: ...

    def record_commit_latency(self, ms: float) -> None: ...

    def decision_span(self, version: int, ops: list[str], estimated_gain: float, verified_gain: float,
                      cost: float, trigger: str, outcome: str) -> None: ...

    def commit_span(self, version: int, parent: int, votes: int, latency_ms: float) -> None: ...


class Performed(NamedTuple):
    """What `DecisionPipeline.perform` did with one Ready: the proposals it sent to the commit backend, in the
    Ready's order, and the Ready's last Explain (None where it had none)."""

    sent: tuple[Decision, ...]
    explain: Explain | None


def _nothing() -> None:
    return None


def _no_wall_clock() -> int:
    return 0


PlanRunner = Callable[[PlanRequest, Callable[[Attempt], None]], None]


def plan_here(request: PlanRequest, done: Callable[[Attempt], None]) -> None:
    """Run a plan at once, on the caller's thread (the default: the bench and the simulated cluster)."""
    done(request.run())


def failed_plan(request: PlanRequest, error: BaseException) -> Attempt:
    """The Attempt a planner that raised is reported as (a defect: the caller logs the traceback)."""
    return Attempt(None, DecisionOutcome.PLANNER_ERROR, f"the planner raised {type(error).__name__}: {error}")


def window_rows(total: npt.NDArray[np.uint64], samples: npt.NDArray[np.uint32] | None,
                window: int) -> npt.NDArray[np.uint32]:
    """What the controller and the replay see of a window: its sampled steps [S, L, E], or, without samples
    (an engine that sends none), one row of its mean step (total / window, rounded), so that every row is one
    step's worth of tokens either way (the copy cost weighs tokens per step)."""
    if samples is not None and samples.shape[0] > 0:
        return np.asarray(samples, dtype=np.uint32)
    mean = (np.asarray(total, dtype=np.uint64) + window // 2) // max(window, 1)
    return np.minimum(mean, np.iinfo(np.uint32).max).astype(np.uint32)[None]


class DecisionPipeline:
    """One node's decision path. Its one input is the sequence of closed cluster windows:

        close_window(seq, total, samples)
            seq: the window number (its first step is seq * params.window);
            total: uint64 [L, E], the window's tokens per (layer, logical expert) summed over the window's steps
                   and over every live node (agent.link.loadpath.ClusterWindows);
            samples: uint32 [S, L, E], the counts of the window's sampled steps (every params.sample_every-th,
                   elasticmoe.loadcodec), summed over the same nodes; None where some engine sent none;
            missing: the nodes whose window is not in the sum: live ones that lag (it closed without them), and
                   those holding ranks active in the head whose agent is dead, restarting or not yet heard
                   (agent.link.loadpath.LoadPath's `absent`: their ranks are not idle). Such a window is not load
                   evidence: the experts their ranks serve look cold in it, and a plan or a rollback judged on it
                   would answer a load no engine has. It is counted, said once per streak (the log, and `emoe
                   explain`: PARTIAL_WINDOW), and this node's own duties run (`each_window`: a repair of ranks the
                   engines lost is proposed from there), but it is neither remembered for replay nor handed to the
                   controller. (DeepSeek-V3 8x8 under `emoe bench --live` on an overloaded machine: two runs of
                   five committed a 260 GB change before any drift and never rolled it back, 1.50 and 1.54 mean
                   step imbalance against 1.26; their logs were not kept, so the cause is inferred. With this,
                   three runs gave 1.26-1.28.)

    fed in increasing `seq`, and, as the backend learns them, the commits: `on_commit(commit, table,
    newest_window)`. Each window is remembered for the voter's replay, judged against the committed head, and
    handed to the controller as WindowClosed (its rows: the sampled steps, or else one row of the window's mean
    step, `window_rows`) with this node's planning turn; the controller's Ready is then performed in its
    contract's order by `perform`, the one consumer of every Ready, whatever event produced it (a window, a
    commit, a failure, a plan's answer, a pause, the operator's `manual`), and each proposal goes to
    `backend.propose`. Operator and repair events enter through `step` and `manual`.

    Collaborators, all passed in whole: `backend` (the committed head and propose), `voter` (the replay
    windows; the backend's verifier is its `verify`), `voters` and `live_voters()` (the turn order and who is
    up now), `clock` (proposal latency), `wall_ms()` (the time of day each plan carries, Unix epoch ms, for
    the operator: 0, the default, where there is none, as in the simulator), `telemetry`, `hooks` (what a
    harness observes), and `each_window`,
    the node's own duties for a window (a rank restore, install lag), run after the window is remembered and
    before the controller decides on it, and `run_plan(request, done)`, which computes a rebalance and calls
    `done(attempt)` on the pipeline's own thread: at once by default (`plan_here`); the agent runs it on a
    worker thread (agent.state.NodeState), so that a plan does not stall its event loop."""

    def __init__(self, node_id: str, params: DecisionParams, backend: Proposals, voter: Voter, *,
                 voters: Sequence[str], live_voters: Callable[[], list[str]], handover_windows: int, clock: Now,
                 telemetry: DecisionTelemetry, hooks: Hooks | None = None,
                 each_window: Callable[[], None] = _nothing, profile: StabilityProfile | None = None,
                 wall_ms: Callable[[], int] = _no_wall_clock, run_plan: PlanRunner = plan_here) -> None:
        """`profile`: an offline expert-stability profile as the planner's prior (the agent loads none)."""
        self.node_id, self.params, self.backend, self.voter = node_id, params, backend, voter
        self.voters, self.live_voters, self.handover_windows = list(voters), live_voters, handover_windows
        self.clock, self.telemetry, self.each_window, self.wall_ms = clock, telemetry, each_window, wall_ms
        self.run_plan = run_plan
        # a closed window's measured steps (LoadPath's ClusterWindows.timing: their wall times [S], the versions
        # they ran on, their strides' mean times), which the controller fits its step time from
        # (controlplane.steptime); the agent wires it to its load path
        self.timing: Callable[[int], Timing] = lambda seq: (None, None, None)
        self.hooks = hooks if hooks is not None else Hooks()
        # plans from the backend's (recovered) head; its rebalances go through run_plan
        self.controller = Controller(params, backend.head, profile, defer_plans=True)
        self.voter.own_step_time = lambda: self.controller.measures.step_time  # a proposer's step time is bounded by it
        self._paused = False  # as the controller was told (SetPaused)
        self.window_seq = -1  # the last closed window
        self.head_seq = -1  # the last closed window when the head was installed (the planner's turn)
        self.imbalance: list[float] = []  # the step imbalance of the last windows under the head
        self.journal: deque[Record] = deque(maxlen=1024)  # the controller's proposal records and resolutions
        self.explains: dict[int, apb.ExplainReply] = {}  # what this node proposed, by version
        self.latest_explain: apb.ExplainReply | None = None  # `emoe explain` for version 0
        self.committed_at = clock.now()  # when this node learned its newest commit (its start, before one)
        self._proposed_at: dict[int, float] = {}  # this node's proposals in flight: version -> when proposed
        self.outcomes: Counter[str] = Counter()  # the controller's decisions by outcome (Explain.outcome)
        self.bytes_moved = 0  # weight bytes the commits this node learned copy (those whose parent it held)
        self.plans = 0  # plans computed (run_plan answered), and their wall seconds: all, and the last
        self.plan_seconds = self.last_plan_seconds = 0.0
        self.partial_windows = 0  # windows closed without some node's load (lagging or absent), not decided on
        self._lagging: tuple[str, ...] = ()  # the nodes missing from the last window (each streak logged once)

    def latest_window(self) -> npt.NDArray[np.uint64] | None:
        """The newest closed cluster window [L, E] (the voter's replay keeps them), None before the first."""
        replay = self.voter.replay
        return None if not replay else replay[-1]

    # ---- input ---------------------------------------------------------------------------------
    def close_window(self, seq: int, total: npt.NDArray[np.uint64],
                     samples: npt.NDArray[np.uint32] | None = None, missing: tuple[str, ...] = ()) -> None:
        """A closed cluster window (see the class docstring)."""
        for h in self.hooks.window_closed:
            h(seq, total, samples)
        if self.window_seq < 0:  # the first window since start: commits caught up on count from here
            self.head_seq = max(self.head_seq, seq - 1)
        self.window_seq = seq
        if missing != self._lagging:
            if missing:
                why = (f"window {seq} closed without the load of {list(missing)} (lagging, or absent: an agent dead, "
                       f"restarting or not yet heard whose ranks are active in version {self.backend.head.version})")
                log.warning("%s: %s: windows without a node's load are not decided on (its ranks are not idle)",
                            self.node_id, why)
                self.latest_explain = apb.ExplainReply(version=0, trigger=why,
                                                       outcome=str(DecisionOutcome.PARTIAL_WINDOW))
            else:
                log.info("%s: window %d closed with every node's load again", self.node_id, seq)
            self._lagging = missing
        if missing:  # not load evidence: counted, and this node's own duties run
            self.partial_windows += 1
            self.each_window()
            return
        rows = window_rows(total, samples, self.params.window)
        self.voter.remember(seq, total, rows)
        self.each_window()
        imb = replay_stats(self.backend.head, rows).mean_imbalance()
        self.imbalance = (self.imbalance + [imb])[-600:]
        self.telemetry.record_imbalance(imb)
        took, ran, strides = self.timing(seq) if samples is not None and samples.shape[0] > 0 else (None, None, None)
        self.step(WindowClosed(seq, seq * self.params.window, rows, *self.turn(seq), span=self.params.window,
                               step_us=took, step_version=ran, stride_us=strides))

    def on_commit(self, commit: cpb.Commit, table: RoutingTable, newest_window: int) -> None:
        """The backend committed `table` (this node's proposal or another's); `newest_window`: the newest window
        reported when this node learned of it (agent.link.loadpath.ClusterWindows.newest_reported)."""
        # the turn restarts at the window that proposed this table (the same on every node, however late it learns)
        now = self.committed_at = self.clock.now()
        before = self.controller.head
        # the bytes diff(before, table) would list, counted without building its moves: this runs on every
        # agent between learning a commit and handing the table to its shims
        moved = (copied_slots(before.phy2log, table.phy2log) * self.params.expert_bytes
                 if before.version == table.parent and before.phy2log.shape == table.phy2log.shape else -1)
        self.bytes_moved += max(moved, 0)
        log.info("%s: committed version %d (%s, proposed by %s): %d operations, %s to copy", self.node_id,
                 table.version, plan_kind(commit.plan), commit.proposer or "?", len(commit.plan.ops),
                 f"{moved / 1e6:.1f} MB" if moved >= 0 else "bytes unknown (this node was behind)")
        end = int(commit.plan.replay_to_step) // self.params.window
        self.head_seq = end - 1 if 0 < end <= self.window_seq + 1 else self.window_seq
        self.step(TableCommitted(table, plan_kind(commit.plan), newest_window))
        rec = self.explains.get(table.version)
        if rec is not None:
            rec.outcome = "committed"
            if not rec.votes:
                rec.votes.extend(commit.votes)
        self.telemetry.record_version(table.version)
        proposed = self._proposed_at.pop(table.version, None)
        for v in [v for v in self._proposed_at if v <= table.version]:  # proposals another table won
            del self._proposed_at[v]
        if proposed is not None:  # the latency is known where the table was proposed: one span, there
            self.telemetry.commit_span(table.version, table.parent, len(commit.qc.voters), (now - proposed) * 1e3)

    def step(self, event: Event) -> None:
        """Hand the controller one event and perform its Ready."""
        self.perform(self.controller.step(event))

    def manual(self, ops: tuple[Operation, ...], trigger: str, force: bool, why: str = "",
               done: asyncio.Future[Outcome] | None = None) -> tuple[Decision | None, str]:
        """The controller's manual event (the operator's operations; with `why`, the agent's own on the operator's
        path), its Ready performed by `perform` like any other: the decision it made of `ops`, proposed (forced
        if `force`; its outcome set on `done`), or None and why the controller refused it."""
        did = self.perform(self.controller.step(ManualProposal(ops, force, why)), force, done)
        mine = [d for d in did.sent if d.kind == "manual"]
        if mine:
            return mine[0], ""
        ex = did.explain
        refused = f"{ex.outcome if ex else 'REFUSED'}: {ex.detail if ex else ''}".rstrip(": ")
        return None, f"{trigger} not proposed by the decision core: {refused}"

    @property
    def paused(self) -> bool:
        """The cluster's pause switch as this node knows it (agent.state.NodeState follows the committed record),
        handed to the controller (SetPaused): while paused it plans no rebalance; windows are still remembered and
        judged, a repair of lost ranks and a due rollback (a change that realised worse, I6) are still proposed,
        and so are the operator's own proposals, drains and restores."""
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        if value != self._paused:
            self._paused = value
            self.step(SetPaused(value))

    @property
    def inflight(self) -> Decision | None:
        """This node's proposal awaiting its outcome, if any."""
        return self.controller.inflight

    def computing(self) -> str:
        """The kind of plan being computed for this node's controller (rebalance, repair, rollback, fill), or ''."""
        req = self.controller.planning
        return req.kind if req is not None else ""

    def fill_after(self, version: int) -> tuple[Decision | None, str] | None:
        """What the controller did when this node's restore committed as `version`: the experts it proposed for
        the restored ranks (controlplane.restore.fill), or None and why not; None if it has not seen that
        commit as its own restore."""
        last = self.controller.last_fill
        if last is None or last[0] != version:
            return None
        a = last[1]
        return a.decision, f"{a.outcome}: {a.detail}".rstrip(": ")

    # ---- the planning turn ------------------------------------------------------------------------
    def turn(self, seq: int) -> tuple[str, int]:
        """The node planning window `seq` in this view ('' if this one; paxos.planner_turn), and this node's place
        after it (paxos.turn_distance: the windows a due rollback waits). Views may differ a moment (two plan,
        consensus picks one); a voter counts itself live; a non-voter plans only if it sees no voter."""
        k = self.handover_windows
        if not k:
            return "", 0
        planner, place = turn(self.backend.head.version + 1, self.voters, self.live_voters(),
                              seq - self.head_seq - 1, k, self.node_id)
        return ("" if planner is None or planner == self.node_id else planner), place

    def planner(self) -> str:
        """The node planning the next window in this view (`turn`; this node's id when it is its own turn), or ""
        when every node plans every window (handover_windows = 0)."""
        if not self.handover_windows:
            return ""
        return self.turn(self.window_seq + 1)[0] or self.node_id

    # ---- the Ready loop -------------------------------------------------------------------------
    def perform(self, ready: Ready, force: bool = False,
                done: asyncio.Future[Outcome] | None = None) -> Performed:
        """Consume one of the controller's Readys, whole, whatever event produced it (automatic or the operator's:
        `step` and `manual` both come here, and nothing else consumes one), in its contract's order (etcd-raft's):
        1. persist: its proposal records and resolutions go to the decision journal. The controller's state is
           soft (after a restart it starts from the committed head), so the journal is in memory; the acceptor
           state that safety needs is persisted by the commit backend before any reply leaves;
        2. advance, before sending: a re-entrant step (a proposal that fails at once) does not see these again;
        3. install check: what the controller took as its new head must be the backend's (they learn commits
           together); one beyond it is logged as an error;
        4. report: every Explain is counted by outcome (`outcomes`: `emoe_decisions`) and handed to the
           `explained` hooks; where nothing was proposed, the last one is what `emoe explain` shows for version
           0; every lifecycle move (OpTransition) goes to the transition telemetry;
        5. send: each proposal goes to the commit backend (`propose`): the operator's own (kind "manual", from
           `manual`) with `force` and `done` (its RPC awaits the outcome), any other with neither;
        6. plan: each plan the controller asked for goes to `run_plan`, whose answer comes back as PlanReady.
        Returns what it sent and the Ready's last Explain (`manual` answers the operator from them)."""
        self.journal.extend(ready.persist)
        proposals, installs, events = list(ready.proposals), list(ready.install), list(ready.events)
        plans = list(ready.plans)
        self.controller.advance()
        for t in installs:
            if t.version > self.backend.head.version:
                log.error("controller installed v%d beyond the committed head v%d", t.version, self.backend.head.version)
        explains = [e for e in events if isinstance(e, Explain)]
        for ex in explains:
            self.outcomes[ex.outcome] += 1
            for h in self.hooks.explained:
                h(ex)
        if explains and not proposals:  # why nothing was proposed, with its figures (e.g. GAIN_NOT_SIGNIFICANT's bound)
            ex = explains[-1]
            self.latest_explain = apb.ExplainReply(
                version=0, trigger=f"{ex.trigger}: {ex.detail}" if ex.detail else ex.trigger, outcome=ex.outcome,
                plan=cpb.Plan(estimated_gain=ex.estimated_gain, verified_gain=ex.verified_gain, cost=ex.cost),
                step_time=self.step_time_said(), copy_cost=self.copy_cost_said())
        for e in events:
            if isinstance(e, OpTransition):
                self.telemetry.record_transition(e.kind, e.state)
        for decision in proposals:
            if decision.kind == "manual":
                self.propose(decision, force, done)
            else:
                self.propose(decision)
        for req in plans:
            self._run(req)
        return Performed(tuple(proposals), explains[-1] if explains else None)

    def step_time_said(self) -> str:
        """The step time the controller decides with and where it came from (ExplainReply.step_time)."""
        st = self.controller.measures.step_time
        return f"{st.load_ms:.4g} ms, {st.why}"

    def copy_cost_said(self) -> str:
        """What the controller charges copies over the cost model's figure and why (ExplainReply.copy_cost); empty
        while nothing was measured."""
        p = self.controller.params
        return f"x{p.copy_slowdown:.3g} ({p.copy_slowdown_source})" if p.copy_slowdown_source else ""

    def _run(self, req: PlanRequest) -> None:
        started = self.clock.now()

        def done(attempt: Attempt) -> None:
            took = self.clock.now() - started
            self.plans += 1
            self.plan_seconds += took
            self.last_plan_seconds = took
            self.step(PlanReady(req, attempt))

        self.run_plan(req, done)

    def propose(self, decision: Decision, force: bool = False, done: asyncio.Future[Outcome] | None = None) -> None:
        """Send `decision` to the commit backend; its outcome is recorded, reported, and (a failure) handed back
        to the controller, then set on `done` if given."""
        table = decision.table
        plan = make_plan(decision.ops, decision.estimated_gain, decision.verified_gain, decision.cost, decision.trigger,
                         decision.replay_from_step, decision.replay_to_step, kind=str(decision.kind), forced=force,
                         load_ms=decision.load_ms)
        if force:
            plan.trigger = f"manual --force: {plan.trigger}"
        plan.proposed_at_unix_ms = max(0, int(self.wall_ms()))
        refused = [apb.Candidate(op=op_to_pb(r.op) if r.op is not None else None, reason=r.reason, gain=r.gain,
                                 cost=r.cost) for r in decision.refused]
        parent = self.controller.head
        copies = copied_slots(parent.phy2log, table.phy2log) if parent.version == table.parent else 0
        record = apb.ExplainReply(version=table.version, trigger=decision.trigger, plan=plan, refused=refused,
                                  outcome="proposed", copy_bytes=copies * self.params.expert_bytes,
                                  step_time=self.step_time_said(), copy_cost=self.copy_cost_said())
        self.explains[table.version] = record
        self.latest_explain = record
        started = self.clock.now()
        self._proposed_at[table.version] = started
        observers = [h(table) for h in self.hooks.proposing]

        def on_done(outcome: Outcome) -> None:
            for seen in observers:
                seen(outcome)
            record.outcome = "committed" if outcome.committed else f"failed: {outcome.reason}"
            record.votes.extend(outcome.votes)
            latency_ms = (self.clock.now() - started) * 1e3
            self.telemetry.decision_span(table.version, [describe(o) for o in decision.ops], decision.estimated_gain,
                                         decision.verified_gain, decision.cost, decision.trigger, record.outcome)
            if not outcome.committed:
                self.step(ProposalFailed(table.version, str(outcome.reason)))
            else:
                self.telemetry.record_commit_latency(latency_ms)
            if done is not None and not done.done():
                done.set_result(outcome)

        self.backend.propose(table, plan, on_done)
