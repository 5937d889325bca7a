"""Issue 48, finding 1, with real agent processes under mutual TLS: a member's certificate cannot write the pause
switch under another name. After an operator's pause, node1's certificate sends node2 one Consensus/ControlAccept
of a resume written as "node3", then one as "admin" (at 67b8e70 node2 accepted and signed both, finished "another
writer's unfinished record" with the other voters, and every agent resumed). Every agent must stay paused, and
node2 must refuse both records, naming the writer. An admin's resume through node2 then names the admin and node2
in `emoe status`.

Driven through what 67b8e70 has too (the gRPC wire, the admin service, the CLI), so that the same test shows the
attack there; names this change adds are read only after the behavioural assertion."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from agent.security import channel_credentials, channel_options, write_dev_certs
from chaos.localcluster import LocalCluster
from elasticmoe.v1 import admin_pb2, admin_pb2_grpc, consensus_pb2_grpc
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.versions import WIRE_KEY, WIRE_VERSION
from tests.adminclient import emoe
from tests.conftest import until

pytestmark = pytest.mark.slow

SHAPE = {"nodes": 3, "ranks_per_node": 2, "slots_per_rank": 4, "layers": 2, "experts": 8, "top_k": 2}
# at 67b8e70 node2 finished the forged record `deadline` = 2 x max_attempts x accept_timeout = 4 s (profile
# test) after it accepted it, at its next sync (1 s): every agent resumed within ~6 s. Watch for twice that.
WATCH_S = 12.0


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    out = tmp_path / "tls"
    write_dev_certs(out, ["node1", "node2", "node3"], ["admin"])
    return out


@pytest.fixture
def cluster(tmp_path: Path, certs: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(3, tmp_path / "cluster", SHAPE, sections={"tls": {"cert_dir": str(certs)}}, log_level="INFO")
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _channel(c: LocalCluster, certs: Path, k: int, identity: str) -> grpc.Channel:
    """A channel to agent k presenting `identity`'s certificate, checking that it talks to agent k."""
    return grpc.secure_channel(c.addresses[k], channel_credentials(certs, identity),
                               options=channel_options(c.ids[k]))


def _status(c: LocalCluster, certs: Path, k: int) -> admin_pb2.StatusReply | None:
    try:
        with _channel(c, certs, k, "admin") as ch:
            r: admin_pb2.StatusReply = admin_pb2_grpc.AdminStub(ch).Status(  # type: ignore[no-untyped-call]
                admin_pb2.StatusRequest(), timeout=3)
            return r
    except grpc.RpcError:
        return None


def _switch(c: LocalCluster, certs: Path) -> list[str]:
    """Each agent's pause switch as its Status says: 'paused by node1 (record 1)', or why there is none."""
    out = []
    for k in range(c.n):
        st = _status(c, certs, k)
        if st is None:
            out.append("no answer")
        elif not st.HasField("pause"):
            out.append("never paused")
        else:
            r = st.pause.record
            out.append(f"{'paused' if r.paused else 'resumed'} by {r.node_id} (record {r.seq}: {r.note})")
    return out


def _forge(c: LocalCluster, certs: Path, writer: str, seq: int) -> cpb.ControlAck:
    """node1's certificate asks node2 to accept a resume written by `writer`, at `seq` (above the pause's 1)."""
    record = cpb.ControlRecord(seq=seq, node_id=writer, paused=False, at_ms=int(time.time() * 1000),
                               note=f"forged by node1 as {writer}")
    with _channel(c, certs, 1, "node1") as ch:
        stub = consensus_pb2_grpc.ConsensusStub(ch)  # type: ignore[no-untyped-call]
        ack: cpb.ControlAck = stub.ControlAccept(
            cpb.ControlAcceptRequest(record=record, from_node="node1"), timeout=5,
            metadata=(("x-emoe-from", "node1"), (WIRE_KEY, str(WIRE_VERSION))))
        return ack


def test_a_members_certificate_cannot_write_the_switch_under_another_name(
        cluster: LocalCluster, certs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = cluster
    until("every agent serves", lambda: all((st := _status(c, certs, k)) is not None and st.health == "SERVING"
                                           for k in range(3)), timeout=60)
    with _channel(c, certs, 0, "admin") as ch:
        ack = admin_pb2_grpc.AdminStub(ch).Pause(admin_pb2.Empty(), timeout=30)  # type: ignore[no-untyped-call]
    assert ack.ok, ack.reason
    paused = "paused by node1 (record 1: emoe pause)"
    until("every agent holds the pause", lambda: _switch(c, certs) == [paused] * 3)

    acks = {writer: _forge(c, certs, writer, seq) for writer, seq in (("node3", 2), ("admin", 3))}
    t0 = time.monotonic()
    while time.monotonic() - t0 < WATCH_S:  # node2's finish deadline and several anti-entropy rounds
        now = _switch(c, certs)
        assert now == [paused] * 3, (f"{time.monotonic() - t0:.1f} s after node1's certificate sent node2 resumes "
                                     f"written as node3 and admin, the agents hold: {now}")
        time.sleep(0.5)

    for writer, a in acks.items():  # refused, naming the record's writer, with a code (read after the assertion)
        assert not a.ok and "PERMISSION_DENIED" in a.reason and f"record.node_id = '{writer}'" in a.reason, a
        # "admin" is no member; node1 is a voter, so it could finish node3's record, but only with node3's signature
        assert a.code == (cpb.CONTROL_UNKNOWN_WRITER if writer == "admin" else cpb.CONTROL_WRITER_UNSIGNED), a
        assert not a.signature

    # an admin's resume through node2: node2 vouches for it, and every agent names the admin who asked
    monkeypatch.setenv("EMOE_CERT_DIR", str(certs))
    monkeypatch.setenv("EMOE_IDENTITY", "admin")
    r = emoe("resume", "--agent", c.addresses[1])
    assert r.returncode == 0 and "by node2 for admin admin" in r.stdout, (r.stdout, r.stderr)
    until("every agent holds the admin's resume",
          lambda: _switch(c, certs) == ["resumed by node2 (record 2: emoe resume)"] * 3)
    for k in range(3):
        st = _status(c, certs, k)
        assert st is not None and st.pause.record.admin == "admin", st
        text = emoe("status", "--agent", c.addresses[k]).stdout
        assert "resumed cluster-wide by node2 for admin admin" in text, text
