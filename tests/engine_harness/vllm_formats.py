"""Adapter round trips through vLLM's own functions (run with the engine virtualenv; prints one JSON line).

- `compute_logical_maps` (what vLLM commits after a rearrange), padded to the width of `EplbState`'s
  `logical_to_physical_map`, equals `to_vllm`, and `from_vllm` of vLLM's maps gives the table back;
- vLLM's `DefaultEplbPolicy` (DeepSeek EPLB) at DeepSeek-V3 shape (58 layers, 256 experts, 288 slots on 32
  ranks, log-normal loads): its placements, same-rank duplicates included, import as valid tables;
- `EplbState.build_initial_global_physical_to_logical_map` equals the "vllm" genesis.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from vllm.distributed.eplb.eplb_state import EplbState, compute_logical_maps
from vllm.distributed.eplb.policy import DefaultEplbPolicy

from controlplane.table import RoutingTable, rank_duplicates
from controlplane.topology import Topology
from dataplane_shim import adapters as ad
from dataplane_shim.genesis import vllm_boot_phy2log


def vllm_maps(phy: np.ndarray, experts: int) -> dict[str, torch.Tensor]:
    l2p, cnt = compute_logical_maps(torch.tensor(phy), experts)
    return {"physical_to_logical_map": torch.tensor(phy),
            "logical_to_physical_map": torch.nn.functional.pad(l2p, (0, ad.VLLM_L2P_WIDTH - l2p.shape[-1]), value=-1),
            "logical_replica_count": cnt}


def main() -> None:
    rng = np.random.default_rng(0)
    topo = Topology(2, 2, 4)
    checked = 0
    for _ in range(50):
        E = int(rng.integers(4, 16))
        phy = np.stack([np.concatenate([rng.permutation(E), rng.integers(-1, E, topo.slots - E)]) for _ in range(3)])
        phy = np.stack([rng.permutation(row) for row in phy])
        t = RoutingTable(topo, E, phy)
        mine = ad.to_vllm(t, as_torch=True)
        theirs = vllm_maps(phy, E)
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), "to_vllm differs from vLLM's maps"
        assert ad.from_vllm(theirs, topo).content_equal(t)
        checked += 1

    v3 = Topology(4, 8, 9)  # 32 ranks x 9 slots = 288 slots
    weight = torch.from_numpy(rng.lognormal(0.0, 1.0, (58, 256)) * 1000).round().to(torch.int64)
    p2l = DefaultEplbPolicy.rebalance_experts(weight, v3.slots, 8, 4, v3.ranks).numpy().astype(np.int64)
    t = ad.from_vllm(vllm_maps(p2l, 256), v3)
    t.validate()
    dup_layers = int((rank_duplicates(t.phy2log, v3).sum(axis=1) > 0).sum())
    assert ad.from_eplb(*ad.to_eplb(t), v3).content_equal(t)

    boot = np.array(EplbState.build_initial_global_physical_to_logical_map(8, 12))
    assert np.array_equal(vllm_boot_phy2log(1, 8, 20)[0], boot)
    print("RESULT " + json.dumps({"round_trips": checked, "dsv3_layers_with_same_rank_duplicates": dup_layers}))


if __name__ == "__main__":
    main()
