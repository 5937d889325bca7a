"""Implausible reports on a real agent's shim socket (issue 48, finding 3): 3 agent processes; a raw gRPC
client on node1's unix socket sends what no engine plugin of node1 can say: a negative rank, another node's
rank, a count of 2^32 - 1 for one expert in one step, a layer's sum past the declared batch x top_k, an
installed version of 2^64 - 1, and unreachable_ranks from a rank that is not node1's or naming no EP rank.
Each is refused with INVALID_ARGUMENT naming the field and its value, and changes nothing the agent shows:
`emoe status` / the admin Status (its ranks, their installed versions, the members' incarnations), the closed
load windows (LoadView), which hold the honest reports' counts exactly. The engine's own evidence (a rank of
node1 naming a rank of node3) is taken: node3 is suspected, refutes, and is never declared dead.

Driven only through what the release 67b8e70 already had (the shim socket, the admin gRPC service, the CLI,
/metrics), with raw bytes for the new LoadReport.max_batch_tokens (field 16), so that it runs against that
release too, and fails there on its first assertion."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from chaos.localcluster import ROOT, LocalCluster, free_ports
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import admin_pb2_grpc as agrpc
from elasticmoe.v1 import dataplane_pb2 as dpb
from elasticmoe.v1 import gossip_pb2 as gpb
from tests.conftest import until

pytestmark = pytest.mark.slow

L, E, NODES, RPN, S, W, TOP_K = 2, 8, 3, 2, 4, 10, 2
SHAPE = {"nodes": NODES, "ranks_per_node": RPN, "slots_per_rank": S, "layers": L, "experts": E, "top_k": TOP_K}
MINE, OTHER, NODE3_RANK = 0, 2, 4  # a rank of node1, of node2, of node3
U32, U64 = 2**32 - 1, 2**64 - 1


class Cluster:
    """The agents, an admin stub per agent, node1's metrics port, and the next load window to drive."""

    def __init__(self, c: LocalCluster, metrics_port: int) -> None:
        self.c, self.metrics_port = c, metrics_port
        self.channels = [grpc.insecure_channel(a) for a in c.addresses]
        self.admin = [agrpc.AdminStub(ch) for ch in self.channels]  # type: ignore[no-untyped-call]
        self.window = 0

    def status(self, k: int) -> apb.StatusReply:
        reply: apb.StatusReply = self.admin[k].Status(apb.StatusRequest(), timeout=10)
        return reply

    def member(self, k: int, node: str) -> gpb.MemberState:
        return next(m for m in self.status(k).members if m.node_id == node)

    def send(self, k: int, raw: bytes) -> tuple[dpb.ReportLoadAck | None, str]:
        """One report (its serialized bytes) on agent k's shim socket: (the ack, "") or (None, why refused)."""
        with grpc.insecure_channel(f"unix:{self.c.shim_socket(k)}") as ch:
            call = ch.stream_unary("/elasticmoe.v1.DataplaneLink/ReportLoad", request_serializer=None,
                                   response_deserializer=dpb.ReportLoadAck.FromString)
            try:
                return call(iter([raw]), timeout=10), ""
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e  # type: ignore[attr-defined]
                return None, str(e.details())  # type: ignore[attr-defined]

    def drive_window(self) -> int:
        """Every rank of every node reports the next window honestly (rank g: g + 1 tokens per expert a step);
        returns its seq once node1 closed it as a cluster window."""
        k = self.window
        self.window += 1
        for g in range(NODES * RPN):
            counts = np.full((L, E), (g + 1) * W, dtype="<u4")
            ack, why = self.send(g // RPN, report(shim_id=f"rank{g}", rank=g, first_step=k * W, steps=W, version=1,
                                                  counts=counts.tobytes()))
            assert ack is not None and ack.accepted == 1, f"an honest report of rank {g} was refused: {why}"
        until(f"window {k} closes on node1", lambda: self.load().window_seq >= k and self.load().counts != b"")
        return k

    def load(self) -> apb.LoadViewReply:
        reply: apb.LoadViewReply = self.admin[0].LoadView(apb.LoadViewRequest(), timeout=10)
        return reply

    def refused_metric(self, code: str) -> float | None:
        """node1's emoe_reports_refused_total{reason=code} (at most a second old); None where it has none."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(f'emoe_reports_refused_total{{reason="{code}"}}'):
                return float(line.split()[-1])
        return None


def report(max_batch_tokens: int = 0, **fields: Any) -> bytes:
    """A LoadReport's bytes; `max_batch_tokens` (field 16, uint64) appended as raw bytes: a release without the
    field skips it."""
    fields.setdefault("layers", L)
    fields.setdefault("experts", E)
    fields.setdefault("counts", np.ones((L, E), "<u4").tobytes())
    raw = dpb.LoadReport(**fields).SerializeToString()
    if max_batch_tokens:
        raw += _varint(16 << 3) + _varint(max_batch_tokens)  # (field 16, wire type 0: varint)
    return raw


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = LocalCluster(NODES, tmp_path_factory.mktemp("implausible"), SHAPE, profile="test",
                     sections={"decision": {"window": W}})
    port = free_ports(1)[0]
    c.configs[0].write_text(c.configs[0].read_text() + f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n')
    with c.running(timeout=60):
        cl = Cluster(c, port)
        cl.admin[0].Pause(apb.Empty(), timeout=10)  # no rebalancing: the versions stay where they are
        until("every node sees every node alive", lambda: all(
            sum(m.status == gpb.ALIVE for m in cl.status(k).members) == NODES for k in range(NODES)))
        cl.drive_window()  # each node learns its shims (a node's window closes once the shims it knows reported)
        try:
            yield cl
        finally:
            for ch in cl.channels:
                ch.close()


def _refused(got: tuple[dpb.ReportLoadAck | None, str], *expect: str) -> None:
    ack, why = got
    assert ack is None, f"accepted (ack: accepted {ack.accepted}, rejected {ack.rejected})"
    for e in expect:
        assert e in why, why


@pytest.mark.parametrize("rank, code", [(-1, "rank_not_here"), (OTHER, "rank_not_here")])
def test_a_rank_not_this_nodes_is_refused(cluster: Cluster, rank: int, code: str) -> None:
    before = cluster.refused_metric(code) or 0.0
    _refused(cluster.send(0, report(shim_id="stranger", rank=rank, first_step=cluster.window * W, steps=W,
                                    version=1)), f"rank = {rank}")
    assert sorted(r.rank for r in cluster.status(0).ranks) == [0, 1]  # node1 shows its own ranks only
    k = cluster.drive_window()  # the stranger's counts are not in the window
    assert np.frombuffer(cluster.load().counts, "<u4").tolist() == [21 * W] * (L * E), k
    until(f"node1 counts it under {code}", lambda: cluster.refused_metric(code) == before + 1, timeout=5)


def test_a_count_past_the_batch_in_one_step_is_refused(cluster: Cluster) -> None:
    counts = np.ones((L, E), "<u4")
    counts[1, 3] = U32
    _refused(cluster.send(0, report(shim_id="rank0", rank=MINE, first_step=cluster.window * W, steps=1, version=1,
                                    counts=counts.tobytes())), f"counts[1, 3] = {U32}")
    # each expert within the declared batch (200), the layer's sum (8 x 200) past 200 x top_k 2, in one step
    _refused(cluster.send(0, report(shim_id="rank0", rank=MINE, first_step=cluster.window * W, steps=1, version=1,
                                    counts=np.full((L, E), 200, "<u4").tobytes(), max_batch_tokens=200)),
             "sum of counts[0, :] = 1600")
    k = cluster.drive_window()  # neither is in the window that step belongs to
    assert np.frombuffer(cluster.load().counts, "<u4").tolist() == [21 * W] * (L * E), k
    until("node1 counts them by code", lambda: cluster.refused_metric("count_above_batch") == 1
          and cluster.refused_metric("layer_above_batch") == 1, timeout=5)


def test_a_version_past_the_committed_head_is_refused(cluster: Cluster) -> None:
    head = cluster.status(0).committed_version
    _refused(cluster.send(0, report(shim_id="rank0", rank=MINE, first_step=cluster.window * W, steps=W,
                                    version=U64)), f"version = {U64}")
    _refused(cluster.send(0, report(shim_id="rank0", rank=MINE, first_step=cluster.window * W, steps=W,
                                    version=head + 1)), f"version = {head + 1}")
    r = subprocess.run([sys.executable, "-m", "agent.cli", "status", "--json", "--agent", cluster.c.addresses[0]],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    ranks = {int(i["rank"]): i for i in json.loads(r.stdout)["ranks"]}
    assert all(int(i["installed_version"]) <= head for i in ranks.values()), ranks
    cluster.drive_window()  # honest reports of version 1 are still taken
    assert cluster.status(0).ranks[MINE].installed_version == 1
    until("node1 counts them by code", lambda: cluster.refused_metric("version_ahead") == 2, timeout=5)


def test_evidence_from_no_rank_of_this_node_or_of_no_ep_rank_is_refused(cluster: Cluster) -> None:
    node3 = cluster.c.ids[2]
    before = cluster.status(2).members
    inc = next(m.incarnation for m in before if m.node_id == node3)
    for rank in (OTHER, -3):  # node2's rank, a negative one, naming node3's rank
        _refused(cluster.send(0, report(shim_id="stranger", rank=rank, first_step=cluster.window * W, steps=0,
                                        version=1, counts=np.zeros((L, E), "<u4").tobytes(),
                                        unreachable_ranks=[NODE3_RANK])), f"rank = {rank}")
    _refused(cluster.send(0, report(shim_id="rank0", rank=MINE, first_step=cluster.window * W, steps=0, version=1,
                                    counts=np.zeros((L, E), "<u4").tobytes(), unreachable_ranks=[NODES * RPN])),
             f"unreachable_ranks [{NODES * RPN}]")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2.0:  # node1 does not suspect node3: node3 has nothing to refute
        assert cluster.member(0, node3).status == gpb.ALIVE
        time.sleep(0.1)
    assert cluster.member(2, node3).incarnation == inc


def test_this_nodes_own_evidence_suspects_and_never_declares(cluster: Cluster) -> None:
    """The engine's word about a peer it cannot reach is Lifeguard's local evidence: node1 suspects node3 at
    once; node3, alive, refutes (its incarnation goes up) and no node ever takes it for dead."""
    node3 = cluster.c.ids[2]
    inc = cluster.member(2, node3).incarnation
    ack, why = cluster.send(0, report(shim_id="rank0", rank=MINE, first_step=cluster.window * W, steps=0, version=1,
                                      counts=np.zeros((L, E), "<u4").tobytes(), unreachable_ranks=[NODE3_RANK]))
    assert ack is not None and ack.accepted == 1, why
    until("node3 refutes node1's suspicion", lambda: cluster.member(2, node3).incarnation > inc, timeout=10)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3.0:  # past the test profile's suspicion timeout
        assert all(cluster.member(k, node3).status in (gpb.ALIVE, gpb.SUSPECT) for k in range(NODES))
        time.sleep(0.2)
    until("node3 alive everywhere", lambda: all(cluster.member(k, node3).status == gpb.ALIVE for k in range(NODES)))
