"""The wire version on every gRPC call (elasticmoe/versions.py): an agent serves callers within one version of
its own and answers with its version; one further away is refused by name (FAILED_PRECONDITION, logged once),
both ways: the transport drops the reply of a server too far away, which an older agent would not refuse."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
import uvloop
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from agent.config import from_dict
from agent.credentials import interceptors
from agent.transport.grpc import GrpcTransport
from elasticmoe.v1 import gossip_pb2 as gpb
from elasticmoe.versions import WIRE_KEY, WIRE_VERSION, wire_of, wire_refusal

PROBE = "/elasticmoe.v1.Gossip/Probe"


def test_wire_versions_within_one_of_this_release_interoperate() -> None:
    assert wire_of(None) == 1 and wire_of("2") == 2 and wire_of(b"3") == 3
    assert wire_of("two") == -1 and wire_of("0") == -1 and wire_of("-1") == -1
    for v in (WIRE_VERSION - 1, WIRE_VERSION, WIRE_VERSION + 1):
        assert wire_refusal(v, "node9") == ""
    why = wire_refusal(WIRE_VERSION + 2, "node9")
    assert f"wire version {WIRE_VERSION + 2}" in why and f"this agent {WIRE_VERSION}" in why and "newer" in why
    assert "not a positive integer" in wire_refusal(-1, "node9")


async def _agent_server() -> tuple[grpc.aio.Server, GrpcTransport, str]:
    """An agent's gRPC server as AgentProcess builds it (its interceptors, the peer methods, health)."""
    cfg = from_dict({"node_id": "b", "listen": "127.0.0.1:1", "seeds": [], "data_dir": "/nonexistent"})
    server = grpc.aio.server(interceptors=interceptors(cfg))
    port = server.add_insecure_port("127.0.0.1:0")
    t = GrpcTransport("b", {})
    t.attach(server)
    t.serve(lambda src, method, req: gpb.ProbeAck(from_node="b", seq=req.seq, ok=True), service="Gossip")  # type: ignore[attr-defined]
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    await server.start()
    return server, t, f"127.0.0.1:{port}"


async def _probe(ch: grpc.aio.Channel, wire: str | None) -> tuple[grpc.StatusCode, str, str | None]:
    md = [("x-emoe-from", "a")] + ([(WIRE_KEY, wire)] if wire is not None else [])
    call = ch.unary_unary(PROBE, request_serializer=gpb.ProbeRequest.SerializeToString,
                          response_deserializer=gpb.ProbeAck.FromString)(gpb.ProbeRequest(from_node="a", seq=7),
                                                                          metadata=md, timeout=5)
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or "", None
    answer = dict(await call.initial_metadata()).get(WIRE_KEY)
    return grpc.StatusCode.OK, "", answer if answer is None else str(answer)


def test_an_agent_serves_callers_within_one_version_and_refuses_the_others_by_name(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        server, t, addr = await _agent_server()
        try:
            async with grpc.aio.insecure_channel(addr) as ch:
                for wire in (None, str(WIRE_VERSION - 1), str(WIRE_VERSION), str(WIRE_VERSION + 1)):
                    assert await _probe(ch, wire) == (grpc.StatusCode.OK, "", str(WIRE_VERSION)), wire
                for wire in (str(WIRE_VERSION + 2), "x"):
                    for _ in range(2):  # (logged once per caller and version)
                        code, details, _ = await _probe(ch, wire)
                        assert code == grpc.StatusCode.FAILED_PRECONDITION and "a (calling " in details, details
                # health (any gRPC client calls it) is served without a version
                r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())  # type: ignore[no-untyped-call]
                assert r.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await t.close()
            await server.stop(None)

    with caplog.at_level(logging.ERROR, logger="agent.wireversion"):
        uvloop.run(main())
    refused = [r.getMessage() for r in caplog.records if r.name == "agent.wireversion"]
    assert len(refused) == 2, refused
    assert f"speaks wire version {WIRE_VERSION + 2}, this agent {WIRE_VERSION}" in refused[0]


def test_a_reply_from_a_server_two_versions_newer_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    """The other direction: an older agent that does not check callers answers; this one drops the answer."""

    async def probe(req: gpb.ProbeRequest, ctx: grpc.aio.ServicerContext) -> gpb.ProbeAck:
        await ctx.send_initial_metadata(((WIRE_KEY, str(WIRE_VERSION + 2)),))
        return gpb.ProbeAck(from_node="b", seq=req.seq, ok=True)

    async def main() -> list[Message | None]:
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("elasticmoe.v1.Gossip", {
            "Probe": grpc.unary_unary_rpc_method_handler(probe, gpb.ProbeRequest.FromString,
                                                         gpb.ProbeAck.SerializeToString)}),))
        await server.start()
        t = GrpcTransport("a", {"b": f"127.0.0.1:{port}"})
        got: list[Message | None] = []
        try:
            for seq in range(2):
                fut: asyncio.Future[Message | None] = asyncio.get_running_loop().create_future()
                t.call("b", "Gossip/Probe", gpb.ProbeRequest(from_node="a", seq=seq), 5.0, fut.set_result)
                got.append(await fut)
        finally:
            await t.close()
            await server.stop(None)
        return got

    with caplog.at_level(logging.ERROR, logger="agent.transport.grpc"):
        assert uvloop.run(main()) == [None, None]
    dropped = [r.getMessage() for r in caplog.records if "dropped a reply" in r.getMessage()]
    assert len(dropped) == 1 and f"peer b speaks wire version {WIRE_VERSION + 2}" in dropped[0], dropped


def test_the_transport_learns_which_peers_sign_control_records() -> None:
    """A peer answering through this release's WireInterceptor says it signs control records; one whose
    answers lack the capability (the release before, at the same wire version) does not; an unheard peer is
    taken to sign (agent.consensus.controlnode refuses its unsigned name until it answers otherwise)."""
    from agent.wireversion import WireInterceptor

    async def probe(req: gpb.ProbeRequest, ctx: grpc.aio.ServicerContext) -> gpb.ProbeAck:
        return gpb.ProbeAck(from_node="b", seq=req.seq, ok=True)

    async def before(req: gpb.ProbeRequest, ctx: grpc.aio.ServicerContext) -> gpb.ProbeAck:
        await ctx.send_initial_metadata(((WIRE_KEY, str(WIRE_VERSION)),))  # what the release before answers
        return gpb.ProbeAck(from_node="c", seq=req.seq, ok=True)

    async def main() -> tuple[bool, bool, bool, bool]:
        servers, addrs = [], {}
        for name, fn, icpt in (("b", probe, [WireInterceptor()]), ("c", before, [])):
            server = grpc.aio.server(interceptors=icpt)
            port = server.add_insecure_port("127.0.0.1:0")
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("elasticmoe.v1.Gossip", {
                "Probe": grpc.unary_unary_rpc_method_handler(fn, gpb.ProbeRequest.FromString,
                                                             gpb.ProbeAck.SerializeToString)}),))
            await server.start()
            servers.append(server)
            addrs[name] = f"127.0.0.1:{port}"
        t = GrpcTransport("a", addrs)
        unheard = t.signs_control("c")
        try:
            for dst in ("b", "c"):
                fut: asyncio.Future[Message | None] = asyncio.get_running_loop().create_future()
                t.call(dst, "Gossip/Probe", gpb.ProbeRequest(from_node="a", seq=1), 5.0, fut.set_result)
                assert await fut is not None
        finally:
            await t.close()
            for server in servers:
                await server.stop(None)
        return unheard, t.signs_control("b"), t.signs_control("c"), t.signs_control("nobody")

    assert uvloop.run(main()) == (True, True, False, True)
