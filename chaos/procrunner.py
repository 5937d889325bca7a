"""The real-process chaos runner: `emoe agent` processes on loopback, faults by signal and by partition file.

- agents: `agent.cluster.LocalCluster` (one process each, own data dir, own shim socket);
- engines: one asyncio task per agent in this process, a shim client over the agent's unix socket
  (`dataplane_shim.link.ShimLink`): it reports skewed load every window (the hot experts move at each
  schedule, so real plans are proposed, voted and committed), installs every certified table it is
  streamed (re-connecting after its agent restarts) and checks each one;
- faults, from a seeded generator, one to three episodes per schedule, each holding 0.8-2.5 s: kill -9
  then restart, SIGSTOP then SIGCONT, partitions (isolate one node, minority | majority, halves) through
  the transport's test-only fault file (`agent.transport.faults`, EMOE_FAULTS_FILE): network namespaces
  with veth pairs need iptables/tc rules per agent and an address per namespace, which this loopback-only
  runner does not use; `partition_mechanism` in the result says so;
- checks (chaos.proccheck): I1 one table per version across every agent's store log; I2 each log and each
  engine strictly increasing with parent = previous; I3 every committed table certified and valid; I5
  after the last heal of a schedule every live agent and engine reach one version within `converge_s`
  (the time is reported); I6 every committed rebalance has a verified gain >= tau, and one that made the
  load the engines reported worse than its parent would have (over the next 3 fault-free windows) is
  superseded within 3 + 10 windows; I7 every commit a node had on disk and the head it acknowledged
  before kill -9 are there after its restart. I4 needs token routing, which these engines do not do.
Every wait is bounded; every process is killed in `finally`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from agent.cluster import LocalCluster, stable_ports
from agent.transport.faults import ENV, write_faults
from chaos.proccheck import Checks, Engine, agent_head, read_log, versions
from controlplane.topology import Topology

SHAPE = {"ranks_per_node": 1, "slots_per_rank": 6, "layers": 2, "experts": 16, "top_k": 2}
DECISION = {"window": 10, "budget_windows": 1, "theta": 1.05, "tau": 0.01}
ROLLBACK_WINDOWS = 3  # decision.rollback_windows (the default)
# I6's grace for a rollback to commit, in windows of 0.1 s: wall time on a shared machine, where 8 agents
# and their gossip compete for a few cores, so wider than the simulator's 3
I6_GRACE_WINDOWS = 10
MECHANISM = ("transport fault file (EMOE_FAULTS_FILE, agent/transport/faults.py): each agent drops gRPC "
             "calls to and from the listed peers; network namespaces unused (loopback-only runner)")


@dataclass
class Episode:
    kill: list[int] = field(default_factory=list)
    pause: list[int] = field(default_factory=list)
    groups: list[list[int]] = field(default_factory=list)  # partition: no traffic between groups
    hold_s: float = 1.0

    def describe(self, ids: list[str]) -> str:
        parts = [f"kill -9 {ids[k]}" for k in self.kill] + [f"SIGSTOP {ids[k]}" for k in self.pause]
        if self.groups:
            parts.append("partition " + " | ".join(",".join(ids[k] for k in g) for g in self.groups))
        return f"{'; '.join(parts)} for {self.hold_s:.1f} s"


def make_schedule(rng: random.Random, n: int) -> list[Episode]:
    """One to three episodes; each a partition and/or a kill and/or a pause, on distinct nodes."""
    out = []
    for _ in range(rng.randint(1, 3)):
        ep = Episode(hold_s=round(rng.uniform(0.8, 2.5), 2))
        nodes = list(range(n))
        rng.shuffle(nodes)
        kinds = rng.sample(["partition", "kill", "pause"], rng.randint(1, 2))
        if "partition" in kinds:
            shape = rng.choice(["isolate", "minority", "halves"])
            cut = {"isolate": 1, "minority": (n - 1) // 2, "halves": n // 2}[shape]
            ep.groups = [sorted(nodes[:cut]), sorted(nodes[cut:])]
        if "kill" in kinds:
            ep.kill = [nodes.pop()]
        if "pause" in kinds:
            ep.pause = [nodes.pop()]
        out.append(ep)
    return out


def _drop_map(ids: list[str], groups: list[list[int]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for g in groups:
        others = [ids[k] for h in groups if h is not g for k in h]
        for k in g:
            out[ids[k]] = others
    return out


class ProcRunner:
    def __init__(self, nodes: int, base: Path, seed: int, converge_s: float = 30.0, warm_s: float = 1.0,
                 log: Any = None) -> None:
        self.n, self.base, self.seed, self.converge_s, self.warm_s = nodes, base, seed, converge_s, warm_s
        self.rng = random.Random(seed)
        self.faults_path = str(base / "faults.json")
        self.cluster = LocalCluster(nodes, base / "agents", {"nodes": nodes, **SHAPE}, profile="test",
                                    sections={"decision": DECISION}, ports=stable_ports(nodes))
        self.topo = Topology(nodes, SHAPE["ranks_per_node"], SHAPE["slots_per_rank"])
        self.checks = Checks(self.topo, self.cluster.ids, tau=DECISION["tau"])
        self.windows: dict[int, np.ndarray] = {}  # window seq -> load the engines reported, summed [L, E]
        self.reporters: dict[int, int] = {}  # window seq -> engines that reported it
        self.faulty: list[tuple[float, float]] = []  # (first fault, every agent serving again) per episode
        self.hot = np.arange(2)
        self.engines = [Engine(i, self.cluster.shim_socket(i), self.topo, self.checks, self) for i in range(nodes)]
        self.channels: list[grpc.aio.Channel] = []  # made on the runner's loop
        self.paused: set[int] = set()
        self.t0 = time.monotonic()  # the engines' shared step clock
        self.healed_at = self.t0
        self.down: set[int] = set()
        self.failed: set[int] = set()  # agents that did not come back after a restart (not live)
        self.convergence: list[float] = []
        self.fault_counts = {"kill": 0, "pause": 0, "partition": 0}
        self.log = log or (lambda *a: None)

    def log_path(self, k: int) -> Path:
        return Path(self.cluster.configs[k]).parent / "data" / "consensus"

    def counts(self, rng: np.random.Generator, steps: int) -> np.ndarray:
        """Skewed load [L, E] for one window: the current hot experts take most tokens."""
        p = np.ones(SHAPE["experts"])
        p[self.hot] = 10.0
        p /= p.sum()
        return np.stack([rng.multinomial(steps * 32, p) for _ in range(SHAPE["layers"])]).astype(np.uint32)

    async def heads(self) -> list[int | None]:
        return list(await asyncio.gather(*(agent_head(self.channels[k]) for k in range(self.n))))

    async def wait_serving(self, ks: list[int], limit_s: float = 30.0) -> bool:
        deadline = time.monotonic() + limit_s
        for k in ks:
            while await agent_head(self.channels[k]) is None:
                proc = self.cluster.procs[k]
                if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
                    return False
                await asyncio.sleep(0.2)
        return True

    async def episode(self, ep: Episode) -> None:
        start = time.monotonic()
        try:
            await self._episode(ep)
        finally:
            self.faulty.append((start, time.monotonic()))

    async def _episode(self, ep: Episode) -> None:
        ids = self.cluster.ids
        before: dict[int, tuple[dict[int, bytes], int | None]] = {}  # node -> (version -> hash on disk, acked head)
        if ep.groups:
            write_faults(self.faults_path, _drop_map(ids, ep.groups))
            self.fault_counts["partition"] += 1
        for k in ep.pause:
            self.cluster.signal(k, signal.SIGSTOP)
            self.paused.add(k)
            self.fault_counts["pause"] += 1
        for k in ep.kill:
            acked = await agent_head(self.channels[k])
            self.cluster.signal(k, signal.SIGKILL)
            proc = self.cluster.procs[k]
            if proc is not None:
                await asyncio.to_thread(proc.wait, 10)
            before[k] = (versions(read_log(self.log_path(k))), acked)  # what was on disk at the kill
            self.down.add(k)
            self.fault_counts["kill"] += 1
        await asyncio.sleep(ep.hold_s)
        write_faults(self.faults_path, {})
        for k in ep.pause:
            self.cluster.signal(k, signal.SIGCONT)
            self.paused.discard(k)
        for k in ep.kill:
            self.cluster.start(k)
        self.healed_at = time.monotonic()  # I5's clock starts when the faults are lifted (restart issued)
        for k in ep.kill:
            self.down.discard(k)
            if not await self.wait_serving([k]):  # counted once; the node is left out of I5 until it is back
                self.failed.add(k)
                self.checks.note("I7", f"{ids[k]}:restart{self.fault_counts['kill']}",
                                 f"{ids[k]} not serving 30 s after restart: {self.log_tail(k)}")
                continue
            self.failed.discard(k)
            after, acked_after = versions(read_log(self.log_path(k))), await agent_head(self.channels[k])
            self.checks.restart(ids[k], before[k][0], before[k][1], after, acked_after)

    def log_tail(self, k: int, lines: int = 3) -> str:
        try:
            text = self.cluster.log(k).read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " / ".join(text[-lines:]) or "(empty log)"

    async def converge(self) -> float | None:
        """Seconds from the last heal until every agent and engine runs one version (None past converge_s)."""
        t0 = self.healed_at
        live = [k for k in range(self.n) if k not in self.failed]
        while time.monotonic() - t0 < self.converge_s:
            hs = [h for k, h in enumerate(await self.heads()) if k in live]
            es = {self.engines[k].head for k in live}
            if None not in hs and len(set(hs)) == 1 and es == set(hs):
                return time.monotonic() - t0
            await asyncio.sleep(0.1)
        return None

    def judge_realised(self) -> None:
        """I6 on realised effect, over every rebalance installed so far (each counted once)."""
        from controlplane.table import initial_table

        genesis = initial_table(self.topo, SHAPE["layers"], SHAPE["experts"])
        e = self.engines[0]
        self.checks.i6_judged = 0
        whole = {k: w for k, w in self.windows.items() if self.reporters.get(k) == self.n}
        self.checks.realised(genesis, whole, self.t0, e.step_s * e.window, self.faulty,
                             n=ROLLBACK_WINDOWS, grace=I6_GRACE_WINDOWS, now=time.monotonic())

    async def run(self, schedules: int) -> dict[str, Any]:
        t_start = time.monotonic()
        old = os.environ.get(ENV)
        os.environ[ENV] = self.faults_path
        write_faults(self.faults_path, {})
        tasks: list[asyncio.Task[None]] = []
        self.channels = [grpc.aio.insecure_channel(a) for a in self.cluster.addresses]
        try:
            self.cluster.start()
            if not await self.wait_serving(list(range(self.n)), 90.0):
                raise RuntimeError(f"agents not serving after 90 s: see {self.cluster.base}")
            tasks = [asyncio.create_task(e.run()) for e in self.engines]
            for s in range(schedules):
                self.hot = np.array(self.rng.sample(range(SHAPE["experts"]), 2))  # drift: new hot experts
                eps = make_schedule(self.rng, self.n)
                await asyncio.sleep(self.warm_s)  # unfaulted load: plans for the new hot set start committing
                for ep in eps:
                    self.log(f"schedule {s}: {ep.describe(self.cluster.ids)}")
                    await self.episode(ep)
                c = await self.converge()
                if c is None:
                    hs = await self.heads()
                    self.checks.note("I5", f"schedule {s}: no agreement within {self.converge_s} s: agents {hs}, "
                                           f"engines {[e.head for e in self.engines]}")
                else:
                    self.convergence.append(c)
                self.checks.logs({self.cluster.ids[k]: read_log(self.log_path(k)) for k in range(self.n)})
                self.judge_realised()
                self.log(f"schedule {s}: converged in {c} s at v{self.engines[0].head}; {self.checks.summary()}")
            # the last rebalances' deadlines: unfaulted load until they pass, then judge them too
            e = self.engines[0]
            await asyncio.sleep((ROLLBACK_WINDOWS + I6_GRACE_WINDOWS + 2) * e.step_s * e.window)
            self.checks.logs({self.cluster.ids[k]: read_log(self.log_path(k)) for k in range(self.n)})
            self.judge_realised()
        finally:
            for e in self.engines:
                e.stop = True
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for k in range(self.n):
                self.cluster.signal(k, signal.SIGCONT)
            await asyncio.to_thread(self.cluster.stop)
            for ch in self.channels:
                await ch.close()
            if old is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = old
        conv = np.array(self.convergence) if self.convergence else np.array([np.nan])
        return {
            "runner": "processes", "nodes": self.n, "schedules": schedules,
            "violations": self.checks.violations(),
            "convergence_p99_s": None if np.isnan(conv).all() else round(float(np.percentile(conv, 99)), 3),
            "partition_mechanism": MECHANISM,
            "convergence_max_s": None if np.isnan(conv).all() else round(float(np.max(conv)), 3),
            "restart_failures": sorted(self.cluster.ids[k] for k in self.failed),
            "commits": self.checks.max_version - 1, "installs_checked": sum(e.installs for e in self.engines),
            "faults": self.fault_counts, "i6_judged": self.checks.i6_judged,
            "not_checked": {"I4": "these engines install tables but route no tokens: I4 is checked by the sim "
                                  "runner and by 8 engine processes on shared-memory counters "
                                  "(tests/test_shim_multiprocess.py)"},
            "details": self.checks.details[:20], "seed": self.seed, "wall_s": round(time.monotonic() - t_start, 1),
        }


def run_processes(nodes: int, schedules: int, seed: int, out: Path | None = None, progress: bool = False) -> dict[str, Any]:
    """Run `schedules` fault schedules against `nodes` agent processes; the JSON report as a dict (also
    written to out/report.json when `out` is given)."""
    import json

    if nodes < 3:
        raise ValueError(f"--nodes {nodes}: expected >= 3 (a quorum must survive one fault)")
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else None
    with tempfile.TemporaryDirectory(prefix="emoe-chaos-") as tmp:
        runner = ProcRunner(nodes, Path(tmp), seed, log=say)
        result = asyncio.run(runner.run(schedules))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(result, indent=2) + "\n")
    return result



def main(a: argparse.Namespace) -> int:
    """`python -m chaos run --runner processes ...` (chaos/__main__.py's hook): print the report (one JSON
    line with --json, progress on stderr otherwise); exit status 1 if an invariant was violated."""
    import json

    try:
        res = run_processes(a.nodes, a.schedules, a.seed, Path(a.out) if a.out else None,
                            progress=not a.json or bool(getattr(a, "progress", 0)))
    except (ValueError, RuntimeError) as e:
        print(f"chaos run --runner processes: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res) if a.json else json.dumps(res, indent=2))
    return 1 if any(res["violations"].values()) else 0
