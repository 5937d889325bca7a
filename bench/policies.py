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
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

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


@dataclass
class Elastic:
    """This project's decision core (controlplane.controller) with agents simulated in-process.

    At each window close the controller gets the window's per-step counts; every proposal it makes that
    is not refused commits after `commit_latency` steps (one accept round trip and a step boundary), the
    controller is told at once (it sees no window in between), and the copies then overlap serving.
    """

    window: int
    commit_latency: int = 3
    params: dict[str, Any] = field(default_factory=dict)
    profile: Any = None  # controlplane.profile.StabilityProfile: the planner's prior (None: none)
    name: str = "elastic"
    holds_tokens: bool = True  # the shim masks a dead rank once detected and holds pairs it cannot serve
    ctrl: Any = None
    seq: int = 0
    decisions: list[dict[str, Any]] = field(default_factory=list)
    explains: list[dict[str, Any]] = field(default_factory=list)

    def start(self, base: RoutingTable, counts: Counts, drift_steps: list[int]) -> list[Change]:
        mod = importlib.import_module("controlplane.controller")
        params = mod.DecisionParams(**{"window": self.window, **self.params})
        self.ctrl = mod.Controller(params, base, self.profile)
        self._mod = mod
        return []

    def on_window(self, first: int, end: int, seen: Counts) -> list[Change]:
        ready = self.ctrl.step(self._mod.WindowClosed(self.seq, first, np.ascontiguousarray(seen[first:end])))
        self.seq += 1
        return self._proposals(ready, end)

    def on_ranks_lost(self, step: int, ranks: list[int]) -> list[Change]:
        """Membership declared `ranks` dead at `step`: the controller proposes a repair (RanksLost)."""
        return self._proposals(self.ctrl.step(self._mod.RanksLost(tuple(ranks))), step)

    def _proposals(self, ready: Any, step: int) -> list[Change]:
        mod = self._mod
        for ev in ready.events:  # why the controller did or did not act (Explain), for the report
            if hasattr(ev, "outcome"):
                self.explains.append({"window": self.seq - 1, "step": step, "outcome": ev.outcome,
                                      "detail": ev.detail, "imbalance": float(ev.imbalance)})
        self.ctrl.advance()
        out: list[Change] = []
        for d in list(ready.proposals):  # every proposal is sent; `refused` lists the candidates it left out
            self.decisions.append({
                "window": self.seq - 1, "step": step, "kind": d.kind, "trigger": d.trigger, "ops": len(d.ops),
                "op_kinds": dict(sorted(Counter(str(o.kind) for o in d.ops).items())),
                "refused_candidates": len(d.refused), "estimated_gain": float(d.estimated_gain),
                "verified_gain": float(d.verified_gain), "cost_s": float(d.cost), "version": d.table.version,
            })
            self.ctrl.step(mod.TableCommitted(d.table, d.kind))  # quorum reached within commit_latency steps
            self.ctrl.advance()
            out.append(Change(d.table, step + self.commit_latency, "overlapped", d.kind))
        return out


POLICY_NAMES = ("static", "eplb", "craft", "craft-periodic", "elastic", "hindsight")


def make_policy(spec: str, window: int, groups: int, craft_budget: float, commit_latency: int,
                elastic_params: dict[str, Any] | None = None) -> Policy:
    """`static`, `eplb[:PERIOD]`, `craft[:PERIOD]`, `craft-periodic[:PERIOD]`, `elastic`, `hindsight`."""
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
    return Elastic(window, commit_latency, dict(elastic_params or {}))
