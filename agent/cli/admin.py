"""Operator commands against a running agent: status, placement, history, explain, top, propose,
drain, restore, pause, resume. Read commands print rich tables, or JSON with --json. Errors are one line
naming the agent and the reason, with the exit status of agent.cli.exits (1 refused or failed, 2 bad input,
3 the agent could not be reached)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from agent.cli import add_timeout, exits, render
from agent.cli.argtypes import INT32_MAX, UINT64_MAX, float_in, int_in
from agent.cli.connect import CliError, channel, check_address, config_address, rpc_failure
from agent.cli.installwait import ASK_TIMEOUT_S, wait_installed
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import admin_pb2_grpc
from elasticmoe.v1 import consensus_pb2 as cpb

DEFAULT_AGENT = "127.0.0.1:7400"
TIMEOUT_S = 5.0         # per RPC, unless --timeout says otherwise
COMMIT_TIMEOUT_S = 30.0  # propose, drain, restore: the agent answers once the commit is decided
HISTORY_MAX = 10_000


def rpc_timeout(args: argparse.Namespace, default: float = TIMEOUT_S) -> float:
    """Seconds one RPC may take: --timeout, else `default`."""
    t = getattr(args, "timeout", None)
    return float(t) if t else default


def add_agent_options(p: argparse.ArgumentParser) -> None:
    """--agent, --config and --timeout: how a command reaches one agent."""
    p.add_argument("--agent", default=None, metavar="HOST:PORT",
                   help=f"the agent's admin address (default $EMOE_AGENT or {DEFAULT_AGENT})")
    p.add_argument("--config", default=None, metavar="FILE", help="take the agent address from this config's `listen`")
    add_timeout(p)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    def add(name: str, help: str, func: Callable[[argparse.Namespace, admin_pb2_grpc.AdminStub], int],
            read: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        add_agent_options(p)
        if read:
            p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        p.set_defaults(func=lambda a, f=func: _run(a, f))
        return p

    def verbose(p: argparse.ArgumentParser) -> None:
        p.add_argument("-v", "--verbose", action="store_true",
                       help=f"list every operation and candidate (default: a summary past {render.SHORT_OPS} operations)")

    add("status", "members, committed versions and health", cmd_status)
    p = add("placement", "the routing table as a ranks x slots grid", cmd_placement)
    p.add_argument("--layer", type=int_in(-1, INT32_MAX), default=0, help="layer to show (-1: all)")
    p.add_argument("--version", type=int_in(0, UINT64_MAX), default=0,
                   help="table version (default: latest committed)")
    p = add("history", "committed versions with their time, operations, gains and votes", cmd_history)
    p.add_argument("--limit", type=int_in(1, HISTORY_MAX), default=20,
                   help=f"newest commits to show, 1..{HISTORY_MAX} (default 20)")
    verbose(p)
    p = add("explain", "why a version was (or was not) committed", cmd_explain)
    p.add_argument("version", type=int_in(0, UINT64_MAX), nargs="?", default=0,
                   help="version (default: the latest decision)")
    verbose(p)
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
    p.add_argument("--json", action="store_true", help="print the agent's answer as JSON")
    verbose(p)
    for name, help, rank_help in (
            ("drain", "move a rank's experts away, then take it out of service (returns once every active engine "
                      "rank installed the commit)", "the global rank to drain (emoe placement shows ranks by node)"),
            ("restore", "return a drained rank to service with experts on it, planned on the recent load "
                        "(returns once every active engine rank installed the commit)",
             "the global rank to restore (a drained one)")):
        p = add(name, help, cmd_drain if name == "drain" else cmd_restore, read=False)
        p.add_argument("rank", type=int_in(0, INT32_MAX), help=rank_help)
        _install_timeout(p)
        p.add_argument("--json", action="store_true", help="print the agent's answer as JSON")
        verbose(p)
    for name in ("pause", "resume"):
        p = add(name, f"{name} automatic rebalancing cluster-wide (a record committed by a quorum of the voters; "
                      f"exits 1 if it cannot commit)", cmd_pause if name == "pause" else cmd_resume, read=False)
        p.add_argument("--json", action="store_true", help="print the agent's answer as JSON")


def _install_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--install-timeout", type=float_in(0.0, 3600.0), default=None, metavar="S",
                   help="seconds to wait for the engines to install the commit (default: the agent's "
                        "engine.install_lag_s); past it, the ranks that did not are named and the exit is 1")


def _address(args: argparse.Namespace) -> str:
    """The agent to ask: --agent, else --config's `listen` (a wildcard as loopback), else $EMOE_AGENT, else the
    default; CliError (exit 2) for a bad one."""
    if args.agent is not None:
        return check_address(str(args.agent), "--agent")
    if args.config:
        return config_address(args.config)
    if os.environ.get("EMOE_AGENT") is not None:
        return check_address(os.environ["EMOE_AGENT"], "$EMOE_AGENT")
    return DEFAULT_AGENT


def _run(args: argparse.Namespace, func: Callable[[argparse.Namespace, admin_pb2_grpc.AdminStub], int]) -> int:
    from agent.security import TlsFilesError

    try:
        address = _address(args)
    except CliError as e:
        print(f"emoe {args.command}: {e}", file=sys.stderr)
        return e.exit
    try:
        with channel(address) as ch:
            return func(args, admin_pb2_grpc.AdminStub(ch))  # type: ignore[no-untyped-call]
    except TlsFilesError as e:
        print(f"emoe {args.command}: EMOE_CERT_DIR: {e}", file=sys.stderr)
        return exits.USAGE
    except grpc.RpcError as e:
        what, status = rpc_failure(e, address)
        print(f"emoe {args.command}: {what}", file=sys.stderr)
        return status
    except CliError as e:
        print(f"emoe {args.command}: agent {address}: {e}", file=sys.stderr)
        return e.exit


def _doc(msg: Any) -> dict[str, Any]:
    doc: dict[str, Any] = MessageToDict(msg, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True)
    return doc


def _dump(msg: Any) -> None:
    print(json.dumps(_doc(msg), indent=2, sort_keys=True))


def _show(args: argparse.Namespace, reply: Any, human: Callable[[Any], None]) -> int:
    """Print a read command's reply as JSON (--json) or through its human renderer."""
    if args.json:
        _dump(reply)
    else:
        human(reply)
    return exits.OK


def cmd_status(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    return _show(args, stub.Status(apb.StatusRequest(), timeout=rpc_timeout(args)), render.status)


def cmd_placement(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    r = stub.Placement(apb.PlacementRequest(layer=args.layer, version=args.version), timeout=rpc_timeout(args))
    if args.json:
        print(json.dumps(render.placement_json(r, args.layer), indent=2))
    else:
        render.placement(r, args.layer)
    return exits.OK


def cmd_history(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    r = stub.History(apb.HistoryRequest(limit=args.limit), timeout=rpc_timeout(args))
    return _show(args, r, partial(render.history, verbose=args.verbose))


def cmd_explain(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    try:
        r = stub.Explain(apb.ExplainRequest(version=args.version), timeout=rpc_timeout(args))
    except grpc.RpcError as e:
        # no decision at all yet is not an error of the read: say plainly what it waits for, as text or JSON
        if args.version == 0 and e.code() == grpc.StatusCode.NOT_FOUND:
            if args.json:
                print(json.dumps({"version": "0", "outcome": "NO_DECISION", "detail": e.details()}, indent=2,
                                 sort_keys=True))
            else:
                print(e.details())
            return exits.OK
        raise
    return _show(args, r, partial(render.explain, verbose=args.verbose))


def cmd_top(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    n = 0
    t = rpc_timeout(args)
    while True:
        status = stub.Status(apb.StatusRequest(), timeout=t)
        view = stub.LoadView(apb.LoadViewRequest(), timeout=t)
        hist = stub.History(apb.HistoryRequest(limit=5), timeout=t)
        n += 1
        if args.json:
            print(json.dumps(render.top_json(status, view, hist)), flush=True)
        else:
            render.top(status, view, hist, clear=args.iterations != 1)
        if args.iterations and n >= args.iterations:
            return exits.OK
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
         stub: admin_pb2_grpc.AdminStub | None = None, summarise: bool = False) -> int:
    """Print a mutating call's answer; with `stub`, first wait until the engines installed `version`; with
    `summarise`, say in text what the commit changed (its operations, summarised unless --verbose)."""
    state = None
    if ok and stub is not None:
        t = rpc_timeout(args)
        state, waited = wait_installed(lambda: stub.Status(apb.StatusRequest(), timeout=t),
                                       partial(_ask_status, timeout=rpc_timeout(args, ASK_TIMEOUT_S)),
                                       version, args.install_timeout)
    if args.json:
        doc = _doc(msg)
        if state is not None:
            doc["install"] = state.as_dict()
        print(json.dumps(doc, indent=2, sort_keys=True))
    elif ok:
        print(f"ok: version {version}" + (f" ({reason})" if reason else ""))
        if summarise and stub is not None:
            _print_change(args, stub, version)
        if state is not None and state.done:
            print(f"installed: {state.summary()}")
    if not ok:
        raise CliError(f"refused: {reason}")
    if state is not None and not state.done:
        raise CliError(state.failure(waited))
    return exits.OK


def _print_change(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub, version: int) -> None:
    """The operations of the committed `version` (best effort: the commit stands whatever this read says)."""
    try:
        r = stub.Explain(apb.ExplainRequest(version=version), timeout=rpc_timeout(args))
    except grpc.RpcError:
        return
    for line in render.op_lines(r.plan.ops, r.copy_bytes, args.verbose):
        print(f"  {line}")


def _ask_status(address: str, timeout: float = ASK_TIMEOUT_S) -> apb.StatusReply:
    """Another member's agent's Status (its own engine ranks), at its gossip address."""
    with channel(address) as ch:
        reply: apb.StatusReply = admin_pb2_grpc.AdminStub(ch).Status(  # type: ignore[no-untyped-call]
            apb.StatusRequest(), timeout=timeout)
        return reply


def cmd_propose(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    try:
        ops = parse_ops(args.op)
    except CliError as e:
        print(f"emoe propose: {e}", file=sys.stderr)
        return exits.USAGE
    r = stub.Propose(apb.ProposeRequest(ops=ops, force=args.force), timeout=rpc_timeout(args, COMMIT_TIMEOUT_S))
    return _ack(args, r.committed, r.reason, r.version, r, stub if args.wait else None)


def cmd_drain(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    r = stub.Drain(apb.RankRequest(rank=args.rank), timeout=rpc_timeout(args, COMMIT_TIMEOUT_S))
    return _ack(args, r.ok, r.reason, r.version, r, stub, summarise=True)


def cmd_restore(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    r = stub.Restore(apb.RankRequest(rank=args.rank), timeout=rpc_timeout(args, COMMIT_TIMEOUT_S))
    return _ack(args, r.ok, r.reason, r.version, r, stub, summarise=True)


def admin_metadata() -> tuple[tuple[str, str], ...]:
    """Who this operator says they are, for the record a pause or resume writes: $EMOE_IDENTITY, else the login
    name. Only a plaintext agent reads it (unchecked: plaintext has no identities); under mTLS the agent names
    the CN of the admin certificate it verified instead."""
    import getpass

    from agent.admin.admin import ADMIN_KEY
    from agent.consensus.control import MAX_ADMIN

    name = os.environ.get("EMOE_IDENTITY", "")
    if not name:
        try:
            name = getpass.getuser()
        except (OSError, KeyError):  # no login name (a container without a passwd entry)
            name = ""
    name = "".join(ch for ch in name if " " <= ch <= "~")[:MAX_ADMIN]  # printable ASCII: a gRPC metadata value
    return ((ADMIN_KEY, name),) if name else ()


def cmd_pause(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    r = stub.Pause(apb.Empty(), timeout=rpc_timeout(args, 30.0),  # a quorum write: the agent answers within ~20 s
                   metadata=admin_metadata())
    return _ack(args, r.ok, r.reason, r.version, r)


def cmd_resume(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> int:
    r = stub.Resume(apb.Empty(), timeout=rpc_timeout(args, 30.0), metadata=admin_metadata())
    return _ack(args, r.ok, r.reason, r.version, r)
