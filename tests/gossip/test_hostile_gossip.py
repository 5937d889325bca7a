"""Hostile input to the Gossip handlers of GossipNode (Probe, IndirectProbe, PushPull, Broadcast, Pull, Push):
refused with InvalidArgument (INVALID_ARGUMENT on the wire) naming the problem, and nothing changes: member
table, own incarnation, suspicions, rumour queue, stored windows, messages sent (GossipTarget.snapshot)."""

from __future__ import annotations

import pytest

from agent.transport import InvalidArgument
from chaos.fuzz_gossip import GossipTarget, member, window
from elasticmoe.v1 import gossip_pb2 as pb


def refused(method: str, req: pb.Message, expect: str) -> None:
    t = GossipTarget(method)
    before = t.snapshot()
    v = t.call(req)
    assert v.rejected, f"{method} accepted hostile input: {req}"
    assert expect.lower() in v.reason.lower(), v.reason
    assert t.snapshot() == before


def test_fixture_knows_b_and_c_and_a_window() -> None:
    t = GossipTarget("Push")
    assert sorted(m.node_id for m in t.node.members()) == ["a", "b", "c"]
    assert not t.call(pb.PushRequest(from_node="b", windows=[window("b", 2)])).rejected


@pytest.mark.parametrize("method, field", [("Broadcast", "members"), ("PushPull", "members"), ("Push", "members"),
                                           ("Probe", "piggyback"), ("IndirectProbe", "piggyback")])
@pytest.mark.parametrize("bad", [pb.MemberState(node_id="", status=pb.ALIVE),
                                 pb.MemberState(node_id="d", status=pb.MEMBER_STATUS_UNSPECIFIED),
                                 pb.MemberState(node_id="d", status=99)])
def test_malformed_member_states(method: str, field: str, bad: pb.MemberState) -> None:
    req = GossipTarget(method).seeds()[0]
    getattr(req, field).append(bad)  # after valid ones: none of them may be applied either
    refused(method, req, "member state")


@pytest.mark.parametrize("method", ["PushPull", "Push"])
@pytest.mark.parametrize("change, expect", [
    (dict(layers=3), "count bytes"),
    (dict(counts=b"\x00" * 7), "count bytes"),
    (dict(layers=0, counts=b""), "shape"),
    (dict(node_id=""), "node id"),
    (dict(layers=1, experts=16), "expected [2, 8]"),  # right byte length, wrong shape
])
def test_malformed_load_windows(method: str, change: dict[str, object], expect: str) -> None:
    w = window("c", 3)
    for k, v in change.items():
        setattr(w, k, v)
    req = pb.PushRequest(from_node="b", windows=[window("b", 5), w]) if method == "Push" else \
        pb.PushPullRequest(from_node="b", windows=[window("b", 5), w])
    refused(method, req, expect)


@pytest.mark.parametrize("method, req", [
    ("Broadcast", pb.BroadcastRequest(from_node="b", digests=[pb.Digest(node_id="", window_seq=1)])),
    ("PushPull", pb.PushPullRequest(from_node="b", digests=[pb.Digest(node_id="")])),
    ("Pull", pb.PullRequest(from_node="b", want=[pb.Digest(node_id="b"), pb.Digest(node_id="")])),
])
def test_digests_without_node(method: str, req: pb.Message) -> None:
    refused(method, req, "digest")


def test_probe_for_someone_else_and_indirect_without_target() -> None:
    refused("Probe", pb.ProbeRequest(from_node="b", seq=1, target="zz"), "reached")
    refused("IndirectProbe", pb.IndirectProbeRequest(from_node="b", seq=1), "target")


@pytest.mark.parametrize("node", ["a", "c"])
def test_overflowing_incarnation(node: str) -> None:
    """An incarnation of 2^64 - 1 can never be beaten: a member so named could never refute a suspicion,
    and refuting it about ourselves would need incarnation 2^64 (which uint64 cannot carry)."""
    refused("Broadcast", pb.BroadcastRequest(from_node="b", members=[member(node, pb.SUSPECT, 2**64 - 1)]),
            "incarnation")


def test_pull_is_read_only() -> None:
    t = GossipTarget("Pull")
    before = t.snapshot()
    r = t.call(pb.PullRequest(from_node="zz", want=[pb.Digest(node_id="b", incarnation=2**63 - 1,
                                                               window_seq=2**63 - 1)]))
    assert not r.rejected and t.snapshot() == before
    with pytest.raises(InvalidArgument):
        t.transport.handlers["Gossip"]("b", "Gossip/Nope", pb.PullRequest())


@pytest.mark.parametrize("field", ["incarnation", "window_seq"])
def test_overflowing_window_keys(field: str) -> None:
    """Newest-wins by (incarnation, window_seq): a window keyed 2^64 - 1 could never be replaced."""
    w = window("c", 3)
    setattr(w, field, 2**64 - 1)
    refused("Push", pb.PushRequest(from_node="b", windows=[w]), "2^63")
    refused("Broadcast", pb.BroadcastRequest(from_node="b", digests=[pb.Digest(node_id="c", **{field: 2**63})]),
            "2^63")
