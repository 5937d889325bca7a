"""The reference engines of the simulated cluster: one small loop per node, on the node's own clock.

Every `step_s` of virtual time each rank of the node takes its share of the trace's counts for that step,
routes the tokens through its Shim (`dispatch`: version counters, stale re-routing, masking of ranks the
node's membership declared dead), hands each token to its destination rank's shim (`accepts`) and checks
the destination's real expert memory (written only by the shim's mover): a token accepted by a slot whose
memory does not hold its expert is an I4 violation. Tokens the receiver refuses (stale) are NACKed and
re-sent next step; deferred ones (destination behind, or no live replica) wait a step. Each window the
node reports its ranks' counts to its NodeState, so that real plans are proposed and committed.

Because the loop runs on the node's clock, a paused node's engine stops too (SIGSTOP), and a crashed one's
never runs again (its ranks are lost with it).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from controlplane.table import RoutingTable
from dataplane_shim.link import make_load_report
from dataplane_shim.shim import Shim

if TYPE_CHECKING:
    from chaos.simcluster import SimCluster

I64 = npt.NDArray[np.int64]
MAX_RETRY_STEPS = 50  # a token waiting longer than this (no live replica, no repair) is dropped


@dataclass
class TokenStats:
    """Cluster-wide token accounting (I4 and issue 10's figures)."""

    sent: int = 0              # token-expert pairs handed to a live destination
    served: int = 0            # accepted by the destination
    nacked: int = 0            # refused by the destination (stale tag): re-sent
    i4: int = 0                # accepted by a slot whose memory does not hold the expert
    to_dead_undetected: int = 0  # sent to a crashed rank before the sender's membership declared it dead
    misrouted: int = 0         # sent to a rank the sender had declared dead (must stay 0)
    delayed: int = 0           # deferred because every replica of the expert was on dead ranks
    dropped: int = 0           # given up after MAX_RETRY_STEPS
    i4_examples: list[str] = field(default_factory=list)


class NodeEngine:
    """The engine loop of one node: its ranks' shims and expert memories."""

    def __init__(self, cluster: SimCluster, node_id: str, ranks: list[int], state: Any, seed: int) -> None:
        self.c, self.node_id, self.ranks, self.state = cluster, node_id, ranks, state
        self.rng = random.Random(seed)
        self.clock = state.clock
        head: RoutingTable = state.head()
        S = cluster.topo.slots_per_rank
        self.shims: dict[int, Shim] = {}
        for g in ranks:
            mem = head.phy2log[:, g * S:(g + 1) * S].copy()  # weights loaded at boot for its table
            cluster.mem[g] = mem

            def mover(layers: I64, slots: I64, experts: I64, mem: I64 = mem) -> None:
                mem[layers, slots] = experts

            self.shims[g] = Shim(cluster.topo, g, head, counters=cluster.counters, mover=mover, wait_polls=0,
                                 poll_sleep_s=0.0)
        self.dead_ranks: set[int] = set()
        self.retry: dict[int, dict[int, list[tuple[int, int]]]] = {g: {} for g in ranks}  # rank -> layer -> (e, age)
        self.acc = {g: np.zeros((cluster.shape.layers, cluster.shape.experts), np.uint64) for g in ranks}
        self.running = True
        state.gossip.on_member_change(self._member)
        self._arm()

    def _member(self, m: Any) -> None:
        st = str(getattr(m.status, "value", m.status)).lower()
        if st in ("dead", "left"):
            self.dead_ranks |= set(m.ranks)
        elif st == "alive":
            self.dead_ranks -= set(m.ranks) - set(self.ranks)
        for s in self.shims.values():
            s.mask_ranks(self.dead_ranks - set(self.ranks))

    # Engines step in lockstep with the cluster (collectives), so step numbers come from the shared clock;
    # the timer is the node's, so that a paused or crashed node's engine stops with it (a skewed node
    # clock counts delays in its own seconds, hence the rate).
    def _arm(self) -> None:
        step_s = self.c.step_s
        now = self.c.clock.now()
        nxt = (int(now / step_s + 1e-9) + 1) * step_s
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
        for g, shim in self.shims.items():
            commits = self.state.commits_since(shim.store.head) if head > shim.store.head else ()
            shim.begin_step(commits, stage_limit=self.rng.choice((1, 2, 4, None)))
            self._route(g, shim, c.share(k, g))
            self.acc[g] += shim.end_step()
        W = c.window
        if (k + 1) % W == 0:
            seq = k // W
            for g in self.shims:
                counts = np.minimum(self.acc[g], np.iinfo(np.uint32).max).astype(np.uint32)
                self.acc[g][:] = 0
                rep = make_load_report(f"{self.node_id}/r{g}", g, seq * W, W, self.shims[g].version, counts)
                try:
                    self.state.on_load_report(rep)
                except Exception as e:  # a rejected report is a bug in this harness, not a fault to hide
                    raise RuntimeError(f"{self.node_id}: load report refused: {e}") from e

    def _route(self, g: int, shim: Shim, share: I64) -> None:
        """share [L, E] tokens of this rank this step; plus the retries of earlier steps."""
        L = share.shape[0]
        retry = self.retry[g]
        self.retry[g] = {}
        for layer in range(L):
            fresh = np.repeat(np.arange(share.shape[1], dtype=np.int64), share[layer])
            if fresh.size:
                self._dispatch(g, shim, layer, fresh, np.zeros(fresh.size, np.int64), True)
            again = retry.get(layer)
            if again:
                arr = np.asarray(again, dtype=np.int64)
                self._dispatch(g, shim, layer, arr[:, 0], arr[:, 1], False)

    def _dispatch(self, g: int, shim: Shim, layer: int, experts: I64, age: I64, count: bool) -> None:
        c, st = self.c, self.c.tokens
        plan = shim.dispatch(layer, torch.from_numpy(experts).reshape(-1, 1), count=count)
        slots = plan.slots.reshape(-1).numpy()
        vers = plan.versions.reshape(-1)
        deferred = plan.deferred.reshape(-1)
        if plan.no_replica is not None:
            nr = plan.no_replica.reshape(-1)
            st.delayed += int((nr & (age == 0)).sum())
        redo = deferred.copy()
        go = np.flatnonzero(~deferred)
        if go.size:
            S = c.topo.slots_per_rank
            dest = slots[go] // S
            for d in np.unique(dest).tolist():
                sel = go[dest == d]
                rx = c.shim_of(d)
                if rx is None:  # the destination's process is gone
                    if d in self.dead_ranks:
                        st.misrouted += int(sel.size)
                    else:
                        st.to_dead_undetected += int(sel.size)
                    continue
                st.sent += int(sel.size)
                ok = np.zeros(sel.size, dtype=bool)
                for v in np.unique(vers[sel]).tolist():
                    m = vers[sel] == v
                    ok[m] = rx.accepts(int(v), np.full(int(m.sum()), layer, np.int64), slots[sel[m]])
                acc = sel[ok]
                mem = c.mem[d]
                bad = mem[layer, slots[acc] - d * S] != experts[acc]
                if bad.any():
                    st.i4 += int(bad.sum())
                    if len(st.i4_examples) < 5:
                        i = int(acc[bad][0])
                        st.i4_examples.append(f"t={c.clock.now():.3f} r{g}->r{d} layer {layer} slot {int(slots[i])} "
                                              f"v{int(vers[i])} expert {int(experts[i])} memory "
                                              f"{int(mem[layer, slots[i] - d * S])}")
                st.served += int(ok.sum())
                st.nacked += int((~ok).sum())
                redo[sel[~ok]] = True
        if redo.any():
            keep = redo & (age < MAX_RETRY_STEPS)
            st.dropped += int((redo & ~keep).sum())
            lst = self.retry[g].setdefault(layer, [])
            lst.extend(zip(experts[keep].tolist(), (age[keep] + 1).tolist(), strict=True))

    def versions(self) -> Counter[int]:
        return Counter(s.version for s in self.shims.values())
