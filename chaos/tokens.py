"""Token routing between the ranks of a test data plane, and its I4 check; shared by the simulated cluster's
engines (chaos/simengine.py) and the process runner's (chaos/proccheck.py).

A rank's `Shim.dispatch` picks a slot and a version tag for each token; the token goes to the destination
rank's shim, which accepts it only if that version's table is installed there (`accepts`: the version
counters); an accepted token is then checked against the destination's real expert memory, which only its
shim's mover writes. A token accepted by a slot whose memory does not hold its expert is an I4 violation.
Refused (stale) tokens are NACKed and sent again; deferred ones (destination behind, or no live replica)
wait a step; after MAX_RETRY_STEPS a token is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from controlplane.table import RoutingTable
from dataplane_shim.counters import DeviceCounters
from dataplane_shim.shim import Shim

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


@dataclass
class Fabric:
    """What a sender reaches: each rank's shim (None: its process is gone) and real expert memory [L, S]."""

    slots_per_rank: int
    shim_of: Callable[[int], Shim | None]
    memory_of: Callable[[int], I64]
    stats: TokenStats
    now: Callable[[], float]


def rank_shim(table: RoutingTable, rank: int, counters: DeviceCounters) -> tuple[Shim, I64]:
    """A rank's shim booted on `table`, and its real expert memory [L, S] (loaded for `table`, then written
    only by the shim's mover)."""
    S = table.topology.slots_per_rank
    mem = table.phy2log[:, rank * S:(rank + 1) * S].copy()

    def mover(layers: I64, slots: I64, experts: I64) -> None:
        mem[layers, slots] = experts

    return Shim(table.topology, rank, table, counters=counters, mover=mover, wait_polls=0, poll_sleep_s=0.0), mem


def deliver(fab: Fabric, src: int, shim: Shim, layer: int, experts: I64, age: I64, count: bool,
            dead_ranks: set[int]) -> npt.NDArray[np.bool_]:
    """Route `experts` (one token-expert pair each, `age` steps old) of rank `src` at `layer`; returns which
    must be sent again next step (deferred or refused)."""
    st, S = fab.stats, fab.slots_per_rank
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
        dest = slots[go] // S
        for d in np.unique(dest).tolist():
            sel = go[dest == d]
            rx = fab.shim_of(d)
            if rx is None:  # the destination's process is gone
                if d in dead_ranks:
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
            mem = fab.memory_of(d)
            bad = mem[layer, slots[acc] - d * S] != experts[acc]
            if bad.any():
                st.i4 += int(bad.sum())
                if len(st.i4_examples) < 5:
                    i = int(acc[bad][0])
                    st.i4_examples.append(f"t={fab.now():.3f} r{src}->r{d} layer {layer} slot {int(slots[i])} "
                                          f"v{int(vers[i])} expert {int(experts[i])} memory "
                                          f"{int(mem[layer, slots[i] - d * S])}")
            st.served += int(ok.sum())
            st.nacked += int((~ok).sum())
            redo[sel[~ok]] = True
    return redo


class Retries:
    """Per-layer tokens of one rank waiting to be sent again: (expert, age)."""

    def __init__(self) -> None:
        self.waiting: dict[int, list[tuple[int, int]]] = {}

    def take(self) -> dict[int, list[tuple[int, int]]]:
        out, self.waiting = self.waiting, {}
        return out

    def keep(self, stats: TokenStats, layer: int, experts: I64, age: I64, redo: npt.NDArray[np.bool_]) -> None:
        if redo.any():
            keep = redo & (age < MAX_RETRY_STEPS)
            stats.dropped += int((redo & ~keep).sum())
            lst = self.waiting.setdefault(layer, [])
            lst.extend(zip(experts[keep].tolist(), (age[keep] + 1).tolist(), strict=True))


def route_step(fab: Fabric, src: int, shim: Shim, share: I64, retries: Retries, dead_ranks: set[int]) -> None:
    """One step of rank `src`: its fresh tokens `share` [L, E] (counted as load), then its retries."""
    again_by_layer = retries.take()
    for layer in range(share.shape[0]):
        fresh = np.repeat(np.arange(share.shape[1], dtype=np.int64), share[layer])
        if fresh.size:
            age = np.zeros(fresh.size, np.int64)
            retries.keep(fab.stats, layer, fresh, age, deliver(fab, src, shim, layer, fresh, age, True, dead_ranks))
        again = again_by_layer.get(layer)
        if again:
            arr = np.asarray(again, dtype=np.int64)
            e, a = arr[:, 0].copy(), arr[:, 1].copy()
            retries.keep(fab.stats, layer, e, a, deliver(fab, src, shim, layer, e, a, False, dead_ranks))
