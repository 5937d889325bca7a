"""Mutual TLS and authorisation: `emoe certs`, credentials, peer identity, AuthzPolicy/AuthzInterceptor."""

from __future__ import annotations

import stat
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
import pytest_asyncio
from cryptography import x509
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from agent.cli import main
from agent.config import ConfigError, from_dict
from agent.security import (
    ADMIN_METHODS,
    SERVER_NAME,
    AuthzInterceptor,
    AuthzPolicy,
    TlsFilesError,
    channel_credentials,
    channel_options,
    peer_identity,
    policy_from_config,
    secure_channel,
    serve_plaintext_health,
    server_credentials,
    write_dev_certs,
)

DRAIN = "/elasticmoe.v1.Admin/Drain"
WHOAMI = "/test.Echo/WhoAmI"
PROBE = "/elasticmoe.v1.Gossip/Probe"
COUNT = "/test.Echo/Count"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    good = tmp_path_factory.mktemp("tls")
    assert main(["certs", "--out", str(good), "--nodes", "node1,node2", "--clients", "admin,viewer"]) == 0
    other = tmp_path_factory.mktemp("other-ca")
    write_dev_certs(other, ["node1"], ["admin"])
    return good, other


def test_certs_carry_identity_in_cn_and_san(certs: tuple[Path, Path]) -> None:
    good, _ = certs
    c = x509.load_pem_x509_certificate((good / "node2.pem").read_bytes())
    assert c.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "node2"
    sans = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert "node2" in sans and SERVER_NAME in sans
    a = x509.load_pem_x509_certificate((good / "admin.pem").read_bytes())
    assert a.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == ["admin"]
    assert stat.S_IMODE((good / "node2-key.pem").stat().st_mode) == 0o600
    assert stat.S_IMODE((good / "ca-key.pem").stat().st_mode) == 0o600


def test_certs_reuse_ca_and_reject_bad_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_dev_certs(tmp_path, ["node1"])
    ca = (tmp_path / "ca.pem").read_bytes()
    write_dev_certs(tmp_path, ["node4"])  # a node added later is signed by the same CA
    assert (tmp_path / "ca.pem").read_bytes() == ca
    assert main(["certs", "--out", str(tmp_path), "--nodes", "no/de"]) == 2
    assert "--nodes: 'no/de'" in capsys.readouterr().err
    assert main(["certs", "--out", str(tmp_path), "--nodes", "node1", "--clients", "node1"]) == 2
    (tmp_path / "ca-key.pem").unlink()
    with pytest.raises(TlsFilesError, match="ca-key.pem: missing"):
        write_dev_certs(tmp_path, ["node5"])


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(TlsFilesError, match=r"ca\.pem: no such file"):
        server_credentials(tmp_path, "node1")


def test_tls_config_section() -> None:
    base = {"node_id": "node1", "seeds": ["node1@127.0.0.1:7400", "node2@127.0.0.1:7410"]}
    cfg = from_dict({**base, "tls": {"cert_dir": "/etc/emoe/tls", "admins": ["ops"]}})
    policy = policy_from_config(cfg)
    assert policy is not None and policy.members == {"node1", "node2"} and policy.admins == {"ops"}
    assert policy_from_config(from_dict(base)) is None  # plaintext: no identities to check
    with pytest.raises(ConfigError, match=r"tls\.admins\[1\] = 'a b'"):
        from_dict({**base, "tls": {"admins": ["ops", "a b"]}})


async def _whoami(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return (peer_identity(context) or "-").encode()


async def _drain(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    _drain.calls += 1  # type: ignore[attr-defined]
    return b"drained " + request


_drain.calls = 0  # type: ignore[attr-defined]


async def _count(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    for i in range(int(request)):
        yield str(i).encode()


@pytest_asyncio.fixture
async def server(certs: tuple[Path, Path]) -> AsyncIterator[str]:
    good, _ = certs
    policy = AuthzPolicy(members={"node1", "node2"}, admins={"admin"})
    srv = grpc.aio.server(interceptors=[AuthzInterceptor(policy, admin_methods=ADMIN_METHODS | {COUNT})])
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), srv)
    srv.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler("test.Echo", {
            "WhoAmI": grpc.unary_unary_rpc_method_handler(_whoami),
            "Count": grpc.unary_stream_rpc_method_handler(_count)}),
        grpc.method_handlers_generic_handler("elasticmoe.v1.Admin", {
            "Drain": grpc.unary_unary_rpc_method_handler(_drain)}),
        grpc.method_handlers_generic_handler("elasticmoe.v1.Gossip", {
            "Probe": grpc.unary_unary_rpc_method_handler(_whoami)}),
    ])
    port = srv.add_secure_port("127.0.0.1:0", server_credentials(good, "node1"))
    await srv.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await srv.stop(None)


async def _call(target: str, creds: grpc.ChannelCredentials, method: str, server_name: str = "node1") -> bytes:
    async with grpc.aio.secure_channel(target, creds, options=channel_options(server_name)) as ch:
        out: bytes = await ch.unary_unary(method)(b"3", timeout=5)
        return out


async def _health(target: str, creds: grpc.ChannelCredentials) -> int:
    async with grpc.aio.secure_channel(target, creds, options=channel_options()) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(reply.status)


@pytest.mark.asyncio
async def test_valid_client_cert_is_served_with_its_identity(server: str, certs: tuple[Path, Path]) -> None:
    good, _ = certs
    assert await _health(server, channel_credentials(good, "viewer")) == health_pb2.HealthCheckResponse.SERVING
    assert await _call(server, channel_credentials(good, "viewer"), WHOAMI) == b"viewer"
    assert await _call(server, channel_credentials(good, "node2"), PROBE) == b"node2"


@pytest.mark.asyncio
async def test_client_without_cert_or_from_another_ca_is_refused(server: str, certs: tuple[Path, Path]) -> None:
    good, other = certs
    no_cert = grpc.ssl_channel_credentials(root_certificates=(good / "ca.pem").read_bytes())
    foreign = grpc.ssl_channel_credentials(
        root_certificates=(good / "ca.pem").read_bytes(),  # trusts our server, presents a foreign cert
        private_key=(other / "admin-key.pem").read_bytes(),
        certificate_chain=(other / "admin.pem").read_bytes())
    for creds in (no_cert, foreign):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _health(server, creds)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.aio.AioRpcError) as e:  # the client refuses a server from another CA too
        await _health(server, channel_credentials(other, "admin"))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.asyncio
async def test_server_name_is_checked(server: str, certs: tuple[Path, Path]) -> None:
    good, _ = certs
    with pytest.raises(grpc.aio.AioRpcError) as e:  # the server presents node1's cert, not node2's
        await _call(server, channel_credentials(good, "admin"), WHOAMI, server_name="node2")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.asyncio
async def test_mutating_call_needs_an_admin_and_member_calls_a_member(server: str,
                                                                      certs: tuple[Path, Path]) -> None:
    good, _ = certs
    before = _drain.calls  # type: ignore[attr-defined]
    for who in ("viewer", "node2"):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _call(server, channel_credentials(good, who), DRAIN)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert f"identity {who!r} is not an authorised admin" in (e.value.details() or "")
    assert _drain.calls == before  # type: ignore[attr-defined]  # the handler never ran
    assert await _call(server, channel_credentials(good, "admin"), DRAIN) == b"drained 3"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _call(server, channel_credentials(good, "admin"), PROBE)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'admin' is not a configured member" in (e.value.details() or "")


def test_policy_denials() -> None:
    p = AuthzPolicy(members={"node1"}, admins={"admin"})
    assert p.member_denial("node1") is None and p.admin_denial("admin") is None
    assert p.member_denial(None) == "no verified client certificate"
    assert p.admin_denial("node1") == "identity 'node1' is not an authorised admin"


@pytest.mark.asyncio
async def test_plaintext_caller_has_no_identity_and_cannot_mutate() -> None:
    srv = grpc.aio.server(interceptors=[AuthzInterceptor(AuthzPolicy(members={"node1"}, admins={"admin"}))])
    srv.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler("test.Echo", {"WhoAmI": grpc.unary_unary_rpc_method_handler(_whoami)}),
        grpc.method_handlers_generic_handler("elasticmoe.v1.Admin", {
            "Drain": grpc.unary_unary_rpc_method_handler(_drain)}),
    ])
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert await ch.unary_unary(WHOAMI)(b"", timeout=5) == b"-"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(DRAIN)(b"", timeout=5)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert e.value.details() == "no verified client certificate"
    finally:
        await srv.stop(None)


@pytest.mark.asyncio
async def test_plaintext_health_listener_serves_only_health() -> None:
    servicer = health.aio.HealthServicer()
    await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    srv, port = await serve_plaintext_health("127.0.0.1:0", servicer)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            await servicer.set("", health_pb2.HealthCheckResponse.SERVING)  # shared with the TLS server
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(DRAIN)(b"", timeout=5)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await srv.stop(None)
    base = {"node_id": "node1", "listen": "0.0.0.0:7400"}
    assert from_dict({**base, "tls": {"health_listen": "0.0.0.0:7401"}}).tls.health_listen == "0.0.0.0:7401"
    for bad in ("0.0.0.0:7400", "7401"):
        with pytest.raises(ConfigError, match="tls.health_listen"):
            from_dict({**base, "tls": {"health_listen": bad}})


@pytest.mark.asyncio
async def test_guarded_streaming_method(server: str, certs: tuple[Path, Path]) -> None:
    good, _ = certs
    async with secure_channel(server, good, "admin") as ch:
        assert [r async for r in ch.unary_stream(COUNT)(b"3", timeout=5)] == [b"0", b"1", b"2"]
    async with secure_channel(server, good, "viewer") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [r async for r in ch.unary_stream(COUNT)(b"3", timeout=5)]
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
