"""Operator commands against a running agent: status, placement, history, explain, top, propose,
drain, restore, pause, resume. Read commands print rich tables, or JSON with --json. Errors are one line
naming the agent and the reason, with a non-zero exit."""

from __future__ import annotations

import argparse
import enum
import json
import os
import socket
import ssl
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from agent.cli import render
from agent.cli.argtypes import INT32_MAX, UINT64_MAX, float_in, int_in
from agent.cli.installwait import ASK_TIMEOUT_S, wait_installed
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import admin_pb2_grpc
from elasticmoe.v1 import consensus_pb2 as cpb

DEFAULT_AGENT = "127.0.0.1:7400"
TIMEOUT_S = 5.0
HISTORY_MAX = 10_000


class CliError(Exception):
    pass


def _agent_default() -> str:
    return os.environ.get("EMOE_AGENT", DEFAULT_AGENT)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    def add(name: str, help: str, func: Callable[[argparse.Namespace, admin_pb2_grpc.AdminStub], int],
            read: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("--agent", default=None, help=f"HOST:PORT of an agent (default $EMOE_AGENT or {DEFAULT_AGENT})")
        p.add_argument("--config", default=None, help="take the agent address from this config's `listen`")
        if read:
            p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        p.set_defaults(func=lambda a, f=func: _run(a, f))
        return p

    add("status", "members, committed versions and health", cmd_status)
    p = add("placement", "the routing table as a ranks x slots grid", cmd_placement)
    p.add_argument("--layer", type=int_in(-1, INT32_MAX), default=0, help="layer to show (-1: all)")
    p.add_argument("--version", type=int_in(0, UINT64_MAX), default=0,
                   help="table version (default: latest committed)")
    p = add("history", "committed versions with their operations, gains, votes", cmd_history)
    p.add_argument("--limit", type=int_in(1, HISTORY_MAX), default=20,
                   help=f"newest commits to show, 1..{HISTORY_MAX} (default 20)")
    p = add("explain", "why a version was (or was not) committed", cmd_explain)
    p.add_argument("version", type=int_in(0, UINT64_MAX), nargs="?", default=0,
                   help="version (default: the latest decision)")
    p = add("top", "live view: per-rank load, imbalance, recent commits", cmd_top)
    p.add_argument("--interval", type=float_in(0.0, 3600.0, lo_open=True), default=1.0,
                   help="refresh period in seconds")
    p.add_argument("--iterations", type=int_in(0, 10**9), default=0,
                   help="stop after this many refreshes (0: until Ctrl-C)")
    p = add("propose", "propose operations (through estimate-verify-commit unless --force)", cmd_propose, read=False)
    p.add_argument("op", nargs="+", help="replicate L E DST | migrate L E SRC DST | consolidate L E1,E2 DST | "
                   "swap L E SRC E2 DST | drop L E SRC (several operations separated by ';')")
    p.add_argument("--force", action="store_true", help="skip the gain check (validity is still checked)")
    p.add_argument("--wait", action="store_true", help="return once every active engine rank installed the commit")
    _install_timeout(p)
    p.add_argument("--json", action="store_true")
    for name, help in (("drain", "move a rank's experts away, then take it out of service (returns once every "
                                 "active engine rank installed the commit)"),
                       ("restore", "return a drained rank to service (returns once every active engine rank "
                                   "installed the commit)")):
        p = add(name, help, cmd_drain if name == "drain" else cmd_restore, read=False)
        p.add_argument("rank", type=int_in(0, INT32_MAX))
        _install_timeout(p)
        p.add_argument("--json", action="store_true")
    for name in ("pause", "resume"):
        p = add(name, f"{name} automatic rebalancing cluster-wide (a record committed by a quorum of the voters; "
                      f"exits 1 if it cannot commit)", cmd_pause if name == "pause" else cmd_resume, read=False)
        p.add_argument("--json", action="store_true")


def _install_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--install-timeout", type=float_in(0.0, 3600.0), default=None, metavar="S",
                   help="seconds to wait for the engines to install the commit (default: the agent's "
                        "engine.install_lag_s); past it, the ranks that did not are named and the exit is 1")


def _address(args: argparse.Namespace) -> str:
    if args.agent:
        return str(args.agent)
    if args.config:
        from agent.config import ConfigError, load

        try:
            return load(args.config).listen.replace("0.0.0.0", "127.0.0.1")
        except ConfigError as e:
            raise CliError(f"invalid config: {e}") from None
    return _agent_default()


def _channel(address: str) -> grpc.Channel:
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
                       listener: Callable[[], Listener] = lambda: Listener.UNKNOWN) -> str:
    """What an operator can act on, from a failed call's code and gRPC's transport detail (presentation only:
    the agent's own UNAVAILABLE answers start with "agent " and are shown as they are). gRPC says "Socket
    closed" both for a plaintext call to a TLS agent and for an agent that died mid-call, so `listener`
    (called only then) asks what listens there now: TLS is suggested only when a TLS server answers."""
    if code == grpc.StatusCode.UNAVAILABLE and detail.startswith("agent "):  # the agent's own answer
        return f"UNAVAILABLE: {detail}"
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


def _run(args: argparse.Namespace, func: Callable[[argparse.Namespace, admin_pb2_grpc.AdminStub], int]) -> int:
    from agent.security import TlsFilesError

    try:
        address = _address(args)
    except CliError as e:
        print(f"emoe {args.command}: {e}", file=sys.stderr)
        return 2
    try:
        with _channel(address) as ch:
            return func(args, admin_pb2_grpc.AdminStub(ch))  # type: ignore[no-untyped-call]
    except TlsFilesError as e:
        print(f"emoe {args.command}: EMOE_CERT_DIR: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        detail = e.details() if hasattr(e, "details") else str(e)
        reason = unavailable_reason(code, detail or "", tls=bool(os.environ.get("EMOE_CERT_DIR")),
                                    listener=partial(probe_listener, address))
        print(f"emoe {args.command}: agent {address}: {reason}", file=sys.stderr)
        return 1
    except CliError as e:
        print(f"emoe {args.command}: agent {address}: {e}", file=sys.stderr)
        return 1


def _dump(msg: Any) -> None:
    print(json.dumps(MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True),
                     indent=2, sort_keys=True))


def _show(args: argparse.Namespace, reply: Any, human: Callable[[Any], None]) -> int:
    """Print a read command's reply as JSON (--json) or through its human renderer."""
    if args.json:
        _dump(reply)
    else:
        human(reply)
    return 0


def cmd_status(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    return _show(args, stub.Status(apb.StatusRequest(), timeout=TIMEOUT_S), render.status)


def cmd_placement(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    r = stub.Placement(apb.PlacementRequest(layer=args.layer, version=args.version), timeout=TIMEOUT_S)
    if args.json:
        print(json.dumps(render.placement_json(r, args.layer), indent=2))
    else:
        render.placement(r, args.layer)
    return 0


def cmd_history(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    return _show(args, stub.History(apb.HistoryRequest(limit=args.limit), timeout=TIMEOUT_S), render.history)


def cmd_explain(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    try:
        r = stub.Explain(apb.ExplainRequest(version=args.version), timeout=TIMEOUT_S)
    except grpc.RpcError as e:
        # no decision at all yet is not an error of the read: say plainly what it waits for
        if args.version == 0 and not args.json and e.code() == grpc.StatusCode.NOT_FOUND:
            print(e.details())
            return 0
        raise
    return _show(args, r, render.explain)


def cmd_top(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    n = 0
    while True:
        status = stub.Status(apb.StatusRequest(), timeout=TIMEOUT_S)
        view = stub.LoadView(apb.LoadViewRequest(), timeout=TIMEOUT_S)
        hist = stub.History(apb.HistoryRequest(limit=5), timeout=TIMEOUT_S)
        n += 1
        if args.json:
            print(json.dumps(render.top_json(status, view, hist)), flush=True)
        else:
            render.top(status, view, hist, clear=args.iterations != 1)
        if args.iterations and n >= args.iterations:
            return 0
        time.sleep(max(0.05, args.interval))


def _num(kind: str, rest: list[str], word: str) -> int:
    try:
        v = int(word)
    except ValueError:
        raise CliError(f"{kind} {' '.join(rest)}: arguments must be integers, got {word!r}") from None
    if not 0 <= v <= INT32_MAX:
        raise CliError(f"{kind} {' '.join(rest)}: {word} is out of range (expected 0..{INT32_MAX})")
    return v


def parse_ops(words: list[str]) -> list[cpb.Operation]:
    """'replicate 3 17 5 ; migrate 0 4 1 2' -> operations; raises CliError naming the bad word."""
    text = " ".join(words).replace(";", " ; ")
    out: list[cpb.Operation] = []
    for chunk in (c.split() for c in text.split(";")):
        if not chunk:
            continue
        kind, rest = chunk[0].lower(), chunk[1:]
        want = {"replicate": 3, "migrate": 4, "consolidate": 3, "swap": 5, "drop": 3}
        if kind not in want:
            raise CliError(f"operation {kind!r}: expected replicate, migrate, consolidate, swap or drop")
        if len(rest) != want[kind]:
            raise CliError(f"{kind} takes {want[kind]} arguments, got {len(rest)}: {' '.join(rest)!r}")
        if kind == "consolidate":
            experts = [_num(kind, rest, e) for e in rest[1].split(",")]
            out.append(cpb.Operation(kind=cpb.CONSOLIDATE, layer=_num(kind, rest, rest[0]), experts=experts,
                                     dst=_num(kind, rest, rest[2]), src=-1, rank=-1, source=-1))
            continue
        nums = [_num(kind, rest, x) for x in rest]
        if kind == "swap":
            out.append(cpb.Operation(kind=cpb.SWAP, layer=nums[0], experts=[nums[1], nums[3]], src=nums[2],
                                     dst=nums[4], rank=-1, source=-1))
        elif kind == "drop":
            out.append(cpb.Operation(kind=cpb.DROP, layer=nums[0], experts=[nums[1]], src=nums[2], dst=-1, rank=-1,
                                     source=-1))
        elif kind == "replicate":
            out.append(cpb.Operation(kind=cpb.REPLICATE, layer=nums[0], experts=[nums[1]], dst=nums[2],
                                     src=-1, rank=-1, source=-1))
        else:
            out.append(cpb.Operation(kind=cpb.MIGRATE, layer=nums[0], experts=[nums[1]], src=nums[2],
                                     dst=nums[3], rank=-1, source=-1))
    if not out:
        raise CliError("no operation given")
    return out


def _ack(args: argparse.Namespace, ok: bool, reason: str, version: int, msg: Any,
         stub: admin_pb2_grpc.AdminStub | None = None) -> int:
    """Print a mutating call's answer; with `stub`, first wait until the engines installed `version`."""
    state = None
    if ok and stub is not None:
        state, waited = wait_installed(lambda: stub.Status(apb.StatusRequest(), timeout=TIMEOUT_S), _ask_status,
                                       version, args.install_timeout)
    if args.json:
        doc = MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        if state is not None:
            doc["install"] = state.as_dict()
        print(json.dumps(doc, indent=2, sort_keys=True))
    elif ok:
        print(f"ok: version {version}" + (f" ({reason})" if reason else ""))
        if state is not None and state.done:
            print(f"installed: {state.summary()}")
    if not ok:
        raise CliError(f"refused: {reason}")
    if state is not None and not state.done:
        raise CliError(state.failure(waited))
    return 0


def _ask_status(address: str) -> apb.StatusReply:
    """Another member's agent's Status (its own engine ranks), at its gossip address."""
    with _channel(address) as ch:
        reply: apb.StatusReply = admin_pb2_grpc.AdminStub(ch).Status(  # type: ignore[no-untyped-call]
            apb.StatusRequest(), timeout=ASK_TIMEOUT_S)
        return reply


def cmd_propose(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    try:
        ops = parse_ops(args.op)
    except CliError as e:
        print(f"emoe propose: {e}", file=sys.stderr)
        return 2
    r = stub.Propose(apb.ProposeRequest(ops=ops, force=args.force), timeout=30.0)
    return _ack(args, r.committed, r.reason, r.version, r, stub if args.wait else None)


def cmd_drain(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    r = stub.Drain(apb.RankRequest(rank=args.rank), timeout=30.0)
    return _ack(args, r.ok, r.reason, r.version, r, stub)


def cmd_restore(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    r = stub.Restore(apb.RankRequest(rank=args.rank), timeout=30.0)
    return _ack(args, r.ok, r.reason, r.version, r, stub)


def cmd_pause(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    r = stub.Pause(apb.Empty(), timeout=30.0)  # a quorum write: the agent answers within ~20 s
    return _ack(args, r.ok, r.reason, r.version, r)


def cmd_resume(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    r = stub.Resume(apb.Empty(), timeout=30.0)
    return _ack(args, r.ok, r.reason, r.version, r)
