"""Adapters: ours -> vLLM / SGLang / DeepSeek EPLB -> ours is exact; inconsistent inputs are refused."""

from __future__ import annotations

from pathlib import Path

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
        for p in perm[E:]:
            e = int(rng.integers(-1, E))
            lo = (p // 3) * 3
            if e < 0 or e not in phy[layer, lo : lo + 3]:
                phy[layer, p] = e
    return RoutingTable(topo, E, phy, version=7, parent=6, active_ranks=(0, 1, 2, 3))


def same(a: RoutingTable, b: RoutingTable) -> bool:
    return a.content_equal(b) and a.digest == b.digest


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_round_trips_are_exact(seed: int) -> None:
    t = table_with_replicas(seed)
    kw = {"version": 7, "parent": 6}
    v = ad.to_vllm(t)
    assert v["logical_to_physical_map"].shape == (2, t.experts, t.slots - t.experts + 1)
    assert same(ad.from_vllm(v, t.topology, **kw), t)
    s = ad.to_sglang(t)
    assert s["logical_to_all_physical_map"].shape == (2, t.experts, t.slots)
    assert same(ad.from_sglang(s, t.topology, **kw), t)
    phy, l2p, cnt = ad.to_eplb(t)
    assert same(ad.from_eplb(phy, l2p, cnt, t.topology, **kw), t)
    # EPLB may list replicas in replica-rank order: a shuffled row still imports
    rng = np.random.default_rng(seed)
    shuffled = np.array(l2p)
    for layer in range(2):
        for e in range(t.experts):
            n = int(cnt[layer, e])
            shuffled[layer, e, :n] = rng.permutation(shuffled[layer, e, :n])
    assert same(ad.from_eplb(phy, shuffled, cnt, t.topology, **kw), t)


def test_torch_tensors_and_files_round_trip(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    t = table_with_replicas(3)
    v = ad.to_vllm(t, as_torch=True)
    assert isinstance(v["physical_to_logical_map"], torch.Tensor)
    assert same(ad.from_vllm(v, t.topology, version=7, parent=6), t)
    for name in ("loc.json", "loc.pt"):
        path = ad.save_sglang_location(t, tmp_path / name)
        assert same(ad.load_sglang_location(path, t.topology, t.experts, version=7, parent=6), t)
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
    assert (t.phy2log < 0).any()  # this seed leaves a slot empty
    with pytest.raises(ad.AdapterError, match="empty"):
        ad.to_vllm(t, strict=True)
