"""ConsensusNode over real gRPC on loopback (GrpcTransport on grpc.aio servers) with fsync'd Stores."""

from __future__ import annotations

import asyncio
import random
import socket
from pathlib import Path

import grpc
import pytest

from agent.clock import RealClock
from agent.config import ConsensusConfig
from agent.consensus.node import ConsensusNode, Outcome
from agent.consensus.paxos import round0_owner
from agent.storage.store import Store
from agent.transport.grpc import GrpcTransport
from bench.consensus_serve import parse_peers
from chaos.quorumsim import successor_table
from controlplane.table import initial_table
from controlplane.topology import Topology
from elasticmoe.v1 import consensus_pb2 as pb


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_parse_peers() -> None:
    assert parse_peers("a@127.0.0.1:1,b@h:2") == {"a": "127.0.0.1:1", "b": "h:2"}
    with pytest.raises(SystemExit, match="node_id@host:port"):
        parse_peers("a127.0.0.1:1")


@pytest.mark.asyncio
async def test_three_nodes_commit_over_grpc_and_a_restart_catches_up(tmp_path: Path) -> None:
    ids = ["a", "b", "c"]
    addrs = {n: f"127.0.0.1:{p}" for n, p in zip(ids, free_ports(3), strict=True)}
    g = initial_table(Topology(2, 4, 4), 3, 16)
    cfg = ConsensusConfig(accept_timeout_ms=500, sync_interval_ms=100)
    servers: dict[str, grpc.aio.Server] = {}
    transports: dict[str, GrpcTransport] = {}
    nodes: dict[str, ConsensusNode] = {}

    async def boot(n: str) -> None:
        server = grpc.aio.server()
        t = GrpcTransport(n, addrs)
        t.attach(server)
        server.add_insecure_port(addrs[n])
        await server.start()
        servers[n], transports[n] = server, t
        nodes[n] = ConsensusNode(n, ids, Store(tmp_path / n / "consensus.log"), RealClock(), t, cfg, g)
        nodes[n].start()

    async def halt(n: str) -> None:
        nodes[n].stop()
        await transports[n].close()
        await servers[n].stop(0)

    async def propose_next(rng: random.Random) -> Outcome:
        head = max((x.head for x in nodes.values() if x.running), key=lambda t: t.version)
        owner = nodes[round0_owner(head.version + 1, ids)]
        if not owner.running or owner.head.version != head.version:
            owner = next(x for x in nodes.values() if x.running and x.head.version == head.version)
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        owner.propose(successor_table(owner.head, rng), pb.Plan(trigger="test"), fut.set_result)
        return await asyncio.wait_for(fut, 10)

    async def settle(version: int) -> None:
        for _ in range(200):
            if all(x.head.version == version for x in nodes.values() if x.running):
                return
            await asyncio.sleep(0.02)

    for n in ids:
        await boot(n)
    rng = random.Random(3)
    try:
        for _ in range(3):
            out = await propose_next(rng)
            assert out.committed, out.reason
        await settle(4)
        assert {x.head.version for x in nodes.values()} == {4}
        await halt("c")  # c misses two versions, then restarts from its file and catches up
        for _ in range(2):
            out = await propose_next(rng)
            assert out.committed, out.reason
        await boot("c")
        assert nodes["c"].head.version == 4
        await settle(6)
        assert {x.head.version for x in nodes.values()} == {6}
        assert len({x.head.digest for x in nodes.values()}) == 1
        assert [c.table.version for c in nodes["c"].commits_since(1)] == [2, 3, 4, 5, 6]
    finally:
        for n in list(nodes):
            if nodes[n].running:
                await halt(n)
