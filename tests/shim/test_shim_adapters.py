"""Adapters: ours -> vLLM / SGLang / DeepSeek EPLB -> ours is exact, in each engine's own widths and layer
counts; what engines produce (same-rank duplicates, dense layers) imports; inconsistent inputs are refused."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.table import RoutingTable
from controlplane.topology import Topology
from dataplane_shim import adapters as ad


def table_with_replicas(seed: int) -> RoutingTable:
    topo = Topology(2, 2, 3)  # 12 slots
    rng = np.random.default_rng(seed)
    E = int(rng.integers(4, 12))
    phy = np.full((2, topo.slots), -1, dtype=np.int64)
    for layer in range(2):
        perm = rng.permutation(topo.slots)
        phy[layer, perm[:E]] = rng.permutation(E)
        for p in perm[E:]:  # spare slots: empty or any expert, same-rank duplicates included
            phy[layer, p] = int(rng.integers(-1, E))
    return RoutingTable(topo, E, phy, version=7, parent=6, active_ranks=(0, 1, 2, 3))


def full(t: RoutingTable) -> RoutingTable:
    """`t` with every empty slot given expert 0 (the engines that cannot take -1)."""
    return RoutingTable(t.topology, t.experts, np.where(t.phy2log < 0, 0, t.phy2log), t.version, t.parent)


def same(a: RoutingTable, b: RoutingTable) -> bool:
    return a.content_equal(b) and a.digest == b.digest


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_round_trips_are_exact(seed: int) -> None:
    t = table_with_replicas(seed)
    kw = {"version": 7, "parent": 6}
    v = ad.to_vllm(t)
    assert v["logical_to_physical_map"].shape == (2, t.experts, ad.VLLM_L2P_WIDTH)
    assert same(ad.from_vllm(v, t.topology, **kw), t)
    # an EplbState: the maps live in model_states[<model hash>]
    state = SimpleNamespace(model_states={"hash0": SimpleNamespace(**v)})
    assert same(ad.from_vllm(state, t.topology, **kw), t)
    f = full(t)
    s = ad.to_sglang(f)
    assert s["logical_to_all_physical_map"].shape == (2, t.experts, t.slots)
    assert same(ad.from_sglang(s, t.topology, **kw), f)
    phy, l2p, cnt = ad.to_eplb(f)
    assert l2p.shape == (2, t.experts, int(f.logcnt.max()))
    assert same(ad.from_eplb(phy, l2p, cnt, t.topology, **kw), f)
    # EPLB may list replicas in replica-rank order: a shuffled row still imports
    rng = np.random.default_rng(seed)
    shuffled = np.array(l2p)
    for layer in range(2):
        for e in range(t.experts):
            n = int(cnt[layer, e])
            shuffled[layer, e, :n] = rng.permutation(shuffled[layer, e, :n])
    assert same(ad.from_eplb(phy, shuffled, cnt, t.topology, **kw), f)


def test_engines_that_cannot_take_an_empty_slot_refuse_it() -> None:
    t = table_with_replicas(5)
    assert (t.phy2log < 0).any()
    for export in (ad.to_sglang, ad.to_eplb):
        with pytest.raises(ad.AdapterError, match=r"slot \d+ is empty"):
            export(t)
    assert (ad.to_vllm(t)["physical_to_logical_map"] == -1).any()  # vLLM leaves it idle


def test_sglang_layers_include_the_dense_ones(tmp_path: Path) -> None:
    """DeepSeek-V3 shape: 61 hidden layers, the first 3 dense; the agents see the 58 MoE layers."""
    ids = ad.sglang_moe_layer_ids(61, first_k_dense=3)
    assert ids == list(range(3, 61))
    assert ad.sglang_moe_layer_ids(6, step=2) == [1, 3, 5]
    topo = Topology(2, 2, 3)
    rng = np.random.default_rng(0)
    phy = np.stack([np.concatenate([rng.permutation(8), rng.integers(0, 8, 4)]) for _ in range(58)])
    t = RoutingTable(topo, 8, phy, version=3, parent=2)
    s = ad.to_sglang(t, moe_layer_ids=ids, num_hidden_layers=61)
    assert s["physical_to_logical_map"].shape == (61, 12)
    np.testing.assert_array_equal(s["physical_to_logical_map"][0], np.arange(12) % 8)  # dense: trivial
    assert same(ad.from_sglang(s, topo, moe_layer_ids=ids, version=3, parent=2), t)
    path = ad.save_sglang_location(t, tmp_path / "loc.json", moe_layer_ids=ids, num_hidden_layers=61)
    assert len(json.loads(path.read_text())["physical_to_logical_map"]) == 61
    assert same(ad.load_sglang_location(path, topo, 8, moe_layer_ids=ids, version=3, parent=2), t)
    counts = rng.integers(0, 100, (4, 58, 8))
    dump = ad.to_sglang_dump(counts, moe_layer_ids=ids, num_hidden_layers=61)
    assert dump["logical_count"].shape == (4, 61, 8) and not dump["logical_count"][:, :3].any()
    np.testing.assert_array_equal(ad.from_sglang_dump(dump, moe_layer_ids=ids), counts)
    with pytest.raises(ad.AdapterError, match="moe_layer_ids"):
        ad.to_sglang(t, moe_layer_ids=ids[:-1], num_hidden_layers=61)


def test_eplb_output_with_same_rank_duplicates_imports() -> None:
    """DeepSeek EPLB's packing (the baseline before its duplicate fix) puts two replicas of a hot expert on
    one rank: such a table is valid, imports, and exports back unchanged."""
    from controlplane.baselines.eplb import rebalance_hierarchical

    topo = Topology(1, 4, 6)
    rng = np.random.default_rng(7)
    weight = rng.lognormal(0.0, 1.5, (8, 8)) * 100
    phy = rebalance_hierarchical(weight, topo.slots, 1, 1, topo.ranks)
    dups = (np.sort(phy.reshape(8, 4, 6), axis=2)[:, :, 1:] == np.sort(phy.reshape(8, 4, 6), axis=2)[:, :, :-1])
    assert dups.any(), "this seed should give a same-rank duplicate"
    t = RoutingTable(topo, 8, phy)
    t.validate()
    assert same(ad.from_eplb(*ad.to_eplb(t), topo), t)
    assert same(ad.from_vllm(ad.to_vllm(t), topo), t)
    assert same(ad.from_sglang(ad.to_sglang(t), topo), t)


def test_torch_tensors_and_files_round_trip(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    t = table_with_replicas(3)
    v = ad.to_vllm(t, as_torch=True)
    assert isinstance(v["physical_to_logical_map"], torch.Tensor)
    assert same(ad.from_vllm(v, t.topology, version=7, parent=6), t)
    f = full(t)
    for name in ("loc.json", "loc.pt"):
        path = ad.save_sglang_location(f, tmp_path / name)
        assert same(ad.load_sglang_location(path, t.topology, t.experts, version=7, parent=6), f)
    counts = np.random.default_rng(0).integers(0, 1000, (5, 2, t.experts)).astype(np.uint32)
    dump = ad.to_sglang_dump(counts, as_torch=True)
    torch.save(dump, tmp_path / "dump.pt")
    np.testing.assert_array_equal(ad.from_sglang_dump(tmp_path / "dump.pt"), counts)
    np.testing.assert_array_equal(ad.from_sglang_dump({"logical_count": counts[0].tolist()}), counts[:1])


def test_inconsistent_maps_are_refused_naming_the_field() -> None:
    t = table_with_replicas(5)
    v = ad.to_vllm(t)
    bad = dict(v, logical_replica_count=v["logical_replica_count"] + 1)
    with pytest.raises(ad.AdapterError, match="replica count"):
        ad.from_vllm(bad, t.topology)
    l2p = v["logical_to_physical_map"].copy()
    l2p[0, 0, 0] = (l2p[0, 0, 0] + 1) % t.slots
    with pytest.raises(ad.AdapterError, match=r"logical_to_physical_map\[0, 0\]"):
        ad.from_vllm(dict(v, logical_to_physical_map=l2p), t.topology)
    with pytest.raises(ad.AdapterError, match="shape"):
        ad.from_sglang({"physical_to_logical_map": t.phy2log[:, :-1]}, t.topology, t.experts)
    with pytest.raises(ad.AdapterError, match="logical_count"):
        ad.from_sglang_dump({"counts": [1]})
    with pytest.raises(ad.AdapterError, match="model_key"):
        ad.from_vllm({"model_states": {"a": v, "b": v}}, t.topology)
    with pytest.raises(ad.AdapterError, match="no replica"):
        ad.from_vllm(dict(v, physical_to_logical_map=np.zeros_like(v["physical_to_logical_map"])), t.topology)
