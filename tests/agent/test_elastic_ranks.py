"""Drain, repair and restore planning (controlplane.elastic)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.elastic import DrainRefused, plan_drain, plan_repair, plan_restore
from controlplane.ops import Drain, Migrate, Repair, apply_ops
from controlplane.table import initial_table
from controlplane.topology import Topology


def test_drain_moves_lone_replicas_then_leaves_active_set() -> None:
    t = initial_table(Topology(2, 8, 5), 4, 64)
    ops = plan_drain(t, 3)
    assert isinstance(ops[-1], Drain) and ops[-1].rank == 3
    assert all(isinstance(o, Migrate) and o.src == 3 and o.dst != 3 for o in ops[:-1])
    # rank 3 held 4 experts in each of 4 layers, each its only replica
    assert len(ops) - 1 == 16
    t2 = apply_ops(t, ops)
    t2.validate()
    assert 3 not in t2.active_ranks
    assert (t2.phy2log.reshape(4, 16, 5)[:, 3] == -1).all()
    # nearest first: the lone replicas stay on rank 3's node (ranks 0-7) while it has room
    assert all(o.dst < 8 for o in ops[:-1] if isinstance(o, Migrate))


def test_drain_below_minimum_viable_size_is_refused_with_numbers() -> None:
    t = initial_table(Topology(1, 4, 4), 2, 16)  # 16 experts fill all 16 slots: no room anywhere
    with pytest.raises(DrainRefused) as ei:
        plan_drain(t, 0)
    msg = str(ei.value)
    assert "replicas required: 4" in msg and "0 free slots" in msg and "16 experts need at least 4 ranks" in msg


def test_repair_reloads_lost_experts_from_host() -> None:
    t = initial_table(Topology(4, 2, 4), 3, 16)  # 8 ranks x 4 slots, 2 experts per rank, 2 free slots each
    ops = plan_repair(t, {6, 7})
    drains = [o for o in ops if isinstance(o, Drain)]
    repairs = [o for o in ops if isinstance(o, Repair)]
    assert sorted(d.rank for d in drains) == [6, 7]
    assert len(repairs) == 3 * 4 and all(r.source == -1 and r.dst < 6 for r in repairs)
    t2 = apply_ops(t, ops)
    t2.validate()
    assert t2.active_ranks == tuple(range(6))


def test_restore_returns_rank_with_empty_slots() -> None:
    t = initial_table(Topology(2, 4, 4), 2, 16)
    drained = apply_ops(t, plan_drain(t, 5))
    with pytest.raises(DrainRefused, match="already active"):
        plan_restore(drained, 4)
    back = apply_ops(drained, plan_restore(drained, 5))
    back.validate()
    assert 5 in back.active_ranks and (back.phy2log.reshape(2, 8, 4)[:, 5] == -1).all()


@settings(max_examples=60, deadline=None)
@given(
    nodes=st.integers(1, 3), rpn=st.integers(2, 4), slots=st.integers(2, 5), layers=st.integers(1, 3),
    data=st.data(),
)
def test_drain_restore_cycles_keep_tables_valid(nodes: int, rpn: int, slots: int, layers: int,
                                                data: st.DataObject) -> None:
    topo = Topology(nodes, rpn, slots)
    experts = data.draw(st.integers(1, topo.ranks * slots))
    t = initial_table(topo, layers, experts)
    load = np.asarray(data.draw(st.lists(st.integers(0, 100), min_size=layers * experts,
                                         max_size=layers * experts))).reshape(layers, experts)
    for _ in range(4):
        rank = data.draw(st.sampled_from(range(topo.ranks)))
        if rank in t.active_ranks:
            try:
                ops = plan_drain(t, rank, load)
            except DrainRefused:
                continue  # refused drains change nothing
        else:
            ops = plan_restore(t, rank)
        t = apply_ops(t, ops)
        t.validate()


def test_repair_drops_cold_extra_replicas_to_make_room() -> None:
    from controlplane.ops import Consolidate, Replicate

    topo = Topology(1, 4, 3)  # 4 ranks x 3 slots = 12 slots, 8 experts: 4 free
    t = initial_table(topo, 1, 8)
    # fill every free slot with second replicas: experts 0-3 get a copy on another rank
    t = apply_ops(t, [Replicate(0, 0, 1), Replicate(0, 1, 2), Replicate(0, 2, 3), Replicate(0, 3, 0)])
    t.validate()
    load = np.array([[1, 50, 100, 200, 5, 5, 5, 5]])
    ops = plan_repair(t, {3}, load)
    cons = [o for o in ops if isinstance(o, Consolidate)]
    assert cons and cons[0].experts == (0,)  # the coldest replicated expert gives up its second copy
    t2 = apply_ops(t, ops)
    t2.validate()
    assert t2.active_ranks == (0, 1, 2)
