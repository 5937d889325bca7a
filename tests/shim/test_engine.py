"""Reference engine: step-time model sanity, the shim-router split, and the price of weight moves."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.engine import DEEPSEEK_V2_LITE, DEEPSEEK_V3, H200, EPCluster, RankEngine, ShimRouter
from bench.policies import Change, Eplb, Static
from bench.run import simulate
from bench.traces import Trace
from controlplane.baselines.eplb import eplb_table
from controlplane.load import slot_load
from controlplane.table import initial_table
from controlplane.topology import Tier, Topology
from dataplane_shim.router import preference_order


def test_more_tokens_on_a_rank_is_slower() -> None:
    eng = RankEngine(0, Topology(2, 8, 5), DEEPSEEK_V2_LITE, H200)
    tokens = np.array([[[0, 0, 0, 0, 0]], [[10, 0, 0, 0, 0]], [[100, 0, 0, 0, 0]], [[5000, 0, 0, 0, 0]]])
    ms = eng.layer_ms(tokens)[:, 0]
    assert (np.diff(ms) > 0).all()
    # more active slots (more expert weights read) for the same tokens is slower too
    spread = eng.layer_ms(np.array([[[20, 20, 20, 20, 20]]]))[0, 0]
    assert spread > eng.layer_ms(np.array([[[100, 0, 0, 0, 0]]]))[0, 0]
    # a copy in flight that takes link bandwidth slows the all-to-all
    assert eng.layer_ms(tokens[2:3], (0.5, 0.5))[0, 0] > eng.layer_ms(tokens[2:3])[0, 0]


def test_skewed_step_is_slower_than_balanced_with_the_same_tokens() -> None:
    topo = Topology(1, 4, 2)
    table = initial_table(topo, 2, 8)
    cluster = EPCluster(topo, DEEPSEEK_V3)
    balanced = np.full((1, 2, 8), 512, dtype=np.uint32)
    skewed = balanced.copy()
    skewed[0, :, 0] += 1536
    skewed[0, :, 2:] -= 256
    assert skewed.sum() == balanced.sum()
    b, s = cluster.run(table, balanced), cluster.run(table, skewed)
    assert s.step_ms[0] > b.step_ms[0]
    assert b.imbalance[0] == 1.0 and s.imbalance[0] > 1.0


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 2), st.integers(2, 3))
def test_shim_router_split_equals_per_sender_routing(seed: int, nodes: int, slots: int) -> None:
    rng = np.random.default_rng(seed)
    topo = Topology(nodes, 2, slots)
    G, E, L = topo.ranks, 2 * topo.ranks, 2
    counts = rng.integers(0, 40, (3, L, E)).astype(np.uint32)
    table = eplb_table(initial_table(topo, L, E), counts.sum(axis=0))
    got = ShimRouter()(table, counts)
    want = np.zeros_like(got)
    for s in range(G):  # the router's policy, sender by sender, token by token
        pref = preference_order(table, s)
        for t in range(3):
            for layer in range(L):
                for e in range(E):
                    reps = [int(p) for p in pref[layer, e] if p >= 0]
                    c = int(counts[t, layer, e])
                    n = c // G + (s < c % G)
                    for i in range(n):
                        want[t, layer, reps[i % len(reps)]] += 1
    assert np.array_equal(got, want)
    assert np.array_equal(got.sum(axis=-1), slot_load(table, counts).sum(axis=-1))


def test_moves_price_copies_from_the_nearest_holder() -> None:
    topo = Topology(2, 2, 3)
    cluster = EPCluster(topo, DEEPSEEK_V2_LITE)
    old = initial_table(topo, 1, 4)  # expert e on rank e, two spare slots per rank
    assert cluster.moves(old, old).copies == 0
    phy = np.array(old.phy2log).reshape(1, 4, 3)
    phy[0, 1, 1] = 0  # replica of expert 0 (rank 0) on rank 1: same node
    phy[0, 2, 1] = 1  # replica of expert 1 (rank 1) on rank 2: other node
    mv = cluster.moves(old, old.successor(phy.reshape(1, 12)))
    assert mv.copies == 2
    assert mv.bytes_total == 2 * DEEPSEEK_V2_LITE.expert_bytes
    assert mv.bytes_to[1, Tier.SAME_NODE] == DEEPSEEK_V2_LITE.expert_bytes
    assert mv.bytes_to[2, Tier.OTHER_NODE] == DEEPSEEK_V2_LITE.expert_bytes
    assert cluster.copy_ms(mv) > 0
    assert cluster.copy_ms(mv, share=0.5) == 2 * cluster.copy_ms(mv)


def _trace(steps: int) -> Trace:
    rng = np.random.default_rng(0)
    p = np.array([8, 4, 2, 1, 1, 1, 1, 1], dtype=np.float64)
    counts = rng.poisson(200 * p / p.sum(), (steps, 2, 8)).astype(np.uint32)
    return Trace(counts, "test", 2, "test", "synthetic")


def test_blocking_moves_add_stall_and_overlapped_ones_do_not() -> None:
    topo = Topology(1, 4, 3)
    cluster = EPCluster(topo, DEEPSEEK_V2_LITE)
    base = initial_table(topo, 2, 8)
    tr = _trace(60)
    static = simulate(Static(), cluster, base, tr, 20, 0.5)
    eplb = simulate(Eplb(20, period=20), cluster, base, tr, 20, 0.5)
    assert static.stall_ms.sum() == 0
    assert eplb.stall_ms[20] > 0 and eplb.installs[0].step == 20
    assert eplb.step_ms[20] > static.step_ms[20] + eplb.stall_ms[20] * 0.5

    target = eplb_table(base, tr.counts.sum(axis=0))

    class Once(Static):
        def start(self, b, counts, drift):  # type: ignore[no-untyped-def]
            return [Change(target, 5, "overlapped")]

    over = simulate(Once(), cluster, base, tr, 20, 0.5)
    assert over.stall_ms.sum() == 0
    assert over.bytes_at[5] == cluster.moves(base, target).bytes_total
    ins = over.installs[0]
    assert ins.step > 5  # installed once the copies finished, not at the ready step
    # while the copies ran, the steps were no faster than under the old table alone
    assert (over.step_ms[5:ins.step] >= static.step_ms[5:ins.step]).all()
