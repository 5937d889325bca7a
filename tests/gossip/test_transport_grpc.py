"""The real transport (agent.transport.grpc) on loopback grpc.aio servers, run on uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import uvloop
from google.protobuf.message import Message

from agent.transport import Deferred, InvalidArgument
from agent.transport.grpc import GrpcTransport
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.v1 import gossip_pb2 as gpb


async def _servers(n: int) -> tuple[list[grpc.aio.Server], list[GrpcTransport], dict[str, str]]:
    servers, ports = [], []
    for _ in range(n):
        s = grpc.aio.server()
        ports.append(s.add_insecure_port("127.0.0.1:0"))
        servers.append(s)
    ids = [chr(ord("a") + i) for i in range(n)]
    addrs = {i: f"127.0.0.1:{p}" for i, p in zip(ids, ports, strict=True)}
    ts = []
    for i, s in zip(ids, servers, strict=True):
        t = GrpcTransport(i, addrs)
        t.attach(s)
        await s.start()
        ts.append(t)
    return servers, ts, addrs


def run(fn: Callable[[list[GrpcTransport], dict[str, str]], Awaitable[None]], n: int = 2) -> None:
    async def main() -> None:
        servers, ts, addrs = await _servers(n)
        try:
            await fn(ts, addrs)
        finally:
            for t in ts:
                await t.close()
            for s in servers:
                await s.stop(None)

    uvloop.run(main())


async def call(t: GrpcTransport, dst: str, method: str, req: Message, timeout: float = 2.0) -> Message | None:
    fut: asyncio.Future[Message | None] = asyncio.get_running_loop().create_future()
    t.call(dst, method, req, timeout, lambda r: fut.set_result(r))
    return await fut


def test_round_trip_names_the_caller_and_reuses_one_channel() -> None:
    async def body(ts: list[GrpcTransport], addrs: dict[str, str]) -> None:
        a, b = ts
        seen: list[tuple[str, str]] = []

        def h(src: str, method: str, req: Message) -> Message:
            seen.append((src, method))
            assert isinstance(req, gpb.ProbeRequest)
            return gpb.ProbeAck(from_node="b", seq=req.seq, ok=True)

        b.serve(h, service="Gossip")
        for i in range(5):
            r = await call(a, "b", "Gossip/Probe", gpb.ProbeRequest(from_node="a", seq=i))
            assert isinstance(r, gpb.ProbeAck) and r.seq == i
        assert seen == [("a", "Gossip/Probe")] * 5
        assert len(a._peers) == 1
        ch = a._peers["b"].channel
        await call(a, "b", "Gossip/Probe", gpb.ProbeRequest())
        assert a._peers["b"].channel is ch  # one channel per peer, reused

    run(body)


def test_failures_become_none() -> None:
    async def body(ts: list[GrpcTransport], addrs: dict[str, str]) -> None:
        a, b = ts
        loop = asyncio.get_running_loop()
        assert await call(a, "nobody", "Gossip/Probe", gpb.ProbeRequest()) is None  # unknown peer
        assert await call(a, "b", "Gossip/Probe", gpb.ProbeRequest()) is None  # nothing served yet

        def bad(src: str, method: str, req: Message) -> Message:
            raise InvalidArgument("bad probe")

        b.serve(bad, service="Gossip")
        assert await call(a, "b", "Gossip/Probe", gpb.ProbeRequest()) is None
        b.serve(lambda s, m, r: None, service="Gossip")
        assert await call(a, "b", "Gossip/Probe", gpb.ProbeRequest()) is None
        b.serve(lambda s, m, r: Deferred(), service="Gossip")  # never answered: the deadline
        t0 = loop.time()
        assert await call(a, "b", "Gossip/Probe", gpb.ProbeRequest(), timeout=0.3) is None
        assert 0.25 <= loop.time() - t0 < 2.0
        a.add_peer("c", "127.0.0.1:1")  # nothing listens there
        assert await call(a, "c", "Gossip/Probe", gpb.ProbeRequest(), timeout=1.0) is None

    run(body)


def test_deferred_reply_and_consensus_methods_through_the_fallback_handler() -> None:
    async def body(ts: list[GrpcTransport], addrs: dict[str, str]) -> None:
        a, b = ts
        loop = asyncio.get_running_loop()

        def later(src: str, method: str, req: Message) -> Deferred:
            d = Deferred()
            loop.call_later(0.05, d.reply, gpb.ProbeAck(ok=True, from_node="b"))
            return d

        b.serve(later, service="Gossip")
        b.serve(lambda s, m, r: cpb.CatchUpReply(committed_head=42))
        r = await call(a, "b", "Gossip/IndirectProbe", gpb.IndirectProbeRequest(target="c"))
        assert isinstance(r, gpb.ProbeAck) and r.ok
        r2 = await call(a, "b", "Consensus/CatchUp", cpb.CatchUpRequest(from_node="a"))
        assert isinstance(r2, cpb.CatchUpReply) and r2.committed_head == 42

    run(body)


def test_add_peer_replaces_the_channel_and_close_silences_callbacks() -> None:
    async def body(ts: list[GrpcTransport], addrs: dict[str, str]) -> None:
        a, b, c = ts
        for t in (b, c):
            t.serve(lambda s, m, r, n=t.node_id: gpb.ProbeAck(from_node=n), service="Gossip")
        r = await call(a, "b", "Gossip/Probe", gpb.ProbeRequest())
        assert isinstance(r, gpb.ProbeAck) and r.from_node == "b"
        a.add_peer("b", addrs["c"])  # b moved (here: to c's server)
        r = await call(a, "b", "Gossip/Probe", gpb.ProbeRequest())
        assert isinstance(r, gpb.ProbeAck) and r.from_node == "c"
        b.serve(lambda s, m, r: Deferred(), service="Gossip")
        a.add_peer("b", addrs["b"])
        got: list[Any] = []
        a.call("b", "Gossip/Probe", gpb.ProbeRequest(), 5.0, got.append)
        await asyncio.sleep(0.05)
        await a.close()
        await asyncio.sleep(0.05)
        assert got == []  # cancelled by close: no callback after close
        a.call("b", "Gossip/Probe", gpb.ProbeRequest(), 1.0, got.append)
        await asyncio.sleep(0.05)
        assert got == []

    run(body, n=3)
