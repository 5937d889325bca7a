"""Genesis tables: the agents' version 1 is the placement each engine boots with, or a placement file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from controlplane.table import RoutingTable, initial_table
from controlplane.topology import Topology
from dataplane_shim import adapters as ad
from dataplane_shim.errors import BadInput
from dataplane_shim.genesis import content_hex, genesis_table, sglang_boot_phy2log, vllm_boot_phy2log


def test_vllm_boot_placement() -> None:
    """vLLM: routed experts in order, then redundant slot p holds (p - E) % E; every MoE layer alike."""
    np.testing.assert_array_equal(vllm_boot_phy2log(2, 8, 10), [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1]] * 2)
    np.testing.assert_array_equal(vllm_boot_phy2log(1, 2, 8)[0], [0, 1, 0, 1, 0, 1, 0, 1])
    t = genesis_table("vllm", Topology(1, 2, 5), 2, 8)
    assert (t.version, t.parent) == (1, 0) and (t.phy2log >= 0).all()
    np.testing.assert_array_equal(t.logcnt[0], [2, 2, 1, 1, 1, 1, 1, 1])


def test_sglang_boot_placement() -> None:
    np.testing.assert_array_equal(sglang_boot_phy2log(1, 3, 8)[0], [0, 1, 2, 0, 1, 2, 0, 1])
    t = genesis_table("sglang", Topology(2, 2, 2), 3, 3)
    assert t.layers == 3 and t.is_valid()


def test_boot_placements_with_same_rank_duplicates_are_valid() -> None:
    """E=2 over 2 ranks of 4 slots: each rank holds each expert twice, as vLLM boots it."""
    t = genesis_table("vllm", Topology(1, 2, 4), 1, 2)
    assert t.is_valid()
    np.testing.assert_array_equal(t.phy2log[0], [0, 1, 0, 1, 0, 1, 0, 1])


def test_static_is_the_old_initial_table() -> None:
    topo = Topology(2, 2, 4)
    assert genesis_table("static", topo, 3, 12).content_equal(initial_table(topo, 3, 12))


def test_placement_files(tmp_path: Path) -> None:
    topo = Topology(1, 2, 5)
    rng = np.random.default_rng(2)
    phy = np.stack([np.concatenate([rng.permutation(8), rng.integers(0, 8, 2)]) for _ in range(3)])
    want = RoutingTable(topo, 8, phy, version=1, parent=0)
    ad.save_sglang_location(want, tmp_path / "loc.json")
    assert genesis_table(str(tmp_path / "loc.json"), topo, 3, 8).content_equal(want)
    p2l, l2p, cnt = ad.to_eplb(want)
    np.savez(tmp_path / "eplb.npz", phy2log=p2l, log2phy=l2p, logcnt=cnt)
    assert genesis_table(str(tmp_path / "eplb.npz"), topo, 3, 8).content_equal(want)
    with pytest.raises(BadInput, match=r"holds \[3 layers, 8 experts\]: the cluster has \[4, 8\]"):
        genesis_table(str(tmp_path / "loc.json"), topo, 4, 8)
    np.savez(tmp_path / "bad.npz", phy2log=p2l)
    with pytest.raises(BadInput, match="lacks"):
        genesis_table(str(tmp_path / "bad.npz"), topo, 3, 8)


def test_bad_specs_are_named() -> None:
    topo = Topology(1, 2, 4)
    with pytest.raises(BadInput, match="'trtllm'"):
        genesis_table("trtllm", topo, 1, 8)
    with pytest.raises(BadInput, match="experts=9, slots=8"):
        genesis_table("vllm", topo, 1, 9)


def test_both_engines_boot_alike_and_unlike_static() -> None:
    """(p - E) % E == p % E for p >= E: vLLM's boot placement is SGLang's arange(P) % E."""
    for experts, slots in ((8, 10), (3, 12), (5, 5)):
        np.testing.assert_array_equal(vllm_boot_phy2log(2, experts, slots), sglang_boot_phy2log(2, experts, slots))
    topo = Topology(1, 2, 5)
    a, s = genesis_table("vllm", topo, 1, 8), genesis_table("static", topo, 1, 8)
    assert content_hex(a) != content_hex(s) and len(content_hex(a)) == 16
