"""EPLB: DeepSeek's expert-parallelism load balancer, in numpy, producing RoutingTables.

Follows deepseek-ai/EPLB `eplb.py` (and vLLM's port `vllm/distributed/eplb/policy/default.py`):
`replicate_experts` (greedily give the next replica to the expert with the largest load per replica),
`balanced_packing` (heaviest item first into the lightest pack that still has room) and the hierarchical
policy (pack expert groups onto nodes, replicate within each node, pack the physical experts onto the
node's GPUs); when the groups do not divide over the nodes, the global policy (one group, one node).
vLLM's `preserve_intragpu_slots` keeps an expert that stays on a GPU in its old slot, so only slots
whose content really changes are copied.

Two additions needed by this project's "valid table" (no rank holds two replicas of one expert), both
no-ops on typical inputs: an expert gets at most as many replicas as there are GPUs in its packing scope,
and a rank that the packing gave two replicas of one expert swaps one of them with the nearest-weight
slot of another rank of the same scope.

Every slot of every layer is filled (num_physical = G x S), as in the reference: spare slots become
replicas.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from controlplane.errors import InvalidShape, InvalidTable
from controlplane.table import RoutingTable

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


def balanced_packing(weight: F64, num_packs: int) -> tuple[I64, I64]:
    """Pack the n items of each row into `num_packs` packs of exactly n / num_packs items, balancing weight.

    weight: [X, n] -> (pack_index [X, n], rank_in_pack [X, n]). Items are taken heaviest first (stable
    order on ties) and each goes to the lightest pack with room (lowest index on ties). Vectorised over X.
    """
    X, n = weight.shape
    if num_packs < 1 or n % num_packs:
        raise InvalidShape(f"balanced_packing: {n} items do not split into {num_packs} equal packs")
    per_pack = n // num_packs
    rows = np.arange(X)
    if per_pack == 1:
        pack_index = np.broadcast_to(np.arange(n, dtype=np.int64), (X, n)).copy()
        return pack_index, np.zeros((X, n), dtype=np.int64)
    order = np.argsort(-weight, axis=1, kind="stable")
    pack_index = np.full((X, n), -1, dtype=np.int64)
    rank_in_pack = np.full((X, n), -1, dtype=np.int64)
    pack_w = np.zeros((X, num_packs), dtype=np.float64)
    pack_n = np.zeros((X, num_packs), dtype=np.int64)
    for j in range(n):  # n items per row, each step vectorised over the X rows
        item = order[:, j]
        pack = np.argmin(np.where(pack_n < per_pack, pack_w, np.inf), axis=1)
        pack_index[rows, item] = pack
        rank_in_pack[rows, item] = pack_n[rows, pack]
        pack_w[rows, pack] += weight[rows, item]
        pack_n[rows, pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: F64, num_phy: int, max_replicas: int | None = None) -> tuple[I64, I64]:
    """Replicate each row's experts into `num_phy` physical experts minimising the largest load per replica.

    weight: [X, num_log] -> (phy2log [X, num_phy], logcnt [X, num_log]). The first num_log physical
    experts are the logical ones in order; each further one goes to argmax(weight / logcnt) among experts
    with fewer than `max_replicas` replicas.
    """
    X, num_log = weight.shape
    if num_phy < num_log:
        raise InvalidShape(f"replicate_experts: {num_phy} physical < {num_log} logical experts")
    cap = num_phy if max_replicas is None else max_replicas
    if cap * num_log < num_phy:
        raise InvalidTable(f"{num_phy} slots cannot hold {num_log} experts with at most {cap} replicas each")
    rows = np.arange(X)
    phy2log = np.empty((X, num_phy), dtype=np.int64)
    phy2log[:, :num_log] = np.arange(num_log)
    logcnt = np.ones((X, num_log), dtype=np.int64)
    for i in range(num_log, num_phy):
        score = np.where(logcnt < cap, weight / logcnt, -np.inf)
        best = np.argmax(score, axis=1)
        phy2log[:, i] = best
        logcnt[rows, best] += 1
    return phy2log, logcnt


def _inverse(perm: I64) -> I64:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def rebalance_hierarchical(weight: F64, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int) -> I64:
    """DeepSeek EPLB's hierarchical policy. weight: [L, E] -> phy2log [L, num_physical] (slot p on GPU
    p // (num_physical / num_gpus)). With num_groups = num_nodes = 1 this is the global policy."""
    L, E = weight.shape
    for what, ok in (
        (f"experts {E} % groups {num_groups}", E % num_groups == 0),
        (f"groups {num_groups} % nodes {num_nodes}", num_groups % num_nodes == 0),
        (f"gpus {num_gpus} % nodes {num_nodes}", num_gpus % num_nodes == 0),
        (f"physical {num_physical} % gpus {num_gpus}", num_physical % num_gpus == 0),
    ):
        if not ok:
            raise InvalidShape(f"EPLB needs {what} == 0")
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    per_gpu = num_physical // num_gpus
    gpus_per_node = num_gpus // num_nodes
    # step 1: pack expert groups onto nodes
    tokens_per_group = weight.reshape(L, num_groups, group_size).sum(axis=-1)
    gpack, grank = balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (((gpack * groups_per_node + grank) * group_size)[..., None] + np.arange(group_size)).reshape(L, E)
    mlog2log = _inverse(log2mlog)
    # step 2: replicate within each node
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, axis=1).reshape(-1, E // num_nodes)
    phy2mlog, mlogcnt = replicate_experts(tokens_per_mlog, num_physical // num_nodes, max_replicas=gpus_per_node)
    # step 3: pack the physical experts onto the node's GPUs
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt, phy2mlog, axis=1)
    pack, rank_in = balanced_packing(tokens_per_phy, gpus_per_node)
    pphy2phy = _inverse(pack * per_gpu + rank_in)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)
    pphy2mlog = (pphy2mlog.reshape(L, num_nodes, -1) + (np.arange(num_nodes) * (E // num_nodes))[None, :, None])
    out: I64 = np.take_along_axis(mlog2log, pphy2mlog.reshape(L, -1), axis=1)
    return out


def fix_rank_duplicates(phy2log: I64, weight: F64, num_gpus: int, scope_gpus: int) -> I64:
    """Swap away a second replica of an expert on one GPU. phy2log: [L, P], weight: [L, E] -> [L, P].

    A duplicate's slot is swapped with the slot of another GPU of the same scope (`scope_gpus` consecutive
    GPUs) whose per-replica load is nearest, such that neither GPU ends with a duplicate. Loops only over
    the (rare) duplicates.
    """
    L, P = phy2log.shape
    S = P // num_gpus
    out = phy2log.copy()
    per = out.reshape(L, num_gpus, S)
    srt = np.sort(per, axis=2)
    bad_layers = np.unique(np.nonzero((srt[:, :, 1:] == srt[:, :, :-1]).any(axis=2))[0])
    for layer in bad_layers.tolist():
        row = out[layer]
        cnt = np.bincount(row[row >= 0], minlength=weight.shape[1])
        share = np.where(row >= 0, weight[layer, np.maximum(row, 0)] / np.maximum(cnt[np.maximum(row, 0)], 1), 0.0)
        for g in range(num_gpus):
            for _ in range(S):
                block = row[g * S:(g + 1) * S]
                vals, counts = np.unique(block[block >= 0], return_counts=True)
                dups = vals[counts > 1]
                if dups.size == 0:
                    break
                e = int(dups[0])
                p = g * S + int(np.flatnonzero(block == e)[-1])
                lo = (g // scope_gpus) * scope_gpus
                cands = []
                for h in range(lo, lo + scope_gpus):
                    if h == g or (row[h * S:(h + 1) * S] == e).any():
                        continue
                    for q in range(h * S, (h + 1) * S):
                        f = int(row[q])
                        if f != e and not (block == f).any():
                            cands.append((abs(float(share[q]) - float(share[p])), q))
                if not cands:
                    raise InvalidTable(f"layer {layer}: cannot separate the replicas of expert {e} on rank {g}")
                q = min(cands)[1]
                row[p], row[q] = row[q], row[p]
                share[p], share[q] = share[q], share[p]
    return out


def preserve_slots(new: I64, old: I64, num_gpus: int) -> I64:
    """vLLM's preserve_intragpu_slots: on each GPU, an expert kept from `old` keeps its old slot; the
    incoming experts fill the remaining slots in order. new, old: [L, P] -> [L, P]."""
    L, P = new.shape
    S = P // num_gpus
    n = new.reshape(L, num_gpus, S)
    o = old.reshape(L, num_gpus, S)
    out = np.full_like(n, -1)
    used = np.zeros(n.shape, dtype=bool)
    kept = np.zeros(n.shape, dtype=bool)
    for s in range(S):  # S slots per GPU; vectorised over layers and GPUs
        match = (n == o[:, :, s:s + 1]) & ~used & (o[:, :, s:s + 1] >= 0)
        has = match.any(axis=2)
        first = np.argmax(match, axis=2)
        li, gi = np.nonzero(has)
        out[li, gi, s] = n[li, gi, first[li, gi]]
        used[li, gi, first[li, gi]] = True
        kept[li, gi, s] = True
    # remaining new experts (in slot order) into the free positions (in slot order)
    idx = np.arange(S)
    src = np.argsort(np.where(~used, idx, S + idx), axis=2, kind="stable")
    dst = np.argsort(np.where(~kept, idx, S + idx), axis=2, kind="stable")
    k = (~used).sum(axis=2)
    take = idx[None, None, :] < k[..., None]
    vals = np.take_along_axis(n, src, axis=2)
    cur = np.take_along_axis(out, dst, axis=2)
    np.put_along_axis(out, dst, np.where(take, vals, cur), axis=2)
    result: I64 = out.reshape(L, P)
    return result


def eplb_phy2log(weight: npt.NDArray[np.floating | np.integer], num_physical: int, num_groups: int,
                 num_nodes: int, num_gpus: int) -> I64:
    """rebalance_experts: hierarchical when groups divide over nodes, else global. [L, E] -> [L, P]."""
    w = np.asarray(weight, dtype=np.float64)
    per_gpu = num_physical // num_gpus
    if w.shape[1] < per_gpu:
        raise InvalidTable(f"{w.shape[1]} experts cannot fill {per_gpu} slots per rank without a rank holding "
                           "two replicas of one expert")
    if num_groups % num_nodes == 0 and w.shape[1] % num_groups == 0 and w.shape[1] // num_nodes >= per_gpu:
        phy = rebalance_hierarchical(w, num_physical, num_groups, num_nodes, num_gpus)
        scope = num_gpus // num_nodes
    else:
        phy = rebalance_hierarchical(w, num_physical, 1, 1, num_gpus)
        scope = num_gpus
    return fix_rank_duplicates(phy, w, num_gpus, scope)


def eplb_table(prev: RoutingTable, totals: npt.NDArray[np.integer], num_groups: int = 1) -> RoutingTable:
    """A full EPLB rebalance of `prev` from load totals [L, E]: the successor table (every slot filled)."""
    t = np.asarray(totals)
    if t.shape != (prev.layers, prev.experts):
        raise InvalidShape(f"totals shape {t.shape}: expected [{prev.layers}, {prev.experts}]")
    if len(prev.active_ranks) != prev.topology.ranks:
        raise InvalidTable("EPLB baseline needs every rank active")
    topo = prev.topology
    phy = eplb_phy2log(t, topo.slots, num_groups, topo.nodes, topo.ranks)
    phy = preserve_slots(phy, prev.phy2log, topo.ranks)
    table = prev.successor(phy)
    table.validate()
    return table
