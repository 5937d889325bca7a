"""The policies `emoe bench` runs side by side, each behind one small interface.

A policy sees the trace only up to the window that just closed (hindsight excepted: it is the oracle)
and answers with table changes. How a change reaches serving is the policy's `mode`:
- `blocking`: installed at its ready step, serving stalls while its copies run (vLLM / SGLang sync EPLB);
- `overlapped`: copies run beside serving, sharing link bandwidth, and the table installs when they end;
- `free`: installed at its ready step at no cost (the hindsight reference).
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from bench.agentfeed import LoadFeed
from bench.rankloss import Kill, eplb_surviving, hindsight_with_kills
from controlplane.baselines.craft import craft_table
from controlplane.baselines.static import static_table
from controlplane.table import RoutingTable

Counts = npt.NDArray[np.uint32]


@dataclass
class Change:
    """A new table that may start reaching serving at `ready_step`."""

    table: RoutingTable
    ready_step: int
    mode: str  # "blocking" | "overlapped" | "free"
    kind: str = "rebalance"


class Policy(Protocol):
    name: str

    def start(self, base: RoutingTable, counts: Counts, drift_steps: list[int]) -> list[Change]:
        """Called once before step 0; `counts` is for the oracle only."""

    def on_window(self, first: int, end: int, seen: Counts) -> list[Change]:
        """Window [first, end) just closed; `seen` is counts[:end]."""


def _crossed(end: int, window: int, period: int) -> bool:
    """True for the window ending at `end` that crosses a multiple of `period`."""
    return end >= period and end // period > (end - window) // period


@dataclass
class Static:
    name: str = "static"

    def start(self, base: RoutingTable, counts: Counts, drift_steps: list[int]) -> list[Change]:
        return []

    def on_window(self, first: int, end: int, seen: Counts) -> list[Change]:
        return []


@dataclass
class Eplb:
    """Full EPLB rebalance every `period` steps from the last `period` steps, blocking."""

    window: int
    period: int = 1000
    groups: int = 1
    name: str = "eplb"
    head: RoutingTable | None = None
    dead: set[int] = field(default_factory=set)

    def start(self, base: RoutingTable, counts: Counts, drift_steps: list[int]) -> list[Change]:
        self.head = base
        return []

    def on_ranks_lost(self, step: int, ranks: list[int]) -> list[Change]:
        """vLLM / SGLang EPLB does not react to rank loss; its next full rebalance (in practice a restart)
        plans over the surviving ranks."""
        self.dead |= set(ranks)
        return []

    def on_window(self, first: int, end: int, seen: Counts) -> list[Change]:
        if self.head is None or not _crossed(end, self.window, self.period):
            return []
        totals = seen[max(0, end - self.period):end].sum(axis=0, dtype=np.int64)
        self.head = eplb_surviving(self.head, totals, self.dead, self.groups)
        return [Change(self.head, end, "blocking", "rebalance")]


@dataclass
class Craft:
    """CRAFT planned from the first `period` steps (once) or re-planned every `period` (periodic), blocking."""

    window: int
    period: int = 1000
    periodic: bool = False
    budget_fraction: float = 1.0
    name: str = "craft"
    base: RoutingTable | None = None
    planned: bool = False

    def start(self, base: RoutingTable, counts: Counts, drift_steps: list[int]) -> list[Change]:
        # CRAFT's method adds replicas to the static placement, whatever the boot table was (an EPLB boot
        # fills every slot and would leave it no budget): its plan replaces the boot table
        self.base = static_table(base.topology, base.layers, base.experts)
        return []

    def on_window(self, first: int, end: int, seen: Counts) -> list[Change]:
        if self.base is None or (self.planned and not self.periodic) or not _crossed(end, self.window, self.period):
            return []
        self.planned = True
        free = int((self.base.phy2log < 0).sum())
        table = craft_table(self.base, seen[max(0, end - self.period):end], int(free * self.budget_fraction))
        return [Change(table, end, "blocking")]


@dataclass
class Hindsight:
    """EPLB on each segment's exact totals, installed free at the segment's first step."""

    groups: int = 1
    name: str = "hindsight"
    kills: list[Kill] = field(default_factory=list)  # known in advance: it is the oracle

    def start(self, base: RoutingTable, counts: Counts, drift_steps: list[int]) -> list[Change]:
        return [Change(t, s, "free", "segment")
                for s, t in hindsight_with_kills(base, counts, drift_steps, self.kills, self.groups)]

    def on_window(self, first: int, end: int, seen: Counts) -> list[Change]:
        return []


def controller_available() -> str | None:
    """None when controlplane.controller can be used, else why not."""
    try:
        mod = importlib.import_module("controlplane.controller")
    except ImportError as e:
        return f"controlplane.controller not importable: {e}"
    missing = [n for n in ("Controller", "DecisionParams", "WindowClosed", "TableCommitted") if not hasattr(mod, n)]
    return f"controlplane.controller lacks {missing}" if missing else None


class _CommitAtOnce:
    """The bench's commit backend for one in-process node (agent.decision.pipeline.Proposals): every proposal is chosen
    (one accept round trip of the real consensus takes `commit_latency` steps, charged when the table reaches
    serving), and its outcome and commit reach the pipeline when the bench delivers them (`deliver`), after the
    window that proposed it, as a real backend's would."""

    def __init__(self, head: RoutingTable) -> None:
        self._head = head
        self.pending: list[tuple[RoutingTable, Any, Callable[[Any], None]]] = []

    @property
    def head(self) -> RoutingTable:
        return self._head

    def propose(self, table: RoutingTable, plan: Any, on_done: Callable[[Any], None]) -> None:
        self.pending.append((table, plan, on_done))

    def deliver(self, pipeline: Any) -> list[tuple[RoutingTable, Any]]:
        """Commit what was proposed, in order: (table, plan) of each commit."""
        from agent.consensus.core import Outcome
        from dataplane_shim.certify import certified_commit

        done = []
        while self.pending:
            table, plan, on_done = self.pending.pop(0)
            if table.version != self._head.version + 1:  # proposed on a head another commit replaced
                on_done(Outcome(False, table.version, f"version {table.version} committed another table"))
                continue
            commit = certified_commit(table, ["bench"], 1)
            commit.plan.CopyFrom(plan)
            self._head = table
            on_done(Outcome(True, table.version, "", [], 0.0, commit))
            pipeline.on_commit(commit, table, pipeline.window_seq)
            done.append((table, plan))
        return done


class _StepClock:
    """The pipeline's clock in the bench: steps of the trace, in seconds of `step_s` each."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.step = step_s, 0

    def now(self) -> float:
        return self.step * self.step_s


@dataclass
class Elastic:
    """This project's decision path as every agent runs it: agent.decision.pipeline.DecisionPipeline (the controller,
    the planning turn, the voter's replay windows, the Ready loop) of one deciding node, fed by the agents' load
    path (bench.agentfeed: every node's engine reports with their sampled steps -> its LoadPath -> its window
    as gossip sends it -> the deciding node's cluster windows). Every proposal commits (`_CommitAtOnce`) and
    reaches the engines `commit_latency` steps after its window closed (gossip, the decision, one accept round
    trip); the engines' plugins then install it as they do, at the step after their next version agreement
    (every `agree_every` steps: dataplane_shim.plugin.AGREE_EVERY, overlapped with one step); the copies
    then overlap serving. Not modelled here: the turn among several nodes, consensus faults (`emoe demo`,
    `emoe bench --live` and chaos/ run those)."""

    window: int  # the agents' decision.window: the steps between two closes of the decision path
    commit_latency: int = 3
    agree_every: int = 32  # the plugins' EMOE_AGREE_EVERY (make_policy passes the shipped default)
    params: dict[str, Any] = field(default_factory=dict)
    profile: Any = None  # controlplane.profile.StabilityProfile: the planner's prior (None: none)
    name: str = "elastic"
    holds_tokens: bool = True  # the shim masks a dead rank once detected and holds pairs it cannot serve
    pipeline: Any = None
    seq: int = 0
    decisions: list[dict[str, Any]] = field(default_factory=list)
    # the engine's wall time of sampled steps under a table (bench.agentfeed.StepModel), which its plugins report
    # (LoadReport.step_us) and the agents fit their step time from; None: none reported
    step_ms: Any = None
    served_ms: Any = None  # [T] each step as the bench served it (bench.run.simulate sets it): what the engines report
    served_version: Any = None  # [T] the table version each step was served on (simulate sets it)
    # per decision: the steps [start, end) of each window its step-time fit held, and the table that served them
    fits: list[list[tuple[int, int, Any]]] = field(default_factory=list)
    judged: list[list[tuple[int, int, Any]]] = field(default_factory=list)  # the windows each decision's step time was read at
    served: list[tuple[int, int, Any]] = field(default_factory=list)  # (first, end, table) of every window fed
    explains: list[dict[str, Any]] = field(default_factory=list)

    @property
    def cadence(self) -> int:
        """The bench calls `on_window` every this many steps: the agents' window."""
        return self.window

    def start(self, base: RoutingTable, counts: Counts, drift_steps: list[int]) -> list[Change]:
        from agent.admin.telemetry import Telemetry
        from agent.config import ConsensusConfig, DecisionConfig
        from agent.decision.pipeline import DecisionPipeline
        from agent.decision.voter import Voter
        from controlplane.params import DecisionParams

        params = DecisionParams(**{"window": self.window, **self.params})
        self.backend = _CommitAtOnce(base)
        self.clock = _StepClock(1e-3)
        self.pipeline = DecisionPipeline(
            "bench", params, self.backend, Voter(params, ConsensusConfig().verify_tolerance), voters=["bench"],
            live_voters=lambda: ["bench"], handover_windows=DecisionConfig().handover_windows, clock=self.clock,
            telemetry=Telemetry(enabled=False), profile=self.profile)
        self.pipeline.hooks.explained.append(self._explained)
        self.feed = LoadFeed(base.topology, base.layers, base.experts, self.window, params.sample_every,
                             self.pipeline.close_window, step_ms=self.step_ms)
        self.pipeline.timing = self.feed.paths[self.feed.decider].cluster.timing
        self._step = 0
        return []

    def _explained(self, ev: Any) -> None:  # why the controller did or did not act, for the report
        self.explains.append({"window": self.seq, "step": self._step, "outcome": ev.outcome, "detail": ev.detail,
                              "imbalance": float(ev.imbalance)})

    def on_window(self, first: int, end: int, seen: Counts) -> list[Change]:
        self._step = self.clock.step = end
        self.served.append((first, end, self.backend.head))
        served = None if self.served_ms is None else self.served_ms[first:end]
        ran = None if self.served_version is None else self.served_version[first:end]
        self.feed.feed(first, seen[first:end], self.backend.head, served, ran)  # closes the window at the pipeline
        out = self._commits(end)
        self.seq += 1
        return out

    def on_ranks_lost(self, step: int, ranks: list[int]) -> list[Change]:
        """Membership declared `ranks` dead at `step`: the controller proposes a repair (RanksLost)."""
        from controlplane.controller import RanksLost

        self._step = self.clock.step = step
        self.pipeline.step(RanksLost(tuple(ranks)))
        return self._commits(step)

    def _step_time(self, step: int) -> dict[str, Any]:
        """The step time the controller decided with, where it came from, and the steps its fit saw."""
        ctl = self.pipeline.controller
        st = ctl.measures.step_time
        lo, hi = _fit_span(ctl)
        W = ctl.params.window
        tables = {first: table for first, _, table in self.served}
        self.fits.append([(w * W, (w + 1) * W, tables.get(w * W)) for w in sorted(w[0] for w in ctl.measures.steptime._windows)])
        self.judged.append([(w * W, (w + 1) * W, tables.get(w * W)) for w in ctl.measures.judged_windows])
        cs = ctl.measures.copy_slowdown
        return {"load_ms_estimated": round(float(st.load_ms), 4), "load_ms_source": str(st.source),
                "load_ms_why": st.why, "fit_steps": [lo, hi], "copy_slowdown_estimated": round(cs.factor, 3),
                "copy_slowdown_measured": None if cs.ratio is None else round(cs.ratio, 3),
                "copy_slowdown_measured_low": None if cs.ratio_low is None else round(cs.ratio_low, 3),
                "copy_slowdown_source": str(cs.source), "copy_slowdown_why": cs.why}

    def _commits(self, step: int) -> list[Change]:
        from agent.wire import ops_from_pb, plan_kind

        out: list[Change] = []
        for table, plan in self.backend.deliver(self.pipeline):
            ops = ops_from_pb(plan.ops)
            rec = self.pipeline.explains.get(table.version)
            kind = plan_kind(plan)
            self.decisions.append({
                "window": self.seq, "step": step, "kind": kind, "trigger": plan.trigger, "ops": len(ops),
                "op_kinds": dict(sorted(Counter(str(o.kind) for o in ops).items())),
                "refused_candidates": len(rec.refused) if rec is not None else 0,
                "estimated_gain": float(plan.estimated_gain), "verified_gain": float(plan.verified_gain),
                "cost_s": float(plan.cost), "version": table.version,
                **self._step_time(step),
            })
            out.append(Change(table, install_step(step + self.commit_latency, self.agree_every), "overlapped", kind))
        return out


def _fit_span(ctl: Any) -> tuple[int, int]:
    """The steps [lo, hi) of the windows the controller's step-time fit holds (controlplane.steptime)."""
    held = [w[0] for w in ctl.measures.steptime._windows]
    W = ctl.params.window
    return (min(held) * W, (max(held) + 1) * W) if held else (0, 0)


def install_step(arrival: int, agree_every: int) -> int:
    """The step a version that reaches the engines' plugins at step `arrival` is first served at: they agree at
    the next agreement step (a multiple of `agree_every`) and take the agreement one step later
    (dataplane_shim.vllm_plugin: the all-reduce overlaps that step)."""
    return -(-arrival // agree_every) * agree_every + 1


POLICY_NAMES = ("static", "eplb", "craft", "craft-periodic", "elastic", "hindsight")


def make_policy(spec: str, window: int, groups: int, craft_budget: float, commit_latency: int,
                elastic_params: dict[str, Any] | None = None, agree_every: int | None = None) -> Policy:
    """`static`, `eplb[:PERIOD]`, `craft[:PERIOD]`, `craft-periodic[:PERIOD]`, `elastic`, `hindsight`;
    `agree_every`: the plugins' agreement period (default: theirs, dataplane_shim.plugin.AGREE_EVERY)."""
    name, _, arg = spec.strip().partition(":")
    if name not in POLICY_NAMES:
        raise ValueError(f"policy {spec!r}: expected one of {', '.join(POLICY_NAMES)} (eplb:PERIOD allowed)")
    period = 1000
    if arg:
        if name not in ("eplb", "craft", "craft-periodic") or not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"policy {spec!r}: only eplb/craft/craft-periodic take ':PERIOD' (a positive int)")
        period = int(arg)
    label = spec.strip()
    if name == "static":
        return Static()
    if name == "eplb":
        return Eplb(window, period, groups, name=label)
    if name in ("craft", "craft-periodic"):
        return Craft(window, period, name == "craft-periodic", craft_budget, name=label)
    if name == "hindsight":
        return Hindsight(groups)
    from dataplane_shim.plugin import AGREE_EVERY

    params = dict(elastic_params or {})
    # the agents' window: `--elastic-param window=N`, else the bench's W (run_bench passes the shipped default)
    return Elastic(int(params.pop("window", window)), commit_latency, agree_every or AGREE_EVERY, params)
