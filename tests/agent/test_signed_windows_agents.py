"""Three real agents (AgentProcess: the gRPC server, gossip, consensus, store) in one process on loopback under
mutual TLS, with certificates from `write_dev_certs`. A gossip Push made over node1's own client certificate,
carrying a load window "for node2" (incarnation 10^9, window_seq 10^12, signed with node1's key, or not at all),
is refused and counted by the agents that receive it, and node2's genuine windows keep flowing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from agent.config import from_dict
from agent.gossip.windowguard import Refusal, window_payload
from agent.process import AgentProcess
from agent.security import secure_channel, write_dev_certs
from chaos.localcluster import free_ports
from elasticmoe.v1 import dataplane_pb2 as dpb
from elasticmoe.v1 import gossip_pb2 as gpb
from elasticmoe.v1 import gossip_pb2_grpc

L, E, W = 4, 8, 10
IDS = ["node1", "node2", "node3"]
SHAPE = {"nodes": 3, "ranks_per_node": 1, "slots_per_rank": 12, "layers": L, "experts": E, "top_k": 2}


def _agents(tmp: Path, certs: Path) -> list[AgentProcess]:
    addrs = [f"127.0.0.1:{p}" for p in free_ports(len(IDS))]
    seeds = [f"{n}@{a}" for n, a in zip(IDS, addrs, strict=True)]
    return [AgentProcess(from_dict({
        "node_id": n, "profile": "test", "listen": a, "seeds": seeds, "data_dir": str(tmp / n / "data"),
        "shim_socket": str(tmp / n / "shim.sock"), "cluster": SHAPE, "decision": {"window": W},
        "tls": {"cert_dir": str(certs)}}))
        for n, a in zip(IDS, addrs, strict=True)]


async def _until(pred: object, limit: float) -> None:
    for _ in range(int(limit / 0.02)):
        if pred():  # type: ignore[operator]
            return
        await asyncio.sleep(0.02)
    raise TimeoutError(f"not within {limit} s")


def _report(agents: list[AgentProcess], k: int) -> None:
    """Every node's shim reports window k (W steps from step k x W)."""
    for i, a in enumerate(agents):
        counts = np.full((L, E), 10 * (i + 1), dtype="<u4")
        a.state.load.on_report(dpb.LoadReport(shim_id=f"s{i}", rank=i, first_step=k * W, steps=W, layers=L,
                                              experts=E, counts=counts.tobytes()))


def _seq_of(a: AgentProcess, node: str) -> int:
    g = a.state.gossip
    assert g is not None
    w = g.load._w.get(node)
    return -1 if w is None else int(w.window_seq)


@pytest.mark.asyncio
async def test_a_window_for_node2_pushed_with_node1s_certificate_is_refused(tmp_path: Path) -> None:
    certs = tmp_path / "tls"
    write_dev_certs(certs, IDS, ["admin"])
    agents = _agents(tmp_path, certs)
    started: list[AgentProcess] = []
    try:
        for a in agents:
            await a.start()
            started.append(a)
        await _until(lambda: all(len(a.state.gossip.live_nodes()) == 3
                                 for a in agents), 15.0)
        _report(agents, 1)
        await _until(lambda: all(_seq_of(a, n) == 1 for a in agents for n in IDS if n != a.cfg.node_id), 5.0)

        # node1 speaks for node2 over its own certificate, to node3 (and to itself, as a relay would)
        node1 = agents[0].state.gossip
        assert node1 is not None
        bogus = gpb.LoadWindow(node_id="node2", incarnation=10**9, window_seq=10**12, layers=L, experts=E,
                               counts=np.full((L, E), 10**6, dtype="<u4").tobytes(), steps=W, first_step=0)
        signer = node1.load.guard.signer
        assert signer is not None
        signed = gpb.LoadWindow()
        signed.CopyFrom(bogus)
        signed.signature = signer.sign_window(window_payload(signed))
        signed.certificate = signer.cert_der
        for a in (agents[2], agents[0]):
            async with secure_channel(f"127.0.0.1:{a.port}", certs, "node1", server_name=a.cfg.node_id) as ch:
                stub = gossip_pb2_grpc.GossipStub(ch)
                for w in (signed, bogus):
                    await stub.Push(gpb.PushRequest(from_node="node1", windows=[w]), timeout=5)
        for a in (agents[2], agents[0]):
            g = a.state.gossip
            assert g is not None
            assert g.load.refused[Refusal.BAD_SIGNATURE] == 1 and g.load.refused[Refusal.UNSIGNED] == 1
            assert "'node2'" in g.load.refused_why and "is not signed" in g.load.refused_why  # the last one
            assert _seq_of(a, "node2") == 1

        # node2's genuine windows keep flowing, as Pull shows to any member
        for k in range(2, 5):
            _report(agents, k)
        await _until(lambda: _seq_of(agents[2], "node2") == 4 and _seq_of(agents[0], "node2") == 4, 5.0)
        async with secure_channel(f"127.0.0.1:{agents[2].port}", certs, "node1", server_name="node3") as ch:
            reply = await gossip_pb2_grpc.GossipStub(ch).Pull(
                gpb.PullRequest(from_node="node1", want=[gpb.Digest(node_id="node2")]), timeout=5)
        assert [(w.node_id, w.window_seq) for w in reply.windows] == [("node2", 4)]
        assert reply.windows[0].certificate == agents[1].state.gossip.load.guard.signer.cert_der
        assert all(sum(a.state.gossip.load.refused.values()) == 0 for a in (agents[1],))
    finally:
        for a in reversed(started):
            await a.stop(grace=0.2)
