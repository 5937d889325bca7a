"""Fuzz targets for the Gossip service (agent/gossip/gossip_node.py): Probe, IndirectProbe, PushPull, Broadcast,
Pull, Push. Node "a" knows members b and c and a load window from b; requests arrive from "b".

A refusal is `InvalidArgument` (the transport answers INVALID_ARGUMENT); the snapshot covers the member
table (address, status, incarnation, ranks), our own incarnation, suspicions, the rumour queue, stored
load windows, and what the node sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable

import numpy as np
from google.protobuf.message import Message

from agent.clock import FakeClock
from agent.config import GossipConfig
from agent.gossip.gossip_node import GossipNode
from agent.transport import Deferred, InvalidArgument
from chaos.fuzz_targets import EXPERTS, LAYERS, NullTransport, Target, Verdict
from elasticmoe.v1 import gossip_pb2 as pb

METHODS = {m.name: m.input_type.name for m in pb.DESCRIPTOR.services_by_name["Gossip"].methods}
PEERS = {"b": "10.0.0.2:7000", "c": "10.0.0.3:7000"}
_STATUSES = {pb.ALIVE, pb.SUSPECT, pb.DEAD, pb.LEFT}


def _ser(m: Message) -> bytes:
    return m.SerializeToString(deterministic=True)


def window(node: str = "b", seq: int = 1, inc: int = 0) -> pb.LoadWindow:
    counts = np.arange(LAYERS * EXPERTS, dtype="<u4").tobytes()
    return pb.LoadWindow(node_id=node, incarnation=inc, window_seq=seq, layers=LAYERS, experts=EXPERTS,
                         counts=counts, steps=10, first_step=seq * 10)


def member(node: str, status: int = pb.ALIVE, inc: int = 0, ranks: tuple[int, ...] = (0,)) -> pb.MemberState:
    return pb.MemberState(node_id=node, address=PEERS.get(node, "10.0.0.9:7000"), incarnation=inc, status=status,
                          ranks=list(ranks), from_node="b")


class GossipTarget(Target):
    def __init__(self, method: str, src: str = "b") -> None:
        self.method, self.src = method, src
        self.name = f"Gossip/{method}"
        self.request = getattr(pb, METHODS[method])
        self.fresh()

    def fresh(self) -> None:
        self.clock = FakeClock()
        self.transport = NullTransport()
        self.node = GossipNode("a", "10.0.0.1:7000", [0, 1], GossipConfig(), self.clock, self.transport, {},
                               rng_seed=1, shape=(LAYERS, EXPERTS))
        self.node.start()
        h = self.transport.handlers["Gossip"]
        h("b", "Gossip/PushPull", pb.PushPullRequest(from_node="b", members=[member("b", ranks=(2, 3)),
                                                                            member("c", ranks=(4,))],
                                                    windows=[window()]))
        self.transport.sent.clear()

    def seeds(self) -> list[Message]:
        m = self.method
        ms = [member("b", ranks=(2, 3)), member("c", pb.SUSPECT, 1), member("d"), member("a", pb.SUSPECT, 0)]
        dg = [pb.Digest(node_id="b", incarnation=0, window_seq=2)]
        if m == "Probe":
            return [pb.ProbeRequest(from_node="b", seq=7, target="a", piggyback=ms, digests=dg)]
        if m == "IndirectProbe":
            return [pb.IndirectProbeRequest(from_node="b", seq=3, target="c", target_address=PEERS["c"],
                                            piggyback=ms, timeout_ms=100)]
        if m == "PushPull":
            return [pb.PushPullRequest(from_node="b", members=ms, digests=dg, windows=[window("c", 1)], join=True),
                    pb.PushPullRequest(from_node="b", digests=dg, members_hash=5)]
        if m == "Broadcast":
            return [pb.BroadcastRequest(from_node="b", members=ms, digests=dg)]
        if m == "Pull":
            return [pb.PullRequest(from_node="b", want=[pb.Digest(node_id="b", window_seq=1)])]
        return [pb.PushRequest(from_node="b", windows=[window("b", 2), window("c", 1)], members=ms)]

    def snapshot(self) -> Hashable:
        n = self.node
        mem = n.membership
        members = tuple(sorted((k, s.address, str(s.status), s.incarnation, tuple(s.ranks))
                               for k, s in mem._m.items()))
        rumours = tuple(sorted((str(k), _ser(e.msg)) for k, e in n.rumours._q.items()))
        windows = tuple(sorted((k, _ser(w)) for k, w in n.load._w.items()))
        return (members, mem.me.incarnation, tuple(sorted(mem._suspicions)), rumours, windows, n.load.shape,
                len(self.transport.sent))

    def must_refuse(self, req: Message) -> str:
        states = [s for f in ("piggyback", "members") if f in req.DESCRIPTOR.fields_by_name for s in getattr(req, f)]
        if any(not s.node_id or s.status not in _STATUSES for s in states):
            return "member state without a node id or with an unknown status"
        wins = list(getattr(req, "windows", [])) if "windows" in req.DESCRIPTOR.fields_by_name else []
        if self.method in ("PushPull", "Push") and any(
                (w.layers, w.experts) != (LAYERS, EXPERTS) or len(w.counts) != 4 * LAYERS * EXPERTS for w in wins):
            return "load window of the wrong shape or byte length"
        return ""

    def call(self, req: Message) -> Verdict:
        try:
            reply = self.transport.handlers["Gossip"](self.src, self.name, req)
        except InvalidArgument as e:
            return Verdict(True, str(e) or "InvalidArgument")
        if not isinstance(reply, (Message, Deferred)):
            raise TypeError(f"{self.name} answered {type(reply).__name__}")
        return Verdict(False, read_only=self.method == "Pull")


def gossip_factories() -> dict[str, Callable[[asyncio.AbstractEventLoop], Target]]:
    return {f"Gossip/{m}": (lambda loop, m=m: GossipTarget(m)) for m in METHODS}
