"""Router: the torch router equals the one-token-at-a-time reference; slots hold the requested expert."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from controlplane.table import RoutingTable  # noqa: E402
from controlplane.topology import Topology  # noqa: E402
from dataplane_shim.errors import BadInput  # noqa: E402
from dataplane_shim.router import Router, RouteTables, preference_order, route_reference  # noqa: E402


def random_table(seed: int, nodes: int, rpn: int, spr: int, layers: int, fill: float) -> RoutingTable:
    """A valid table: each expert once somewhere, spare slots filled with extra replicas with prob `fill`."""
    topo = Topology(nodes, rpn, spr)
    rng = np.random.default_rng(seed)
    S, P = spr, topo.slots
    E = int(rng.integers(1, P + 1))
    phy = np.full((layers, P), -1, dtype=np.int64)
    for layer in range(layers):
        perm = rng.permutation(P)
        phy[layer, perm[:E]] = rng.permutation(E)
        for p in perm[E:]:
            if rng.random() < fill:
                e = int(rng.integers(0, E))
                rank_row = phy[layer, (p // S) * S : (p // S + 1) * S]
                if e not in rank_row:
                    phy[layer, p] = e
    t = RoutingTable(topo, E, phy, version=3, parent=2)
    t.validate()
    return t


tables = st.builds(
    random_table,
    seed=st.integers(0, 2**31),
    nodes=st.integers(1, 3),
    rpn=st.integers(1, 3),
    spr=st.integers(1, 4),
    layers=st.integers(1, 3),
    fill=st.floats(0.0, 1.0),
)


@settings(max_examples=60, deadline=None)
@given(table=tables, data=st.data())
def test_torch_router_equals_reference(table: RoutingTable, data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, table.topology.ranks - 1))
    rt = RouteTables(table.layers, table.experts, table.slots)
    rt.load(table, rank)
    router = Router(table.layers, table.experts)
    load = np.zeros((table.layers, table.slots), dtype=np.int64)
    expected_counts = np.zeros((table.layers, table.experts), dtype=np.int64)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    for _ in range(data.draw(st.integers(1, 3))):  # several calls in one step accumulate loads
        layer = int(rng.integers(0, table.layers))
        T, K = int(rng.integers(0, 40)), int(rng.integers(1, min(4, table.experts) + 1))
        ids = np.argsort(rng.random((T, table.experts)), axis=1)[:, :K]  # distinct per token (top-k)
        if rng.random() < 0.3:
            ids = rng.integers(0, table.experts, (T, K))  # repeats too: the policy does not need top-k
        got = router.route(rt, layer, torch.from_numpy(ids)).numpy()
        ref = route_reference(table, rank, layer, ids, load)
        np.testing.assert_array_equal(got, ref)
        # every slot holds the requested logical expert in this version
        np.testing.assert_array_equal(table.phy2log[layer][got], ids)
        np.add.at(expected_counts[layer], ids.reshape(-1), 1)
    np.testing.assert_array_equal(router.load_report(), expected_counts.astype(np.uint32))


def test_ties_go_to_the_nearest_replica_then_round_robin() -> None:
    topo = Topology(nodes=2, ranks_per_node=2, slots_per_rank=2)  # ranks 0,1 on node 0; 2,3 on node 1
    phy = np.array([[0, 1, 2, 3, 0, -1, 0, -1]])  # expert 0 on rank 0 (slot 0), rank 2 (4), rank 3 (6)
    table = RoutingTable(topo, 4, phy)
    assert preference_order(table, 3)[0, 0, :3].tolist() == [6, 4, 0]  # same rank, same node, remote
    rt = RouteTables(1, 4, topo.slots)
    rt.load(table, 3)
    r = Router(1, 4)
    got = r.route(rt, 0, torch.zeros((5, 1), dtype=torch.int64)).reshape(-1).tolist()
    assert got == [6, 4, 0, 6, 4]


def test_bad_ids_are_refused_with_the_value() -> None:
    table = random_table(1, 1, 2, 3, 1, 0.5)
    rt = RouteTables(1, table.experts, table.slots)
    rt.load(table, 0)
    r = Router(1, table.experts)
    with pytest.raises(BadInput, match=str(table.experts)):
        r.route(rt, 0, torch.full((2, 1), table.experts, dtype=torch.int64))
    with pytest.raises(BadInput, match="-1"):
        r.route(rt, 0, torch.full((2, 1), -1, dtype=torch.int64))
    with pytest.raises(BadInput, match="layer=1"):
        r.route(rt, 1, torch.zeros((2, 1), dtype=torch.int64))
