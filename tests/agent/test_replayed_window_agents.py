"""A window of an earlier incarnation, replayed after its node came back at a higher one, is refused (agent/
windowguard.py, Refusal.STALE_INCARNATION), with real agents under mutual TLS on loopback.

node1 (a member, over its own certificate) pulls node2's signed window from node3. node2 stops, its peers reap
it, and it comes back idle (its engine reports nothing) at incarnation 1. node1 then pushes the captured
incarnation-0 window to node1 and node3: it carries node2's genuine signature, is newer than anything they hold
of node2 (nothing), and is not from the future; but it is from node2's previous life. Before the floor, both
held it as node2's newest (and planned on it); now it is refused and counted, and node2's genuine windows at its
new incarnation are taken as before."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from agent.config import from_dict
from agent.process import AgentProcess
from agent.security import secure_channel, write_dev_certs
from chaos.localcluster import free_ports
from elasticmoe.v1 import dataplane_pb2 as dpb
from elasticmoe.v1 import gossip_pb2 as gpb
from elasticmoe.v1 import gossip_pb2_grpc

L, E, W = 4, 8, 10
IDS = ["node1", "node2", "node3"]
SHAPE = {"nodes": 3, "ranks_per_node": 1, "slots_per_rank": 12, "layers": L, "experts": E, "top_k": 2}


def _agent(tmp: Path, certs: Path, node: str, addrs: dict[str, str]) -> AgentProcess:
    return AgentProcess(from_dict({
        "node_id": node, "profile": "test", "listen": addrs[node], "seeds": [f"{n}@{a}" for n, a in addrs.items()],
        "data_dir": str(tmp / node / "data"), "shim_socket": str(tmp / node / "shim.sock"), "cluster": SHAPE,
        "decision": {"window": W}, "gossip": {"dead_reclaim_ms": 1000}, "tls": {"cert_dir": str(certs)}}))


async def _until(what: str, pred: object, limit: float) -> None:
    for _ in range(int(limit / 0.05)):
        if pred():  # type: ignore[operator]
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{what}: not within {limit} s")


def _report(a: AgentProcess, rank: int, k: int) -> None:
    """This node's shim reports window k (W steps from step k x W)."""
    counts = np.full((L, E), 10 * (rank + 1), dtype="<u4")
    a.state.load.on_report(dpb.LoadReport(shim_id=f"s{rank}", rank=rank, first_step=k * W, steps=W, layers=L,
                                          experts=E, counts=counts.tobytes()))


def _held(a: AgentProcess, node: str) -> tuple[int, int] | None:
    """(incarnation, window_seq) of the window `a` holds as `node`'s newest, None when it holds none."""
    g = a.state.gossip
    assert g is not None
    w = g.load._w.get(node)
    return None if w is None else (int(w.incarnation), int(w.window_seq))


def _inc(a: AgentProcess, node: str) -> int | None:
    g = a.state.gossip
    assert g is not None
    m = g.member(node)
    return None if m is None or m.status.value not in ("alive", "suspect") else m.incarnation


async def _as_node1(a: AgentProcess, certs: Path, method: str, req: object) -> object:
    async with secure_channel(f"127.0.0.1:{a.port}", certs, "node1", server_name=a.cfg.node_id) as ch:
        return await getattr(gossip_pb2_grpc.GossipStub(ch), method)(req, timeout=5)


@pytest.mark.asyncio
async def test_a_window_of_node2s_previous_incarnation_replayed_after_it_came_back_is_refused(tmp_path: Path) -> None:
    certs = tmp_path / "tls"
    write_dev_certs(certs, IDS, ["admin"])
    addrs = {n: f"127.0.0.1:{p}" for n, p in zip(IDS, free_ports(len(IDS)), strict=True)}
    agents = {n: _agent(tmp_path, certs, n, addrs) for n in IDS}
    running: dict[str, AgentProcess] = {}
    try:
        for n, a in agents.items():
            await a.start()
            running[n] = a
        node1, node3 = agents["node1"], agents["node3"]
        await _until("all live", lambda: all(len(a.state.gossip.live_nodes()) == 3 for a in running.values()), 15.0)
        for k in (1, 2):
            for i, n in enumerate(IDS):
                _report(agents[n], i, k)
        await _until("node2's window 2 everywhere", lambda: _held(node1, "node2") == _held(node3, "node2") == (0, 2),
                     5.0)

        # node1 captures node2's window (node2's own signature) from node3, as any member may
        reply = await _as_node1(node3, certs, "Pull", gpb.PullRequest(from_node="node1",
                                                                      want=[gpb.Digest(node_id="node2")]))
        assert isinstance(reply, gpb.PullReply)
        (captured,) = reply.windows
        assert (captured.node_id, captured.incarnation, captured.window_seq) == ("node2", 0, 2)
        assert captured.signature and captured.certificate

        # node2 goes, and is reaped by both peers (its window dropped with it)
        await running.pop("node2").stop(grace=0.2)
        await _until("node2 reaped", lambda: all(a.state.gossip.member("node2") is None
                                                 and _held(a, "node2") is None for a in (node1, node3)), 20.0)

        # node2 comes back idle (its engine reports nothing), at a higher incarnation: a member that still
        # held it dead would make it refute; here node1 tells it it is suspect, over node1's certificate
        again = _agent(tmp_path, certs, "node2", addrs)
        await again.start()
        running["node2"] = again
        await _until("node2 live again", lambda: all(_inc(a, "node2") is not None for a in (node1, node3)), 15.0)
        if again.state.gossip.incarnation == 0:
            await _as_node1(again, certs, "Broadcast", gpb.BroadcastRequest(from_node="node1", members=[
                gpb.MemberState(node_id="node2", incarnation=0, status=gpb.SUSPECT, from_node="node1")]))
        await _until("node2 at incarnation 1 everywhere",
                     lambda: all((_inc(a, "node2") or 0) >= 1 for a in (node1, node3)), 10.0)
        assert _held(node1, "node2") is None and _held(node3, "node2") is None

        # the replay: node1 pushes the captured window to node3 and to itself (as a relay would)
        for a in (node3, node1):
            await _as_node1(a, certs, "Push", gpb.PushRequest(from_node="node1", windows=[captured]))
        await asyncio.sleep(1.0)  # a push-pull round or two: had anyone kept it, the others would pull it
        held = {n: _held(a, "node2") for n, a in running.items() if n != "node2"}
        assert all(h != (0, 2) for h in held.values()), \
            f"the replayed incarnation-0 window is held as node2's newest: {held}"

        from agent.gossip.windowguard import Refusal  # (STALE_INCARNATION: a name this change adds)

        for a in (node1, node3):
            g = a.state.gossip
            assert g is not None
            assert g.load.refused[Refusal.STALE_INCARNATION] >= 1, g.load.refused
            assert "incarnation 0" in g.load.refused_why and "'node2'" in g.load.refused_why, g.load.refused_why
            # what /metrics counts (emoe_windows_refused_total{reason="stale_incarnation"})
            assert a.state.view.windows_refused()[Refusal.STALE_INCARNATION.value] >= 1

        # node2's genuine windows at its new incarnation are taken (its engine reports again)
        inc = again.state.gossip.incarnation
        assert inc >= 1
        _report(again, 1, 3)
        await _until("node2's new window everywhere",
                     lambda: _held(node1, "node2") == _held(node3, "node2") == (inc, 3), 5.0)
    finally:
        for a in reversed(list(running.values())):
            await a.stop(grace=0.2)
