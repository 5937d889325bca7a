"""Rank loads under a table, and imbalance: the kernels that replay verification is built on.

Routing-policy model: an expert's tokens in a step are split evenly over its replicas, the remainder
going one each to the lowest-numbered replicas. This is what the shim's least-loaded router converges to
within a step, in integers, so that every node computes identical figures.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from controlplane.errors import InvalidShape
from controlplane.table import RoutingTable

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


def slot_load(table: RoutingTable, counts: npt.NDArray[np.integer]) -> I64:
    """Tokens per slot. counts: [..., L, E] -> [..., L, P] int64 (empty slots get 0)."""
    c = np.asarray(counts)
    if c.shape[-2:] != (table.layers, table.experts):
        raise InvalidShape(f"counts shape {c.shape}: expected [..., {table.layers}, {table.experts}]")
    phy = table.phy2log
    valid = phy >= 0
    e = np.where(valid, phy, 0)
    layer_idx = np.broadcast_to(np.arange(table.layers)[:, None], phy.shape)
    per_slot = c[..., layer_idx, e].astype(np.int64)  # [..., L, P]
    r = np.where(valid, table.logcnt[layer_idx, e], 1)
    j = table.replica_index
    share = per_slot // r + (j < per_slot % r)
    return np.where(valid, share, 0)


def rank_load(table: RoutingTable, counts: npt.NDArray[np.integer]) -> I64:
    """Tokens per rank. counts: [..., L, E] -> [..., L, G] int64."""
    s = slot_load(table, counts)
    G, S = table.topology.ranks, table.topology.slots_per_rank
    return np.asarray(s.reshape(*s.shape[:-1], G, S).sum(axis=-1), dtype=np.int64)


def step_imbalance(loads: I64, active_mask: npt.NDArray[np.bool_]) -> F64:
    """sum over layers of max / sum over layers of mean. loads: [..., L, G] -> [...]."""
    act = loads[..., active_mask]
    mx = act.max(axis=-1).sum(axis=-1).astype(np.float64)
    mean = act.mean(axis=-1).sum(axis=-1)
    return np.asarray(np.divide(mx, mean, out=np.ones_like(mx), where=mean > 0), dtype=np.float64)


def table_step_imbalance(table: RoutingTable, counts: npt.NDArray[np.integer]) -> F64:
    """Step imbalance of `counts [..., L, E]` under `table` -> [...]."""
    return step_imbalance(rank_load(table, counts), table.active_mask)


def replay_imbalance(table: RoutingTable, steps: npt.NDArray[np.integer]) -> float:
    """Mean per-step step imbalance of a replay buffer `steps [T, L, E]` under `table` (1.0 if empty)."""
    if steps.shape[0] == 0:
        return 1.0
    return float(table_step_imbalance(table, steps).mean())
