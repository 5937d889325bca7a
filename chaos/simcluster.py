"""SimCluster: N full agents (NodeState: gossip, consensus, decision core) with shims and reference engines
on one seeded SimNetwork and FakeClock, fault verbs, and a recorded history for the invariant checkers.

    c = SimCluster(64, Shape(layers=4, experts=16), seed=1)
    c.run(3.0); c.partition_kind("minority"); c.run(2.0); c.heal(); c.settle()
    report = chaos.invariants.check_all(c)

Each node gets `clock=net.clock(id)`, `transport=net.transport(id)`, a Store on a MemoryDisk that outlives
its crashes (kill -9 drops everything else: the NodeState, its shims and their expert memory), and one
engine loop (chaos/simengine.py) on its own clock. Everything is a pure function of the seed and the
schedule of faults.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.admin.telemetry import Telemetry
from agent.clock import FakeClock
from agent.config import from_dict
from agent.consensus.core import Outcome
from agent.decision.pipeline import window_rows
from agent.gossip.membership import Member, MemberStatus
from agent.state import NodeState
from agent.storage.store import MemoryDisk
from agent.transport.sim import LinkSpec, SimNetwork
from agent.wire import plan_kind
from chaos.quorumsim import HistoryEvent, RecordingStore
from chaos.simengine import NodeEngine, TokenStats
from chaos.synthetic import synthetic_trace
from controlplane.table import RoutingTable
from controlplane.topology import Topology
from dataplane_shim.counters import DeviceCounters
from dataplane_shim.shim import Shim
from elasticmoe.v1 import consensus_pb2 as pb

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Shape:
    """Model and pool shape: `nodes` x `ranks_per_node` ranks of `slots_per_rank` slots."""

    layers: int = 4
    experts: int = 16
    ranks_per_node: int = 1
    slots_per_rank: int = 2
    top_k: int = 2


@dataclass
class WindowRecord:
    seq: int
    t: float
    total: npt.NDArray[np.uint64]
    head: int
    clean: bool  # no fault active at its close (a node that crashed and restarted inside the window is not seen)
    rows: npt.NDArray[np.uint32] | None = None  # what the controller saw of it (agent.decision.pipeline.window_rows)


@dataclass
class CommitRecord:
    version: int
    parent: int
    t: float
    trigger: str
    verified_gain: float
    table: RoutingTable
    kind: str  # the plan's kind (agent.wire.plan_kind)


@dataclass
class History:
    events: list[HistoryEvent] = field(default_factory=list)  # consensus-level history (chaos/checkers.py)
    commits: dict[int, CommitRecord] = field(default_factory=dict)  # first install of each version
    windows: dict[int, WindowRecord] = field(default_factory=dict)  # first close of each cluster window
    faults: list[tuple[float, str]] = field(default_factory=list)
    convergence_s: list[float | None] = field(default_factory=list)  # one per settle(): time to converge
    # one per outage that some node declared: (node, crashed at, first DEAD verdict while it was down); an
    # outage restarted before anyone declared it has none
    detections: list[tuple[str, float, float]] = field(default_factory=list)
    wipes: list[tuple[str, float, int]] = field(default_factory=list)  # data_dirs wiped: (node, when, its head)


class SimCluster:
    def __init__(self, nodes: int, shape: Shape | None = None, seed: int = 0, profile: str = "test", *,
                 window: int = 2, step_s: float = 0.5, seeds: int = 3, link: LinkSpec | None = None,
                 decision: dict[str, Any] | None = None, gossip: dict[str, Any] | None = None,
                 consensus: dict[str, Any] | None = None, batch_per_rank: int = 4, skew: float = 0.8) -> None:
        if nodes < 1:
            raise ValueError(f"nodes = {nodes}: expected >= 1")
        self.shape = sh = shape or Shape()
        self.seed, self.profile, self.window, self.step_s = seed, profile, window, step_s
        self.rng = random.Random(seed)
        self.clock = FakeClock()
        self.net = SimNetwork(self.clock, seed, link or LinkSpec(latency=0.0005, jitter=0.0002))
        self.ids = [f"n{i:02d}" for i in range(nodes)]
        self.topo = Topology(nodes, sh.ranks_per_node, sh.slots_per_rank)
        self.ranks_of = {n: list(range(i * sh.ranks_per_node, (i + 1) * sh.ranks_per_node))
                         for i, n in enumerate(self.ids)}
        self.node_of_rank = {g: n for n, rs in self.ranks_of.items() for g in rs}
        G = self.topo.ranks
        steps = 64
        # the trace: every rank draws batch_per_rank tokens x top_k per layer per step on average
        tr = synthetic_trace(sh.layers, sh.experts, steps, 2, top_k=sh.top_k, batch=batch_per_rank * G, skew=skew,
                             seed=seed)
        self.trace = tr.counts.astype(np.int64)  # [T, L, E], played in a loop
        self.counters = DeviceCounters(G)
        self.mem: dict[int, I64] = {}
        self.tokens = TokenStats()
        self.history = History()
        self.disks = {n: MemoryDisk() for n in self.ids}
        self.states: dict[str, NodeState] = {}
        self.engines: dict[str, NodeEngine] = {}
        self.down: set[str] = set()       # crashed (kill -9), not restarted
        self.down_since: dict[str, float] = {}  # a node down and not yet declared dead: when it crashed
        self.lost: set[str] = set()       # crashed for good (rank loss): not restarted by settle()
        self.paused: set[str] = set()
        self.rates: dict[str, float] = {}  # skewed node clocks: local seconds per real second
        self.cuts: set[tuple[str, str]] = set()
        self.link_faults = False
        self.partitioned = False
        self.incarnation = dict.fromkeys(self.ids, 0)
        self.identity: set[str] = set()  # nodes whose data_dir holds its IDENTITY marker (it ran before)
        # faults armed for a node's next durable promise, accept or commit: (kind, action), run once
        self.tripwires: dict[str, list[tuple[str, Callable[[], None]]]] = {}
        self._seq = 0
        self._ops = 0
        self._data_dir = tempfile.gettempdir() + "/emoe-simcluster"
        self._tel = Telemetry.for_tests(enabled=False)
        self._cfg = dict(
            profile=profile, seeds=[f"{x}@{x}:7400" for x in self.ids[:max(1, seeds)]],
            cluster=dict(nodes=nodes, ranks_per_node=sh.ranks_per_node, slots_per_rank=sh.slots_per_rank,
                         layers=sh.layers, experts=sh.experts, top_k=sh.top_k),
            # every step of a 2-step window sampled (the plugins' sampled steps, at this scale)
            decision={**dict(window=window, budget_windows=1, theta=1.10, tau=0.02, rollback_windows=2,
                             sample_every=1), **(decision or {})},  # the caller's override any of these
            gossip=dict(gossip or {}), consensus=dict(voters=list(self.ids), **(consensus or {})),
        )
        for n in self.ids:
            self._boot(n)
        self.genesis: RoutingTable = self.states[self.ids[0]].head()
        self.gone_shim_stats: list[Any] = []  # ShimStats of shims lost with their node
        self.on_new_commit: list[Callable[[CommitRecord], None]] = []  # at each version's first install

    # ---- nodes ------------------------------------------------------------------------------------
    def config(self, n: str) -> Any:
        raw = {**self._cfg, "node_id": n, "listen": f"{n}:7400", "data_dir": self._data_dir, "ranks": self.ranks_of[n]}
        return from_dict(raw)

    def _boot(self, n: str) -> None:
        store = RecordingStore(self, n, self.disks[n], len(self.ids) // 2 + 1,
                               durable=lambda kind, n=n: self._durable(n, kind))
        if n in self.rates:  # the skew is the machine's oscillator: it survives a restart of the process
            self.net.clock(n).set_rate(self.rates[n])
        st = NodeState(self.config(n), self.net.transport(n), clock=self.net.clock(n), store=store,
                       telemetry=self._tel, rng_seed=zlib.crc32(f"{n}/{self.seed}/{self.incarnation[n]}".encode()),
                       had_store=n in self.identity)  # the data_dir's marker: an empty store after it was lost
        self.identity.add(n)  # the marker is written once its store first opened
        self.states[n] = st
        st.consensus.on_commit(lambda c, t, n=n: self._installed(n, c, t))
        st.pipeline.hooks.proposing.append(lambda table, n=n: self._proposing(n, table))
        st.pipeline.hooks.window_closed.append(
            lambda seq, total, samples, st=st: self._window_closed(st, seq, total, samples))
        st.gossip.on_member_change(lambda m, n=n: self._member(n, m))
        self.engines[n] = NodeEngine(self, n, self.ranks_of[n], st, self.rng.getrandbits(32))

    def _proposing(self, n: str, table: RoutingTable) -> Callable[[Outcome], None]:
        """An operation of the history (linearizability): invoked now, responded to with its outcome."""
        self._ops += 1
        op = self._ops
        self._ev("invoke", n, version=table.version, parent=table.parent, digest=table.digest, op=op)

        def done(o: Outcome) -> None:
            res = "ok" if o.committed else ("fail" if "committed another table" in o.reason else "unknown")
            self._ev("respond", n, version=table.version, digest=table.digest, result=res, op=op)

        return done

    def _window_closed(self, st: NodeState, seq: int, total: npt.NDArray[np.uint64],
                       samples: npt.NDArray[np.uint32] | None) -> None:
        if seq not in self.history.windows:
            rows = window_rows(total, samples, st.params.window)
            self.history.windows[seq] = WindowRecord(seq, self.clock.now(), total.copy(), st.head_version(), self.clean(),
                                                     rows)

    def _ev(self, kind: str, node: str, **kw: Any) -> HistoryEvent:
        self._seq += 1
        e = HistoryEvent(kind, node, self.clock.now(), self._seq, incarnation=self.incarnation[node], **kw)
        self.history.events.append(e)
        return e

    def _installed(self, n: str, c: pb.Commit, t: RoutingTable) -> None:
        snapshot = n in self.states and self.states[n].consensus.log.base == t.version
        self._ev("install", n, version=t.version, parent=t.parent, digest=t.digest, valid=t.is_valid(),
                 snapshot=snapshot)
        if t.version not in self.history.commits:
            self.history.commits[t.version] = CommitRecord(t.version, t.parent, self.clock.now(), c.plan.trigger,
                                                           float(c.plan.verified_gain), t, plan_kind(c.plan))
            for cb in list(self.on_new_commit):
                cb(self.history.commits[t.version])

    def _durable(self, n: str, kind: str) -> None:
        """n's store made a promise, accept or commit durable: run the first fault armed for that kind."""
        armed = self.tripwires.get(n, [])
        hit = next((i for i, (k, _) in enumerate(armed) if k == kind), None)
        if hit is not None:
            armed.pop(hit)[1]()

    def _member(self, observer: str, m: Member) -> None:
        t0 = self.down_since.get(m.node_id)
        if m.status == MemberStatus.DEAD and m.node_id in self.down and t0 is not None:
            self.history.detections.append((m.node_id, t0, self.clock.now()))
            del self.down_since[m.node_id]  # this outage is declared: later verdicts are echoes

    def shim_of(self, rank: int) -> Shim | None:
        n = self.node_of_rank[rank]
        if n in self.down:
            return None
        return self.engines[n].shims.get(rank)

    def share(self, k: int, g: int) -> I64:
        """Rank g's tokens per (layer, expert) at step k: an even split of the step's counts over all ranks,
        the remainders rotating with the step."""
        counts = self.trace[k % self.trace.shape[0]]
        G = self.topo.ranks
        q, r = np.divmod(counts, G)
        return q + (((g - k) % G) < r).astype(np.int64)

    def engine_reaches(self, node: str, rank: int) -> bool:
        """Whether a collective of `node`'s engine reaches `rank`: its process runs (not crashed, not stopped)
        and the network carries messages between their nodes (no partition, no cut link)."""
        other = self.node_of_rank[rank]
        return (other not in self.down and other not in self.paused and self.net.reachable(node, other)
                and (node, other) not in self.cuts and (other, node) not in self.cuts)

    def up(self) -> list[str]:
        return [n for n in self.ids if n not in self.down]

    def running(self) -> list[str]:
        return [n for n in self.up() if n not in self.paused]

    def clean(self) -> bool:
        return not (self.down or self.paused or self.cuts or self.link_faults or self.partitioned or self.rates)

    # ---- time -------------------------------------------------------------------------------------
    def run(self, seconds: float) -> None:
        self.clock.advance(seconds)

    # ---- faults -----------------------------------------------------------------------------------
    def _fault(self, what: str) -> None:
        self.history.faults.append((self.clock.now(), what))

    def crash(self, n: str, *, lost: bool = False) -> None:
        """kill -9: the process and its ranks' memory are gone; only the store's disk survives."""
        if n in self.down:
            return
        st = self.states[n]
        self._ev("crash", n, versions=tuple(sorted(st.consensus.log.commits)))
        self._fault(f"crash {n}" + (" (rank loss)" if lost else ""))
        self.net.crash(n)
        self.engines[n].running = False
        self.gone_shim_stats += [sh.stats for sh in self.engines[n].shims.values()]
        self.down.add(n)
        self.down_since[n] = self.clock.now()
        self.paused.discard(n)
        if lost:
            self.lost.add(n)

    def restart(self, n: str) -> None:
        if n not in self.down:
            return
        self._fault(f"restart {n}")
        self.net.restart(n)
        self.down.discard(n)
        self.down_since.pop(n, None)
        self.lost.discard(n)
        self.incarnation[n] += 1
        self._boot(n)
        st = self.states[n]
        self._ev("recover", n, versions=tuple(sorted(st.consensus.log.commits)), version=st.head_version())

    def pause(self, n: str, seconds: float | None = None) -> None:
        if n in self.down:
            return
        self._fault(f"pause {n}")
        self.paused.add(n)
        self.net.pause(n)
        if seconds is not None:
            self.clock.call_later(seconds, lambda: self.resume(n))

    def resume(self, n: str) -> None:
        if n in self.paused:
            self.paused.discard(n)
            self.net.resume(n)

    def partition(self, groups: list[list[str]]) -> None:
        self._fault("partition " + " | ".join(",".join(g) for g in groups))
        self.net.partition(groups)
        self.partitioned = True

    def cut(self, pairs: set[tuple[str, str]]) -> None:
        """Drop every message between each pair (both directions): rings and bridges."""
        dead = LinkSpec(loss=1.0)
        for a, b in pairs:
            self.net.set_link(a, b, dead)
        self.cuts |= pairs

    def partition_kind(self, kind: str, rng: random.Random | None = None) -> str:
        """one | minority | majority | ring | bridge, drawn from `rng` (default the cluster's)."""
        rng = rng or self.rng
        ids = list(self.ids)
        rng.shuffle(ids)
        N = len(ids)
        if kind == "one":
            self.partition([ids[:1], ids[1:]])
        elif kind == "minority":
            k = rng.randint(1, max(1, (N - 1) // 2))
            self.partition([ids[:k], ids[k:]])
        elif kind == "majority":  # no side but one holds a quorum: a bare majority and two small groups
            k = N // 2 + 1
            rest = ids[k:]
            h = len(rest) // 2
            self.partition([g for g in (ids[:k], rest[:h], rest[h:]) if g])
        elif kind == "ring":  # each node talks only to its two ring neighbours
            pos = {n: i for i, n in enumerate(ids)}
            self.cut({(a, b) for a in ids for b in ids if a < b and (pos[a] - pos[b]) % N not in (1, N - 1)})
            self._fault("partition ring")
        elif kind == "bridge":  # two halves that meet only through one bridge node
            bridge, rest = ids[0], ids[1:]
            h = len(rest) // 2
            A, B = rest[:h], rest[h:]
            self.cut({(min(a, b), max(a, b)) for a in A for b in B})
            self._fault(f"partition bridge via {bridge}")
        else:
            raise ValueError(f"partition kind {kind!r}: expected one, minority, majority, ring or bridge")
        return kind

    def heal(self) -> None:
        self._fault("heal")
        self.net.heal()
        self.partitioned = False
        for a, b in self.cuts:
            self.net.set_link(a, b, None)
        self.cuts.clear()

    def link(self, **changes: float) -> None:
        """Message faults on every link: loss=, duplicate=, reorder=, latency=, jitter=."""
        self._fault("link " + " ".join(f"{k}={v}" for k, v in changes.items()))
        self.net.set_default(**changes)
        self.link_faults = True

    def clear_link(self) -> None:
        self.net.set_default(loss=0.0, duplicate=0.0, reorder=0.0, latency=0.0005, jitter=0.0002)
        self.link_faults = False

    def admin(self, call: Any, limit_s: float = 10.0, tries: int = 5) -> Any:
        """Run an admin coroutine of a NodeState (`call()` makes it: drain, restore, propose) while driving
        virtual time; retried, as an operator would, when a concurrent rebalance won its version."""
        ack: Any = None
        for _ in range(tries):
            ack = asyncio.run(self._drive(call(), limit_s))
            if getattr(ack, "ok", True) or "committed another table" not in str(getattr(ack, "reason", "")):
                break
        return ack

    async def _drive(self, coro: Any, limit_s: float) -> Any:
        task = asyncio.ensure_future(coro)
        for _ in range(int(limit_s / 0.02)):
            await asyncio.sleep(0)
            if task.done():
                return task.result()
            self.run(0.02)
        task.cancel()
        raise TimeoutError(f"admin call did not finish within {limit_s} virtual seconds")

    # ---- settling and convergence (I5) --------------------------------------------------------------
    def skew(self, n: str, rate: float) -> None:
        """Node n's clock counts `rate` local seconds per real second from now on (its timeouts, gossip and
        probe intervals stretch or shrink; the engines stay in lockstep); rate 1 ends the skew."""
        self._fault(f"skew {n} x{rate:g}")
        if n not in self.down:
            self.net.clock(n).set_rate(rate)
        if rate == 1.0:
            self.rates.pop(n, None)
        else:
            self.rates[n] = rate

    def heal_all(self, restart: bool = True) -> None:
        """Every fault ends: heal, clear link faults, resume, restart killed nodes (not lost ones), unskew; faults
        armed for a later step are dropped."""
        self.tripwires.clear()
        self.heal()
        self.clear_link()
        for n in sorted(self.rates):
            self.skew(n, 1.0)
        for n in sorted(self.paused):
            self.resume(n)
        if restart:
            for n in sorted(self.down - self.lost):
                self.restart(n)

    def converged(self) -> bool:
        live = self.up()
        heads = {self.states[n].head_version() for n in live}
        if len(heads) != 1:
            return False
        h = heads.pop()
        return all(s.version == h for n in live for s in self.engines[n].shims.values())

    def settle(self, limit_s: float = 20.0, poll_s: float = 0.1) -> float | None:
        """Run until every live agent and shim hold the same latest version (I5); the time it took, or None
        if not within `limit_s`. Recorded in history.convergence_s."""
        t0 = self.clock.now()
        took: float | None = None
        for _ in range(int(limit_s / poll_s) + 1):
            if self.converged():
                took = self.clock.now() - t0
                break
            self.run(poll_s)
        self.history.convergence_s.append(took)
        return took

    def shim_totals(self) -> dict[str, int]:
        """Summed ShimStats of every shim that ran (deferred, masked, no_replica, stale_detected, ...)."""
        out: dict[str, int] = {}
        stats = self.gone_shim_stats + [sh.stats for n in self.up() for sh in self.engines[n].shims.values()]
        for st in stats:
            for k, v in vars(st).items():
                out[k] = out.get(k, 0) + int(v)
        return out

    def heads(self) -> dict[str, int]:
        return {n: self.states[n].head_version() for n in self.up()}
