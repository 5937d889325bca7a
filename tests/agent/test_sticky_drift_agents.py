"""The config-drift guard is sticky (agent/fingerprint.py), with three real agents in one process on loopback.

node3 runs with top_k = 3 where node1 and node2 run with 2. While all three are up it abstains (a quorum of the
voters holds another fingerprint). Then node2 goes: one fingerprint against one, no quorum on either, and
before the guard was sticky node3 voted again (`v2 ... votes 2/2` by node1 and the drifted node3). Now it goes on
abstaining, against the fingerprint a quorum of the voters last held, and so after its own restart too (kept in
its data_dir): no commit carries its vote, and node1 alone commits nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from agent.config import from_dict
from agent.process import AgentProcess
from chaos.localcluster import free_ports
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import admin_pb2_grpc
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.v1 import gossip_pb2 as gpb

IDS = ["node1", "node2", "node3"]
SHAPE = {"nodes": 3, "ranks_per_node": 2, "slots_per_rank": 4, "layers": 2, "experts": 8, "top_k": 2}
ABSTAINS = "NOT_SERVING: cluster fingerprint differs"


def _agent(tmp: Path, node: str, addrs: dict[str, str]) -> AgentProcess:
    shape = {**SHAPE, "top_k": 3} if node == "node3" else SHAPE
    return AgentProcess(from_dict({
        "node_id": node, "profile": "test", "listen": addrs[node], "seeds": [f"{n}@{a}" for n, a in addrs.items()],
        "data_dir": str(tmp / node / "data"), "shim_socket": str(tmp / node / "shim.sock"), "cluster": shape,
        "consensus": {"accept_timeout_ms": 300}}))


async def _admin(a: AgentProcess, method: str, req: object, timeout: float = 5) -> object:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as ch:
        return await getattr(admin_pb2_grpc.AdminStub(ch), method)(req, timeout=timeout)  # type: ignore[no-untyped-call]


async def _status(a: AgentProcess) -> apb.StatusReply:
    r = await _admin(a, "Status", apb.StatusRequest())
    assert isinstance(r, apb.StatusReply)
    return r


async def _until(what: str, pred: object, limit: float) -> None:
    for _ in range(int(limit / 0.1)):
        if await pred():  # type: ignore[operator]
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{what}: not within {limit} s")


async def _propose(node1: AgentProcess, dst: int) -> str:
    """node1 proposes a forced replica (as `emoe propose --force` does): what came of it, in words."""
    op = cpb.Operation(kind=cpb.REPLICATE, layer=0, experts=[0], dst=dst, src=-1, rank=-1, source=-1)
    try:
        r = await _admin(node1, "Propose", apb.ProposeRequest(ops=[op], force=True), timeout=8)
    except grpc.aio.AioRpcError as e:
        return f"not committed ({e.code().name})"
    assert isinstance(r, apb.ProposeReply)
    return f"committed v{r.version}" if r.committed else f"not committed ({r.reason})"


async def _node3_voted(a: AgentProcess) -> list[str]:
    """The versions in `a`'s history that carry an accepting vote of node3."""
    h = await _admin(a, "History", apb.HistoryRequest(limit=100))
    assert isinstance(h, apb.HistoryReply)
    return [f"v{e.version} votes {[v.voter for v in e.votes if v.accept]}" for e in h.entries
            if any(v.voter == "node3" and v.accept for v in e.votes)]


@pytest.mark.asyncio
async def test_a_drifted_node_abstains_with_a_majority_member_down_and_after_its_restart(tmp_path: Path) -> None:
    addrs = {n: f"127.0.0.1:{p}" for n, p in zip(IDS, free_ports(len(IDS)), strict=True)}
    running: dict[str, AgentProcess] = {}
    try:
        for n in IDS:
            a = _agent(tmp_path, n, addrs)
            await a.start()
            running[n] = a
        node1 = running["node1"]

        async def abstains() -> bool:
            return (await _status(running["node3"])).health.startswith(ABSTAINS)

        await _until("node3 abstains against node1 and node2", abstains, 20.0)
        assert (await _status(node1)).health == "SERVING"

        async def voters() -> bool:  # (a new cluster's voters first learn that none of them ran before)
            return [(await _status(running[n])).role for n in ("node1", "node2")] == ["voter", "voter"]

        await _until("node1 and node2 vote", voters, 20.0)
        outcome = await _propose(node1, 5)  # the cluster commits without node3
        assert outcome.startswith("committed") and not await _node3_voted(node1), outcome

        # node2 goes (a majority member): node1's and node3's fingerprints, one against one
        await running.pop("node2").stop(grace=0.2)

        async def node2_gone() -> bool:
            return not any([await _sees(a, "node2") for a in (node1, running["node3"])])

        await _until("node2 gone at node1 and node3", node2_gone, 10.0)
        await asyncio.sleep(0.5)  # gossip settled: a verdict that follows the live members has followed them
        health = (await _status(running["node3"])).health
        outcome = await _propose(node1, 4)
        voted = await _node3_voted(node1)
        assert health.startswith(ABSTAINS) and "top_k = 3 here, 2" in health and not voted, \
            f"with node2 down the drifted node3 votes again: its health {health!r}; node1's proposal {outcome}; " \
            f"node1's history: {voted}"
        assert outcome.startswith("not committed"), outcome

        # node3 restarts, still drifted, node2 still down: it abstains from the start
        await running.pop("node3").stop(grace=0.2)
        again = _agent(tmp_path, "node3", addrs)
        await again.start()
        running["node3"] = again
        health = (await _status(again)).health
        assert health.startswith(ABSTAINS) and "top_k = 3 here, 2" in health, health
        await _until("node1 and node3 see each other", lambda: _sees(again, "node1"), 10.0)
        outcome = await _propose(node1, 3)
        assert not await _node3_voted(node1) and not await _node3_voted(again), outcome
        assert outcome.startswith("not committed"), outcome
        assert (await _status(again)).health.startswith(ABSTAINS)
    finally:
        for a in reversed(list(running.values())):
            await a.stop(grace=0.2)


async def _sees(a: AgentProcess, node: str) -> bool:
    """Whether `a` holds `node` live (alive or suspect)."""
    return any(m.node_id == node and m.status in (gpb.ALIVE, gpb.SUSPECT) for m in (await _status(a)).members)
