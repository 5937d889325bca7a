"""How the CLI reaches an agent, and what it says when it cannot: addresses checked before dialing, the
channel (mutual TLS when $EMOE_CERT_DIR is set), and a failed call turned into one line an operator can act on
with the exit status of agent.cli.exits."""

from __future__ import annotations

import enum
import os
import socket
import ssl
from collections.abc import Callable
from functools import partial

import grpc

from agent.admin.answer import is_own_answer, legacy_own_answer
from agent.cli import exits


class CliError(Exception):
    """A command's one-line error; `exit` is its status (agent.cli.exits)."""

    def __init__(self, message: str, exit: int = exits.FAILED) -> None:
        super().__init__(message)
        self.exit = exit


def check_address(text: str, source: str) -> str:
    """`text` if it is HOST:PORT (an IPv6 host in brackets) with a port in 1..65535; else CliError (exit 2)
    naming the value and where it came from (`source`): checked before dialing, so that a typo is not
    reported as an agent that refuses connections."""
    host, sep, port = text.rpartition(":")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    ok = (bool(sep) and bool(bare) and port.isdigit() and 0 < int(port) < 65536
          and not any(c.isspace() or c in "/@[]" for c in bare) and (":" not in bare or bare != host))
    if not ok:
        raise CliError(f"bad address {text!r} ({source}): expected HOST:PORT with a port in 1..65535 (an IPv6 "
                       f"host in brackets: [::1]:7400)", exits.USAGE)
    return text


def config_address(path: str) -> str:
    """The admin address of the agent that runs `path` (its `listen`, a wildcard as loopback)."""
    from agent.config import ConfigError
    from agent.state import load_checked

    try:
        listen = load_checked(path).listen
    except ConfigError as e:
        raise CliError(f"invalid config: {e}", exits.USAGE) from None
    host, _, port = listen.rpartition(":")
    host = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(host, host)
    return check_address(f"{host}:{port}", f"listen in {path}")


def channel(address: str) -> grpc.Channel:
    cert_dir = os.environ.get("EMOE_CERT_DIR", "")
    if cert_dir:
        from agent.security import channel_credentials, channel_options  # mutual TLS when configured

        identity = os.environ.get("EMOE_IDENTITY", "admin")
        return grpc.secure_channel(address, channel_credentials(cert_dir, identity), options=channel_options())
    return grpc.insecure_channel(address)


class Listener(enum.Enum):
    """What answers at an agent's address when a call failed without an answer from the agent itself."""

    TLS = "speaks TLS"
    OTHER = "accepts connections, and does not answer as a TLS server"
    REFUSED = "refuses connections"
    UNKNOWN = "cannot be asked (no HOST:PORT, or no route)"


def probe_listener(address: str, timeout: float = 2.0) -> Listener:
    """Send a TLS ClientHello to `address` and look at the first byte back: a TLS server answers with a
    handshake (22) or alert (21) record, whatever it then thinks of the client; a plaintext gRPC server
    answers with an HTTP/2 frame or closes. Used only to explain a failed call."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return Listener.UNKNOWN
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    hello = ssl.MemoryBIO()
    try:
        ctx.wrap_bio(ssl.MemoryBIO(), hello).do_handshake()
    except ssl.SSLWantReadError:
        pass  # the ClientHello is written to `hello`; the answer is read from the socket below
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except ConnectionRefusedError:
        return Listener.REFUSED
    except OSError:
        return Listener.UNKNOWN
    with sock:
        try:
            sock.sendall(hello.read())
            first = sock.recv(1)
        except OSError:  # reset or silent: it accepted the connection, and is not a TLS server answering
            return Listener.OTHER
    return Listener.TLS if first in (b"\x15", b"\x16") else Listener.OTHER


def unavailable_reason(code: grpc.StatusCode | None, detail: str, tls: bool,
                       listener: Callable[[], Listener] = lambda: Listener.UNKNOWN, own: bool = False) -> str:
    """What an operator can act on, from a failed call's code and gRPC's transport detail (presentation only;
    `own`: the agent itself answered, agent.admin.answer, and its words are shown as they are). gRPC says "Socket
    closed" both for a plaintext call to a TLS agent and for an agent that died mid-call, so `listener`
    (called only then) asks what listens there now: TLS is suggested only when a TLS server answers."""
    if own:
        return f"{code.name if code else 'error'}: {detail}"
    if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return f"{code.name if code else 'error'}: {detail}"
    low = detail.lower()
    if "connection refused" in low:
        return "unreachable (connection refused: is an agent listening there?)"
    if tls and ("handshake" in low or "ssl" in low or "certificate" in low):
        return ("unreachable (TLS handshake failed: the agent may not use TLS, or its certificate is not from "
                "the CA in $EMOE_CERT_DIR; unset EMOE_CERT_DIR for a plaintext agent)")
    there = listener()
    if there is Listener.TLS and not tls:
        return ("unreachable (the agent closed the connection: it requires TLS; set EMOE_CERT_DIR to a "
                "directory with ca.pem, admin.pem and admin-key.pem)")
    if there is Listener.REFUSED:
        return "unreachable (connection closed, and now refused: the agent stopped?)"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "unreachable (deadline_exceeded: no answer in time)"
    if there is Listener.OTHER or "socket closed" in low or "connection reset" in low or "eof" in low:
        return "unreachable (the agent closed the connection)"
    return f"unreachable ({code.name.lower()})"


def rpc_exit(code: grpc.StatusCode | None, own: bool = False) -> int:
    """The exit status of a failed call: the agent called the request invalid (2), no answer from the agent
    (3: the transport's UNAVAILABLE or a deadline; `own`, the agent's own UNAVAILABLE, "agent X is NOT_SERVING",
    is an answer), anything else the agent answered (1)."""
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return exits.USAGE
    if code == grpc.StatusCode.DEADLINE_EXCEEDED or (code == grpc.StatusCode.UNAVAILABLE and not own):
        return exits.UNREACHABLE
    return exits.FAILED


def own_unavailable(e: grpc.RpcError, detail: str) -> bool:
    """Whether an UNAVAILABLE is the agent's own answer (agent.admin.answer's code in the trailing metadata), not
    the transport's; an agent of a release before that code is told by its words, in the one adapter."""
    trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    return is_own_answer(trailing) or (not trailing and legacy_own_answer(detail))


def rpc_failure(e: grpc.RpcError, address: str) -> tuple[str, int]:
    """What to say of a failed call to `address`, and the exit status."""
    code = e.code() if hasattr(e, "code") else None
    detail = (e.details() if hasattr(e, "details") else str(e)) or ""
    own = code == grpc.StatusCode.UNAVAILABLE and own_unavailable(e, detail)
    reason = unavailable_reason(code, detail, tls=bool(os.environ.get("EMOE_CERT_DIR")),
                                listener=partial(probe_listener, address), own=own)
    return f"agent {address}: {reason}", rpc_exit(code, own)
