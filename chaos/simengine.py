"""The reference engines of the simulated cluster: one small loop per node, on the node's own clock.

Every `step_s` of virtual time each rank of the node takes its share of the trace's counts for that step
and routes the tokens through its Shim to their destination ranks (chaos/tokens.py: version counters,
stale re-routing, masking of ranks the node's membership declared dead, and the I4 check against each
destination's real expert memory). Each window the node reports its ranks' counts to its NodeState, so
that real plans are proposed and committed.

Because the loop runs on the node's clock, a paused node's engine stops too (SIGSTOP), and a crashed one's
never runs again (its ranks are lost with it).

The engine's word on lost ranks, as the plugins give it (dataplane_shim.peers, PluginCore.peer_unreachable):
the ranks of one EP group step together, so a step's collective involves every rank active in the table it
runs; a rank whose process is gone or stopped, or whose node the network does not carry this node's messages
to (a partition, a cut link), fails it. Each report names those ranks (LoadReport.unreachable_ranks); the
agent suspects their nodes, and repairs them once membership no longer holds them live (agent.decision.reactions).
An agent that dies alone is not simulated here: a crash takes the node's engine with it.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from agent.clock import FakeClock
from agent.gossip.membership import Member, MemberStatus
from chaos.tokens import Fabric, Retries, TokenStats, rank_shim, route_step
from controlplane.table import RoutingTable
from controlplane.topology import Topology
from dataplane_shim.counters import DeviceCounters
from dataplane_shim.link import make_load_report
from dataplane_shim.shim import Shim
from elasticmoe.loadcodec import sample_steps

__all__ = ["NodeEngine", "TokenStats"]

I64 = npt.NDArray[np.int64]


class EngineWorld(Protocol):
    """What a node's engines need of the simulated cluster around them (chaos.simcluster.SimCluster)."""

    clock: FakeClock
    counters: DeviceCounters
    mem: dict[int, I64]
    shape: Any  # chaos.simcluster.Shape: layers, experts
    tokens: TokenStats
    topo: Topology
    step_s: float
    window: int

    def shim_of(self, rank: int) -> Shim | None: ...

    def share(self, k: int, g: int) -> I64: ...

    def engine_reaches(self, node: str, rank: int) -> bool: ...


class NodeEngine:
    """The engine loop of one node: its ranks' shims and expert memories."""

    def __init__(self, cluster: EngineWorld, node_id: str, ranks: list[int], state: Any, seed: int) -> None:
        self.c, self.node_id, self.ranks, self.state = cluster, node_id, ranks, state
        self.rng = random.Random(seed)
        self.clock = state.clock
        head: RoutingTable = state.head()
        S = cluster.topo.slots_per_rank
        self.shims: dict[int, Shim] = {}
        for g in ranks:
            self.shims[g], cluster.mem[g] = rank_shim(head, g, cluster.counters)
        self.dead_ranks: set[int] = set()
        self.retry = {g: Retries() for g in ranks}
        self.fabric = Fabric(S, cluster.shim_of, lambda d: cluster.mem[d], cluster.tokens, cluster.clock.now)
        self.acc = {g: np.zeros((cluster.shape.layers, cluster.shape.experts), np.uint64) for g in ranks}
        self.every = state.params.sample_every  # the agent's decision.sample_every, as the plugins are set
        self.rows: dict[int, list[npt.NDArray[np.uint32]]] = {g: [] for g in ranks}
        self.unreachable: set[int] = set()  # ranks this node's collectives failed to reach since its last report
        self.running = True
        state.gossip.on_member_change(self._member)
        self._arm(first=True)

    def _member(self, m: Member) -> None:
        if m.status in (MemberStatus.DEAD, MemberStatus.LEFT):
            self.dead_ranks |= set(m.ranks)
        elif m.status == MemberStatus.ALIVE:
            self.dead_ranks -= set(m.ranks) - set(self.ranks)
        for s in self.shims.values():
            s.mask_ranks(self.dead_ranks - set(self.ranks))

    # Engines step in lockstep with the cluster (collectives), so step numbers come from the shared clock;
    # the timer is the node's, so that a paused or crashed node's engine stops with it (a skewed node
    # clock counts delays in its own seconds, hence the rate).
    def _arm(self, first: bool = False) -> None:
        """Time the next step; `first`: an engine that starts on a step boundary serves that step."""
        step_s = self.c.step_s
        now = self.c.clock.now()
        at = now / step_s
        nxt = (int(np.ceil(at - 1e-9)) if first else int(at + 1e-9) + 1) * step_s
        self.clock.call_later((nxt - now) * self.clock.rate, self._tick)

    def _tick(self) -> None:
        if not self.running:
            return
        self._arm()
        k = int(round(self.c.clock.now() / self.c.step_s))
        self.step(k)

    # ---- one step ---------------------------------------------------------------------------------
    def step(self, k: int) -> None:
        c = self.c
        head = self.state.head_version()
        if self.shims:  # the step's collective: every rank active in the table the engine runs takes part
            group = next(iter(self.shims.values())).store.active.active_ranks
            self.unreachable.update(g for g in group if g not in self.shims and not c.engine_reaches(self.node_id, g))
        for g, shim in self.shims.items():
            commits = self.state.commits_since(shim.store.head) if head > shim.store.head else ()
            shim.begin_step(commits, stage_limit=self.rng.choice((1, 2, 4, None)))
            route_step(self.fabric, g, shim, c.share(k, g), self.retry[g], self.dead_ranks)
            served = shim.end_step()
            self.acc[g] += served
            if self.every and k % self.every == 0:  # the plugin's sampled steps (elasticmoe.loadcodec)
                self.rows[g].append(np.minimum(served, np.iinfo(np.uint32).max).astype(np.uint32))
        W = c.window
        if (k + 1) % W == 0:
            seq = k // W
            for g in self.shims:
                counts = np.minimum(self.acc[g], np.iinfo(np.uint32).max).astype(np.uint32)
                self.acc[g][:] = 0
                want = len(sample_steps(seq * W, W, self.every))
                rows, self.rows[g] = self.rows[g], []
                samples = None  # an engine (re)started inside the window has not seen all of its sampled steps
                if len(rows) == want:
                    samples = np.stack(rows) if want else np.zeros((0, *counts.shape), np.uint32)
                rep = make_load_report(f"{self.node_id}/r{g}", g, seq * W, W, self.shims[g].version, counts,
                                       samples=samples, sample_every=self.every if samples is not None else 0,
                                       unreachable_ranks=self.unreachable)
                try:
                    self.state.load.on_report(rep)
                except Exception as e:  # a rejected report is a bug in this harness, not a fault to hide
                    raise RuntimeError(f"{self.node_id}: load report refused: {e}") from e
            self.unreachable = set()

    def versions(self) -> Counter[int]:
        return Counter(s.version for s in self.shims.values())
