"""Multi-process simulation of EP engines around the shim: one process per rank, shared-memory version
counters, tables that change every few steps, random install delays, and an oracle on every token.

Each rank runs lock-step rounds (one data and one NACK message to every rank per round, so nothing is in
flight across a round boundary, yet the counter reads and swaps of different ranks interleave freely):
  a) step boundary: offer the commits up to the shared head, stage a random number of slots, swap, release
  b) route fresh tokens and retries through `Shim.dispatch`, send each destination its tokens with tags
  c) receive: `Shim.accepts` decides; the oracle checks the rank's real expert memory (written only by the
     mover) holds each accepted token's expert; rejected tokens are NACKed (stale at the receiver)
  d) NACKed and deferred tokens are retried next round (never counted twice in the load)
`run(...)` returns the summed counts; the test asserts zero oracle violations and that every token was
eventually accepted. Rank 0 commits a new version every `every` rounds.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from controlplane.errors import InvalidTable
from controlplane.table import RoutingTable, initial_table, validate_phy2log
from controlplane.topology import Topology
from dataplane_shim.certify import certified_commit
from dataplane_shim.counters import SharedCounters

GET_TIMEOUT_S = 20.0


def table_sequence(topo: Topology, layers: int, experts: int, versions: int, seed: int) -> list[RoutingTable]:
    """versions tables, v1 static EP, each next one a few random edits: replicate into a free slot, drop a
    spare replica, or overwrite a spare replica in place with another expert (the forced-load path)."""
    rng = np.random.default_rng(seed)
    S = topo.slots_per_rank
    out = [initial_table(topo, layers, experts)]
    while len(out) < versions:
        phy = out[-1].phy2log.copy()
        for layer in range(layers):
            for _ in range(int(rng.integers(2, 5))):
                row = phy[layer].copy()
                cnt = np.bincount(row[row >= 0], minlength=experts)
                kind = int(rng.choice(3, p=[0.4, 0.2, 0.4]))
                pick = np.flatnonzero(row < 0) if kind == 0 else np.flatnonzero((row >= 0) & (cnt[row] > 1))
                if pick.size == 0:
                    continue
                p = int(rng.choice(pick))
                lo = (p // S) * S
                e = int(rng.choice(np.setdiff1d(np.arange(experts), row[lo : lo + S])))
                row[p] = -1 if kind == 1 else e
                try:
                    validate_phy2log(row[None], experts, topo)
                except InvalidTable:
                    continue
                phy[layer] = row
        if not np.array_equal(phy, out[-1].phy2log):
            out.append(out[-1].successor(phy))
    return out


@dataclass
class RankResult:
    rank: int = 0
    generated: int = 0
    accepted: int = 0
    violations: int = 0
    stale_at_sender: int = 0
    rerouted: int = 0
    waited: int = 0
    deferred: int = 0
    nacked: int = 0
    late_served: int = 0
    retried: int = 0
    swaps: int = 0
    forced: int = 0
    released: int = 0
    final_version: int = 0
    rounds: int = 0


def _worker(rank: int, cfg: dict[str, Any], names: tuple[str, str, str], data_q: list[Any], nack_q: list[Any],
            barrier: Any, results: Any) -> None:
    import torch

    from dataplane_shim.shim import Shim

    torch.set_num_threads(1)
    topo = Topology(cfg["nodes"], cfg["rpn"], cfg["spr"])
    G, S, L, E = topo.ranks, topo.slots_per_rank, cfg["layers"], cfg["experts"]
    tables = table_sequence(topo, L, E, cfg["versions"], cfg["seed"])
    commits = [certified_commit(t, ["n0", "n1", "n2"], 2) for t in tables]
    counters = SharedCounters(names[0], G)
    head = SharedCounters(names[1], 1)
    mem = tables[0].phy2log[:, rank * S : (rank + 1) * S].copy()  # this rank's real expert memory

    def mover(layers: np.ndarray, slots: np.ndarray, experts: np.ndarray) -> None:
        mem[layers, slots] = experts

    def newer(version: int) -> list[Any]:
        return [c for c in commits[version: int(head.read()[0])]]  # commits[i] is version i + 1

    rng = np.random.default_rng(cfg["seed"] * 1000 + rank)
    shim = Shim(topo, rank, tables[0], counters=counters, mover=mover, refresh=newer, wait_polls=cfg["polls"],
                poll_sleep_s=1e-4)
    res = RankResult(rank=rank)
    retry: list[tuple[int, int]] = []  # (layer, expert)
    rnd = 0
    try:
        while True:
            fresh = rnd < cfg["steps"]
            if rank == 0 and fresh and rnd % cfg["every"] == 0:
                head.publish(0, min(len(commits), int(head.read()[0]) + 1))
            if cfg["jitter_ms"]:  # ranks reach the boundary at different times: swaps race with sends
                time.sleep(float(rng.random()) * cfg["jitter_ms"] / 1000)
            # a) step boundary
            shim.begin_step(newer(shim.store.head), stage_limit=int(rng.integers(0, 3)))
            # b) dispatch
            out: list[list[np.ndarray]] = [[] for _ in range(G)]
            batches = []
            if fresh:
                for layer in range(L):
                    ids = np.argsort(rng.random((cfg["tokens"], E)), axis=1)[:, : cfg["topk"]]
                    res.generated += ids.size
                    batches.append((layer, ids, True))
            for layer in range(L):
                again = np.array([e for lyr, e in retry if lyr == layer], dtype=np.int64)
                if again.size:
                    res.retried += int(again.size)
                    batches.append((layer, again[:, None], False))
            retry = []
            for layer, ids, count in batches:
                exp = ids.reshape(-1)
                if cfg["unsafe"]:  # no version check at all: route under whatever this rank runs
                    slots = shim.route(layer, torch.from_numpy(ids), count=count).reshape(-1).numpy()
                    vers, go = np.full(slots.shape, shim.version), np.ones(slots.shape, dtype=bool)
                else:
                    plan = shim.dispatch(layer, torch.from_numpy(ids), count=count)
                    slots = plan.slots.reshape(-1).numpy()
                    vers, go = plan.versions.reshape(-1), ~plan.deferred.reshape(-1)
                    retry += [(layer, int(e)) for e in exp[~go]]
                dest = slots // S
                for d in np.unique(dest[go]).tolist():
                    m = go & (dest == d)
                    out[d].append(np.stack([vers[m], np.full(int(m.sum()), layer), slots[m], exp[m]]))
            for d in range(G):
                data_q[d].put((rank, np.concatenate(out[d], axis=1) if out[d] else np.zeros((4, 0), np.int64)))
            # c) receive
            nacks: list[list[tuple[int, int]]] = [[] for _ in range(G)]
            for _ in range(G):
                src, msg = data_q[rank].get(timeout=GET_TIMEOUT_S)
                if msg.shape[1] == 0:
                    continue
                ok = np.zeros(msg.shape[1], dtype=bool)
                for tag in np.unique(msg[0]).tolist():
                    m = msg[0] == tag
                    ok[m] = True if cfg["unsafe"] else shim.accepts(int(tag), msg[1, m], msg[2, m])
                lay, loc, exp = msg[1, ok], msg[2, ok] - rank * S, msg[3, ok]
                res.violations += int((mem[lay, loc] != exp).sum())  # the oracle: real memory
                res.accepted += int(ok.sum())
                res.late_served += int((ok & (msg[0] != shim.version)).sum())
                res.nacked += int((~ok).sum())
                nacks[src] += list(zip(msg[1, ~ok].tolist(), msg[3, ~ok].tolist(), strict=True))
            for d in range(G):
                nack_q[d].put(nacks[d])
            # d) NACKs come back to their senders
            for _ in range(G):
                retry += nack_q[rank].get(timeout=GET_TIMEOUT_S)
            rnd += 1
            if not fresh:  # drain phase: stop once nobody has anything left to retry
                pending = SharedCounters(names[2], G)
                pending.publish(rank, len(retry))
                barrier.wait(GET_TIMEOUT_S)
                done = int(pending.read().sum()) == 0 and int(counters.read().min()) == len(commits)
                barrier.wait(GET_TIMEOUT_S)
                pending.close()
                if done or rnd > cfg["steps"] + cfg["drain_rounds"]:
                    break
    finally:
        st, ss = shim.stats, shim.store.stats
        res.stale_at_sender, res.rerouted, res.waited, res.deferred = (st.stale_detected, st.rerouted,
                                                                        st.waited, st.deferred)
        res.swaps, res.forced, res.released = ss.swaps, ss.forced, ss.released
        res.final_version, res.rounds = shim.version, rnd
        results.put(asdict(res))
        counters.close()
        head.close()


def run(*, nodes: int = 2, rpn: int = 4, spr: int = 4, layers: int = 2, experts: int = 16, versions: int = 12,
        steps: int = 48, every: int = 3, tokens: int = 32, topk: int = 4, seed: int = 0, polls: int = 20,
        jitter_ms: float = 2.0, drain_rounds: int = 40, unsafe: bool = False) -> dict[str, Any]:
    """Run the simulation; returns per-rank results and their sums. `unsafe` turns the version checks off
    on both sides (a negative control: the oracle must then see violations)."""
    cfg = dict(nodes=nodes, rpn=rpn, spr=spr, layers=layers, experts=experts, versions=versions, steps=steps,
               every=every, tokens=tokens, topk=topk, seed=seed, polls=polls, jitter_ms=jitter_ms,
               drain_rounds=drain_rounds, unsafe=unsafe)
    G = nodes * rpn
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "dataplane_shim.shim", "chaos.shimsim"])
    tag = f"emoe{int(time.time() * 1e6) % 10**10}"
    shms = [SharedCounters(f"{tag}c", G, create=True), SharedCounters(f"{tag}h", 1, create=True),
            SharedCounters(f"{tag}p", G, create=True)]
    shms[1].publish(0, 1)
    data_q = [ctx.Queue() for _ in range(G)]
    nack_q = [ctx.Queue() for _ in range(G)]
    barrier, results = ctx.Barrier(G), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, cfg, (shms[0].name, shms[1].name, shms[2].name), data_q,
                                                 nack_q, barrier, results), daemon=True) for r in range(G)]
    try:
        for p in procs:
            p.start()
        per_rank: list[dict[str, Any]] = []
        deadline = time.monotonic() + 120
        while len(per_rank) < G and time.monotonic() < deadline:
            try:
                per_rank.append(results.get(timeout=0.5))
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
        for p in procs:
            p.join(10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for q in [*data_q, *nack_q, results]:
            q.close()
            q.join_thread()
        for s in shms:
            s.close()
            s.unlink()
    total = {k: sum(r[k] for r in per_rank) for k in RankResult.__dataclass_fields__ if k not in ("rank",)}
    total["final_versions"] = sorted({r["final_version"] for r in per_rank})
    total["ranks_reported"] = len(per_rank)
    total["exit_codes"] = [p.exitcode for p in procs]
    return {"cfg": cfg, "total": total, "per_rank": per_rank, "versions": versions}
