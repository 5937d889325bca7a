"""Rumour queue, Lifeguard suspicion, SWIM merge rules, load gossip: unit and property tests."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.clock import FakeClock
from agent.gossip.broadcasts import RumourQueue, retransmit_limit
from agent.gossip.gossip_node import GossipNode
from agent.gossip.membership import MemberStatus, Suspicion
from agent.transport import InvalidArgument
from agent.transport.sim import SimNetwork
from chaos.gossipsim import GossipSim, profile_gossip
from elasticmoe.v1 import gossip_pb2 as pb

# ---- rumour queue ---------------------------------------------------------------------------------


def ms(node: str, inc: int = 0, status: int = pb.ALIVE) -> pb.MemberState:
    return pb.MemberState(node_id=node, incarnation=inc, status=status, address=f"{node}:1")


def test_retransmit_limit_is_memberlists() -> None:
    assert [retransmit_limit(4, n) for n in (1, 8, 9, 64, 128, 1024)] == [4, 4, 4, 8, 12, 16]


def test_newer_state_replaces_queued_older_state_and_limit_applies() -> None:
    q = RumourQueue(1, lambda: 9)  # limit 1 x ceil(log10(10)) = 1
    q.put("m", "x", ms("x", 0))
    q.put("m", "x", ms("x", 0, pb.SUSPECT))
    q.put("w", "x", pb.Digest(node_id="x", window_seq=3))
    assert len(q) == 2  # one per (kind, key)
    members: list[pb.MemberState] = []
    digests: list[pb.Digest] = []
    q.take(10_000, members, digests, dst="d")
    assert [m.status for m in members] == [pb.SUSPECT] and [d.window_seq for d in digests] == [3]
    assert len(q) == 0  # each was sent its limit (once)


def test_fewest_sent_first_budget_seen_and_member_only() -> None:
    q = RumourQueue(4, lambda: 8)  # limit 4
    for n in "abc":
        q.put("m", n, ms(n), source="s")
    first: list[pb.MemberState] = []
    q.take(10_000, first, [], dst="d1")
    assert [m.node_id for m in first] == ["c", "b", "a"]  # newest first
    q.put("m", "e", ms("e"))
    out: list[pb.MemberState] = []
    q.take(3 * (ms("e").ByteSize() + 4) - 1, out, [], dst="d2")
    assert [m.node_id for m in out][0] == "e"  # never sent beats sent once
    assert len(out) == 2  # the budget
    again: list[pb.MemberState] = []
    q.take(10_000, again, [], dst="s")
    assert [m.node_id for m in again] == ["e"]  # "s" told us a, b, c: no copies back to it
    q.put("w", "z", pb.Digest(node_id="z"))
    only_members: list[pb.MemberState] = []
    q.take(10_000, only_members, None, dst="d3")
    assert "z" not in [m.node_id for m in only_members] and q.queued("w", "z") is not None
    q.seen_by("m", "e", "d4", ms("e", 0))
    q.seen_by("w", "z", "d4", pb.Digest(node_id="z"))
    later: list[pb.MemberState] = []
    digests: list[pb.Digest] = []
    q.take(10_000, later, digests, dst="d4")
    assert "e" not in [m.node_id for m in later] and digests == []


# ---- Lifeguard suspicion ----------------------------------------------------------------------------


def test_suspicion_shrinks_with_independent_confirmations() -> None:
    clock = FakeClock()
    fired: list[float] = []
    s = Suspicion(clock, "a", k=3, lo=2.0, hi=12.0, grace=0.2, on_expire=lambda: fired.append(clock.now()))
    assert s.timeout() == 12.0
    assert s.confirm("b") and not s.confirm("b") and not s.confirm("a")
    assert s.timeout() == pytest.approx(12.0 - math.log(2) / math.log(4) * 10.0)
    clock.advance(1.0)
    assert s.confirm("c") and s.confirm("d") and not s.confirm("e")  # k reached
    assert s.timeout() == 2.0
    clock.advance(0.99)
    assert fired == []
    clock.advance(0.02)
    assert fired == [pytest.approx(2.0)]


def test_suspicion_fired_late_waits_one_grace_period() -> None:
    clock = FakeClock()
    net = SimNetwork(clock, 0)
    node_clock = net.clock("x")
    fired: list[float] = []
    Suspicion(node_clock, "a", k=0, lo=1.0, hi=1.0, grace=0.3, on_expire=lambda: fired.append(clock.now()))
    net.pause_for("x", 3.0)
    clock.advance(5.0)
    assert fired == [pytest.approx(3.3)]  # woke at 3.0, two seconds late: refutations get 0.3 s first


# ---- SWIM merge rules -------------------------------------------------------------------------------

RANK = {pb.ALIVE: 0, pb.SUSPECT: 1, pb.DEAD: 2, pb.LEFT: 3}
STATUS = {pb.ALIVE: MemberStatus.ALIVE, pb.SUSPECT: MemberStatus.SUSPECT, pb.DEAD: MemberStatus.DEAD,
          pb.LEFT: MemberStatus.LEFT}


def lone_node() -> tuple[GossipNode, FakeClock]:
    clock = FakeClock()
    net = SimNetwork(clock, 0)
    node = GossipNode("me", "me:1", [0], profile_gossip("lan"), net.clock("me"), net.transport("me"), {}, rng_seed=0,
                      shape=(2, 2))
    node.start()
    node.membership.apply(ms("x", 0), push_pull=True)
    return node, clock


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from([pb.ALIVE, pb.SUSPECT, pb.DEAD, pb.LEFT])),
                min_size=1, max_size=12))
def test_merge_is_order_free_and_keeps_the_newest_worst_state(states: list[tuple[int, int]]) -> None:
    """Applied in any order (no time passing), states about a member end at the maximum of
    (incarnation, ALIVE < SUSPECT < DEAD < LEFT), as in a brute-force reference."""
    results = set()
    for order in (states, states[::-1], sorted(states)):
        node, _ = lone_node()
        for inc, status in order:
            node.membership.apply(ms("x", inc, status))
        m = node.member("x")
        assert m is not None
        results.add((m.incarnation, m.status))
    inc, status = max([(0, pb.ALIVE), *states], key=lambda s: (s[0], RANK[s[1]]))
    assert results == {(inc, STATUS[status])}


def test_refutation_outbids_and_tells_everyone() -> None:
    node, clock = lone_node()
    sent: list[tuple[str, str]] = []
    t = node.transport
    real_call = t.call

    def spy(dst: str, method: str, req: Any, timeout: float, cb: Any) -> None:
        sent.append((dst, method))
        real_call(dst, method, req, timeout, cb)

    t.call = spy  # type: ignore[method-assign]
    for n in ("y", "z"):
        node.membership.apply(ms(n, 0), push_pull=True)
    node.membership.apply(ms("me", 4, pb.SUSPECT))
    assert node.incarnation == 5 and node.member("me").status == MemberStatus.ALIVE  # type: ignore[union-attr]
    assert {d for d, m in sent if m == "Gossip/Broadcast"} == {"x", "y", "z"}
    node.membership.apply(ms("me", 5, pb.DEAD))
    assert node.incarnation == 6
    node.membership.apply(ms("me", 3, pb.DEAD))  # old news
    assert node.incarnation == 6


def test_dead_in_a_full_sync_is_only_a_suspicion() -> None:
    node, clock = lone_node()
    node.membership.apply(ms("x", 0, pb.DEAD), push_pull=True)
    assert node.member("x").status == MemberStatus.SUSPECT  # type: ignore[union-attr]


# ---- load gossip ------------------------------------------------------------------------------------


def test_publish_validates() -> None:
    node, _ = lone_node()
    node.publish_window(1, 0, 10, np.ones((2, 2), np.uint32))
    with pytest.raises(ValueError, match="window_seq = 1"):
        node.publish_window(1, 0, 10, np.ones((2, 2), np.uint32))
    with pytest.raises(ValueError, match="shape"):
        node.publish_window(2, 0, 10, np.ones((3, 2), np.uint32))
    with pytest.raises(ValueError, match="uint32"):
        node.publish_window(2, 0, 10, -np.ones((2, 2), np.int64))


def test_bad_window_from_the_network_changes_nothing() -> None:
    node, _ = lone_node()
    good = pb.LoadWindow(node_id="x", window_seq=1, layers=2, experts=2, counts=bytes(16))
    bad = pb.LoadWindow(node_id="x", window_seq=2, layers=2, experts=2, counts=bytes(15))
    with pytest.raises(InvalidArgument, match="count bytes"):
        node._handle("x", "Gossip/Push", pb.PushRequest(from_node="x", windows=[good, bad]))
    assert node.load_view().windows == {}


def test_view_sums_live_windows_newest_wins_and_callbacks_fire_for_others_only() -> None:
    sim = GossipSim(seed=3, shape=(2, 3))
    sim.add_nodes(4)
    assert sim.stabilize(10) is not None
    got: list[tuple[str, int, tuple[int, ...], int, int]] = []
    sim.nodes["n1"].on_window(lambda n, seq, c, first, steps, *_: got.append((n, seq, c.shape, first, steps)))
    for n, k in (("n1", 1), ("n2", 2), ("n3", 3)):
        sim.publish_array(n, 1, np.full((2, 3), k, np.uint32))
    sim.publish_array("n2", 2, np.full((2, 3), 20, np.uint32))
    sim.run(1.0)
    v = sim.nodes["n4"].load_view()
    assert v.total.dtype == np.uint64 and v.total.shape == (2, 3)
    assert {n: w.window_seq for n, w in v.windows.items()} == {"n1": 1, "n2": 2, "n3": 1}
    assert int(v.total[0, 0]) == 1 + 20 + 3 and v.missing == ("n4",)
    assert sorted(g[:2] for g in got) == [("n2", 1), ("n2", 2), ("n3", 1)] or \
        sorted(g[:2] for g in got) == [("n2", 2), ("n3", 1)]  # window 1 of n2 may be overtaken
    assert got[0][2:] == ((2, 3), 0, 100)
    sim.crash("n3")
    sim.run(5.0)
    v = sim.nodes["n4"].load_view()
    assert "n3" not in v.windows and int(v.total[0, 0]) == 21


def test_messages_stay_within_max_message_bytes() -> None:
    """40 DeepSeek-V3 windows (59 KiB each) do not fit one 1 MiB push-pull: replies carry what fits and
    later exchanges the rest."""
    cfg = profile_gossip("lan")
    sim = GossipSim(seed=4, cfg=cfg, shape=(58, 256))
    sim.add_nodes(40)
    assert sim.stabilize(20) is not None
    rng = np.random.default_rng(0)
    for n in sim.ids()[:-1]:
        sim.publish_array(n, 1, rng.integers(0, 100, (58, 256), dtype=np.uint32))
    late = sim.add_nodes(1)[0]  # joins after the rumours: push-pull must carry 39 windows
    biggest = 0
    real = sim.net._account

    def account(src: str, method: str, size: int) -> None:
        nonlocal biggest
        biggest = max(biggest, size)
        real(src, method, size)

    sim.net._account = account  # type: ignore[method-assign]
    for _ in range(30):
        sim.run(1.0)
        if len(sim.nodes[late].load_view().windows) == 39:
            break
    assert len(sim.nodes[late].load_view().windows) == 39
    assert 59392 < biggest <= cfg.max_message_bytes


def test_a_stalled_node_accuses_nobody() -> None:
    """n5's probe verdicts and suspicion timers fall due while it is paused; on resume it must not
    suspect the members it could not hear while stalled."""
    sim = GossipSim(seed=9)
    sim.add_nodes(8)
    assert sim.stabilize(10) is not None
    sim.events.clear()
    sim.pause("n5", 3.0)
    sim.run(6.0)
    accused = {(e.member.node_id, e.member.status.value) for e in sim.events
               if e.observer == "n5" and e.member.node_id != "n5" and e.member.status != MemberStatus.ALIVE}
    assert accused == set()
    assert sim.stabilize(10) is not None


def test_leave_reports_done_and_members_see_left() -> None:
    sim = GossipSim(seed=2)
    sim.add_nodes(4)
    assert sim.stabilize(10) is not None
    done: list[float] = []
    sim.nodes["n2"].leave(on_done=lambda: done.append(sim.clock.now()))
    sim.run(1.0)
    assert len(done) == 1 and done[0] < 0.5
    assert all(sim.nodes[o].member("n2").status == MemberStatus.LEFT  # type: ignore[union-attr]
               for o in ("n1", "n3", "n4"))
