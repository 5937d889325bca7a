"""EtcdBackend against a real etcd server started on free loopback ports (skipped without the binary)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from agent.consensus.node import Outcome
from agent.etcd.etcd_backend import EtcdBackend, parse_endpoint
from agent.storage.store import Store
from chaos.etcdserver import EtcdProcess
from chaos.quorumsim import successor_table
from controlplane.table import RoutingTable, initial_table
from controlplane.topology import Topology
from elasticmoe.v1 import consensus_pb2 as pb


@pytest.fixture(scope="module")
def etcd(etcd_server: EtcdProcess) -> str:
    return etcd_server.endpoint


def genesis() -> RoutingTable:
    return initial_table(Topology(2, 2, 4), 2, 8)


async def until(what: str, ok: Any, timeout: float = 20.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if ok():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_parse_endpoint() -> None:
    assert parse_endpoint("http://127.0.0.1:2379") == ("127.0.0.1", 2379)
    with pytest.raises(ValueError, match="host:port"):
        parse_endpoint("localhost")


@pytest.mark.asyncio
async def test_commit_learn_and_compare_and_swap(etcd: str, tmp_path: Path) -> None:
    g = genesis()
    a = EtcdBackend([etcd], "a", g, cluster="cas", store=Store(tmp_path / "a.log"))
    b = EtcdBackend([etcd], "b", g, cluster="cas")
    seen: list[int] = []
    b.on_commit(lambda c, t: seen.append(t.version))
    a.start()
    b.start()
    try:
        await a.ready()
        await b.ready()
        rng = random.Random(1)
        t2 = successor_table(a.head, rng)
        out = await a.propose_async(t2, pb.Plan(trigger="test"))
        assert out.committed and out.version == 2 and out.commit is not None
        assert out.commit.qc.table_hash == t2.digest
        # two proposals race for version 3: the transaction lets exactly one through
        t3a, t3b = successor_table(a.head, rng), successor_table(a.head, rng)
        for _ in range(200):
            if b.head.version == 2:
                break
            await asyncio.sleep(0.01)
        assert b.head.version == 2 and b.head.digest == t2.digest
        outs: list[Outcome] = list(await asyncio.gather(a.propose_async(t3a, pb.Plan()), b.propose_async(t3b, pb.Plan())))
        assert sorted(o.committed for o in outs) == [False, True]
        loser = next(o for o in outs if not o.committed)
        assert "committed another table" in loser.reason
        for _ in range(200):
            if a.head.version == b.head.version == 3:
                break
            await asyncio.sleep(0.01)
        assert a.head.digest == b.head.digest
        assert seen == [2, 3]
        # a stale proposal is refused locally, naming the expected version
        stale = await b.propose_async(t2, pb.Plan())
        assert not stale.committed and "expected version 4" in stale.reason
    finally:
        await a.close()
        await b.close()
    # the local store kept what was installed: a restarted backend resumes at version 3
    rec = Store(tmp_path / "a.log").open()
    assert [c.table.version for c in rec.commits] == [2, 3]


@pytest.mark.asyncio
async def test_seed_discovery_with_leases(etcd: str) -> None:
    g = genesis()
    a = EtcdBackend([etcd], "a", g, cluster="disc")
    b = EtcdBackend([etcd], "b", g, cluster="disc")
    a.start()
    b.start()
    try:
        await a.register("127.0.0.1:7401", ttl=5)
        await b.register("127.0.0.1:7402", ttl=5)
        assert await a.members() == {"a": "127.0.0.1:7401", "b": "127.0.0.1:7402"}
        await b.close()  # revokes its lease: its key goes with it
        assert await a.members() == {"a": "127.0.0.1:7401"}
    finally:
        await a.close()
        await b.close()


@pytest.mark.asyncio
async def test_unreachable_endpoint_is_named() -> None:
    a = EtcdBackend(["127.0.0.1:1"], "a", genesis(), timeout=1.0)
    with pytest.raises(ConnectionError, match="127.0.0.1"):
        await a._connect()


@pytest.mark.asyncio
async def test_waits_for_etcd_and_reconnects(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """etcd down when the backend starts: it retries with backoff, logging each attempt at WARNING (the endpoint
    and the next delay, no traceback) and saying why in `failure`; once etcd serves it connects and commits;
    etcd killed mid-run: `failure` says so, proposals are refused; etcd back: it reconnects and commits again."""
    import logging
    import shutil

    from chaos.localcluster import stable_ports

    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd binary not found (Debian: apt-get install etcd-server, or `make etcd`)")
    client, peer = stable_ports(2)  # below the ephemeral range: no outgoing connection takes them while it is down
    server = EtcdProcess(binary, str(tmp_path / "etcd"), ports=(client, peer), start=False)
    caplog.set_level(logging.WARNING, logger="agent.etcd.etcd_backend")
    a = EtcdBackend([server.endpoint], "a", genesis(), cluster="later", timeout=2.0)
    a.start()
    rng = random.Random(3)

    try:
        await until("two failed attempts", lambda: len(caplog.records) >= 2)
        assert "no etcd endpoint reachable" in a.failure and server.endpoint in a.failure
        first, second = caplog.records[:2]
        assert server.endpoint in first.getMessage() and "retrying in 0.5 s" in first.getMessage()
        assert "retrying in 1.0 s" in second.getMessage()  # backoff
        assert all(r.levelno == logging.WARNING and r.exc_info is None for r in caplog.records)
        refused = await a.propose_async(successor_table(a.head, rng), pb.Plan())
        # refused as the node abstains (no session: agent.commit.CommitBackend.abstains), naming the endpoint
        assert not refused.committed and "no etcd endpoint reachable" in refused.reason
        assert server.endpoint in refused.reason

        server.start()
        await until("connected", lambda: a.failure == "")
        out = await a.propose_async(successor_table(a.head, rng), pb.Plan())
        assert out.committed and out.version == 2

        server.stop()
        await until("the lost connection noticed", lambda: a.failure != "")
        assert "lost the connection to etcd" in a.failure or "no etcd endpoint reachable" in a.failure
        server.start()
        await until("reconnected", lambda: a.failure == "")
        out = await a.propose_async(successor_table(a.head, rng), pb.Plan())
        assert out.committed and out.version == 3, out.reason
    finally:
        await a.close()
        server.stop()


async def _wipe(endpoint: str, cluster: str) -> None:
    """What a wiped etcd (or one restored from a backup older than the cluster) holds of `cluster`: nothing."""
    import aetcd

    host, port = parse_endpoint(endpoint)
    async with aetcd.Client(host=host, port=port) as c:
        await c.delete_prefix(f"/emoe/{cluster}/".encode())




async def _committed(tmp_path: Path, cluster: str, etcd: str, n: int, seed: int) -> list[RoutingTable]:
    """Versions 2..n+1 committed through a backend whose store is tmp_path / a.log; the tables, in order."""
    a = EtcdBackend([etcd], "a", genesis(), cluster=cluster, store=Store(tmp_path / "a.log"))
    a.start()
    rng, out = random.Random(seed), []
    try:
        await a.ready()
        for _ in range(n):
            t = successor_table(a.head, rng)
            assert (await a.propose_async(t, pb.Plan(trigger="test"))).committed
            out.append(t)
    finally:
        await a.close()
    return out


@pytest.mark.asyncio
async def test_a_wiped_etcd_gets_the_committed_versions_back_before_a_new_node_can_commit(
        etcd: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """etcd wiped under a cluster at version 3: the first node back with a store writes versions 2 and 3 back,
    so a node at genesis (a new node, a wiped data_dir) follows them and its next commit is version 4, never a
    second table for version 2."""
    import logging

    tables = await _committed(tmp_path, "wiped", etcd, 2, seed=3)
    await _wipe(etcd, "wiped")
    a = EtcdBackend([etcd], "a", genesis(), cluster="wiped", store=Store(tmp_path / "a.log"))
    fresh = EtcdBackend([etcd], "fresh", genesis(), cluster="wiped")
    with caplog.at_level(logging.WARNING, logger="agent"):  # agent.etcd.etcd_backend and agent.etcd.etcd_seed
        a.start()
        try:
            await a.ready()
            assert a.head.version == 3 and a.failure == ""
            fresh.start()
            await fresh.ready()
            await until("the new node follows the written-back versions", lambda: fresh.head.version == 3)
            assert [fresh.committed(v).qc.table_hash for v in (2, 3)] == [t.digest for t in tables]  # type: ignore[union-attr]
            out = await fresh.propose_async(successor_table(fresh.head, random.Random(9)), pb.Plan())
            assert out.committed and out.version == 4
            await until("the restored node installs the new version", lambda: a.head.version == 4)
        finally:
            await a.close()
            await fresh.close()
    said = [r.getMessage() for r in caplog.records if "wrote back" in r.getMessage()]
    assert len(said) == 1 and "held no head, below version 3" in said[0] and "versions 2..3" in said[0], said


@pytest.mark.asyncio
async def test_a_node_refuses_an_etcd_that_committed_another_table_over_its_history(
        etcd: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """etcd wiped, and a node at genesis committed a new version 2 before any node with the history came back:
    the node that committed the old version 2 says so (NOT_SERVING, ERROR once), installs nothing from etcd
    and refuses to propose."""
    import logging

    await _committed(tmp_path, "forked", etcd, 2, seed=5)
    await _wipe(etcd, "forked")
    fresh = EtcdBackend([etcd], "fresh", genesis(), cluster="forked")
    fresh.start()
    a = EtcdBackend([etcd], "a", genesis(), cluster="forked", store=Store(tmp_path / "a.log"))
    try:
        await fresh.ready()
        assert (await fresh.propose_async(successor_table(fresh.head, random.Random(11)), pb.Plan())).committed
        with caplog.at_level(logging.ERROR, logger="agent.etcd.etcd_backend"):
            a.start()
            await until("the fork is named", lambda: "another table for version 2" in a.failure)
        assert a.head.version == 3 and a.abstains and "wipe this node's data_dir" in a.failure
        refused = await a.propose_async(successor_table(a.head, random.Random(12)), pb.Plan())
        assert not refused.committed
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [a.failure]
    finally:
        await a.close()
        await fresh.close()
