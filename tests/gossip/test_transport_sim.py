"""The simulated network (agent.transport.sim), the method table and the pausable node clock."""

from __future__ import annotations

import pytest
from google.protobuf.message import Message

from agent.clock import FakeClock
from agent.transport import Deferred, InvalidArgument
from agent.transport.methods import METHODS, grpc_path, lookup
from agent.transport.sim import LinkSpec, SimNetwork, SimTransport
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.v1 import gossip_pb2 as gpb


def test_method_table_covers_gossip_and_consensus() -> None:
    for mod, svc in ((gpb, "Gossip"), (cpb, "Consensus")):
        for m in mod.DESCRIPTOR.services_by_name[svc].methods:
            req, rep = METHODS[f"{svc}/{m.name}"]
            assert req.DESCRIPTOR.full_name == m.input_type.full_name
            assert rep.DESCRIPTOR.full_name == m.output_type.full_name
    assert lookup("Consensus/Prepare") == (cpb.PrepareRequest, cpb.Promise)
    assert grpc_path("Gossip/Probe") == "/elasticmoe.v1.Gossip/Probe"
    with pytest.raises(KeyError, match="Gossip/Nope"):
        lookup("Gossip/Nope")


class Pair:
    def __init__(self, seed: int = 1, **link: float) -> None:
        self.clock = FakeClock()
        self.net = SimNetwork(self.clock, seed, LinkSpec(**link))
        self.a, self.b = self.net.transport("a"), self.net.transport("b")
        self.got: list[tuple[float, Message | None]] = []
        self.served: list[tuple[str, Message]] = []

    def echo(self, src: str, method: str, req: Message) -> Message | None:
        self.served.append((src, req))
        assert isinstance(req, gpb.ProbeRequest)
        return gpb.ProbeAck(from_node="b", seq=req.seq, ok=True)

    def call(self, t: SimTransport, dst: str = "b", timeout: float = 1.0, seq: int = 1) -> None:
        t.call(dst, "Gossip/Probe", gpb.ProbeRequest(from_node=t.node_id, seq=seq), timeout,
               lambda r: self.got.append((self.clock.now(), r)))


def test_round_trip_copies_messages_and_counts_bytes() -> None:
    p = Pair(latency=0.001, jitter=0.0)
    p.b.serve(p.echo)
    req = gpb.ProbeRequest(from_node="a", seq=7)
    p.a.call("b", "Gossip/Probe", req, 1.0, lambda r: p.got.append((p.clock.now(), r)))
    req.seq = 99  # the sender's object is not what travels
    assert p.got == []  # never synchronously
    p.clock.advance(0.01)
    assert len(p.got) == 1
    t, reply = p.got[0]
    assert t == pytest.approx(0.002) and isinstance(reply, gpb.ProbeAck) and reply.seq == 7
    assert p.served[0][0] == "a"
    st = p.net.stats
    assert st.msgs_by_node["a"] == 1 and st.msgs_by_node["b"] == 1
    assert st.bytes_by_method["Gossip/Probe"] == gpb.ProbeRequest(from_node="a", seq=7).ByteSize() + reply.ByteSize()


def test_timeout_loss_and_exactly_once() -> None:
    p = Pair(loss=1.0)
    p.b.serve(p.echo)
    p.call(p.a, timeout=0.3)
    p.clock.advance(1.0)
    assert [(round(t, 6), r) for t, r in p.got] == [(0.3, None)]
    p = Pair(duplicate=1.0)
    p.b.serve(p.echo)
    p.call(p.a)
    p.clock.advance(1.0)
    assert len(p.served) == 2 and len(p.got) == 1 and p.got[0][1] is not None


def test_handler_none_invalid_argument_unimplemented_and_deferred() -> None:
    p = Pair(jitter=0.0)
    p.b.serve(lambda s, m, r: None, service="Gossip")
    p.call(p.a, timeout=0.5)
    p.clock.advance(1.0)
    assert p.got[-1] == (0.5, None)  # no reply: the caller times out

    def bad(s: str, m: str, r: Message) -> Message:
        raise InvalidArgument("nope")

    p.b.serve(bad, service="Gossip")
    p.call(p.a, timeout=0.5)
    p.clock.advance(1.0)
    assert p.got[-1][1] is None and p.got[-1][0] < 0.5 + 1.0  # failed at once, not at the deadline
    p.b.serve(None, service="Gossip")  # type: ignore[arg-type]
    p.call(p.a, timeout=0.5)
    t0 = p.clock.now()
    p.clock.advance(1.0)
    assert p.got[-1][1] is None and p.got[-1][0] - t0 < 0.01  # UNIMPLEMENTED: at once

    pending: list[Deferred] = []

    def later(s: str, m: str, r: Message) -> Deferred:
        d = Deferred()
        pending.append(d)
        return d

    p.b.serve(later, service="Gossip")
    p.call(p.a, timeout=0.5)
    p.clock.advance(0.1)
    pending[0].reply(gpb.ProbeAck(ok=True))
    pending[0].reply(gpb.ProbeAck(ok=False))  # ignored
    p.clock.advance(0.1)
    assert isinstance(p.got[-1][1], gpb.ProbeAck) and p.got[-1][1].ok


def test_service_handlers_and_fallback() -> None:
    p = Pair()
    seen: list[str] = []
    p.b.serve(lambda s, m, r: seen.append("gossip") or gpb.ProbeAck(), service="Gossip")
    p.b.serve(lambda s, m, r: seen.append("other") or cpb.CatchUpReply())
    p.call(p.a)
    p.a.call("b", "Consensus/CatchUp", cpb.CatchUpRequest(from_node="a"), 1.0, lambda r: seen.append(type(r).__name__))
    p.clock.advance(1.0)
    assert sorted(seen) == sorted(["gossip", "other", "CatchUpReply"])
    assert isinstance(p.got[-1][1], gpb.ProbeAck)
    with pytest.raises(TypeError, match="expected ProbeRequest"):
        p.a.call("b", "Gossip/Probe", cpb.CatchUpRequest(), 1.0, lambda r: None)


def test_partition_and_heal() -> None:
    p = Pair()
    p.b.serve(p.echo)
    p.net.partition([["a"], ["b"]])
    p.call(p.a, timeout=0.2)
    p.clock.advance(0.5)
    assert p.got[-1][1] is None
    p.net.heal()
    p.call(p.a, timeout=0.2)
    p.clock.advance(0.5)
    assert p.got[-1][1] is not None
    p.net.partition([["a", "b"], ["c"]])  # same side
    p.call(p.a, timeout=0.2)
    p.clock.advance(0.5)
    assert p.got[-1][1] is not None


def test_pause_holds_timers_and_drops_messages_then_resume_runs_them_late() -> None:
    p = Pair(jitter=0.0)
    p.b.serve(p.echo)
    clock_a = p.net.clock("a")
    fired: list[float] = []
    clock_a.call_later(0.5, lambda: fired.append(p.clock.now()))
    cancelled = clock_a.call_later(0.6, lambda: fired.append(-1.0))
    p.call(p.a, timeout=0.3)  # its reply will arrive while a is paused: dropped
    p.net.pause_for("a", 2.0)
    p.clock.advance(1.0)
    cancelled.cancel()
    assert fired == [] and p.got == []
    p.call(p.b, dst="a", timeout=0.2)  # b -> a: a does not receive
    p.clock.advance(1.5)
    assert fired == [2.0]  # ran late, at resume
    assert p.got[0] == (pytest.approx(1.2), None)  # b's call to the paused node timed out
    assert p.got[1] == (2.0, None)  # a's own call timed out, at resume
    assert len(p.served) == 1  # the request got there before the pause


def test_crash_is_forever_and_restart_is_a_new_process() -> None:
    p = Pair()
    p.b.serve(p.echo)
    fired: list[int] = []
    p.net.clock("b").call_later(0.1, lambda: fired.append(1))
    p.net.crash("b")
    p.call(p.a, timeout=0.2)
    p.clock.advance(1.0)
    assert fired == [] and p.got[-1][1] is None and p.net.is_crashed("b")
    p.net.restart("b")
    b2 = p.net.transport("b")
    b2.serve(p.echo)
    p.call(p.a, timeout=0.2)
    p.clock.advance(1.0)
    assert p.got[-1][1] is not None


def _trace(seed: int) -> list[tuple[float, int | None]]:
    p = Pair(seed=seed, loss=0.3, duplicate=0.2, reorder=0.3, jitter=0.002)
    p.b.serve(p.echo)
    for i in range(200):
        p.call(p.a, timeout=0.05, seq=i)
        p.clock.advance(0.001)
    p.clock.advance(1.0)
    return [(t, None if r is None else r.seq) for t, r in p.got]  # type: ignore[attr-defined]


def test_deterministic_from_the_seed() -> None:
    a, b, c = _trace(5), _trace(5), _trace(6)
    assert a == b and a != c
    assert len(a) == 200
    replies = [s for _, s in a if s is not None]
    assert replies != sorted(replies)  # reordered
    assert 0 < sum(s is None for _, s in a) < 200


def test_link_spec_validation() -> None:
    with pytest.raises(ValueError, match="loss"):
        LinkSpec(loss=1.5).validate()
    net = SimNetwork(FakeClock(), 0)
    with pytest.raises(ValueError, match="latency"):
        net.set_default(latency=-1.0)


def test_a_skewed_node_clock_stays_continuous_and_scales_its_delays() -> None:
    base = FakeClock()
    net = SimNetwork(base, 0)
    fast, slow, plain = net.clock("f"), net.clock("s"), net.clock("p")
    base.advance(1.0)
    fast.set_rate(2.0)
    slow.set_rate(0.5)
    assert fast.now() == slow.now() == plain.now() == 1.0  # no jump at the change
    fired: list[tuple[str, float]] = []
    for name, c in (("f", fast), ("s", slow), ("p", plain)):
        c.call_later(1.0, lambda name=name: fired.append((name, base.now())))  # one local second
    base.advance(3.0)
    assert fired == [("f", 1.5), ("p", 2.0), ("s", 3.0)]
    assert (fast.now(), slow.now(), plain.now()) == (7.0, 2.5, 4.0)
    fast.set_rate(1.0)  # back in step with real time, but 3 s ahead
    base.advance(1.0)
    assert fast.now() == 8.0 and plain.now() == 5.0
    with pytest.raises(ValueError, match="rate 0"):
        slow.set_rate(0.0)
