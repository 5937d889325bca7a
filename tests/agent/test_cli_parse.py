from __future__ import annotations

import io
import socket
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.cli import main, render
from agent.cli.admin import parse_ops
from agent.cli.connect import CliError
from agent.security import server_credentials, write_dev_certs
from agent.wire import ops_from_pb
from chaos.localcluster import ROOT
from controlplane.ops import Consolidate, Drop, Migrate, Replicate, Swap
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import consensus_pb2 as pb
from elasticmoe.v1 import gossip_pb2 as gpb


def test_parse_ops_round_trip() -> None:
    ops = ops_from_pb(parse_ops(["replicate", "3", "17", "5", ";", "migrate", "0", "4", "1", "2;",
                                 "consolidate", "2", "7,9", "4"]))
    assert ops == (Replicate(3, 17, 5), Migrate(0, 4, 1, 2), Consolidate(2, (7, 9), 4))
    assert ops_from_pb(parse_ops(["swap", "1", "4", "0", "9", "3", ";", "drop", "2", "5", "6"])) == (
        Swap(1, 4, 0, 9, 3), Drop(2, 5, 6))


@pytest.mark.parametrize(("words", "needle"), [
    (["explode", "1"], "'explode'"),
    (["replicate", "1", "2"], "takes 3 arguments"),
    (["migrate", "a", "b", "c", "d"], "must be integers"),
    ([";"], "no operation"),
])
def test_parse_ops_errors(words: list[str], needle: str) -> None:
    with pytest.raises(CliError, match=needle):
        parse_ops(words)


# ---- out-of-range numbers are one argparse line, not a ValueError traceback (issue 17 item 8) ---------

def _closed_port() -> str:
    from chaos.localcluster import free_ports

    return f"127.0.0.1:{free_ports(1)[0]}"


@pytest.mark.parametrize(("argv", "needle"), [
    (["drain", "99999999999"], "argument rank: 99999999999: expected an integer in 0..2147483647"),
    (["restore", "-1"], "argument rank: -1"),
    (["drain", "two"], "argument rank: 'two'"),
    (["history", "--limit", "-1"], "argument --limit: -1: expected an integer in 1..10000"),
    (["history", "--limit", "99999999999"], "argument --limit: 99999999999"),
    (["placement", "--layer", "99999999999"], "argument --layer: 99999999999"),
    (["placement", "--version", "-1"], "argument --version: -1"),
    (["explain", "-5"], "argument version: -5"),
    (["explain", str(2**64)], f"argument version: {2**64}"),
    (["top", "--interval", "nan"], "argument --interval: nan"),
    (["top", "--interval", "-1"], "argument --interval: -1"),
    (["top", "--interval", "inf"], "argument --interval: inf"),
    (["top", "--iterations", "-1"], "argument --iterations: -1"),
])
def test_out_of_range_numbers_are_one_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--agent", _closed_port()])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert e.value.code == 2 and len(errors) == 1 and needle in errors[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("words", [["replicate", "99999999999", "1", "1"], ["migrate", "0", "1", "2", "-3"],
                                   ["consolidate", "0", "1,99999999999", "2"]])
def test_parse_ops_out_of_range(words: list[str]) -> None:
    with pytest.raises(CliError, match="out of range"):
        parse_ops(words)


# ---- what the CLI says when the connection, not the agent, fails ------------------------------------

def _serve(handler: Any, tls_dir: Path | None) -> tuple[grpc.Server, str]:
    srv = grpc.server(futures.ThreadPoolExecutor(2))
    srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("elasticmoe.v1.Admin", {
        "Status": grpc.unary_unary_rpc_method_handler(handler, request_deserializer=apb.StatusRequest.FromString,
                                                      response_serializer=apb.StatusReply.SerializeToString)})])
    creds = None if tls_dir is None else server_credentials(tls_dir, "node1")
    port = srv.add_insecure_port("127.0.0.1:0") if creds is None else srv.add_secure_port("127.0.0.1:0", creds)
    srv.start()
    return srv, f"127.0.0.1:{port}"


def _status(req: apb.StatusRequest, ctx: grpc.ServicerContext) -> apb.StatusReply:
    return apb.StatusReply(node_id="node1", committed_version=1, health="SERVING")


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    write_dev_certs(d, ["node1"], ["admin"])
    return d


def test_plaintext_client_against_a_tls_agent(tls_dir: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMOE_CERT_DIR", raising=False)
    srv, addr = _serve(_status, tls_dir)
    try:
        assert main(["status", "--agent", addr]) == 3  # not reached (exit 3)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and addr in err and "requires TLS" in err and "EMOE_CERT_DIR" in err, err
        monkeypatch.setenv("EMOE_CERT_DIR", str(tls_dir))
        assert main(["status", "--agent", addr]) == 0, capsys.readouterr().err
    finally:
        srv.stop(None)


def test_tls_client_against_a_plaintext_agent(tls_dir: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMOE_CERT_DIR", str(tls_dir))
    srv, addr = _serve(_status, None)
    try:
        assert main(["status", "--agent", addr]) == 3
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "TLS handshake failed" in err, err
    finally:
        srv.stop(None)
    monkeypatch.setenv("EMOE_CERT_DIR", str(tls_dir / "nowhere"))
    assert main(["status", "--agent", addr]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "EMOE_CERT_DIR" in err and "no such file" in err, err


def test_the_agents_own_unavailable_answer_is_kept(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMOE_CERT_DIR", raising=False)

    def not_serving(req: apb.StatusRequest, ctx: grpc.ServicerContext) -> apb.StatusReply:
        ctx.abort(grpc.StatusCode.UNAVAILABLE, "agent node1 is NOT_SERVING: disk full")
        raise AssertionError("abort raises")

    srv, addr = _serve(not_serving, None)
    try:
        assert main(["status", "--agent", addr]) == 1
        err = capsys.readouterr().err
        assert "UNAVAILABLE: agent node1 is NOT_SERVING: disk full" in err and "TLS" not in err, err
    finally:
        srv.stop(None)
    assert main(["status", "--agent", addr]) == 3  # nothing listens there now
    assert "unreachable (connection refused" in capsys.readouterr().err


_SLOW_AGENT = """
import time
from concurrent import futures
import grpc
from elasticmoe.v1 import admin_pb2 as apb

def status(req, ctx):
    print("called", flush=True)
    time.sleep(120)

srv = grpc.server(futures.ThreadPoolExecutor(2))
srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("elasticmoe.v1.Admin", {
    "Status": grpc.unary_unary_rpc_method_handler(status, request_deserializer=apb.StatusRequest.FromString,
                                                  response_serializer=apb.StatusReply.SerializeToString)})])
print(srv.add_insecure_port("127.0.0.1:0"), flush=True)
srv.start()
time.sleep(120)
"""


def test_a_plaintext_agent_killed_mid_call_is_unreachable_not_tls(capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """kill -9 of a plaintext agent while it answers: the connection closes, and then nothing listens. That
    is no reason to suggest TLS."""
    monkeypatch.delenv("EMOE_CERT_DIR", raising=False)
    with subprocess.Popen([sys.executable, "-c", _SLOW_AGENT], cwd=ROOT, stdout=subprocess.PIPE, text=True) as p:
        assert p.stdout is not None
        addr = f"127.0.0.1:{int(p.stdout.readline())}"

        def kill_once_called() -> None:
            assert p.stdout is not None
            if p.stdout.readline().strip() == "called":
                p.kill()

        killer = threading.Thread(target=kill_once_called)
        killer.start()
        try:
            assert main(["status", "--agent", addr]) == 3
        finally:
            p.kill()
            killer.join()
    err = capsys.readouterr().err
    # refused once the process is gone; 'closed' if the probe reached it while the kernel still tore it down
    assert err.count("\n") == 1 and f"agent {addr}: unreachable" in err and ("refuse" in err or "closed" in err), err
    assert "TLS" not in err, err


def test_a_plaintext_listener_that_closes_the_connection_gets_no_tls_hint(capsys: pytest.CaptureFixture[str],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """gRPC reports this exactly as it does a TLS agent called in plaintext ("Socket closed"): what listens
    there is asked, and it does not speak TLS."""
    monkeypatch.delenv("EMOE_CERT_DIR", raising=False)
    lsn = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def close_each() -> None:
        lsn.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = lsn.accept()
            except TimeoutError:
                continue
            conn.close()

    t = threading.Thread(target=close_each)
    t.start()
    try:
        addr = f"127.0.0.1:{lsn.getsockname()[1]}"
        assert main(["status", "--agent", addr]) == 3
    finally:
        stop.set()
        t.join()
        lsn.close()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unreachable (the agent closed the connection" in err and "TLS" not in err, err


# ---- read commands with nothing to show yet say so ---------------------------------------------------

def test_history_of_genesis_only_is_a_sentence(capsys: pytest.CaptureFixture[str]) -> None:
    for entries in ([], [apb.HistoryEntry(version=1, parent=0)]):
        render.history(apb.HistoryReply(entries=entries))
        out = capsys.readouterr().out
        assert out == "no commits since the initial table: nothing has been rebalanced yet\n"


def test_history_never_shortens_names(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "60")
    op = pb.Operation(kind=pb.REPLICATE, layer=1, experts=[3], dst=0, src=-1, rank=-1, source=-1)
    entries = [apb.HistoryEntry(version=3, parent=2, proposer="node1", committed_at_ms=1_700_000_000_000,
                                plan=pb.Plan(ops=[op] * 6, estimated_gain=0.1),
                                votes=[pb.Vote(voter="node1", accept=True)]),
               apb.HistoryEntry(version=1, parent=0)]
    render.history(apb.HistoryReply(entries=entries))
    out = capsys.readouterr().out
    assert "…" not in out and "proposer node1" in out and "votes 1/1" in out and out.count("replicate") == 6
    assert "v1  the initial table" in out


def test_top_without_load_says_so_and_shows_members(capsys: pytest.CaptureFixture[str]) -> None:
    members = [gpb.MemberState(node_id=n, status=gpb.ALIVE) for n in ("node2", "node1")]
    s = apb.StatusReply(node_id="node1", committed_version=1, members=members)
    render.top(s, apb.LoadViewReply(layers=2, experts=4), apb.HistoryReply(), clear=False)
    out = capsys.readouterr().out
    assert "no load has arrived yet" in out and "members: node1 (alive), node2 (alive)" in out
    doc = render.top_json(s, apb.LoadViewReply(), apb.HistoryReply())
    assert doc["load_arrived"] is False and [m["node"] for m in doc["members"]] == ["node1", "node2"]


@pytest.mark.parametrize(("argv", "needle"), [
    (["certs", "--out", "x", "--nodes", "n1", "--days", "99999999999"], "argument --days: 99999999999"),
    (["certs", "--out", "x", "--nodes", "n1", "--days", "0"], "argument --days: 0"),
    # (cases that the old code refused too, in its own way: it started a demo for any larger count)
    (["demo", "--agents", "2"], "argument --agents: 2: expected an integer in 3..64"),
    (["demo", "--window", "0"], "argument --window: 0"),
])
def test_offline_tools_bound_their_numbers(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "Traceback" not in err, err


# ---- a reader that goes away (`emoe status --json | head -1`) ends the command quietly ------------------

class _ClosedPipe(io.StringIO):
    def write(self, s: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_stdout_ends_quietly(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMOE_CERT_DIR", raising=False)
    srv, addr = _serve(_status, None)
    try:
        for argv in (["status", "--json"], ["status"]):
            monkeypatch.setattr(sys, "stdout", _ClosedPipe())
            assert main([*argv, "--agent", addr]) == 141
            monkeypatch.undo()
            assert capsys.readouterr().err == ""
    finally:
        srv.stop(None)


def test_piped_into_a_reader_that_closed_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real process: its stdout is a pipe whose reader has gone when the answer arrives."""
    monkeypatch.delenv("EMOE_CERT_DIR", raising=False)
    gate = threading.Event()

    def status(req: apb.StatusRequest, ctx: grpc.ServicerContext) -> apb.StatusReply:
        gate.wait(30)  # answer only once the reader has closed its end
        return _status(req, ctx)

    srv, addr = _serve(status, None)
    try:
        with subprocess.Popen([sys.executable, "-m", "agent.cli", "status", "--json", "--agent", addr], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:
            assert p.stdout is not None and p.stderr is not None
            p.stdout.close()
            gate.set()
            err = p.stderr.read().decode()
            assert p.wait(timeout=60) == 141 and err == "", err
    finally:
        srv.stop(None)


def test_propose_prints_why_the_proposal_failed(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMOE_CERT_DIR", raising=False)
    why = ("ballot (1, 'node1'): no quorum within 500 ms (1/2): node2: UNAVAILABLE: store failed: write of 358 "
           "bytes at offset 0 failed: No space left on device; no reply from node3")
    srv = grpc.server(futures.ThreadPoolExecutor(2))
    srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("elasticmoe.v1.Admin", {
        "Propose": grpc.unary_unary_rpc_method_handler(
            lambda req, ctx: apb.ProposeReply(committed=False, version=2, reason=why),
            request_deserializer=apb.ProposeRequest.FromString,
            response_serializer=apb.ProposeReply.SerializeToString)})])
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        assert main(["propose", "replicate", "0", "1", "2", "--agent", f"127.0.0.1:{port}"]) == 1
    finally:
        srv.stop(None)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"refused: {why}" in err, err
