"""End to end on loopback: 3 agent processes exchange load, one proposes, the others vote, a version is
committed, each node's shim link streams it, and the CLI shows it (human and --json forms)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from chaos.localcluster import ROOT, LocalCluster, free_ports
from elasticmoe.v1 import dataplane_pb2 as dpb
from elasticmoe.v1 import dataplane_pb2_grpc

pytestmark = pytest.mark.slow

L, E, W = 4, 16, 10
SHAPE = {"nodes": 3, "ranks_per_node": 2, "slots_per_rank": 4, "layers": L, "experts": E, "top_k": 2}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    base = tmp_path_factory.mktemp("cluster")
    c = LocalCluster(3, base, SHAPE, profile="test",
                     sections={"decision": {"window": W, "budget_windows": 1, "theta": 1.05, "tau": 0.01}})
    with c.running(timeout=60):
        yield c


def skewed_counts(rng: np.random.Generator) -> np.ndarray:
    p = np.full(E, 1.0)
    p[0] = 12.0  # expert 0 is hot in every layer
    p /= p.sum()
    return np.stack([rng.multinomial(W * 64, p) for _ in range(L)]).astype("<u4")


async def _drive(cluster: LocalCluster, windows: int) -> dict[int, list[dpb.TableUpdate]]:
    rng = np.random.default_rng(1)
    seen: dict[int, list[dpb.TableUpdate]] = {i: [] for i in range(cluster.n)}
    chans = [grpc.aio.insecure_channel(f"unix://{cluster.shim_socket(i)}") for i in range(cluster.n)]
    stubs = [dataplane_pb2_grpc.DataplaneLinkStub(ch) for ch in chans]

    async def watch(i: int) -> None:
        async for upd in stubs[i].WatchTables(dpb.WatchTablesRequest(from_version=1, shim_id=f"s{i}")):
            seen[i].append(upd)

    watchers = [asyncio.create_task(watch(i)) for i in range(cluster.n)]
    try:
        for k in range(windows):
            for i in range(cluster.n):
                counts = skewed_counts(rng)
                rep = dpb.LoadReport(shim_id=f"s{i}", rank=i * SHAPE["ranks_per_node"], first_step=k * W, steps=W,
                                     layers=L, experts=E, counts=counts.tobytes())  # (node i's first rank)
                await stubs[i].ReportLoad(iter([rep]), timeout=5)
            await asyncio.sleep(0.3)
            if all(seen[i] for i in seen):
                break
        deadline = time.monotonic() + 15
        while not all(seen[i] for i in seen) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    finally:
        for w in watchers:
            w.cancel()
        for ch in chans:
            await ch.close()
    return seen


def first_commit_on_every_shim(cluster: LocalCluster) -> Any:
    """Drive skewed load for 30 windows: every shim is streamed the same first new table, v2 after v1,
    and it replicates the hot expert 0. Returns that commit."""
    seen = asyncio.run(_drive(cluster, windows=30))
    firsts = {i: seen[i][0].commit for i in seen if seen[i]}
    assert len(firsts) == cluster.n, f"not every shim got a new version: {[len(v) for v in seen.values()]}"
    assert len({c.table.content_hash for c in firsts.values()}) == 1
    c = firsts[0]
    assert c.table.version == 2 and c.table.parent == 1
    phy = np.frombuffer(c.table.phy2log, "<i8").reshape(L, -1)
    assert (phy == 0).sum(axis=1).max() >= 2, "the hot expert 0 was not replicated"
    return c


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_fresh_cluster_read_commands_say_what_they_wait_for(cluster: LocalCluster) -> None:
    """Before any engine reports load (this runs first, on the module's fresh cluster): top says no load has
    arrived and lists the members, explain says there is no decision yet and why, history that nothing
    has been committed since genesis; all exit 0 (issue 17 item 8)."""
    a = cluster.addresses[0]
    deadline = time.monotonic() + 20
    while True:  # gossip needs a moment to list every member
        r = _cli("top", "--iterations", "1", "--agent", a)
        members = next((line for line in r.stdout.splitlines() if line.startswith("members:")), "")
        if all(n in members for n in cluster.ids) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.returncode == 0 and "no load has arrived yet" in r.stdout, (r.stdout, r.stderr)
    assert all(f"{n} (alive)" in members for n in cluster.ids), members
    r = _cli("explain", "--agent", a)
    assert r.returncode == 0 and r.stdout.startswith("no decision yet on agent node1 (head is version 1)"), r
    assert "no load has arrived" in r.stdout and r.stdout.count("\n") == 1
    r = _cli("explain", "--agent", a, "--json")  # the same answer, the same exit status (issue 33)
    assert r.returncode == 0 and json.loads(r.stdout)["outcome"] == "NO_DECISION", r
    r = _cli("status", "--agent", a)  # no window yet: a dash, not 0.000
    head = r.stdout.splitlines()[0]
    assert r.returncode == 0 and "step imbalance -" in head and "window -" in head, r.stdout
    r = _cli("history", "--agent", a)
    assert r.returncode == 0 and r.stdout == "no commits since the initial table: nothing has been rebalanced yet\n", r
    r = _cli("history", "--agent", a, "--json")
    assert {e["version"] for e in json.loads(r.stdout).get("entries", [])} <= {1}


def test_commit_reaches_every_shim_and_cli(cluster: LocalCluster) -> None:
    c = first_commit_on_every_shim(cluster)
    assert len(c.qc.voters) >= 2 and c.qc.quorum == 2

    r = _cli("placement", "--agent", cluster.addresses[1], "--json", "--layer", "-1")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["version"] >= 2 and any("0" in lay["replicas"] for lay in doc["layers"].values())
    r = _cli("placement", "--agent", cluster.addresses[2])
    assert r.returncode == 0 and "routing table version" in r.stdout
    assert all(n in r.stdout for n in cluster.ids) and " n0 " not in r.stdout  # the nodes as status names them
    assert doc["rank_nodes"] == ["node1", "node1", "node2", "node2", "node3", "node3"]
    # the commit's time is the time of day (UTC), not a monotonic clock's reading
    hist = json.loads(_cli("history", "--agent", cluster.addresses[0], "--json").stdout)
    e = next(e for e in hist["entries"] if int(e["version"]) == 2)
    assert abs(int(e["committed_at_unix_ms"]) / 1000 - time.time()) < 600, e
    stamp = time.strftime("%Y-%m-%dT", time.gmtime(int(e["committed_at_unix_ms"]) / 1000))
    assert stamp in _cli("history", "--agent", cluster.addresses[0]).stdout


@pytest.mark.parametrize("cmd", [["status"], ["history"], ["explain", "2"], ["top", "--iterations", "1"],
                                 ["placement", "--layer", "1"]])
@pytest.mark.parametrize("as_json", [False, True])
def test_read_commands(cluster: LocalCluster, cmd: list[str], as_json: bool) -> None:
    r = _cli(*cmd, "--agent", cluster.addresses[0], *(["--json"] if as_json else []))
    assert r.returncode == 0, r.stderr
    if as_json:
        json.loads(r.stdout.strip().splitlines()[-1] if cmd[0] == "top" else r.stdout)
    else:
        assert r.stdout.strip()


def test_unreachable_agent_and_unknown_version(cluster: LocalCluster) -> None:
    port = free_ports(1)[0]
    r = _cli("status", "--agent", f"127.0.0.1:{port}")
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0 and f"127.0.0.1:{port}" in r.stderr and "unreachable" in r.stderr
    r = _cli("placement", "--agent", cluster.addresses[0], "--version", "999")
    assert r.returncode != 0 and "version 999" in r.stderr and r.stderr.strip().count("\n") == 0


def test_health_and_reflection(cluster: LocalCluster) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(cluster.addresses[0]) as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert {"elasticmoe.v1.Admin", "elasticmoe.v1.Gossip", "elasticmoe.v1.Consensus",
            "grpc.health.v1.Health"} <= services
    assert cluster.healthy(0)


def test_pause_resume_and_bad_propose(cluster: LocalCluster) -> None:
    a = cluster.addresses[0]
    assert _cli("pause", "--agent", a).returncode == 0
    assert json.loads(_cli("status", "--agent", a, "--json").stdout)["paused"] is True
    r = _cli("resume", "--agent", a, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True
    r = _cli("pause", "--agent", a, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True
    assert _cli("resume", "--agent", a).returncode == 0
    r = _cli("propose", "--agent", a, "replicate", "0", "99", "1")
    assert r.returncode != 0 and "expert" in r.stderr and "99" in r.stderr
    assert r.stderr.strip().count("\n") == 0
    # the planner may have filled slots by now (a re-pack fills every slot of the layers it moves): replicate
    # L1 E3 onto a rank with room, or else drop a second replica
    lay = json.loads(_cli("placement", "--agent", a, "--json", "--layer", "1").stdout)["layers"]["1"]
    room = [g for g, row in enumerate(lay["ranks"]) if -1 in row and 3 not in row]
    if room:
        op = ["replicate", "1", "3", str(room[0])]
    else:
        e = int(next(iter(lay["replicas"])))
        op = ["drop", "1", str(e), str(next(g for g, row in enumerate(lay["ranks"]) if e in row))]
    r = _cli("propose", "--agent", a, "--json", "--force", *op)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["committed"] is True and int(doc["version"]) >= 2, r.stderr


def test_drain_then_restore(cluster: LocalCluster, tmp_path: Path) -> None:
    a = cluster.addresses[0]
    r = _cli("restore", "--agent", a, "3")
    assert r.returncode != 0 and "already active" in r.stderr
    r = _cli("drain", "--agent", a, "5")
    assert r.returncode == 0, r.stderr
    doc = json.loads(_cli("placement", "--agent", cluster.addresses[2], "--json", "--layer", "-1").stdout)
    deadline = time.monotonic() + 10
    while 5 in doc["active_ranks"] and time.monotonic() < deadline:  # the other agents learn the commit
        time.sleep(0.2)
        doc = json.loads(_cli("placement", "--agent", cluster.addresses[2], "--json", "--layer", "-1").stdout)
    assert 5 not in doc["active_ranks"]
    assert all(row == [-1] * 4 for lay in doc["layers"].values() for row in lay["ranks"][5:6])
    r = _cli("restore", "--agent", a, "5", "--json")
    assert r.returncode == 0, r.stderr
    ack = json.loads(r.stdout)
    assert ack["ok"] is True and "experts on it in v" in ack["reason"], ack  # work back on the rank (issue 33)
    doc = json.loads(_cli("placement", "--agent", a, "--json", "--layer", "-1", "--version", ack["version"]).stdout)
    assert 5 in doc["active_ranks"] and any(x >= 0 for lay in doc["layers"].values() for x in lay["ranks"][5])


def test_million_op_propose_is_refused_at_once_and_the_agent_keeps_answering(cluster: LocalCluster) -> None:
    """Issue 17 item 7: one Admin Propose of 1,000,000 operations (~42 MB) held the agent's event loop for
    7.3 s. Now it is refused with INVALID_ARGUMENT naming the bound, and Status keeps answering meanwhile."""
    from agent.admin.admin import MAX_PROPOSE_OPS
    from elasticmoe.v1 import admin_pb2 as apb
    from elasticmoe.v1 import admin_pb2_grpc
    from elasticmoe.v1 import consensus_pb2 as cpb

    op = cpb.Operation(kind=cpb.REPLICATE, layer=0, experts=[1], dst=2, src=-1, rank=-1, source=-1)
    raw = apb.ProposeRequest(ops=[op] * 1_000_000, force=True).SerializeToString()
    a = cluster.addresses[0]
    with grpc.insecure_channel(a, options=[("grpc.max_send_message_length", 64 << 20)]) as ch, \
            grpc.insecure_channel(a) as ch2:
        propose = ch.unary_unary("/elasticmoe.v1.Admin/Propose", request_serializer=None,
                                 response_deserializer=apb.ProposeReply.FromString)
        stub = admin_pb2_grpc.AdminStub(ch2)
        stub.Status(apb.StatusRequest(), timeout=5)
        t0 = time.monotonic()
        fut = propose.future(raw, timeout=60)
        worst, n = 0.0, 0
        while not fut.done():
            s = time.monotonic()
            stub.Status(apb.StatusRequest(), timeout=10)
            worst, n = max(worst, time.monotonic() - s), n + 1
        took = time.monotonic() - t0
        err = fut.exception()
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert f"expected at most {MAX_PROPOSE_OPS}" in err.details()
    print(f"\n1,000,000-op Propose ({len(raw)} bytes) refused in {took:.3f} s; {n} concurrent Status calls, "
          f"slowest {worst * 1000:.0f} ms")
    # before the bounds: answered after 17.9 s, one Status call waiting 17.5 s. Now typically ~0.6 s and
    # < 0.5 s (receiving and parsing 42 MB); the margins are for a loaded 2-core machine
    # printed above; the bound only tells a refusal from the old 17.9 s stall, with room for a loaded machine
    assert took < 10.0 and worst < 8.0, (took, worst)
    assert cluster.healthy(0) and json.loads(_cli("status", "--agent", a, "--json").stdout)["health"] == "SERVING"
