"""Mutual TLS between agents and for admin traffic, and who may call what.

Certificate layout of a `cert_dir` (what `emoe certs` writes):

    ca.pem                   the cluster CA every agent and client trusts
    ca-key.pem               the CA's key: keep it off the nodes (only `emoe certs` needs it)
    <name>.pem, <name>-key.pem   one pair per node id and per client identity

A certificate's subject CN is the identity (`node1`, `admin`); its SAN carries the same name as a DNS
entry, plus `SERVER_NAME` on node certificates so that a client that does not know which node it reaches
(the admin CLI through a load balancer) can still verify it holds a cluster node certificate.

Peers dial each other by address but check the name: `channel_options(peer_node_id)` sets gRPC's
`ssl_target_name_override`, so node2 only accepts a server certificate issued to node2.

`AuthzPolicy` decides per identity: proposals, votes and gossip only from configured members; mutating admin
calls only from configured admins. `AuthzInterceptor` applies it by method name to a grpc.aio server, so
the gossip, consensus and admin servicers need no checks of their own.
"""

from __future__ import annotations

import datetime
import inspect
import ipaddress
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

# Every node certificate also carries this DNS name (see module docstring).
SERVER_NAME = "emoe-agent"

# Method paths by the role they need. Read-only admin calls need only a valid certificate (any CN).
def _member_methods() -> frozenset[str]:
    """Every agent-to-agent method (all of Gossip and Consensus), from the transport's method table, so a
    method added there is guarded here too."""
    from agent.transport.methods import METHODS, grpc_path

    return frozenset(grpc_path(m) for m in METHODS if m.split("/", 1)[0] in ("Gossip", "Consensus"))


MEMBER_METHODS: frozenset[str] = _member_methods()
ADMIN_METHODS: frozenset[str] = frozenset(
    f"/elasticmoe.v1.Admin/{m}" for m in ("Propose", "Drain", "Restore", "Pause", "Resume")
)


class TlsFilesError(ValueError):
    """A certificate or key file that is missing or unreadable; the message names the path."""


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TlsFilesError(f"{path}: no such file ({what}); create it with `emoe certs`") from None
    except OSError as e:
        raise TlsFilesError(f"{path}: cannot read {what}: {e.strerror}") from None


def cert_paths(cert_dir: str | Path, name: str) -> tuple[Path, Path]:
    """(certificate, key) paths of identity `name` in `cert_dir`."""
    d = Path(cert_dir)
    return d / f"{name}.pem", d / f"{name}-key.pem"


def identity_files(cert_dir: str | Path, name: str) -> tuple[bytes, bytes, bytes]:
    """(CA certificate, certificate, private key) of identity `name`, PEM; TlsFilesError names a bad file."""
    cert, key = cert_paths(cert_dir, name)
    ca = _read(Path(cert_dir) / "ca.pem", "the cluster CA certificate")
    return ca, _read(cert, f"the certificate of {name!r}"), _read(key, f"the private key of {name!r}")


def server_credentials(cert_dir: str | Path, node_id: str) -> grpc.ServerCredentials:
    """TLS server credentials for `node_id` that require and verify a client certificate from the CA."""
    ca, cert, key = identity_files(cert_dir, node_id)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def channel_credentials(cert_dir: str | Path, identity: str) -> grpc.ChannelCredentials:
    """TLS channel credentials presenting `identity`'s certificate and trusting only the cluster CA."""
    ca, cert, key = identity_files(cert_dir, identity)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def channel_options(server_name: str = SERVER_NAME) -> list[tuple[str, str]]:
    """Channel options that verify the server certificate against `server_name` (a peer's node id, or
    SERVER_NAME to accept any cluster node) instead of the host in the dialled address."""
    return [("grpc.ssl_target_name_override", server_name)]


def secure_channel(target: str, cert_dir: str | Path, identity: str,
                   server_name: str = SERVER_NAME) -> grpc.aio.Channel:
    """A grpc.aio channel to `target` ("host:port") under mutual TLS."""
    return grpc.aio.secure_channel(target, channel_credentials(cert_dir, identity),
                                   options=channel_options(server_name))


async def serve_plaintext_health(listen: str, servicer: Any) -> tuple[grpc.aio.Server, int]:
    """Start a plaintext server on `listen` ("host:port") with only `servicer` (a grpc_health.v1
    HealthServicer, normally the one the TLS server also serves, so both report the same status).
    For `[tls] health_listen`: Kubernetes gRPC probes cannot present a client certificate. Returns the
    started server and its port."""
    from grpc_health.v1 import health_pb2_grpc

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])  # a second agent's bind fails, not shares
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"tls.health_listen = {listen!r}: cannot listen there")
    await server.start()
    return server, port


def peer_identity(context: grpc.ServicerContext | grpc.aio.ServicerContext) -> str | None:
    """The verified certificate CN of the caller, or None on a plaintext or unauthenticated connection."""
    auth = context.auth_context()
    if not auth or not context.peer_identities():  # peer_identities is None unless the cert was verified
        return None
    cns = auth.get("x509_common_name") or []
    if len(cns) != 1:
        return None
    cn = cns[0]
    return cn.decode("utf-8", "replace") if isinstance(cn, bytes) else str(cn)


@dataclass(frozen=True)
class AuthzPolicy:
    """Who may do what: `members` (node ids) gossip, propose and vote; `admins` make mutating admin calls."""

    members: frozenset[str] | set[str] = field(default_factory=frozenset)
    admins: frozenset[str] | set[str] = field(default_factory=frozenset)

    def member_denial(self, identity: str | None) -> str | None:
        """Why `identity` may not act as a member, or None if it may."""
        if identity is None:
            return "no verified client certificate"
        if identity not in self.members:
            return f"identity {identity!r} is not a configured member"
        return None

    def admin_denial(self, identity: str | None) -> str | None:
        """Why `identity` may not make a mutating admin call, or None if it may."""
        if identity is None:
            return "no verified client certificate"
        if identity not in self.admins:
            return f"identity {identity!r} is not an authorised admin"
        return None

    async def check_member(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's identity if it is a member; otherwise aborts the call with PERMISSION_DENIED."""
        return await self._check(context, self.member_denial)

    async def check_admin(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's identity if it is an admin; otherwise aborts the call with PERMISSION_DENIED."""
        return await self._check(context, self.admin_denial)

    @staticmethod
    async def _check(context: grpc.aio.ServicerContext,
                     deny: Callable[[str | None], str | None]) -> str:
        ident = peer_identity(context)
        reason = deny(ident)
        if reason is not None or ident is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason or "no identity")
        return ident  # type: ignore[return-value]  # abort raises


def policy_from_config(cfg: Any) -> AuthzPolicy | None:
    """The policy of an AgentConfig: members are this node, the seeds and the voters; admins from
    `[tls] admins`. None when TLS is off (`tls.cert_dir` empty): plaintext has no identities."""
    if not cfg.tls.cert_dir:
        return None
    members = {cfg.node_id, *cfg.seed_map, *cfg.consensus.voters}
    return AuthzPolicy(members=frozenset(members), admins=frozenset(cfg.tls.admins))


Check = Callable[[grpc.aio.ServicerContext], Awaitable[str]]


class AuthzInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Applies an AuthzPolicy by method path: `member_methods` need a member, `admin_methods` an admin;
    any other method is served to every caller the TLS handshake accepted."""

    def __init__(self, policy: AuthzPolicy, member_methods: Iterable[str] = MEMBER_METHODS,
                 admin_methods: Iterable[str] = ADMIN_METHODS) -> None:
        self._checks: Mapping[str, Check] = {
            **{m: policy.check_member for m in member_methods},
            **{m: policy.check_admin for m in admin_methods},
        }

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        check = self._checks.get(handler_call_details.method)
        if handler is None or check is None:
            return handler
        return _guarded(handler, check)


async def _maybe_await(x: Any) -> Any:
    return await x if inspect.isawaitable(x) else x


async def _aiter(x: Any) -> AsyncIterator[Any]:
    if inspect.isawaitable(x):  # a handler that writes with context.write() and returns None
        await x
    elif hasattr(x, "__aiter__"):
        async for item in x:
            yield item
    elif x is not None:
        for item in x:
            yield item


def _guarded(h: grpc.RpcMethodHandler, check: Check) -> grpc.RpcMethodHandler:
    """`h` with `check(context)` run before its behaviour."""
    ser = {"request_deserializer": h.request_deserializer, "response_serializer": h.response_serializer}
    if h.unary_unary:
        fn_uu = h.unary_unary

        async def uu(req: Any, ctx: grpc.aio.ServicerContext) -> Any:
            await check(ctx)
            return await _maybe_await(fn_uu(req, ctx))

        return grpc.unary_unary_rpc_method_handler(uu, **ser)
    if h.stream_unary:
        fn_su = h.stream_unary

        async def su(reqs: Any, ctx: grpc.aio.ServicerContext) -> Any:
            await check(ctx)
            return await _maybe_await(fn_su(reqs, ctx))

        return grpc.stream_unary_rpc_method_handler(su, **ser)
    if h.unary_stream:
        fn_us = h.unary_stream

        async def us(req: Any, ctx: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await check(ctx)
            async for item in _aiter(fn_us(req, ctx)):
                yield item

        return grpc.unary_stream_rpc_method_handler(us, **ser)
    fn_ss = h.stream_stream

    async def ss(reqs: Any, ctx: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await check(ctx)
        async for item in _aiter(fn_ss(reqs, ctx)):
            yield item

    return grpc.stream_stream_rpc_method_handler(ss, **ser)


# ---- development certificates (`emoe certs`) -------------------------------------------------------

_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def _check_names(nodes: Sequence[str], clients: Sequence[str]) -> None:
    for flag, names in (("--nodes", nodes), ("--clients", clients)):
        for n in names:
            if not _NAME_OK.match(n) or n in ("ca", SERVER_NAME):
                raise ValueError(f"{flag}: {n!r}: expected a name of letters, digits, '.', '_' or '-' "
                                 f"(at most 63), other than 'ca' and {SERVER_NAME!r}")
    both = sorted(set(nodes) & set(clients))
    if both:
        raise ValueError(f"--clients: {both[0]!r} is also in --nodes; an identity is one or the other")
    if not nodes and not clients:
        raise ValueError("--nodes: expected at least one node id (or --clients)")


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _load_or_make_ca(out: Path, days: int, now: datetime.datetime) -> tuple[Any, Any, bool]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_cert, ca_key = out / "ca.pem", out / "ca-key.pem"
    if ca_cert.exists() != ca_key.exists():
        have, miss = (ca_cert, ca_key) if ca_cert.exists() else (ca_key, ca_cert)
        raise TlsFilesError(f"{miss}: missing while {have} exists; remove both to create a new CA")
    if ca_cert.exists():
        cert = x509.load_pem_x509_certificate(ca_cert.read_bytes())
        key = serialization.load_pem_private_key(ca_key.read_bytes(), password=None)
        return cert, key, False
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ElasticMoE"),
                      x509.NameAttribute(NameOID.COMMON_NAME, "ElasticMoE development CA")])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     key_cert_sign=True, crl_sign=True, encipher_only=False,
                                     decipher_only=False), critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(ca_key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()), private=True)
    _write(ca_cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return cert, key, True


def _issue(ca_cert: Any, ca_key: Any, name: str, is_node: bool, days: int,
           now: datetime.datetime) -> tuple[bytes, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(name)]
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if is_node:  # a node serves peers and the admin CLI, and dials peers
        sans += [x509.DNSName(SERVER_NAME), x509.DNSName("localhost"),
                 x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(ipaddress.ip_address("::1"))]
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ElasticMoE"),
                                 x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     key_cert_sign=False, crl_sign=False, encipher_only=False,
                                     decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), pem_key


def write_dev_certs(out: str | Path, nodes: Sequence[str], clients: Sequence[str] = (),
                    days: int = 365) -> list[Path]:
    """Create (or reuse) a development CA in `out` and issue a certificate per node id and per client
    identity (ECDSA P-256, CN and SAN = the name). Returns the files written. Raises ValueError naming
    the bad argument."""
    if days < 1:
        raise ValueError(f"--days: {days}: expected >= 1")
    _check_names(nodes, clients)
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.datetime.now(datetime.UTC)
    ca_cert, ca_key, created = _load_or_make_ca(d, days, now)
    written = [d / "ca.pem", d / "ca-key.pem"] if created else []
    for name, is_node in [*((n, True) for n in dict.fromkeys(nodes)),
                          *((c, False) for c in dict.fromkeys(clients))]:
        cert, key = _issue(ca_cert, ca_key, name, is_node, days, now)
        cpath, kpath = cert_paths(d, name)
        _write(kpath, key, private=True)
        _write(cpath, cert, private=False)
        written += [cpath, kpath]
    return written
