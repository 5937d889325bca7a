"""Replay kernels against brute force: per-token loop, direct split, and the gain of a change."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane import load, verify
from controlplane import table as table_mod
from controlplane.errors import InvalidShape
from controlplane.ops import Consolidate, Drain, Migrate, Operation, Replicate, Swap, apply_ops
from controlplane.table import RoutingTable, initial_table
from controlplane.topology import Topology


def single_ops(t: RoutingTable) -> list[Operation]:
    """Every Replicate, Migrate, Consolidate (of one expert) and Swap that applies to `t` (by the operations'
    own preconditions: a free slot on the destination, the expert not already there, the source holding it)
    and gives a different valid table."""
    G, S = t.topology.ranks, t.topology.slots_per_rank
    out: list[Operation] = []
    for layer in range(t.layers):
        rows = t.phy2log[layer].reshape(G, S)
        on = [set(int(e) for e in rows[g] if e >= 0) for g in range(G)]
        free = [bool((rows[g] < 0).any()) for g in range(G)]
        replicas = np.bincount(rows[rows >= 0], minlength=t.experts)
        for e in range(t.experts):
            holders = [g for g in range(G) if e in on[g]]
            for dst in range(G):
                if free[dst] and e not in on[dst]:
                    out.append(Replicate(layer, e, dst))
                    out += [Migrate(layer, e, src, dst) for src in holders]
                if replicas[e] > 1 and (e in on[dst] or free[dst]):
                    out.append(Consolidate(layer, (e,), dst))
        for src in range(G):
            for dst in range(src + 1, G):
                out += [Swap(layer, e, src, o, dst)
                        for e in sorted(on[src] - on[dst]) for o in sorted(on[dst] - on[src])]
    return [op for op in out if (n := apply_ops(t, [op])).is_valid() and not n.content_equal(t)]


@st.composite
def tables(draw: st.DrawFn, max_layers: int = 3, min_ranks: int = 1) -> RoutingTable:
    """A valid table: static EP on a small topology, then up to 8 random operations that apply to it."""
    topo = Topology(draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    if topo.ranks < min_ranks:
        topo = Topology(topo.nodes, min_ranks, topo.slots_per_rank)
    G, S = topo.ranks, topo.slots_per_rank
    experts = draw(st.integers(1, G * S))
    layers = draw(st.integers(1, max_layers))
    t = initial_table(topo, layers, experts)
    for _ in range(draw(st.integers(0, 8))):
        ops = single_ops(t)
        if not ops:
            break
        t = apply_ops(t, [draw(st.sampled_from(ops))])
    return t


def counts_for(draw: st.DrawFn, t: RoutingTable, max_steps: int = 4, high: int = 40) -> np.ndarray:
    T = draw(st.integers(1, max_steps))
    seed = draw(st.integers(0, 2**31 - 1))
    return np.random.default_rng(seed).integers(0, high, size=(T, t.layers, t.experts)).astype(np.uint32)


def naive_rank_load(t: RoutingTable, counts: np.ndarray) -> np.ndarray:
    """Per-token loop: token i of expert e goes to its replica i mod r (replicas in slot order)."""
    T, L, E = counts.shape
    S, G = t.topology.slots_per_rank, t.topology.ranks
    out = np.zeros((T, L, G), dtype=np.int64)
    for s in range(T):
        for layer in range(L):
            for e in range(E):
                slots = sorted(int(p) for p in np.flatnonzero(t.phy2log[layer] == e))
                for i in range(int(counts[s, layer, e])):
                    if slots:
                        out[s, layer, slots[i % len(slots)] // S] += 1
    return out


def direct_rank_load(t: RoutingTable, counts: np.ndarray) -> np.ndarray:
    """Router split computed per expert: replica j of r gets c // r + (j < c % r)."""
    T, L, E = counts.shape
    S, G = t.topology.slots_per_rank, t.topology.ranks
    out = np.zeros((T, L, G), dtype=np.int64)
    for layer in range(L):
        for e in range(E):
            slots = [int(p) for p in t.log2phy[layer, e] if p >= 0]
            r = len(slots)
            for j, p in enumerate(slots):
                c = counts[:, layer, e].astype(np.int64)
                out[:, layer, p // S] += c // r + (j < c % r)
    return out


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_vectorised_replay_equals_per_token_loop(data: st.DataObject) -> None:
    t = data.draw(tables())
    c = counts_for(data.draw, t)
    expect = naive_rank_load(t, c)
    assert np.array_equal(load.rank_load(t, c), expect)
    assert np.array_equal(verify.RankLoadKernel(t).rank_load(c), expect)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_router_split_equals_direct_computation(data: st.DataObject) -> None:
    t = data.draw(tables())
    c = counts_for(data.draw, t, high=5000)
    expect = direct_rank_load(t, c)
    assert np.array_equal(load.rank_load(t, c), expect)
    k = verify.RankLoadKernel(t)
    assert np.array_equal(k.rank_load(c), expect)
    assert np.array_equal(k.layer_max(c), expect.max(axis=-1))
    ls = np.array(sorted(set(data.draw(st.lists(st.integers(0, t.layers - 1), max_size=3)))), dtype=np.int64)
    assert np.array_equal(verify.RankLoadKernel(t, ls).rank_load(c), expect[:, ls])


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_layer_views_match_table(data: st.DataObject) -> None:
    """layer_views (which RoutingTable.replica_index uses) against a plain count of each slot's replicas."""
    t = data.draw(tables())
    cnt, j = table_mod.layer_views(np.asarray(t.phy2log), t.experts)
    naive = np.full(t.phy2log.shape, -1, dtype=np.int64)
    for lay, row in enumerate(t.phy2log.tolist()):
        seen: dict[int, int] = {}
        for s, e in enumerate(row):
            if e >= 0:
                naive[lay, s] = seen.get(e, 0)
                seen[e] = naive[lay, s] + 1
    assert np.array_equal(cnt, t.logcnt) and np.array_equal(j, naive) and np.array_equal(t.replica_index, naive)


def test_large_counts_use_int64() -> None:
    t = initial_table(Topology(1, 2, 2), 1, 3)
    t = apply_ops(t, [Replicate(0, 0, 1)])
    c = np.full((2, 1, 3), 2**31 - 5, dtype=np.uint32)
    assert np.array_equal(verify.RankLoadKernel(t).rank_load(c), load.rank_load(t, c))


def test_kernel_rejects_bad_shape() -> None:
    t = initial_table(Topology(1, 2, 2), 2, 3)
    with pytest.raises(InvalidShape):
        verify.RankLoadKernel(t).rank_load(np.zeros((4, 3, 3), dtype=np.uint32))
    assert verify.RankLoadKernel(t).rank_load(np.zeros((0, 2, 3), dtype=np.uint32)).shape == (0, 2, 2)


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_gain_matches_replay_imbalance(data: st.DataObject) -> None:
    """verify_decision's gain equals the relative change of load.replay_imbalance, and the per-layer
    contributions add up to it."""
    a = data.draw(tables(min_ranks=2))
    ops = single_ops(a)
    assert ops, "with two ranks some operation always changes a table (a swap when every slot is full)"
    b = apply_ops(a, [data.draw(st.sampled_from(ops))])
    assert b.version == a.version + 1 and b.parent == a.version and not b.content_equal(a)
    c = counts_for(data.draw, a, max_steps=5, high=300)
    ia, ib = load.replay_imbalance(a, c), load.replay_imbalance(b, c)
    ok, g, reason = verify.verify_decision(a, b, c, 0.0)
    assert g == pytest.approx((ia - ib) / ia, abs=1e-12)
    assert ok == (g >= 0.0) and reason in ("OK", "GAIN_BELOW_TAU")
    base = verify.replay_stats(a, c)
    new = verify.stats_with(base, b, c, a)
    assert np.array_equal(new.layer_max, verify.replay_stats(b, c).layer_max)
    ls = verify.changed_layers(a, b)
    assert float(verify.layer_gains(base, new, ls).sum()) == pytest.approx(g, abs=1e-12)


def test_verify_decision_reasons() -> None:
    topo = Topology(1, 2, 3)
    head = initial_table(topo, 2, 4)
    c = np.zeros((3, 2, 4), dtype=np.uint32)
    c[:, :, 0] = 100  # expert 0 (rank 0) is hot
    good = apply_ops(head, [Replicate(0, 0, 1), Replicate(1, 0, 1)])
    ok, g, reason = verify.verify_decision(head, good, c, 0.02)
    assert ok and reason == "OK" and g == pytest.approx(0.5)
    assert verify.verify_decision(head, good, c, 0.6) == (False, pytest.approx(0.5), "GAIN_BELOW_TAU")
    assert verify.verify_decision(head, good.with_version(5, 4), c, 0.0)[2] == "PARENT_MISMATCH"
    assert verify.verify_decision(head, good, c[:, :1], 0.0)[2] == "SHAPE_MISMATCH"
    assert verify.verify_decision(head, good, c[:0], 0.0)[2] == "EMPTY_REPLAY"
    bad = head.successor(np.full_like(head.phy2log, -1))
    assert verify.verify_decision(head, bad, c, 0.0)[2] == "INVALID_TABLE"


def test_verify_with_a_drained_rank() -> None:
    """A different active set: every layer is replayed, means are over the remaining ranks."""
    head = initial_table(Topology(1, 3, 2), 2, 3)
    drained = apply_ops(head, [Migrate(0, 2, 2, 0), Migrate(1, 2, 2, 1), Drain(2)])
    drained.validate()
    c = np.random.default_rng(1).integers(0, 50, size=(4, 2, 3)).astype(np.uint32)
    ok, g, _ = verify.verify_decision(head, drained, c, -10.0)
    ia, ib = load.replay_imbalance(head, c), load.replay_imbalance(drained, c)
    assert ok and g == pytest.approx((ia - ib) / ia, abs=1e-12)


def test_a_voter_can_replay_only_the_windows_since_a_drift() -> None:
    """Window-total rows [mix A, mix A, mix B]: with drift_tv the voter replays the B row only, as the proposer."""
    verify_decision = verify.verify_decision
    head = initial_table(Topology(1, 4, 2), 1, 4)  # one expert per rank, one spare slot each
    a = np.array([[400, 100, 100, 100]], dtype=np.uint32)
    b = np.array([[100, 100, 100, 400]], dtype=np.uint32)
    replay = np.stack([a, a, b])
    proposed = apply_ops(head, [Replicate(0, 3, 0)])  # helps B, and A's hot rank 0 gets busier
    ok_all, g_all, _ = verify_decision(head, proposed, replay, 0.0)
    ok_b, g_b, _ = verify_decision(head, proposed, replay, 0.0, drift_tv=0.05)
    assert g_b == verify_decision(head, proposed, replay[-1:], 0.0)[1] and g_b > 0
    assert g_all < g_b and not ok_all and ok_b
    assert verify_decision(head, proposed, replay, 0.0, drift_tv=1.0)[1] == g_all  # one mix: every row
