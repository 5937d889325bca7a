"""The engine-facing shim: the four calls an EP engine makes, around tables, counters and the router.

    shim = Shim(topo, rank, initial_table, device=..., mover=..., counters=..., refresh=...)
    shim.begin_step(commits)                 # 1. step boundary: install certified versions, swap, release
    plan = shim.dispatch(layer, topk_ids)    # 2. per MoE layer: route + version check + stale retry
    ok = shim.accepts(tag, layers, slots)    # 3. receive side: tokens whose tag/slot this rank can serve
    counts = shim.end_step()                 # 4. step end: uint32 [L, E] load for the agent's report
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from controlplane.table import RoutingTable
from controlplane.topology import Topology
from dataplane_shim.counters import VersionCounters, wait_until_caught_up
from dataplane_shim.errors import ShimError, StaleVersion
from dataplane_shim.router import Router
from dataplane_shim.tables import Mover, TableStore
from elasticmoe.v1 import consensus_pb2 as pb

I64 = npt.NDArray[np.int64]


@dataclass
class DispatchPlan:
    """slots [T, K] int64 tensor; versions [T, K] the tag each token travels with; deferred [T, K] tokens
    whose destination stayed behind past the bounded wait or ran a version this rank cannot get yet
    (send them next step); stale: tokens whose first routing found the destination on another version."""

    slots: Any
    versions: I64
    deferred: npt.NDArray[np.bool_]
    stale: int
    no_replica: npt.NDArray[np.bool_] | None = None  # [T, K] deferred because every replica is masked


@dataclass
class ShimStats:
    steps: int = 0
    stale_detected: int = 0   # tokens first routed to a destination on another version
    rerouted: int = 0         # tokens re-routed under the destination's (newer) version
    waited: int = 0           # tokens whose destination was behind and was waited for
    deferred: int = 0         # tokens handed back to the engine for the next step
    refused: int = 0          # commits refused (stale or uncertified)
    masked: int = 0           # tokens first routed to a masked (dead) rank, re-routed to a live replica
    no_replica: int = 0       # tokens of an expert whose every replica is masked: delayed, never sent


class Shim:
    """One rank's shim. `counters` holds every rank's running version; `refresh()` pulls commits newer than
    this rank's head (from the local link), called when a destination runs a version this rank lacks."""

    def __init__(
        self,
        topo: Topology,
        rank: int,
        initial: RoutingTable,
        *,
        counters: VersionCounters,
        device: Any = "cpu",
        mover: Mover | None = None,
        refresh: Callable[[int], Iterable[pb.Commit]] | None = None,
        peers: Sequence[int] | None = None,
        wait_polls: int = 200,
        poll_sleep_s: float = 50e-6,
    ) -> None:
        self.topo, self.rank, self.counters, self.refresh = topo, rank, counters, refresh
        self.store = TableStore(topo, rank, initial, device=device, mover=mover, counters=counters, peers=peers)
        self.router = Router(initial.layers, initial.experts, device)
        self.wait_polls, self.poll_sleep_s = wait_polls, poll_sleep_s
        self.stats = ShimStats()
        self.masked: frozenset[int] = frozenset()
        self._alt: dict[int, tuple[I64, I64]] = {}  # version -> (live slots [L, E, W], their count [L, E])

    def mask_ranks(self, ranks: Iterable[int]) -> None:
        """Ranks found dead (membership): from now on no token is dispatched to them. A token routed to one
        goes to a live replica of its expert (nearest first, spread round-robin); a token whose expert has no
        live replica is deferred and counted in `stats.no_replica` until a repaired table lands."""
        new = frozenset(int(r) for r in ranks)
        if new != self.masked:
            self.masked = new
            self._alt.clear()

    def _live_replicas(self, table: RoutingTable) -> tuple[I64, I64]:
        hit = self._alt.get(table.version)
        if hit is not None:
            return hit
        from dataplane_shim.router import preference_order

        pref = preference_order(table, self.rank)  # [L, E, W] slots nearest first, -1 padded
        S = self.topo.slots_per_rank
        dead = np.isin(np.where(pref >= 0, pref // S, -1), sorted(self.masked)) | (pref < 0)
        order = np.argsort(dead, axis=2, kind="stable")  # live slots first, preference order kept
        live = np.where(np.take_along_axis(dead, order, axis=2), -1, np.take_along_axis(pref, order, axis=2))
        cnt = (live >= 0).sum(axis=2).astype(np.int64)
        if len(self._alt) > 4:
            self._alt.clear()
        self._alt[table.version] = (live, cnt)
        return live, cnt

    def _table_of(self, version: int) -> RoutingTable | None:
        st = self.store
        for t in (st.active, st.pending, st.previous):
            if t is not None and t.version == version:
                return t
        return None

    @property
    def version(self) -> int:
        return self.store.active.version

    def offer(self, commits: Iterable[pb.Commit]) -> int:
        """Offer certified commits in order; refused ones (stale, uncertified) are counted. Returns accepted."""
        n = 0
        for c in commits:
            try:
                self.store.offer_commit(c)
                n += 1
            except StaleVersion:
                self.stats.refused += 1
            except ShimError:
                self.stats.refused += 1
        return n

    # 1 ---------------------------------------------------------------------------------------
    def begin_step(self, commits: Iterable[pb.Commit] = (), stage_limit: int | None = None) -> int:
        """Offer `commits`, stage up to `stage_limit` slots, swap if ready, release what peers left. -> version."""
        self.offer(commits)
        if self.store.pending is not None:
            self.store.stage(stage_limit)
            self.store.swap()
        self.store.release_ready()
        self.router.begin_step()
        self.stats.steps += 1
        return self.version

    def route(self, layer: int, topk_ids: Any, *, count: bool = True) -> Any:
        """topk_ids [T, K] logical ids -> slots [T, K] under the active version (no version check)."""
        return self.router.route(self.store.active_tables, layer, topk_ids, count=count)

    # 2 ---------------------------------------------------------------------------------------
    def dispatch(self, layer: int, topk_ids: Any, attempts: int = 3, *, count: bool = True) -> DispatchPlan:
        """Route, then check each destination's counter: equal -> send; behind -> bounded wait; ahead ->
        refresh and re-route under the destination's version. At most `attempts` rounds; rest deferred.
        `count=False` for tokens re-sent after a NACK or a deferral (already in this step's load)."""
        import torch

        slots_t = self.route(layer, topk_ids, count=count)
        shape = tuple(slots_t.shape)
        slots = slots_t.reshape(-1).cpu().numpy().copy()
        ids = topk_ids.reshape(-1)
        vers = np.full(slots.shape, self.version, dtype=np.int64)
        open_ = np.ones(slots.shape, dtype=bool)
        waited = np.zeros(slots.shape, dtype=bool)
        stale = 0
        S = self.topo.slots_per_rank
        for attempt in range(attempts):
            idx = np.flatnonzero(open_)
            if idx.size == 0:
                break
            dv = self.counters.read()[slots[idx] // S]
            same = dv == vers[idx]
            open_[idx[same]] = False
            idx, dv = idx[~same], dv[~same]
            if idx.size == 0:
                break
            if attempt == 0:
                stale = int(idx.size)
                self.stats.stale_detected += stale
            behind = dv < vers[idx]
            if behind.any():
                dests = np.unique(slots[idx[behind]] // S)
                self.stats.waited += int((~waited[idx[behind]]).sum())
                waited[idx[behind]] = True
                wait_until_caught_up(self.counters, dests, self.version, polls=self.wait_polls,
                                     sleep_s=self.poll_sleep_s)
            ahead_idx, ahead_v = idx[~behind], dv[~behind]
            for v in np.unique(ahead_v).tolist():
                sel = ahead_idx[ahead_v == v]
                tables = self.store.tables_for(v)
                if tables is None and self.refresh is not None:
                    self.offer(self.refresh(self.store.head))
                    tables = self.store.tables_for(v)
                if tables is None:
                    continue  # stays open; deferred if no later round resolves it
                sel_t = torch.from_numpy(sel).to(ids.device)
                new = self.router.route(tables, layer, ids.index_select(0, sel_t).reshape(-1, 1), count=False)
                slots[sel] = new.reshape(-1).cpu().numpy()
                vers[sel] = v
                self.stats.rerouted += int(sel.size)
        if open_.any():  # last look: anything now matching may go
            idx = np.flatnonzero(open_)
            dv = self.counters.read()[slots[idx] // S]
            open_[idx[dv == vers[idx]]] = False
        none = self._mask(layer, ids, slots, vers, open_) if self.masked else None
        self.stats.deferred += int(open_.sum())
        vers[open_] = -1
        out = torch.from_numpy(slots).to(slots_t.device).reshape(shape)
        return DispatchPlan(out, vers.reshape(shape), open_.reshape(shape), stale,
                            None if none is None else none.reshape(shape))

    def _mask(self, layer: int, ids: Any, slots: I64, vers: I64, open_: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
        """Re-route tokens headed for masked ranks to live replicas (same version, destination counter
        checked again) or defer them; returns [n] True where the expert had no live replica."""
        S = self.topo.slots_per_rank
        none = np.zeros(slots.shape, dtype=bool)
        bad = ~open_ & np.isin(slots // S, sorted(self.masked))
        if not bad.any():
            return none
        self.stats.masked += int(bad.sum())
        exp = ids.cpu().numpy().astype(np.int64) if hasattr(ids, "cpu") else np.asarray(ids, dtype=np.int64)
        for v in np.unique(vers[bad]).tolist():
            sel = np.flatnonzero(bad & (vers == v))
            table = self._table_of(int(v))
            if table is None:  # cannot happen for a version this rank routed by; defer rather than guess
                open_[sel] = True
                continue
            live, cnt = self._live_replicas(table)
            e = exp[sel]
            c = cnt[layer, e]
            none[sel[c == 0]] = True
            ok = sel[c > 0]
            if ok.size:
                k = np.arange(ok.size) % np.maximum(c[c > 0], 1)  # spread over the live replicas
                slots[ok] = live[layer, exp[ok], k]
            open_[sel[c == 0]] = True
        # a re-routed token goes only to a destination that runs its version; else it waits a step
        idx = np.flatnonzero(bad & ~open_)
        if idx.size:
            dv = self.counters.read()[slots[idx] // S]
            open_[idx[dv != vers[idx]]] = True
        self.stats.no_replica += int(none.sum())
        return none

    # 3 ---------------------------------------------------------------------------------------
    def accepts(self, version: int, layers: I64, slots: I64) -> npt.NDArray[np.bool_]:
        """Receive side: [n] tokens tagged `version` for `slots` of `layers` -> [n] servable here."""
        return self.store.accepts(version, layers, slots)

    # 4 ---------------------------------------------------------------------------------------
    def end_step(self) -> npt.NDArray[np.uint32]:
        """uint32 [L, E] tokens per logical expert routed this step (for the link's LoadReport)."""
        return self.router.load_report()
