"""The CLI without surprises (issue 33): one exit-status scheme on every command (agent.cli.exits), bad
addresses named before dialing, help on every command and argument, --version and --timeout."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from agent.cli import build_parser, commands, main, package_version
from agent.cli.connect import check_address
from chaos.localcluster import free_ports
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import consensus_pb2 as cpb

Handler = Callable[[Any, grpc.ServicerContext], Any]


def _serve(handlers: dict[str, Handler]) -> tuple[grpc.Server, str]:
    """A stand-in Admin service answering `handlers` (method name -> function) on loopback."""
    service = apb.DESCRIPTOR.services_by_name["Admin"]
    table = {}
    for name, fn in handlers.items():
        m = service.methods_by_name[name]
        req = getattr(apb, m.input_type.name)
        rep = getattr(apb, m.output_type.name)
        table[name] = grpc.unary_unary_rpc_method_handler(fn, request_deserializer=req.FromString,
                                                          response_serializer=rep.SerializeToString)
    srv = grpc.server(futures.ThreadPoolExecutor(4))
    srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("elasticmoe.v1.Admin", table)])
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    return srv, f"127.0.0.1:{port}"


def _abort(code: grpc.StatusCode, detail: str) -> Handler:
    def fn(req: Any, ctx: grpc.ServicerContext) -> Any:
        ctx.abort(code, detail)

    return fn


def _status(req: Any, ctx: grpc.ServicerContext) -> apb.StatusReply:
    return apb.StatusReply(node_id="node1", committed_version=3, health="SERVING")


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[dict[str, Handler]], str]]:
    monkeypatch.delenv("EMOE_CERT_DIR", raising=False)
    monkeypatch.delenv("EMOE_AGENT", raising=False)
    servers: list[grpc.Server] = []

    def start(handlers: dict[str, Handler]) -> str:
        srv, addr = _serve(handlers)
        servers.append(srv)
        return addr

    yield start
    for s in servers:
        s.stop(None)


def _one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("emoe")]
    assert len(lines) == 1, err
    return lines[0]


# ---- the exit-status scheme ---------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "handlers", "status", "needle"), [
    (["status"], {"Status": _status}, 0, ""),
    # the agent answered: what was asked does not exist or is refused -> 1
    (["placement", "--version", "99"], {"Placement": _abort(grpc.StatusCode.NOT_FOUND, "version 99 unknown")},
     1, "version 99 unknown"),
    (["explain", "7"], {"Explain": _abort(grpc.StatusCode.NOT_FOUND, "no decision recorded for version 7")},
     1, "no decision recorded"),
    (["explain", "7", "--json"], {"Explain": _abort(grpc.StatusCode.NOT_FOUND, "no decision recorded")}, 1,
     "no decision recorded"),
    (["status"], {"Status": _abort(grpc.StatusCode.UNAVAILABLE, "agent node1 is NOT_SERVING: disk full")}, 1,
     "NOT_SERVING"),
    (["drain", "3"], {"Drain": _abort(grpc.StatusCode.PERMISSION_DENIED, "caller ipv4:10.0.0.9: not an admin")},
     1, "PERMISSION_DENIED"),
    (["restore", "3"], {"Restore": lambda r, c: apb.AdminAck(ok=False, reason="rank 3 is already active")}, 1,
     "refused: rank 3 is already active"),
    # the agent calls the request invalid -> 2, as a bad argument found by the CLI itself
    (["placement", "--layer", "40"], {"Placement": _abort(grpc.StatusCode.INVALID_ARGUMENT, "layer 40: expected")},
     2, "INVALID_ARGUMENT"),
    (["propose", "replicate", "0", "99", "1"],
     {"Propose": _abort(grpc.StatusCode.INVALID_ARGUMENT, "ops[0].expert = 99: expected 0..63")}, 2, "expert = 99"),
    (["propose", "explode", "1"], {}, 2, "'explode'"),
])
def test_exit_status_by_what_happened(agent: Callable[[dict[str, Handler]], str], argv: list[str],
                                      handlers: dict[str, Handler], status: int, needle: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    addr = agent(handlers)
    assert main([*argv, "--agent", addr]) == status
    err = capsys.readouterr().err
    if status:
        assert needle in _one_line(err)
    else:
        assert err == ""


def test_unreachable_agent_exits_3(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMOE_CERT_DIR", raising=False)
    addr = f"127.0.0.1:{free_ports(1)[0]}"
    for argv in (["status"], ["history", "--json"], ["explain"], ["explain", "--json"], ["drain", "1"],
                 ["top", "--iterations", "1"], ["pause"]):
        assert main([*argv, "--agent", addr]) == 3, argv
        assert "unreachable (connection refused" in _one_line(capsys.readouterr().err)


def test_explain_before_any_decision_is_0_as_text_and_as_json(agent: Callable[[dict[str, Handler]], str],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    why = "no decision yet on agent node1 (head is version 1): no load has arrived from an engine's shim"
    addr = agent({"Explain": _abort(grpc.StatusCode.NOT_FOUND, why)})
    assert main(["explain", "--agent", addr]) == 0
    assert capsys.readouterr().out == why + "\n"
    assert main(["explain", "--json", "--agent", addr]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"version": "0", "outcome": "NO_DECISION", "detail": why}


# ---- --timeout: seconds for each RPC --------------------------------------------------------------------

def test_timeout_bounds_each_rpc(agent: Callable[[dict[str, Handler]], str], capsys: pytest.CaptureFixture[str]) -> None:
    def slow(req: Any, ctx: grpc.ServicerContext) -> apb.StatusReply:
        time.sleep(3)
        return _status(req, ctx)

    addr = agent({"Status": slow})
    for argv in (["--timeout", "0.3", "status", "--agent", addr], ["status", "--agent", addr, "--timeout", "0.3"]):
        t0 = time.monotonic()
        assert main(argv) == 3
        assert time.monotonic() - t0 < 2.5
        assert "no answer in time" in _one_line(capsys.readouterr().err)
    assert main(["--timeout", "5", "status", "--agent", addr]) == 0  # long enough


@pytest.mark.parametrize("value", ["0", "-1", "nan", "x"])
def test_bad_timeout_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--timeout", value, "status"], ["status", "--timeout", value]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "argument --timeout" in capsys.readouterr().err


# ---- addresses are checked before dialing ----------------------------------------------------------------

@pytest.mark.parametrize("address", ["127.0.0.1", ":99999", ":7400", "127.0.0.1:0", "127.0.0.1:65536", "host:port",
                                     "::1:7400", "[::1]", "a b:7400", "", "unix:/tmp/x.sock"])
def test_bad_addresses_are_named_not_dialed(address: str, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["status", "--agent", address]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"bad address {address!r} (--agent)" in line and "HOST:PORT" in line and "refused" not in line
    monkeypatch.setenv("EMOE_AGENT", address)
    assert main(["history"]) == 2
    assert f"bad address {address!r} ($EMOE_AGENT)" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("address", ["127.0.0.1:7400", "localhost:1", "[::1]:7400", "gpu-node-1.example:65535"])
def test_good_addresses_pass(address: str) -> None:
    assert check_address(address, "--agent") == address


# ---- help, version -----------------------------------------------------------------------------------------

def test_every_command_and_argument_has_help() -> None:
    parser = build_parser()
    missing = []
    for cmd, help_text in [(parser, parser.description or ""), *commands(parser)]:
        if not help_text or not cmd.description:
            missing.append(f"{cmd.prog}: no help")
        for a in cmd._actions:
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help:
                missing.append(f"{cmd.prog} {'/'.join(a.option_strings) or a.dest}: no help")
    assert not missing, missing


def test_drain_help_says_what_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["drain", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "Move a rank's experts away" in out and "the global rank to drain" in out and "exit status:" in out


def test_version_is_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"emoe {version('elasticmoe')}\n" == f"emoe {package_version()}\n"


def test_a_drain_summarises_what_it_committed(agent: Callable[[dict[str, Handler]], str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The drain's own answer, then its commit's operations: a summary of 130 migrations, not 130 of them."""
    ops = [cpb.Operation(kind=cpb.MIGRATE, layer=lay, experts=[27 + k], src=5, dst=[4, 7, 1, 2, 8][k], rank=-1,
                         source=-1) for lay in range(26) for k in range(5)]
    ops.append(cpb.Operation(kind=cpb.DRAIN, layer=-1, src=-1, dst=-1, rank=5, source=-1))
    addr = agent({
        "Drain": lambda r, c: apb.AdminAck(ok=True, reason="drain r5", version=2),
        "Explain": lambda r, c: apb.ExplainReply(version=2, plan=cpb.Plan(ops=ops), copy_bytes=130 * 17_301_504),
        "Status": lambda r, c: apb.StatusReply(node_id="node1", committed_version=2, health="SERVING"),
    })
    assert main(["drain", "5", "--agent", addr]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "ok: version 2 (drain r5)"
    assert out[1] == "  131 operations: 130 migrate, 1 drain; copies 2.2 GB; ranks touched: 1-2, 4-5, 7-8"
    assert out[2].startswith("  first: migrate L0 E27 r5 -> r4; ") and out[2].endswith("(--verbose lists all 131)")
    assert len(out) == 4 and out[3].startswith("installed: ")
    assert main(["drain", "5", "--agent", addr, "--verbose"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum(1 for x in out if x.startswith("  migrate ")) == 130 and "  drain r5" in out
