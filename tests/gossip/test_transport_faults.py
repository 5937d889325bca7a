"""The gRPC transport's drop hook and the chaos harness's fault file behind it (chaos.faults, chaos.agentproc)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from chaos.faults import FaultFile, write_faults
from chaos.localcluster import free_ports
from elasticmoe.v1 import gossip_pb2 as gpb


def test_fault_file_reads_its_node_entry_and_follows_rewrites(tmp_path: Path) -> None:
    path = str(tmp_path / "faults.json")
    f = FaultFile(path, "a", recheck_s=0.0)
    assert not f.drops("b")  # no file: nothing dropped
    write_faults(path, {"a": ["b", "c"], "b": ["a"]})
    assert f.drops("b") and f.drops("c") and not f.drops("d")
    assert FaultFile(path, "b", recheck_s=0.0).drops("a") and not FaultFile(path, "c", recheck_s=0.0).drops("a")
    write_faults(path, {"a": ["d"]})
    assert not f.drops("b") and f.drops("d")
    Path(path).write_text('{"drop": {"a": "not a list"}}')
    assert not f.drops("d")  # malformed: nothing dropped
    Path(path).unlink()
    assert not f.drops("d")


@pytest.mark.asyncio
async def test_grpc_transport_drops_calls_both_ways_while_the_file_lists_the_peer(tmp_path: Path) -> None:
    from agent.transport.grpc import GrpcTransport

    path = str(tmp_path / "faults.json")
    addrs = {n: f"127.0.0.1:{p}" for n, p in zip("ab", free_ports(2), strict=True)}
    servers, ts = [], {}
    for n in "ab":
        server = grpc.aio.server()
        t = GrpcTransport(n, addrs, drops=FaultFile(path, n, recheck_s=0.0).drops)
        t.serve(lambda src, method, req: gpb.ProbeAck())
        t.attach(server)
        server.add_insecure_port(addrs[n])
        await server.start()
        servers.append(server)
        ts[n] = t

    async def call(src: str, dst: str) -> bool:
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        ts[src].call(dst, "Gossip/Probe", gpb.ProbeRequest(), 0.5, lambda r: fut.set_result(r is not None))
        return await fut

    try:
        assert await call("a", "b") and await call("b", "a")
        write_faults(path, {"a": ["b"]})  # only a's side: a neither calls b nor answers it
        assert not await call("a", "b") and not await call("b", "a")
        write_faults(path, {})
        assert await call("a", "b") and await call("b", "a")
    finally:
        for t in ts.values():
            await t.close()
        for s in servers:
            await s.stop(None)
