"""Table store: certified, increasing versions only; slot lifecycle STAGED -> ACTIVE -> RETAINED -> RELEASED;
dispatch against peers' version counters (one process, device counters)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from chaos.shimsim import table_sequence  # noqa: E402
from controlplane.table import RoutingTable  # noqa: E402
from controlplane.topology import Topology  # noqa: E402
from dataplane_shim.certify import certified_commit  # noqa: E402
from dataplane_shim.counters import DeviceCounters, imm_decode, imm_encode  # noqa: E402
from dataplane_shim.errors import StaleVersion, Uncertified  # noqa: E402
from dataplane_shim.shim import Shim  # noqa: E402
from dataplane_shim.tables import SlotState, TableStore  # noqa: E402

TOPO = Topology(nodes=1, ranks_per_node=2, slots_per_rank=3)  # rank 0: slots 0-2, rank 1: slots 3-5
V1 = RoutingTable(TOPO, 4, np.array([[0, 1, -1, 2, 3, -1]]), version=1)
# v2 on rank 1: slot 3 keeps 2, slot 4 drops 3 (-> retained), slot 5 gains a replica of 0; 3 moves to slot 2
V2 = V1.successor(np.array([[0, 1, 3, 2, -1, 0]]))
# v3 on rank 1: slot 3 overwritten in place (2 -> 1) while v2 runs it; 2 moves to slot 4
V3 = V2.successor(np.array([[0, -1, 3, 1, 2, 0]]))


class Mem:
    """The engine's expert memory on one rank: what the mover really copied."""

    def __init__(self, table: RoutingTable, rank: int) -> None:
        self.rank, self.calls = rank, []
        self.slots = table.phy2log[:, rank * 3 : rank * 3 + 3].copy()

    def __call__(self, layers: np.ndarray, slots: np.ndarray, experts: np.ndarray) -> None:
        self.calls.append((layers.tolist(), slots.tolist(), experts.tolist()))
        self.slots[layers, slots] = experts


def commit(t: RoutingTable) -> object:
    return certified_commit(t, ["n1", "n2"], 2)


def test_uncertified_and_older_versions_are_refused_and_change_nothing() -> None:
    store = TableStore(TOPO, 1, V1)
    bad = [commit(V2), commit(V2), commit(V2), commit(V2)]
    bad[0].qc.quorum = 3
    bad[1].qc.table_hash = b"x" * 32
    bad[2].qc.version = 5
    bad[3].table.phy2log = V3.phy2log.astype("<i8").tobytes()  # tampered: hashes no longer match content
    for c, why in zip(bad, ["2 distinct voters for quorum 3", "qc.table_hash", "qc.version=5", "recomputed"],
                      strict=True):
        with pytest.raises(Uncertified, match=why):
            store.offer_commit(c)
    assert store.pending is None and store.head == 1
    store.offer_commit(commit(V2))
    with pytest.raises(StaleVersion, match="version 2 offered"):
        store.offer_commit(commit(V2))
    with pytest.raises(StaleVersion):
        store.offer(V1)
    assert store.head == 2 and store.stats.refused_stale == 2


def test_slot_lifecycle_and_release_after_every_peer() -> None:
    counters = DeviceCounters(2)
    mem = Mem(V1, 1)
    store = TableStore(TOPO, 1, V1, mover=mem, counters=counters)
    counters.publish(0, 1)
    store.offer(V2)
    assert store.stage(limit=0) == 1 and not store.ready() and not store.swap()
    assert store.stage() == 0 and store.ready()
    assert store.state[0].tolist() == [SlotState.ACTIVE, SlotState.ACTIVE, SlotState.STAGED]
    assert mem.slots[0].tolist() == [2, 3, 0]  # staged into the free slot, the running version untouched
    assert store.active.version == 1 and store.accepts(1, np.array([0]), np.array([4])).all()
    assert store.swap() and counters.read().tolist() == [1, 2]
    assert store.state[0].tolist() == [SlotState.ACTIVE, SlotState.RETAINED, SlotState.ACTIVE]
    # a token rank 0 routed under v1 to slot 4 (expert 3) is still served: the slot is retained
    assert store.accepts(1, np.array([0]), np.array([4])).all()
    assert store.release_ready() == 0  # rank 0 still runs v1
    counters.publish(0, 2)
    assert store.release_ready() == 1 and mem.slots[0].tolist() == [2, -1, 0]
    assert not store.accepts(1, np.array([0]), np.array([4])).any()  # released: refused, the sender retries
    # v3 overwrites slot 3 in place: it cannot stage early, so it loads at the swap (forced)
    store.offer(V3)
    assert store.stage() == 1 and store.ready()
    assert mem.slots[0].tolist() == [2, 2, 0]  # expert 2's new home staged in slot 4; slot 3 still serves v2
    assert store.accepts(2, np.array([0]), np.array([3])).all()
    assert store.swap() and store.stats.forced == 1 and mem.slots[0].tolist() == [1, 2, 0]
    assert not store.accepts(2, np.array([0]), np.array([3])).any()
    assert store.accepts(3, np.array([0, 0, 0]), np.array([3, 4, 5])).all()
    assert (store.resident == mem.slots).all()


def test_dispatch_reroutes_to_a_peer_ahead_and_defers_a_peer_behind() -> None:
    counters = DeviceCounters(2)
    s0 = Shim(TOPO, 0, V1, counters=counters, wait_polls=3, poll_sleep_s=0)
    s1 = Shim(TOPO, 1, V1, counters=counters, wait_polls=3, poll_sleep_s=0)
    s1.begin_step([commit(V2)])  # rank 1 stages and swaps to v2 at once
    assert s1.version == 2 and counters.read().tolist() == [1, 2]
    s0.refresh = lambda head: [commit(V2)] if head < 2 else []
    ids = torch.tensor([[3], [2], [0]])  # expert 3 lives on rank 1 in v1 (slot 4); rank 0 in v2 (slot 2)
    plan = s0.dispatch(0, ids)
    assert plan.stale == 2  # experts 3 and 2 were first routed to rank 1, which runs v2
    slots, vers = plan.slots.reshape(-1).numpy(), plan.versions.reshape(-1)
    # expert 3's v2 home is slot 2 on rank 0 itself, which still runs v1: held back until it swaps
    assert plan.deferred.reshape(-1).tolist() == [True, False, False] and vers[0] == -1
    for e, p, v in zip([2, 0], slots[1:], vers[1:], strict=True):
        assert {1: V1, 2: V2}[int(v)].phy2log[0, p] == e  # the slot holds the expert in the tagged version
        assert counters.read()[p // 3] == v  # which is the version its destination runs
    # rank 1 (v2) sending expert 3 to rank 0 (v1, behind): waited for (bounded), then deferred
    plan = s1.dispatch(0, torch.tensor([[3]]))
    assert plan.deferred.all() and plan.versions.tolist() == [[-1]]
    assert s1.stats.waited == 1 and s1.stats.deferred == 1
    assert s0.end_step().tolist() == [[1, 0, 1, 1]]  # re-routed tokens counted once
    # next boundary: rank 0 swaps to v2 (it got v2 by refresh); the held-back token now goes
    assert s0.begin_step() == 2
    for s in (s0, s1):
        plan = s.dispatch(0, torch.tensor([[3]]))
        assert plan.slots.tolist() == [[2]] and plan.versions.tolist() == [[2]] and plan.stale == 0


def test_immediate_carries_the_version_low_bits() -> None:
    for ref in (5, 70000, 2**40 + 3):
        for v in (ref - 100, ref, ref + 1, ref + 32767):
            assert imm_decode(imm_encode(v), ref) == v


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), data=st.data())
def test_every_dispatched_slot_holds_its_expert_in_the_version_its_destination_runs(
    seed: int, data: st.DataObject
) -> None:
    topo = Topology(2, 2, 3)
    tables = table_sequence(topo, 2, 6, 4, seed)
    commits = [certified_commit(t, ["a"], 1) for t in tables]
    counters = DeviceCounters(topo.ranks)
    me = data.draw(st.integers(0, topo.ranks - 1))
    active = data.draw(st.integers(1, 3))
    shim = Shim(topo, me, tables[0], counters=counters, wait_polls=0, poll_sleep_s=0,
                refresh=lambda head: commits[head:])
    shim.begin_step(commits[1:active], stage_limit=None)  # now runs `active`
    if data.draw(st.booleans()):
        shim.offer(commits[active : active + 1])  # and holds the next one pending, unswapped
    for r in range(topo.ranks):
        if r != me:
            counters.publish(r, data.draw(st.integers(1, 4)))
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((data.draw(st.integers(1, 30)), 6)), axis=1)[:, :2]
    layer = data.draw(st.integers(0, 1))
    plan = shim.dispatch(layer, torch.from_numpy(ids))
    sent = ~plan.deferred.reshape(-1)
    slots, vers, exp = plan.slots.reshape(-1).numpy()[sent], plan.versions.reshape(-1)[sent], ids.reshape(-1)[sent]
    dest_version = counters.read()[slots // 3]
    np.testing.assert_array_equal(vers, dest_version)  # tagged with the version the destination runs
    held = np.array([tables[v - 1].phy2log[layer, p] for v, p in zip(vers, slots, strict=True)], dtype=np.int64)
    np.testing.assert_array_equal(held, exp)  # and that version puts the requested expert in the slot
    assert shim.stats.deferred == int((~sent).sum())
