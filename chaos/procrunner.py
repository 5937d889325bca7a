"""The real-process chaos runner: `emoe agent` processes, faults by signal, by the kernel's packet filters and a
switch process between network namespaces, and on tmpfs data_dirs (the fault file only where none of that exists).

- agents: `chaos.localcluster.LocalCluster` (one process each, own data dir, own shim socket);
- engines: one asyncio task per agent in this process, a shim client over the agent's unix socket
  (`dataplane_shim.link.ShimLink`): it reports skewed load every window (the hot experts move at each
  schedule, so real plans are proposed, voted and committed), installs every certified table it is
  streamed (re-connecting after its agent restarts) and checks each one;
- network: as root with nftables, each agent in a network namespace of its own, joined by a switch process
  (chaos/netns.py, chaos/wire.py); partitions and packet loss are kernel rules in those namespaces, and the
  switch delays (with reordering) and duplicates the packets between them; elsewhere the
  agents share loopback and partitions go through a fault file that each agent's transport reads through its
  drop hook (chaos.faults, run by chaos.agentproc); `partition_mechanism` in the result says which;
- faults, from a seeded generator, one to three episodes per schedule, each holding 0.8-2.5 s: kill -9 then
  restart, SIGSTOP then SIGCONT, partitions (isolate one node, minority | majority, halves), one-way links,
  packet loss, delay and duplication (namespaces only), and with `disks` (root: each data_dir a tmpfs of its
  own, chaos/procfaults.py) a whole-cluster kill -9 and restart, a lost log (the node rebuilds as a
  learner), a whole data_dir wiped (log and IDENTITY marker: the restart looks new, and must enrol with the
  others before it votes), a full disk (the node fail-stops, then resumes), and a byte flipped mid-log (the restart must
  refuse, naming the offset; then `emoe store repair` and a restart that rebuilds);
- checks (chaos.proccheck): I1 one table per version across every agent's store log; I2 each log and each
  engine strictly increasing with parent = previous; I3 every committed table certified and valid; I5
  after the last heal of a schedule every live agent and engine reach one version within `converge_s`
  (the time is reported); I6 every committed rebalance has a verified gain >= tau, and one that made the
  load the engines reported worse than its parent would have (over the next 3 fault-free windows) is
  rolled back (not merely superseded by another rebalance) within 3 + 10 windows, unless the load moved and it is no longer worse over the last 3 of
  them (a rollback would then be the change replay shows worse); I7 every commit a node had on disk and the
  head it acknowledged before kill -9 are there after its restart; I4 no token accepted by a slot whose
  rank's memory lacks its expert, as the engines route tokens between their shims on the streamed tables
  (chaos.proccheck.DataPlane).
Every wait is bounded; every process is killed in `finally`.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from agent.storage.datadir import LOG_NAME
from chaos import procfaults
from chaos.episodes import Episode, make_schedule
from chaos.faults import write_faults
from chaos.localcluster import ROOT, LocalCluster, stable_ports
from chaos.netns import NetLab, unavailable
from chaos.proccheck import Checks, DataPlane, Engine, agent_head, read_log, versions
from controlplane.table import initial_table
from controlplane.topology import Topology

SHAPE = {"ranks_per_node": 1, "slots_per_rank": 6, "layers": 2, "experts": 16, "top_k": 2}
DECISION = {"window": 10, "budget_windows": 1, "theta": 1.05, "tau": 0.01}
ROLLBACK_WINDOWS = 3  # decision.rollback_windows (the default)
HEAD_AGAIN_S = 10.0  # a restarted agent's head, asked again for I7: how long it may take to answer
# I6's grace for a rollback to commit, in windows of 0.1 s: wall time on a shared machine, where 8 agents
# and their gossip compete for a few cores, so wider than the simulator's 3
I6_GRACE_WINDOWS = 10
MECHANISM = ("transport fault file (chaos/faults.py, the transport's drop hook via chaos.agentproc): each agent drops gRPC "
             "calls to and from the listed peers; network namespaces unused ({why})")
NETNS_MECHANISM = ("kernel: each agent in its own network namespace, joined by a switch process on TAP devices; "
                   "partitions, one-way links and packet loss are nftables drop rules on each namespace's input; "
                   "delay, reordering and duplication are the switch's (chaos/netns.py, chaos/wire.py)")


def _drop_map(ids: list[str], groups: list[list[int]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for g in groups:
        others = [ids[k] for h in groups if h is not g for k in h]
        for k in g:
            out[ids[k]] = others
    return out


class ProcRunner:
    def __init__(self, nodes: int, base: Path, seed: int, converge_s: float = 30.0, warm_s: float = 1.0,
                 log: Any = None, netns: bool = True, disks: bool = False) -> None:
        self.n, self.base, self.seed, self.converge_s, self.warm_s = nodes, base, seed, converge_s, warm_s
        self.rng = random.Random(seed)
        self.faults_path = str(base / "faults.json")
        why = unavailable() if netns else "not asked for"
        self.lab = NetLab(nodes) if not why else None
        self.wire_stats: dict[str, int] = {}
        self.mechanism = NETNS_MECHANISM if self.lab is not None else MECHANISM.format(why=why)
        sections: dict[str, dict[str, Any]] = {"decision": DECISION}
        if self.lab is not None:  # an isolated network of namespaces this runner made: plaintext is fine there
            sections["tls"] = {"insecure": True}
            self.cluster = LocalCluster(nodes, base / "agents", {"nodes": nodes, **SHAPE}, profile="test",
                                        sections=sections, ports=[7400] * nodes,
                                        hosts=[self.lab.addr(k) for k in range(nodes)],
                                        wrap=[self.lab.wrap(k) for k in range(nodes)])
        else:
            self.cluster = LocalCluster(nodes, base / "agents", {"nodes": nodes, **SHAPE}, profile="test",
                                        sections=sections, ports=stable_ports(nodes), faults_file=self.faults_path)
        self.disks = ""
        if disks:  # each data_dir a tmpfs of its own, so that one can fill up
            for k in range(nodes):
                why = procfaults.mount_tmpfs(self.data_dir(k))
                if why:
                    self.disks = f"disk faults left out: {why}"
                    break
        else:
            self.disks = "disk faults not asked for"
        self.fault_kinds = {"net": self.lab is not None, "disks": disks and not self.disks}
        self.topo = Topology(nodes, SHAPE["ranks_per_node"], SHAPE["slots_per_rank"])
        self.checks = Checks(self.topo, self.cluster.ids, tau=DECISION["tau"])
        self.windows: dict[int, np.ndarray] = {}  # window seq -> load the engines reported, summed [L, E]
        self.reporters: dict[int, int] = {}  # window seq -> engines that reported it
        self.faulty: list[tuple[float, float]] = []  # (first fault, every agent serving again) per episode
        self.hot = np.arange(2)
        self.engines = [Engine(i, self.cluster.shim_socket(i), self.topo, self.checks, self) for i in range(nodes)]
        self.dataplane = DataPlane(self.engines, initial_table(self.topo, SHAPE["layers"], SHAPE["experts"]),
                                   seed=seed)
        self.channels: list[grpc.aio.Channel] = []  # made on the runner's loop
        self.paused: set[int] = set()
        self.t0 = time.monotonic()  # the engines' shared step clock
        self.healed_at = self.t0
        self.down: set[int] = set()
        self.failed: set[int] = set()  # agents that did not come back after a restart (not live)
        self.convergence: list[float] = []
        self.serving_s: list[float] = []  # restart issued -> that agent answering Admin Status again
        self.head_again_s: list[float] = []  # its head asked again for I7: how long until it answered
        self.fault_counts = {"kill": 0, "pause": 0, "partition": 0, "one_way": 0, "loss": 0, "delay": 0,
                             "duplicate": 0, "restart_all": 0, "lose_store": 0,
                             "corrupt": 0, "disk_full": 0, "cut_log": 0, "wipe_data_dir": 0}
        self.log = log or (lambda *a: None)

    def data_dir(self, k: int) -> Path:
        return self.base / "agents" / f"node{k + 1}" / "data"

    def log_path(self, k: int) -> Path:
        return self.data_dir(k) / LOG_NAME

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
            if self.lab is not None:
                self.lab.partition(ep.groups)
            else:
                write_faults(self.faults_path, _drop_map(ids, ep.groups))
            self.fault_counts["partition"] += 1
        for k in ep.deaf if self.lab is not None else []:
            self.lab.deafen(k)
            self.fault_counts["one_way"] += 1
        if ep.loss and self.lab is not None:
            self.lab.loss(ep.loss)
            self.fault_counts["loss"] += 1
        if (ep.delay_ms or ep.dup) and self.lab is not None:
            if ep.slow and ep.dup:
                self.lab.delay(dup=ep.dup)
            self.lab.delay(ep.delay_ms, ep.delay_ms, ep.dup, nodes=ep.slow or None)
            self.fault_counts["delay"] += bool(ep.delay_ms)
            self.fault_counts["duplicate"] += bool(ep.dup)
        if ep.restart_all:
            ep.kill = list(range(self.n))
            self.fault_counts["restart_all"] += 1
        for k in ep.disk_full if self.fault_kinds["disks"] else []:
            procfaults.fill(self.data_dir(k))
            self.fault_counts["disk_full"] += 1
        for k in ep.pause:
            self.cluster.signal(k, signal.SIGSTOP)
            self.paused.add(k)
            self.fault_counts["pause"] += 1
        for k in ep.kill:
            before[k] = await self._kill(k)
            self.fault_counts["kill"] += 1
        wiped = set()  # nodes whose log is gone: nothing of theirs to find after the restart
        cut: dict[int, int] = {}  # node -> bytes cut off its log
        store_faults = ep.lose_store + ep.corrupt + ep.cut_log + ep.wipe_data_dir
        for k in store_faults if self.fault_kinds["disks"] else []:
            if k not in ep.kill:
                await self._kill(k)
                ep.kill.append(k)
            if k in ep.wipe_data_dir:
                procfaults.wipe_data_dir(self.data_dir(k))
                self.fault_counts["wipe_data_dir"] += 1
            elif k in ep.lose_store:
                procfaults.lose_log(self.log_path(k))
                self.fault_counts["lose_store"] += 1
            elif k in ep.cut_log:
                cut[k] = procfaults.cut_log(self.log_path(k), self.rng.randint(1, 4))
                self.fault_counts["cut_log"] += 1
            elif await self._corrupt(k):
                self.fault_counts["corrupt"] += 1
            wiped.add(k)
        await asyncio.sleep(ep.hold_s)
        write_faults(self.faults_path, {})
        if self.lab is not None:
            self.lab.heal()
        for k in ep.disk_full if self.fault_kinds["disks"] else []:
            procfaults.unfill(self.data_dir(k))
        for k in ep.pause:
            self.cluster.signal(k, signal.SIGCONT)
            self.paused.discard(k)
        for k in ep.kill:
            self.cluster.start(k)
        self.healed_at = time.monotonic()  # I5's clock starts when the faults are lifted (restart issued)
        for k in ep.kill:
            self.down.discard(k)
            ok = await self.wait_serving([k])
            self.serving_s.append(time.monotonic() - self.healed_at)
            if not ok:  # counted once; the node is left out of I5 until it is back
                self.failed.add(k)
                self.checks.note("I7", f"{ids[k]}:restart{self.fault_counts['kill']}",
                                 f"{ids[k]} not serving 30 s after restart: {self.log_tail(k)}")
                continue
            self.failed.discard(k)
            if cut.get(k) and "bytes of acknowledged records are missing" not in self.log_tail(k, 40):
                self.checks.note("I7", f"{ids[k]}:cut{self.fault_counts['cut_log']}",
                                 f"{ids[k]}: {cut[k]} bytes cut off the end of its log went unnoticed at restart: "
                                 f"{self.log_tail(k)}")
            if k in wiped or k not in before:
                continue  # a lost or repaired log: the node rebuilds from its peers (I1 is what is at stake)
            after, acked_after = versions(read_log(self.log_path(k))), await self._head_again(k)
            if acked_after is None:  # it served, then stopped answering: its head cannot be judged
                self.checks.note("I7", f"{ids[k]}:silent{self.fault_counts['kill']}",
                                 f"{ids[k]} answered Status after its restart, then not for {HEAD_AGAIN_S:.0f} s: "
                                 f"{self.log_tail(k)}")
                continue
            self.checks.restart(ids[k], before[k][0], before[k][1], after, acked_after)

    async def _head_again(self, k: int) -> int | None:
        """Agent k's head, asked again after it first served: a restarted agent on an overloaded machine can
        miss one 1 s deadline (it answered a moment before). Retried for HEAD_AGAIN_S; how long it took is
        reported (`head_again_s`), so that a stall shows."""
        t0 = time.monotonic()
        head = await agent_head(self.channels[k])
        while head is None and time.monotonic() - t0 < HEAD_AGAIN_S:
            await asyncio.sleep(0.2)
            head = await agent_head(self.channels[k])
        self.head_again_s.append(time.monotonic() - t0)
        return head

    async def _kill(self, k: int) -> tuple[dict[int, bytes], int | None]:
        """kill -9 of agent k; returns what it had on disk and the head it acknowledged."""
        acked = await agent_head(self.channels[k])
        self.cluster.signal(k, signal.SIGKILL)
        proc = self.cluster.procs[k]
        if proc is not None:
            await asyncio.to_thread(proc.wait, 10)
        self.down.add(k)
        return versions(read_log(self.log_path(k))), acked

    async def _corrupt(self, k: int) -> bool:
        """A byte flipped mid-log of the (killed) agent k: its restart must refuse, naming the offset (else I7
        is noted), then the operator's repair moves the log aside. False if the log was too short."""
        ids = self.cluster.ids
        at = procfaults.flip_mid_log(self.log_path(k), self.rng.randrange(1 << 30))
        if at is None:
            return False
        self.cluster.start(k)
        proc = self.cluster.procs[k]
        code = await asyncio.to_thread(proc.wait, 30) if proc is not None else None
        if code != 2 or "corrupt record at offset" not in self.log_tail(k, 5):
            self.checks.note("I7", f"{ids[k]}:corrupt{at}", f"{ids[k]}: a byte flipped at {at} mid-log, restart "
                                                          f"exited {code}: {self.log_tail(k)}")
            if proc is not None and proc.poll() is None:
                self.cluster.signal(k, signal.SIGKILL)
                await asyncio.to_thread(proc.wait, 10)
        r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "agent.cli", "store", "repair", "--config",
                                                     str(self.cluster.configs[k])], cwd=ROOT, capture_output=True,
                                    text=True, timeout=60)
        if r.returncode != 0:
            self.checks.note("I7", f"{ids[k]}:repair{at}", f"{ids[k]}: emoe store repair failed: {r.stderr.strip()}")
        return True

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
        genesis = initial_table(self.topo, SHAPE["layers"], SHAPE["experts"])
        e = self.engines[0]
        self.checks.i6_judged = 0
        whole = {k: w for k, w in self.windows.items() if self.reporters.get(k) == self.n}
        self.checks.realised(genesis, whole, self.t0, e.step_s * e.window, self.faulty,
                             n=ROLLBACK_WINDOWS, grace=I6_GRACE_WINDOWS, now=time.monotonic())

    async def run(self, schedules: int) -> dict[str, Any]:
        t_start = time.monotonic()
        write_faults(self.faults_path, {})
        tasks: list[asyncio.Task[None]] = []
        self.channels = [grpc.aio.insecure_channel(a) for a in self.cluster.addresses]
        try:
            if self.lab is not None:
                self.lab.up()
            self.cluster.start()
            if not await self.wait_serving(list(range(self.n)), 90.0):
                raise RuntimeError(f"agents not serving after 90 s: see {self.cluster.base}")
            tasks = [asyncio.create_task(e.run()) for e in self.engines]
            tasks.append(asyncio.create_task(self.dataplane.run(lambda: self.hot)))
            for s in range(schedules):
                self.hot = np.array(self.rng.sample(range(SHAPE["experts"]), 2))  # drift: new hot experts
                eps = make_schedule(self.rng, self.n, **self.fault_kinds)
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
            self.dataplane.stop = True
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for k in range(self.n):
                self.cluster.signal(k, signal.SIGCONT)
            await asyncio.to_thread(self.cluster.stop)
            for ch in self.channels:
                await ch.close()
            if self.lab is not None:
                self.wire_stats = self.lab.stats()
                self.lab.close()
            for k in range(self.n):
                procfaults.umount(self.data_dir(k))
        conv = _quantiles(self.convergence)
        tokens = self.dataplane.report(self.checks)
        return {
            "runner": "processes", "nodes": self.n, "schedules": schedules,
            "violations": self.checks.violations(),
            "convergence_p99_s": conv["p99"],
            "partition_mechanism": self.mechanism, "disk_faults": self.disks or "on",
            "convergence_max_s": conv["max"],
            "restart_failures": sorted(self.cluster.ids[k] for k in self.failed),
            "restart_to_serving_s": _quantiles(self.serving_s),
            "head_again_s": _quantiles(self.head_again_s),
            "commits": self.checks.max_version - 1,
            "commit_kinds": dict(sorted(Counter(self.checks.kinds.values()).items())),
            "installs_checked": sum(e.installs for e in self.engines),
            "faults": self.fault_counts, "i6_judged": self.checks.i6_judged,
            "tokens": tokens, "switch_frames": self.wire_stats,
            "details": self.checks.details[:20], "seed": self.seed, "wall_s": round(time.monotonic() - t_start, 1),
        }


def _quantiles(xs: list[float]) -> dict[str, float | None]:
    a = np.array(xs) if xs else np.array([np.nan])
    return {q: None if np.isnan(a).all() else round(float(np.percentile(a, p)), 3)
            for q, p in (("p50", 50), ("p99", 99), ("max", 100))}
