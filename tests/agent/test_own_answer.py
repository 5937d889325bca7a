"""The agent's own UNAVAILABLE answer (STARTING, NOT_SERVING) is told from the transport's by a code in the call's
trailing metadata (agent.admin.answer), not by its words (issue 50, typed outcomes): the CLI exits 1 for the
first (the agent answered) and 3 for the second (nothing answered). An agent of a release before the code is
told by its words, in the one adapter."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import grpc.aio
import pytest

from agent.admin.admin import AdminService
from agent.admin.answer import ANSWER_KEY, NOT_SERVING
from agent.cli import exits, main
from agent.cli.connect import rpc_failure
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import admin_pb2_grpc


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, detail: str, trailing: Sequence[tuple[str, str]] = ()) -> None:
        self._code, self._detail, self._trailing = code, detail, tuple(trailing)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._detail

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing


def test_the_code_decides_not_the_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMOE_CERT_DIR", raising=False)
    addr = "127.0.0.1:1"
    # the agent's own answer, whatever its words say
    what, status = rpc_failure(_Failed(grpc.StatusCode.UNAVAILABLE, "node1 cannot serve yet",
                                       [(ANSWER_KEY, NOT_SERVING)]), addr)
    assert status == exits.FAILED and what == f"agent {addr}: UNAVAILABLE: node1 cannot serve yet", what
    # the same words with no code and no metadata at all: the transport's (nothing answered)
    _, status = rpc_failure(_Failed(grpc.StatusCode.UNAVAILABLE, "node1 cannot serve yet"), addr)
    assert status == exits.UNREACHABLE
    # metadata of another kind is not the code, and then the words are not read either
    _, status = rpc_failure(_Failed(grpc.StatusCode.UNAVAILABLE, "agent node1 is STARTING", [("other", "x")]), addr)
    assert status == exits.UNREACHABLE
    # an agent of a release before the code: its words, "agent X is ...", in the one adapter
    _, status = rpc_failure(_Failed(grpc.StatusCode.UNAVAILABLE, "agent node1 is NOT_SERVING: disk full"), addr)
    assert status == exits.FAILED


@pytest.mark.asyncio
async def test_a_starting_agent_answers_with_the_code(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMOE_CERT_DIR", raising=False)
    srv = grpc.aio.server()
    admin_pb2_grpc.add_AdminServicer_to_server(AdminService("node1"), srv)  # not bound yet: STARTING
    addr = f"127.0.0.1:{srv.add_insecure_port('127.0.0.1:0')}"
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(addr) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await admin_pb2_grpc.AdminStub(ch).Status(apb.StatusRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and e.value.details() == "agent node1 is STARTING"
        assert (ANSWER_KEY, NOT_SERVING) in tuple(e.value.trailing_metadata() or ()), e.value.trailing_metadata()
        assert await asyncio.to_thread(main, ["status", "--agent", addr]) == exits.FAILED
        assert "UNAVAILABLE: agent node1 is STARTING" in capsys.readouterr().err
    finally:
        await srv.stop(None)
