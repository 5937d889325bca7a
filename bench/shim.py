"""Data-plane shim micro-benchmark on CPU, DeepSeek-V3 shape (256 experts, 8 nodes x 8 ranks x 5 slots,
58 MoE layers, 4096 tokens x top-8).

    python -m bench.shim --json
    {"tokens": 4096, "topk": 8, "route_us_median": R, "gather_us_median": G, "overhead_ratio": R/G,
     "swap_us_median": S}

R: `Router.route` (least loaded among replicas, ties to the nearest, plus the per-expert load counts).
G: the plain gather vLLM's EPLB does, round-robin over replicas by token position:
   `log2phy[layer][ids, pos % logcnt[layer][ids]]` (same tensors, same width P - E + 1).
The two are measured interleaved, one single-threaded torch call each per repetition, medians reported.
S: `TableStore.swap()` with the next version staged (flip of the double buffer, slot states, counter).
Without --json it also prints two more gathers for context: vLLM's literal expression
(`log2phy[ids].gather(-1, ...)`, which materialises [T*K, W] rows) and an index_select form.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from controlplane.table import RoutingTable, initial_table
from controlplane.topology import Topology


def replicated_table(topo: Topology, layers: int, experts: int, seed: int) -> RoutingTable:
    """Static EP plus one extra replica of a random expert in every free slot (a full table, as EPLB's)."""
    rng = np.random.default_rng(seed)
    base = initial_table(topo, layers, experts)
    phy = base.phy2log.copy()
    S = topo.slots_per_rank
    for layer in range(layers):
        for p in np.flatnonzero(phy[layer] < 0).tolist():
            lo = (p // S) * S
            choices = np.setdiff1d(np.arange(experts), phy[layer, lo : lo + S])
            phy[layer, p] = int(rng.choice(choices))
    return RoutingTable(topo, experts, phy, version=1)


def skewed_topk(tokens: int, experts: int, k: int, seed: int) -> np.ndarray:
    """[T, K] distinct expert ids per token, Zipf-skewed popularity (Gumbel top-k)."""
    rng = np.random.default_rng(seed)
    logp = -1.1 * np.log(np.arange(1, experts + 1))[rng.permutation(experts)]
    scores = logp[None, :] + rng.gumbel(size=(tokens, experts))
    return np.argsort(-scores, axis=1)[:, :k].astype(np.int64)


def _time(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def measure(tokens: int = 4096, topk: int = 8, reps: int = 200, swaps: int = 30, seed: int = 0) -> dict[str, Any]:
    import torch

    from dataplane_shim.counters import DeviceCounters
    from dataplane_shim.router import Router, RouteTables
    from dataplane_shim.tables import TableStore

    torch.set_num_threads(1)
    topo, layers, experts = Topology(8, 8, 5), 58, 256
    table = replicated_table(topo, layers, experts, seed)
    rank = 3
    rt = RouteTables(layers, experts, topo.slots)
    rt.load(table, rank)
    router = Router(layers, experts)
    ids = torch.from_numpy(skewed_topk(tokens, experts, topk, seed))
    log2phy = torch.full((layers, experts, rt.width), -1, dtype=torch.int64)
    log2phy[:, :, : table.log2phy.shape[2]] = torch.from_numpy(np.array(table.log2phy))
    logcnt = torch.from_numpy(np.array(table.logcnt))
    layer = 7

    def route() -> Any:
        return router.route(rt, layer, ids)

    def gather() -> Any:  # vLLM's round-robin replica choice as a plain gather
        flat = ids.reshape(-1)
        pos = torch.arange(flat.numel())
        return log2phy[layer][flat, pos % logcnt[layer][flat]].view_as(ids)

    def vllm_literal() -> Any:
        cnt = logcnt[layer][ids]
        pos = torch.arange(ids.numel()).reshape_as(ids)
        return log2phy[layer][ids].gather(-1, (pos % cnt).unsqueeze(-1)).squeeze(-1)

    def gather_index_select() -> Any:
        flat = ids.reshape(-1)
        idx = torch.arange(flat.numel()).remainder_(logcnt[layer].index_select(0, flat))
        idx += flat * rt.width
        return log2phy[layer].reshape(-1).index_select(0, idx).view_as(ids)

    # correctness first: every slot holds its expert; the gathers agree with each other
    out = route()
    if not bool((torch.from_numpy(np.array(table.phy2log[layer]))[out] == ids).all()):
        raise RuntimeError("route returned a slot that does not hold the requested expert")
    if not (torch.equal(gather(), vllm_literal()) and torch.equal(gather(), gather_index_select())):
        raise RuntimeError("the three gathers disagree")
    for fn in (route, gather, vllm_literal, gather_index_select):  # warm up
        fn()
    r_us, g_us, lit_us, sel_us = [], [], [], []
    for i in range(reps):
        router.begin_step()
        pair = [(route, r_us), (gather, g_us)]
        for fn, acc in pair if i % 2 == 0 else pair[::-1]:
            acc.append(_time(fn))
        if i % 10 == 0:
            lit_us.append(_time(vllm_literal))
            sel_us.append(_time(gather_index_select))

    counters = DeviceCounters(topo.ranks)
    store = TableStore(topo, rank, table, counters=counters)
    alt = replicated_table(topo, layers, experts, seed + 1)
    s_us = []
    for v in range(2, swaps + 2):
        nxt = (alt if v % 2 == 0 else table).with_version(v, v - 1)
        store.offer(nxt)
        store.stage()
        s_us.append(_time(store.swap))
        if store.active.version != v:
            raise RuntimeError(f"swap did not activate version {v}")
    R, G = float(np.median(r_us)), float(np.median(g_us))
    return {
        "tokens": tokens, "topk": topk, "route_us_median": round(R, 1), "gather_us_median": round(G, 1),
        "overhead_ratio": round(R / G, 3), "swap_us_median": round(float(np.median(s_us)), 1),
        "_vllm_literal_us_median": round(float(np.median(lit_us)), 1),
        "_gather_index_select_us_median": round(float(np.median(sel_us)), 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args(argv)
    res = measure(a.tokens, a.topk, a.reps)
    if a.json:
        print(json.dumps({k: v for k, v in res.items() if not k.startswith("_")}))
        return
    for k, v in res.items():
        print(f"{k.lstrip('_'):32s} {v}")
    print(f"{'ratio vs vllm literal':32s} {res['route_us_median'] / res['_vllm_literal_us_median']:.3f}")
    print(f"{'ratio vs index_select gather':32s} {res['route_us_median'] / res['_gather_index_select_us_median']:.3f}")


if __name__ == "__main__":
    main()
