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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from bench.agentfeed import StepModel, rank_shares
from bench.policies import Change, Counts
from chaos.localcluster import LocalCluster
from controlplane.table import RoutingTable, initial_table
from controlplane.topology import Topology
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import admin_pb2_grpc

# the agents' decision settings the bench's --elastic-param may carry (agent.config.DecisionConfig)
DECISION_KEYS = ("window", "theta", "budget_windows", "tau", "rollback_windows", "max_ops", "replay_windows",
                 "planner", "sample_every", "handover_windows", "load_ms", "horizon_windows", "worth_margin",
                 "polish_theta", "polish_lam", "fast_theta", "copy_cost_measured")


@dataclass
class Install:
    step: int  # the first step served under `table`
    table: RoutingTable


@dataclass
class LiveRun:
    installs: list[Install]
    replay_s: float  # wall seconds the replay of every step took (its schedule: steps x step_s)
    # per installed version, what `emoe explain VERSION` says of the step time and copy cost its proposer decided
    # with (ExplainReply.step_time, .copy_cost; empty where no agent holds its record)
    explained: dict[int, dict[str, str]] = field(default_factory=dict)


def behind(steps: int, step_s: float, replay_s: float) -> float:
    """How far behind its schedule (steps x step_s) a replay of `replay_s` wall seconds ran: 0.1 is 10% late."""
    return replay_s / (steps * step_s) - 1


def behind_warning(steps: int, step_s: float, replay_s: float, agents: int, ranks: int) -> str | None:
    """A warning when the replay ran more than 10% behind its schedule: this machine could not step `ranks`
    plugin cores beside `agents` agents in real time, so the agents worked in a slower, overloaded cluster than
    the one modelled (late plans, peers suspected), and the live figures measure that cluster."""
    late, planned = behind(steps, step_s, replay_s), steps * step_s
    if late <= 0.1:
        return None
    return (f"emoe bench --live: the replay ran {late:.0%} behind its schedule ({steps} steps in "
            f"{replay_s:.1f} s, not {planned:.1f}): this machine could not run {agents} agents and {ranks} engine "
            f"ranks in real time, and the live figures measure an overloaded cluster; raise --live-step-ms "
            f"(now {step_s * 1e3:g}; a DeepSeek-V3 decode step takes about 30)")


def genesis_spec(base: RoutingTable, directory: Path) -> str:
    """The agents' and plugins' genesis for `base`: "static", or an EPLB placement file written for it."""
    from dataplane_shim.adapters import to_eplb

    if base.content_equal(initial_table(base.topology, base.layers, base.experts)):
        return "static"
    path = directory / "genesis.npz"
    phy2log, log2phy, logcnt = to_eplb(base)
    np.savez(path, phy2log=phy2log, log2phy=log2phy, logcnt=logcnt)
    return str(path)


class MemoryGroup:
    """The EP ranks' MIN all-reduce over the cores in memory, overlapped as vLLM's: each rank's side
    (`ranks[g]`, a `dataplane_shim.agreement.Collective`) starts an agreement at an agreement step and takes, at
    the next step, the MIN of the vectors every rank started with it."""

    def __init__(self, n: int) -> None:
        self.ranks = [_MemoryRank(self) for _ in range(n)]
        self.rounds: dict[int, list[npt.NDArray[np.int64]]] = {}  # agreement round -> the vectors started in it
        self.taken: dict[int, int] = {}  # agreement round -> how many ranks took its result


class _MemoryRank:
    def __init__(self, group: MemoryGroup) -> None:
        self.group = group
        self.started = 0  # agreements this rank started
        self.in_flight: int | None = None  # the round it started and has not taken

    def start_agreement(self, vector: npt.NDArray[np.int64]) -> npt.NDArray[np.int64] | None:
        self.in_flight, self.started = self.started, self.started + 1
        self.group.rounds.setdefault(self.in_flight, []).append(np.array(vector, dtype=np.int64))
        return None

    def take_agreement(self) -> npt.NDArray[np.int64] | None:
        r, self.in_flight = self.in_flight, None
        if r is None:
            return None
        vectors = self.group.rounds[r]
        if len(vectors) != len(self.group.ranks):  # a rank that skipped a collective: the replay's own bug
            raise RuntimeError(f"agreement round {r}: {len(vectors)} of {len(self.group.ranks)} ranks started it")
        self.group.taken[r] = self.group.taken.get(r, 0) + 1
        if self.group.taken[r] == len(vectors):  # every rank took it
            del self.group.rounds[r], self.group.taken[r]
        return np.asarray(np.min(vectors, axis=0), dtype=np.int64)


class ReplayEngine:
    """EP ranks' plugin cores and installers (one per rank in `sockets`, each linked to its node's agent at
    that unix socket), stepped in lockstep on this thread. `emoe bench --live` feeds every rank of its own
    cluster; `emoe load replay` the ranks of the agents it is given."""

    def __init__(self, sockets: Mapping[int, str], topo: Topology, counts: Counts, base: RoutingTable, genesis: str,
                 sample_every: int, agree_every: int | None = None, window: int = 100,
                 report_every: int | None = None, claim: bool = True, first_step: int = 0,
                 step_ms: StepModel | None = None) -> None:
        """The plugins report every `report_every` steps; by default EMOE_REPORT_EVERY (25), or, where that
        does not divide the agents' `window`, every largest divisor of it below that (as an operator sets
        EMOE_REPORT_EVERY then). `claim`: each link names its rank when it opens, as an engine's plugin does,
        so that the agent repairs the rank when the link closes (its process left); without, the ranks are
        fed and may close without being drained. `first_step`: the first step's number (the agents' windows
        are numbered by the engines' steps: a feed that starts past their newest window is not dropped as late)."""
        from dataplane_shim.install import Installer
        from dataplane_shim.link import LinkThread
        from dataplane_shim.plugin import AGREE_EVERY, REPORT_EVERY, PluginCore

        self.topo, self.counts = topo, counts
        L, E = counts.shape[1:]
        self.ranks = sorted(sockets)
        self.links = [LinkThread(sockets[g], 1, shim_id=f"rank{g}", ranks=[g] if claim else []) for g in self.ranks]
        agree_every = agree_every or AGREE_EVERY
        if report_every is None:
            report_every = max(d for d in range(1, min(REPORT_EVERY, window) + 1) if window % d == 0)
        self.cores = [PluginCore(link, topo, L, E, g, base.phy2log, genesis=genesis, report_every=report_every,
                                 shim_id=f"rank{g}", sample_every=sample_every, first_step=first_step)
                      for g, link in zip(self.ranks, self.links, strict=True)]
        self.insts = [Installer(c, agree_every=agree_every, stall_steps=1 << 30, rank=c.rank) for c in self.cores]
        self.table = base
        self._share, self._first = rank_shares(base)
        self.step_ms = step_ms  # the engine's wall time of a step (ms) under its table, which the plugins report
        self.group = MemoryGroup(len(self.cores))  # the ranks' agreement collective
        self.replay_s = 0.0  # wall seconds the last `run` took

    def step(self, counts: npt.NDArray[np.integer]) -> RoutingTable | None:
        """One decode step of `counts` [L, E] tokens: the plugins' agreement and install at its boundary, then
        each rank serves its share under the table it runs and reports on its schedule. Returns the table
        installed at this step, if any."""
        # the plugins' step order (Installer.begin_step), their MIN all-reduce over the cores in memory here,
        # overlapped as in vLLM: started at an agreement step, taken at the next (vllm_plugin.start_agreement)
        armed = [i.begin_step(c) for i, c in zip(self.insts, self.group.ranks, strict=True)]
        for i in self.insts:
            i.after_step(moving=False, matched=True)  # the replay engine installs at once
        installed = armed[0]
        if installed is not None:
            self.table = installed
            self._share, self._first = rank_shares(installed)
        c = np.asarray(counts, dtype=np.int64)
        per = np.floor(c[None] * self._share).astype(np.int64)  # [G, L, E]
        rem = c - per.sum(axis=0)
        li, ei = np.nonzero(rem)
        per[self._first[li, ei], li, ei] += rem[li, ei]
        took = None  # every step is timed: a sampled step reports its own and its stride's mean (dataplane_shim.plugin)
        if self.step_ms is not None:  # every rank's step takes the EP step's time
            took = float(self.step_ms(self.table, c[None])[0]) * 1e3
        for core in self.cores:
            g = core.rank
            offs = core.sampled(1)
            if took is not None:
                core.step_took(0, took)
            core.add_load(per[g], 1, per[g][None] if offs else None)
            core.maybe_report()
        return installed

    def run(self, step_s: float, progress: bool) -> list[Install]:
        """Step every row of the trace, one every `step_s` of wall time (no sooner; later when this machine is
        slower than that: `replay_s` says how long it took); the installs, in order."""
        T = self.counts.shape[0]
        installs: list[Install] = []
        t_start = time.monotonic()
        tenth = -1
        for t in range(T):
            table = self.step(self.counts[t])
            if table is not None:
                installs.append(Install(t, table))
            if progress and (t + 1) * 10 // T > tenth:
                tenth = (t + 1) * 10 // T
                print(f"  live: step {t + 1}/{T}, version {self.table.version}, {time.monotonic() - t_start:.1f} s",
                      file=sys.stderr, flush=True)
            wait = t_start + (t + 1) * step_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        self.replay_s = time.monotonic() - t_start
        self.flush()
        return installs

    def flush(self) -> None:
        """Offer every rank's load since its last report."""
        for core in self.cores:
            core.flush()

    @property
    def reports(self) -> tuple[int, int]:
        """(load reports sent to the agents, reports dropped: an agent too slow or absent)."""
        return sum(link.sent for link in self.links), sum(link.dropped for link in self.links)

    def close(self) -> None:
        # newest first: gRPC's aio completion queue is shared by the loops of one process and was created on the
        # first link's loop; closing that loop last made gRPC's "Event loop is closed" callbacks at exit rare
        # (none in 12 runs of `emoe load replay`, against 3 of 12 in creation order; rare, not never)
        for link in reversed(self.links):
            link.close()


def run_live(counts: Counts, top_k: int, base: RoutingTable, window: int, params: dict[str, Any],
             step_s: float = 0.01, progress: bool = True, agree_every: int | None = None,
             step_ms: StepModel | None = None) -> LiveRun:
    """Replay `counts` [T, L, E] through real agents (one a node of base's topology) and the ranks' plugin
    cores; the installs, in order, and how long the replay took. `params`: the elastic policy's decision
    settings (DECISION_KEYS) and `expert_bytes`; `step_ms`: the engine's step time the plugins report."""
    topo = base.topology
    L, E = counts.shape[1:]
    unknown = sorted(set(params) - set(DECISION_KEYS) - {"expert_bytes", "load_ms_override"})
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
            rpn = topo.ranks_per_node
            sockets = {g: cluster.shim_socket(g // rpn) for g in range(topo.ranks)}
            engine = ReplayEngine(sockets, topo, counts, base, genesis, sample_every, agree_every,
                                  int(decision["window"]), step_ms=step_ms)
            try:
                installs = engine.run(step_s, progress)
                return LiveRun(installs, engine.replay_s, explained(cluster, [i.table.version for i in installs]))
            finally:
                engine.close()


def explained(cluster: LocalCluster, versions: list[int]) -> dict[int, dict[str, str]]:
    """What the agents' admin Explain says of each of `versions`: the step time and copy cost its proposer
    decided with, from the first agent that holds its record (the proposer; a version with none is left out)."""
    out: dict[int, dict[str, str]] = {}
    for address in cluster.addresses:
        with grpc.insecure_channel(address) as ch:
            stub = admin_pb2_grpc.AdminStub(ch)
            for v in versions:
                if v in out:
                    continue
                try:
                    r = stub.Explain(apb.ExplainRequest(version=v), timeout=5.0)
                except grpc.RpcError:  # not this agent's record (or it is gone): the next one
                    continue
                if r.step_time:
                    out[v] = {"step_time": r.step_time, "copy_cost": r.copy_cost, "trigger": r.trigger}
    return out


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
