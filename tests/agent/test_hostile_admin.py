"""Hostile input to the Admin service: INVALID_ARGUMENT / NOT_FOUND / PERMISSION_DENIED with a reason,
and the backend sees no mutation (FakeAdminBackend records every call that would change the cluster)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import grpc.aio
import pytest
import pytest_asyncio

from agent.admin.admin import MAX_PROPOSE_OPS, OFFLOAD_OPS, AdminService, is_local_peer, local_callers_only
from agent.decode_guard import DecodeGuardInterceptor
from agent.security import AuthzPolicy
from chaos.fuzz_targets import Aborted, AdminTarget, FakeAdminBackend, FakeContext
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import admin_pb2_grpc
from elasticmoe.v1 import consensus_pb2 as pb

G, L, E = 4, 2, 8  # the fake backend's head: 4 ranks, 2 layers, 8 experts


@pytest.fixture
def loop() -> asyncio.AbstractEventLoop:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def refused(loop: asyncio.AbstractEventLoop, method: str, req: object, code: grpc.StatusCode, expect: str,
            identity: str | None = None, authorize: object = None) -> None:
    t = AdminTarget(method, loop, identity=identity, authorize=authorize)
    before = t.snapshot()
    with pytest.raises(Aborted) as e:
        loop.run_until_complete(getattr(t.service, method)(req, FakeContext(identity)))
    assert e.value.code == code, e.value
    assert expect.lower() in e.value.details.lower(), e.value.details
    assert t.snapshot() == before and t.backend.mutations == []


def op(kind: int, layer: int = 0, experts: tuple[int, ...] = (1,), src: int = -1, dst: int = 2, rank: int = -1,
       source: int = -1) -> pb.Operation:
    return pb.Operation(kind=kind, layer=layer, experts=list(experts), src=src, dst=dst, rank=rank, source=source)


def test_valid_mutations_reach_the_backend(loop: asyncio.AbstractEventLoop) -> None:
    t = AdminTarget("Propose", loop)
    assert not t.call(apb.ProposeRequest(ops=[op(pb.REPLICATE)])).rejected
    assert t.backend.mutations and t.backend.mutations[0][0] == "propose"


@pytest.mark.parametrize("bad, expect", [
    ([], "ops is empty"),
    ([op(99)], "operation.kind"),
    ([op(pb.OP_KIND_UNSPECIFIED)], "operation.kind"),
    ([op(pb.ROLLBACK)], "operation.kind"),
    ([op(pb.REPLICATE, experts=())], "experts"),
    ([op(pb.REPLICATE, experts=(1, 2))], "experts"),
    ([op(pb.CONSOLIDATE, experts=())], "experts"),
    ([op(pb.REPLICATE, layer=L)], "layer"),
    ([op(pb.REPLICATE, layer=-1)], "layer"),
    ([op(pb.REPLICATE, experts=(E,))], "expert"),
    ([op(pb.REPLICATE, experts=(-5,))], "expert"),
    ([op(pb.REPLICATE, dst=G)], "dst"),
    ([op(pb.REPLICATE, dst=2**31 - 1)], "dst"),
    ([op(pb.MIGRATE, src=-1, dst=1)], "src"),
    ([op(pb.CONSOLIDATE, experts=(0, 1, 99), dst=1)], "expert"),
    ([op(pb.DRAIN, rank=G)], "rank"),
    ([op(pb.RESTORE, rank=-(2**31))], "rank"),
    ([op(pb.REPAIR, source=-2)], "source"),
    ([op(pb.REPLICATE), op(pb.MIGRATE, experts=(E + 3,), src=0, dst=1)], "ops[1]"),  # the second one is bad
])
def test_propose_malformed_or_unknown_ids(loop: asyncio.AbstractEventLoop, bad: list[pb.Operation],
                                          expect: str) -> None:
    refused(loop, "Propose", apb.ProposeRequest(ops=bad, force=True), grpc.StatusCode.INVALID_ARGUMENT, expect)


@pytest.mark.parametrize("method", ["Drain", "Restore"])
@pytest.mark.parametrize("rank", [-1, G, 2**31 - 1, -(2**31)])
def test_drain_restore_unknown_rank(loop: asyncio.AbstractEventLoop, method: str, rank: int) -> None:
    refused(loop, method, apb.RankRequest(rank=rank), grpc.StatusCode.INVALID_ARGUMENT, "rank")


@pytest.mark.parametrize("layer", [-2, L, 2**31 - 1, -(2**31)])
def test_placement_unknown_layer(loop: asyncio.AbstractEventLoop, layer: int) -> None:
    refused(loop, "Placement", apb.PlacementRequest(layer=layer), grpc.StatusCode.INVALID_ARGUMENT, "layer")


@pytest.mark.parametrize("version", [4, 2**64 - 1])
def test_unknown_versions(loop: asyncio.AbstractEventLoop, version: int) -> None:
    refused(loop, "Placement", apb.PlacementRequest(version=version), grpc.StatusCode.NOT_FOUND, "unknown")
    refused(loop, "Explain", apb.ExplainRequest(version=version), grpc.StatusCode.NOT_FOUND, "no decision")


def test_history_huge_limit_is_bounded_by_what_exists(loop: asyncio.AbstractEventLoop) -> None:
    t = AdminTarget("History", loop)
    r = loop.run_until_complete(t.service.History(apb.HistoryRequest(limit=2**32 - 1), FakeContext()))
    assert [e.version for e in r.entries] == [3, 2] and t.backend.mutations == []


@pytest.mark.parametrize("identity", [None, "viewer", "node1", ""])
@pytest.mark.parametrize("method, req", [
    ("Propose", apb.ProposeRequest(ops=[op(pb.REPLICATE)])), ("Drain", apb.RankRequest(rank=1)),
    ("Restore", apb.RankRequest(rank=1)), ("Pause", apb.Empty()), ("Resume", apb.Empty()),
])
def test_mutations_need_an_admin_identity(loop: asyncio.AbstractEventLoop, identity: str | None, method: str,
                                          req: object) -> None:
    policy = AuthzPolicy(members=frozenset({"node1"}), admins=frozenset({"admin"}))
    refused(loop, method, req, grpc.StatusCode.PERMISSION_DENIED, "", identity=identity,
            authorize=policy.check_admin)


def test_pause_by_an_admin_is_accepted(loop: asyncio.AbstractEventLoop) -> None:
    policy = AuthzPolicy(members=frozenset(), admins=frozenset({"admin"}))
    t = AdminTarget("Pause", loop, identity="admin", authorize=policy.check_admin)
    assert not t.call(apb.Empty()).rejected and t.backend.switch
    assert t.backend.admin == "admin"  # the record names the admin certificate's CN


@pytest.mark.parametrize("identity, said, named", [
    ("admin", "mallory", "admin"),  # mTLS: the verified CN, whatever the caller says
    (None, "bob", "bob"),  # plaintext: what the CLI said (unchecked: plaintext has no identities)
    (None, None, ""),  # plaintext, an older CLI: nobody named
])
def test_pause_and_resume_name_the_admin_who_asked(loop: asyncio.AbstractEventLoop, identity: str | None,
                                                   said: str | None, named: str) -> None:
    from agent.admin.admin import ADMIN_KEY

    for method in ("Pause", "Resume"):
        t = AdminTarget(method, loop)
        md = () if said is None else ((ADMIN_KEY, said),)
        loop.run_until_complete(getattr(t.service, method)(apb.Empty(), FakeContext(identity, md)))
        assert t.backend.switch == (method == "Pause") and t.backend.admin == named


@pytest.mark.parametrize("said", ["x" * 254, "bob\x1b[31m", "line\nbreak"])
def test_a_plaintext_admin_name_out_of_bounds_is_refused(loop: asyncio.AbstractEventLoop, said: str) -> None:
    from agent.admin.admin import ADMIN_KEY

    t = AdminTarget("Pause", loop)
    with pytest.raises(Aborted) as e:
        loop.run_until_complete(t.service.Pause(apb.Empty(), FakeContext(None, ((ADMIN_KEY, said),))))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and ADMIN_KEY in e.value.details, e.value
    assert not t.backend.switch and t.backend.admin == ""


# ---- over a real grpc.aio server: what never reaches the servicer ------------------------------------
async def _serve(options: Sequence[tuple[str, Any]]) -> AsyncIterator[tuple[str, FakeAdminBackend]]:
    """The admin service over a real loopback gRPC server with the decode guard and `options`."""
    backend = FakeAdminBackend()
    srv = grpc.aio.server(interceptors=[DecodeGuardInterceptor()], options=options)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminService.over(backend), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    yield f"127.0.0.1:{port}", backend
    await srv.stop(None)


@pytest_asyncio.fixture
async def server() -> AsyncIterator[tuple[str, FakeAdminBackend]]:
    async for s in _serve([("grpc.max_receive_message_length", 1 << 20)]):
        yield s


@pytest.mark.asyncio
async def test_oversized_message_is_refused_before_the_handler(server: tuple[str, FakeAdminBackend]) -> None:
    addr, backend = server
    big = apb.ProposeRequest(ops=[op(pb.REPLICATE, experts=tuple(range(64)))] * 12000)
    assert big.ByteSize() > 1 << 20
    async with grpc.aio.insecure_channel(addr) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await admin_pb2_grpc.AdminStub(ch).Propose(big, timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in e.value.details()
    assert backend.mutations == []


@pytest.mark.asyncio
@pytest.mark.parametrize("raw", [b"\xff", b"\x0a\x05\x08", b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x02\x08"])
async def test_malformed_protobuf_is_refused_before_the_handler(server: tuple[str, FakeAdminBackend],
                                                               raw: bytes) -> None:
    addr, backend = server
    async with grpc.aio.insecure_channel(addr) as ch:
        call = ch.unary_unary("/elasticmoe.v1.Admin/Propose", request_serializer=None,
                              response_deserializer=apb.ProposeReply.FromString)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call(raw, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert "malformed request to /elasticmoe.v1.Admin/Propose" in e.value.details()
    assert backend.mutations == [] and not backend.switch


def test_agent_server_answers_malformed_protobufs_with_invalid_argument(tmp_path: object) -> None:
    """The agent's gRPC server (admin, consensus, gossip on one port) carries the decode guard."""
    from agent import credentials
    from agent.config import from_dict

    cfg = from_dict({"node_id": "n1", "profile": "test", "data_dir": str(tmp_path)})
    assert any(isinstance(i, DecodeGuardInterceptor) for i in credentials.interceptors(cfg))


# ---- bounded input: huge proposals are refused at once (issue 17 item 7) ------------------------------
def _million() -> apb.ProposeRequest:
    return apb.ProposeRequest(ops=[op(pb.REPLICATE)] * 1_000_000, force=True)


def test_a_million_operations_are_refused_at_once(loop: asyncio.AbstractEventLoop) -> None:
    req = _million()
    t0 = time.perf_counter()
    refused(loop, "Propose", req, grpc.StatusCode.INVALID_ARGUMENT,
            f"1000000 operations: expected at most {MAX_PROPOSE_OPS}")
    assert time.perf_counter() - t0 < 0.5  # decoding them all took 2.2 s, checking them more


@pytest.mark.parametrize("req, expect", [
    (apb.ProposeRequest(ops=[op(pb.CONSOLIDATE, experts=tuple(range(600_000)), dst=1)]), "bytes: expected at most"),
    (apb.ProposeRequest(ops=[op(pb.CONSOLIDATE, experts=tuple(range(20)), dst=1)] * 4000), "expert ids in all"),
])
def test_propose_size_bounds(loop: asyncio.AbstractEventLoop, req: apb.ProposeRequest, expect: str) -> None:
    refused(loop, "Propose", req, grpc.StatusCode.INVALID_ARGUMENT, expect)


def test_large_valid_request_is_checked_off_the_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Within the bounds but above OFFLOAD_OPS: decoded and checked in a worker thread, same answers."""
    ops = [op(pb.REPLICATE)] * (OFFLOAD_OPS * 4) + [op(pb.REPLICATE, experts=(E,))]
    refused(loop, "Propose", apb.ProposeRequest(ops=ops), grpc.StatusCode.INVALID_ARGUMENT, f"ops[{OFFLOAD_OPS * 4}]")
    t = AdminTarget("Propose", loop)
    assert not t.call(apb.ProposeRequest(ops=ops[:-1])).rejected and t.backend.mutations[0][0] == "propose"


@pytest_asyncio.fixture
async def agent_server() -> AsyncIterator[tuple[str, FakeAdminBackend]]:
    """The admin service as the agent serves it: its message limit (64 MiB) and interceptors."""
    from agent.process import SERVER_OPTIONS

    async for s in _serve(SERVER_OPTIONS):
        yield s


@pytest.mark.asyncio
async def test_a_million_operations_do_not_stall_the_server(agent_server: tuple[str, FakeAdminBackend]) -> None:
    addr, backend = agent_server
    raw = _million().SerializeToString()  # ~42 MB, serialized before the clock starts
    big = [("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(addr, options=big) as ch, grpc.aio.insecure_channel(addr) as ch2:
        propose = ch.unary_unary("/elasticmoe.v1.Admin/Propose", request_serializer=None,
                                 response_deserializer=apb.ProposeReply.FromString)
        stub = admin_pb2_grpc.AdminStub(ch2)
        await stub.Status(apb.StatusRequest(), timeout=5)
        t0 = time.perf_counter()
        call = asyncio.ensure_future(propose(raw, timeout=30))
        worst = 0.0
        while not call.done():
            s = time.perf_counter()
            await stub.Status(apb.StatusRequest(), timeout=10)
            worst = max(worst, time.perf_counter() - s)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        took = time.perf_counter() - t0
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and str(MAX_PROPOSE_OPS) in e.value.details()
    assert backend.mutations == []
    print(f"1,000,000-op Propose refused in {took:.3f} s; slowest concurrent Status {worst * 1000:.0f} ms")
    # the figure is printed above; the bound only tells "refused at once" from the old stall (7.3 s of event loop
    # in-process, 17.9 s on a real agent) with room for a loaded CI machine
    assert took < 5.0 and worst < 4.0, (took, worst)


# ---- without TLS, only callers on this host may mutate (local_callers_only) ---------------------------
@pytest.mark.parametrize("peer, local", [
    ("ipv4:127.0.0.1:5000", True), ("ipv4:127.8.0.1:1", True), ("ipv6:[::1]:5000", True), ("unix:/run/a.sock", True),
    ("ipv6:%5B::1%5D:41594", True), ("ipv6:%5B::ffff:127.0.0.1%5D:1", True),  # how gRPC writes IPv6 peers
    ("ipv4:10.0.0.2:5000", False), ("ipv6:[fd00::2]:1", False), ("ipv6:%5Bfd00::2%5D:1", False),
    ("ipv6:%5B::ffff:10.0.0.1%5D:1", False), ("ipv4:0.0.0.0:1", False), ("", False), ("garbage", False),
])
def test_is_local_peer(peer: str, local: bool) -> None:
    assert is_local_peer(peer) is local


def _this_hosts_address() -> str | None:
    """A non-loopback IPv4 address of this host, or None (no packet is sent)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
            ip = str(s.getsockname()[0])
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


@pytest.mark.asyncio
async def test_plaintext_mutations_only_from_this_host() -> None:
    ip = _this_hosts_address()
    if ip is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    backend = FakeAdminBackend()
    srv = grpc.aio.server(interceptors=[DecodeGuardInterceptor()])
    admin_pb2_grpc.add_AdminServicer_to_server(AdminService.over(backend, authorize=local_callers_only), srv)
    port = srv.add_insecure_port("0.0.0.0:0")
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"{ip}:{port}") as ch:
            stub = admin_pb2_grpc.AdminStub(ch)
            assert (await stub.Status(apb.StatusRequest(), timeout=5)).node_id == "a"  # reads stay open
            for call, req in ((stub.Pause, apb.Empty()), (stub.Drain, apb.RankRequest(rank=1)),
                              (stub.Propose, apb.ProposeRequest(ops=[op(pb.REPLICATE)]))):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call(req, timeout=5)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert f"caller ipv4:{ip}:" in e.value.details() and "[tls] cert_dir" in e.value.details()
        assert backend.mutations == [] and not backend.switch
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert (await admin_pb2_grpc.AdminStub(ch).Pause(apb.Empty(), timeout=5)).ok and backend.switch
    finally:
        await srv.stop(None)
