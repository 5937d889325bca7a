"""The SGLang adapters and entry point against SGLang's own code (SGLang 0.5.23 installed without its
dependencies; only modules that import without torchvision: the EPLB manager's path runs in sglang_ranks.py).
Run with the engine virtualenv; prints one JSON line.

- `_compute_logical_to_all_physical_map` (what `init_by_mapping` builds from `physical_to_logical_map`),
  padded to P as `_init_raw` does, equals `to_sglang` over all hidden layers, dense ones included;
- given a -1 slot, SGLang lists it as a replica of the last expert (Python's list[-1]): `to_sglang`
  refuses such a table instead;
- SGLang's plugin loader finds our `sglang.srt.plugins` entry point.
"""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from sglang.srt.eplb.expert_location import _compute_logical_to_all_physical_map
from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

from controlplane.table import RoutingTable
from controlplane.topology import Topology
from dataplane_shim import adapters as ad
from dataplane_shim.errors import ShimError


def sglang_l2p(phy: np.ndarray, experts: int, ep_size: int) -> torch.Tensor:
    got = _compute_logical_to_all_physical_map(torch.tensor(phy), experts, ep_size, None)
    return F.pad(got, (0, phy.shape[1] - got.shape[-1]), value=-1)


def main() -> None:
    rng = np.random.default_rng(0)
    topo = Topology(1, 4, 3)
    ids = ad.sglang_moe_layer_ids(6, first_k_dense=2)
    checked = 0
    for _ in range(20):
        E = int(rng.integers(4, 12))
        phy = np.stack([rng.permutation(np.concatenate([rng.permutation(E), rng.integers(0, E, topo.slots - E)]))
                        for _ in ids])
        t = RoutingTable(topo, E, phy)
        mine = ad.to_sglang(t, moe_layer_ids=ids, num_hidden_layers=6, as_torch=True)
        theirs = sglang_l2p(mine["physical_to_logical_map"].numpy(), E, topo.ranks)
        assert torch.equal(mine["logical_to_all_physical_map"], theirs), "to_sglang differs from SGLang's map"
        num = torch.count_nonzero(theirs != -1, dim=-1)
        assert torch.equal(mine["logical_to_all_physical_map_num_valid"], num)
        back = ad.from_sglang({"physical_to_logical_map": mine["physical_to_logical_map"],
                               "logical_to_all_physical_map": theirs}, topo, moe_layer_ids=ids)
        assert back.content_equal(t)
        checked += 1

    hole = np.array([[0, 1, 2, 3, -1, 1, 2, 0, 3, 1, 2, 3]])
    seen = sglang_l2p(hole, 4, topo.ranks)[0]
    last_expert_lists_the_hole = 4 in seen[3].tolist()
    try:
        ad.to_sglang(RoutingTable(topo, 4, hole))
        refused = False
    except ShimError:
        refused = True

    found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    print("RESULT " + json.dumps({
        "round_trips": checked, "sglang_takes_hole_as_last_expert": last_expert_lists_the_hole,
        "export_refuses_hole": refused,
        "entry_point": found["elasticmoe"][0].__module__ + "." + found["elasticmoe"][0].__name__
        if "elasticmoe" in found else None,
    }))


if __name__ == "__main__":
    main()
