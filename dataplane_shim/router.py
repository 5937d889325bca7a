"""Replica-aware routing: logical top-k ids -> physical slots, least loaded first, ties to the nearest.

Policy (one definition, three implementations that must agree: numpy reference, torch, CUDA):
tokens are assigned in row-major order of `topk_ids [T, K]`; each goes to the replica of its logical
expert with the fewest tokens assigned so far in this step by this sender (counted per (layer, slot) from
`begin_step`); ties go to the nearest replica relative to the sending rank (same rank, same node, remote),
then to the lowest slot id. Because every replica of an expert starts the step at 0 and only that expert's
tokens land on it, the greedy choice has a closed form: the i-th token of expert e in the step goes to
`pref[e][i mod logcnt[e]]`, where `pref[e]` lists e's slots by (tier, slot). The torch router computes `i`
with one stable sort of the ids (a counting-sort rank), so nothing loops over tokens.

Loads are the sender's own: a sender cannot see what other senders send to a replica within the step.
The per-expert token counts `[L, E]` double as the load report.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from controlplane.table import RoutingTable
from controlplane.topology import Topology
from dataplane_shim.errors import BadInput

I64 = npt.NDArray[np.int64]


def slot_tiers(topo: Topology, rank: int) -> I64:
    """[P] tier of each slot seen from `rank`: 0 same rank, 1 same node, 2 other node."""
    ranks = topo.slot_ranks()
    node = ranks // topo.ranks_per_node
    return np.where(ranks == rank, 0, np.where(node == topo.node_of(rank), 1, 2)).astype(np.int64)


def preference_order(table: RoutingTable, rank: int, width: int | None = None) -> I64:
    """[L, E, W] each expert's slots ordered by (tier from `rank`, slot id), -1 padded.

    W defaults to P - E + 1, the most replicas any expert can have (vLLM and EPLB use the same width).
    """
    L, P = table.phy2log.shape
    E = table.experts
    w = max(1, P - E + 1) if width is None else width
    tier = slot_tiers(table.topology, rank)
    phy = table.phy2log
    occupied = phy >= 0
    key = np.where(occupied, phy * (3 * P) + tier[None, :] * P + np.arange(P)[None, :], E * 3 * P + P)
    order = np.argsort(key, axis=1, kind="stable")  # [L, P] slots grouped by expert, nearest first
    exp_sorted = np.take_along_axis(np.where(occupied, phy, E), order, axis=1)
    pos = np.broadcast_to(np.arange(P), (L, P))
    is_start = np.ones((L, P), dtype=bool)
    is_start[:, 1:] = exp_sorted[:, 1:] != exp_sorted[:, :-1]
    j = pos - np.maximum.accumulate(np.where(is_start, pos, 0), axis=1)
    keep = exp_sorted < E
    if (j[keep] >= w).any():
        raise BadInput(f"an expert of version {table.version} has more than width={w} replicas")
    out = np.full((L, E, w), -1, dtype=np.int64)
    rows = np.broadcast_to(np.arange(L)[:, None], (L, P))
    out[rows[keep], exp_sorted[keep], j[keep]] = order[keep]
    return out


def route_reference(
    table: RoutingTable, rank: int, layer: int, topk_ids: npt.NDArray[np.integer], slot_load: I64
) -> I64:
    """The policy written out, one token at a time (tests only). topk_ids [T, K] -> slots [T, K].

    `slot_load [L, P]` holds this step's tokens per slot so far and is updated in place.
    """
    tier = slot_tiers(table.topology, rank)
    ids = np.asarray(topk_ids, dtype=np.int64)
    out = np.empty_like(ids)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            cands = np.flatnonzero(table.phy2log[layer] == e)
            best = min(cands.tolist(), key=lambda p: (int(slot_load[layer, p]), int(tier[p]), p))
            slot_load[layer, best] += 1
            out[t, k] = best
    return out


class RouteTables:
    """One version's routing arrays on a device, for one sending rank; a buffer reused across versions.

    phy2log [L, P], pref [L, E, W] (slots by (tier, id)), logcnt [L, E]; all int64.
    """

    def __init__(self, layers: int, experts: int, slots: int, device: Any = "cpu") -> None:
        import torch

        w = max(1, slots - experts + 1)
        self.version = 0
        self.width = w
        self.phy2log = torch.full((layers, slots), -1, dtype=torch.int64, device=device)
        self.pref = torch.full((layers, experts, w), -1, dtype=torch.int64, device=device)
        self.logcnt = torch.zeros((layers, experts), dtype=torch.int64, device=device)

    def load(self, table: RoutingTable, rank: int) -> None:
        """Copy `table` (as seen from `rank`) into this buffer's tensors (shapes fixed, addresses kept)."""
        import torch

        if tuple(self.phy2log.shape) != tuple(table.phy2log.shape) or self.logcnt.shape[1] != table.experts:
            raise BadInput(f"table shape {table.phy2log.shape}, {table.experts} experts: buffer is "
                           f"{tuple(self.phy2log.shape)}, {self.logcnt.shape[1]} experts")
        self.phy2log.copy_(torch.from_numpy(np.array(table.phy2log)), non_blocking=True)
        self.pref.copy_(torch.from_numpy(preference_order(table, rank, self.width)), non_blocking=True)
        self.logcnt.copy_(torch.from_numpy(np.array(table.logcnt)), non_blocking=True)
        self.version = table.version


class Router:
    """Routes with a `RouteTables` and counts tokens per (layer, logical expert) within the step."""

    def __init__(self, layers: int, experts: int, device: Any = "cpu", max_tokens: int = 1 << 16) -> None:
        import torch

        self.layers, self.experts = layers, experts
        self.counts = torch.zeros((layers, experts), dtype=torch.int64, device=device)
        self._arange = torch.arange(max_tokens, dtype=torch.int64, device=device)
        self._sort_dtype = torch.int16 if experts <= 32767 else torch.int32

    def begin_step(self) -> None:
        self.counts.zero_()

    def load_report(self) -> npt.NDArray[np.uint32]:
        """uint32 [L, E] tokens per logical expert routed since `begin_step`."""
        out: npt.NDArray[np.uint32] = self.counts.cpu().numpy().astype(np.uint32)
        return out

    def route(self, tables: RouteTables, layer: int, topk_ids: Any, *, count: bool = True) -> Any:
        """topk_ids [T, K] integer tensor of logical ids in [0, E) -> slot ids [T, K] int64 (same device).

        `count=False` re-routes tokens already counted this step (a stale retry): the step's per-expert
        counts neither advance nor count them twice.
        """
        import torch

        if not 0 <= layer < self.layers:
            raise BadInput(f"layer={layer}: expected 0..{self.layers - 1}")
        if topk_ids.dim() != 2:
            raise BadInput(f"topk_ids shape {tuple(topk_ids.shape)}: expected [tokens, top_k]")
        flat = topk_ids.reshape(-1).long()
        n = flat.numel()
        if n > self._arange.numel():
            self._arange = torch.arange(n, dtype=torch.int64, device=flat.device)
        if n == 0:
            return flat.view_as(topk_ids)
        if int(flat.min()) < 0:
            raise BadInput(f"topk_ids holds {int(flat.min())}: expected ids in 0..{self.experts - 1}")
        hist = torch.bincount(flat, minlength=self.experts)
        if hist.numel() != self.experts:
            raise BadInput(f"topk_ids holds {hist.numel() - 1}: expected ids in 0..{self.experts - 1}")
        sorted_e, perm = torch.sort(flat.to(self._sort_dtype), stable=True)
        se = sorted_e.long()
        # the i-th occurrence of e (in token order) is its (counts[e] + i)-th token this step
        off = self.counts[layer] - (torch.cumsum(hist, 0) - hist)
        nth = self._arange[:n] + off.index_select(0, se)
        idx = nth.remainder_(tables.logcnt[layer].index_select(0, se))
        idx += se * tables.width
        slot_sorted = tables.pref[layer].reshape(-1).index_select(0, idx)
        out = torch.empty_like(flat).scatter_(0, perm, slot_sorted)
        if count:
            self.counts[layer] += hist
        return out.view_as(topk_ids)
