"""`emoe bench --live`: the elastic policy as real agent processes, fed by the engine plugins' own core.

One `emoe agent` process per node on loopback gRPC (chaos.localcluster, the `local` profile), and one engine
plugin core per EP rank (dataplane_shim.plugin.PluginCore and its Installer, the code that runs inside vLLM
and SGLang) replaying the trace step by step on this process's thread: each rank serves its share of the
step's tokens under the table it runs (its replicas' share of each expert), reports them over its unix
socket every EMOE_REPORT_EVERY steps with the sampled steps, and the ranks agree on a version every
EMOE_AGREE_EVERY steps (the MIN all-reduce, here over the cores in memory, overlapped as in the vLLM plugin:
its result is taken at the next step) and install it at a step boundary.
The agents gossip, close windows, take their planning turns, verify, vote and commit as in production.

What comes out is the sequence of installs (step, table); the bench then serves the trace under them as it
serves every policy (copies overlapped with serving from the install step, bench.run.simulate), so the
results are measured alike. Unlike the in-process path: gossip, the turn, the decision's own CPU time and
consensus take real time here (the in-process path charges `commit_latency` steps for them; both then wait for
the plugins' next agreement), a step takes `step_s` of wall time, not the modelled step time, and weight copies
are not made (the engine installs at once, and the bench charges the copies as for the in-process policy).
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.agentfeed import rank_shares
from bench.policies import Change, Counts
from chaos.localcluster import LocalCluster
from controlplane.table import RoutingTable, initial_table
from controlplane.topology import Topology

# the agents' decision settings the bench's --elastic-param may carry (agent.config.DecisionConfig)
DECISION_KEYS = ("window", "theta", "budget_windows", "tau", "rollback_windows", "max_ops", "replay_windows",
                 "planner", "sample_every", "handover_windows", "load_ms", "horizon_windows", "worth_margin")


@dataclass
class Install:
    step: int  # the first step served under `table`
    table: RoutingTable


def genesis_spec(base: RoutingTable, directory: Path) -> str:
    """The agents' and plugins' genesis for `base`: "static", or an EPLB placement file written for it."""
    from dataplane_shim.adapters import to_eplb

    if base.content_equal(initial_table(base.topology, base.layers, base.experts)):
        return "static"
    path = directory / "genesis.npz"
    phy2log, log2phy, logcnt = to_eplb(base)
    np.savez(path, phy2log=phy2log, log2phy=log2phy, logcnt=logcnt)
    return str(path)


class ReplayEngine:
    """Every EP rank's plugin core and installer, stepped in lockstep on this thread."""

    def __init__(self, cluster: LocalCluster, topo: Topology, counts: Counts, base: RoutingTable, genesis: str,
                 sample_every: int, agree_every: int | None = None, window: int = 100) -> None:
        """The plugins report every EMOE_REPORT_EVERY steps (25), or, where that does not divide the agents'
        `window`, every largest divisor of it below that (as an operator sets EMOE_REPORT_EVERY then)."""
        from dataplane_shim.install import Installer
        from dataplane_shim.link import LinkThread
        from dataplane_shim.plugin import AGREE_EVERY, REPORT_EVERY, PluginCore

        self.topo, self.counts = topo, counts
        L, E = counts.shape[1:]
        rpn = topo.ranks_per_node
        self.links = [LinkThread(cluster.shim_socket(g // rpn), 1, shim_id=f"rank{g}", ranks=[g])
                      for g in range(topo.ranks)]
        agree_every = agree_every or AGREE_EVERY
        report_every = max(d for d in range(1, min(REPORT_EVERY, window) + 1) if window % d == 0)
        self.cores = [PluginCore(link, topo, L, E, g, base.phy2log, genesis=genesis, report_every=report_every,
                                 shim_id=f"rank{g}", sample_every=sample_every) for g, link in enumerate(self.links)]
        self.insts = [Installer(c, agree_every=agree_every, stall_steps=1 << 30, rank=c.rank) for c in self.cores]
        self.table = base

    def run(self, step_s: float, progress: bool) -> list[Install]:
        T = self.counts.shape[0]
        installs: list[Install] = []
        share, first = rank_shares(self.table)
        pending: npt.NDArray[np.int64] | None = None  # the agreement started at the previous step
        t_start = time.monotonic()
        tenth = -1
        for t in range(T):
            # the plugins' overlapped MIN all-reduce (over the cores in memory here): started at an agreement
            # step, taken at the next step (vllm_plugin._agree_step, _take_agreement)
            if pending is not None:
                for i in self.insts:
                    i.agreed(pending)
                pending = None
            if self.insts[0].agreement_due():
                pending = np.min([i.agreement_vector() for i in self.insts], axis=0)
            armed = [i.to_arm() for i in self.insts]
            for i in self.insts:
                i.after_step(moving=False, matched=True)  # the replay engine installs at once
            if armed[0] is not None:
                self.table = armed[0]
                installs.append(Install(t, self.table))
                share, first = rank_shares(self.table)
            c = self.counts[t].astype(np.int64)
            per = np.floor(c[None] * share).astype(np.int64)  # [G, L, E]
            rem = c - per.sum(axis=0)
            li, ei = np.nonzero(rem)
            per[first[li, ei], li, ei] += rem[li, ei]
            for g, core in enumerate(self.cores):
                offs = core.sampled(1)
                core.add_load(per[g], 1, per[g][None] if offs else None)
                core.maybe_report()
            if progress and (t + 1) * 10 // T > tenth:
                tenth = (t + 1) * 10 // T
                print(f"  live: step {t + 1}/{T}, version {self.table.version}, {time.monotonic() - t_start:.1f} s",
                      file=sys.stderr, flush=True)
            wait = t_start + (t + 1) * step_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        for core in self.cores:
            core.flush()
        return installs

    def close(self) -> None:
        for link in self.links:
            link.close()


def run_live(counts: Counts, top_k: int, base: RoutingTable, window: int, params: dict[str, Any],
             step_s: float = 0.01, progress: bool = True, agree_every: int | None = None) -> list[Install]:
    """Replay `counts` [T, L, E] through real agents (one a node of base's topology) and the ranks' plugin
    cores; the installs, in order. `params`: the elastic policy's decision settings (DECISION_KEYS) and
    `expert_bytes`."""
    topo = base.topology
    L, E = counts.shape[1:]
    unknown = sorted(set(params) - set(DECISION_KEYS) - {"expert_bytes"})
    if unknown:
        raise ValueError(f"--live: --elastic-param {unknown}: the agents' [decision] takes only {list(DECISION_KEYS)}")
    decision = {"window": window, **{k: v for k, v in params.items() if k in DECISION_KEYS}}
    sample_every = int(decision.get("sample_every", 10))
    with tempfile.TemporaryDirectory(prefix="emoe-live-") as tmp:
        genesis = genesis_spec(base, Path(tmp))
        shape = {"nodes": topo.nodes, "ranks_per_node": topo.ranks_per_node, "slots_per_rank": topo.slots_per_rank,
                 "layers": L, "experts": E, "top_k": top_k, "genesis": genesis}
        if "expert_bytes" in params:
            shape["expert_bytes"] = int(params["expert_bytes"])
        cluster = LocalCluster(topo.nodes, Path(tmp), shape, profile="local", sections={"decision": decision})
        with cluster.running(timeout=60):
            engine = ReplayEngine(cluster, topo, counts, base, genesis, sample_every, agree_every, window)
            try:
                return engine.run(step_s, progress)
            finally:
                engine.close()


@dataclass
class LivePlayback:
    """The live run's installs as a bench policy: each reaches serving at the step the engines installed it
    (handed to the bench at the window before it, as the in-process policy hands its commits)."""

    installs: list[Install]
    window: int
    name: str = "elastic"
    holds_tokens: bool = True

    def start(self, base: RoutingTable, counts: Counts, drift_steps: list[int]) -> list[Change]:
        return [Change(i.table, i.step, "overlapped") for i in self.installs if i.step < self.window]

    def on_window(self, first: int, end: int, seen: Counts) -> list[Change]:
        return [Change(i.table, i.step, "overlapped") for i in self.installs if end <= i.step < end + self.window]

    @property
    def decisions(self) -> list[dict[str, Any]]:
        """What the engines installed: the step and the version (the agents' own records are in their logs)."""
        return [{"step": i.step, "version": i.table.version} for i in self.installs]
