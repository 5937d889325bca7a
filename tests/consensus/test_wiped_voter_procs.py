"""A wiped voter of a brand-new cluster must not vote again on a version it helped choose (I1), with real agent
processes and the interleaving forced (agent/consensus/rebuild.py).

Three agents start from empty data_dirs (head: genesis v1). OWNER is v2's round-0 owner (paxos.round0_owner),
A and B the others. With B cut off from both (a fault file the transport reads through its drop hook, chaos/faults.py), a forced
proposal through OWNER goes out in round 0 to OWNER and A only, both accept: X is chosen and OWNER persists its
commit; no Learn or catch-up can reach B. Then OWNER is killed (-9), A is killed and its whole data_dir
removed (IDENTITY marker included), B is healed and A restarted: the only peer that answers A is B, which
holds genesis and no acceptor state for v2. A forced proposal of Y through B must be refused (A may have
accepted X: it rejoins as a learner), and once OWNER is back every node holds X at v2.

Before the fix (6a5de53) A took B's genesis answer for "a new node in a new cluster", voted at once, and the
proposal through B committed Y at v2 while OWNER's log held X: two tables for one version.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc
import pytest

from agent.consensus.paxos import round0_owner
from agent.storage.datadir import LOG_NAME
from agent.storage.store import parse
from chaos.faults import write_faults
from chaos.localcluster import ROOT, LocalCluster, stable_ports
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import admin_pb2_grpc
from elasticmoe.v1 import consensus_pb2 as cpb

pytestmark = pytest.mark.slow

# 3 ranks of 4 slots, 8 experts: static genesis leaves a free slot on every rank (L0: [0 1 2 -] [3 4 5 -] [6 7 - -])
SHAPE = {"nodes": 3, "ranks_per_node": 1, "slots_per_rank": 4, "layers": 2, "experts": 8, "top_k": 2}
X_OP = ["replicate", "0", "0", "2"]  # OWNER's table for v2: expert 0 of layer 0 also on rank 2
Y_OP = ["replicate", "0", "1", "1"]  # B's table for v2: expert 1 of layer 0 also on rank 1
# no member is declared dead while the test runs (a dead member's ranks would be repaired by a proposal of
# its own, racing the ones this test forces); no rank a repair drained to restore
SECTIONS = {"gossip": {"suspicion_min_ms": 600_000, "rejoin_ms": 0}}
WAIT_S = 20.0  # bound on each wait below

T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = WAIT_S, every: float = 0.1) -> T:
    """Poll `probe` until it returns something other than None (or False); TimeoutError naming `what` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last is not None and last is not False:
            return last
        time.sleep(every)
    raise TimeoutError(f"after {timeout} s: {what} (last: {last!r})")


def status(c: LocalCluster, k: int) -> apb.StatusReply | None:
    try:
        with grpc.insecure_channel(c.addresses[k]) as ch:
            return admin_pb2_grpc.AdminStub(ch).Status(apb.StatusRequest(), timeout=2.0)
    except grpc.RpcError:
        return None


def table_hash(c: LocalCluster, k: int, version: int) -> bytes | None:
    """The content hash of the table agent k holds at `version` (Admin Placement), None if it holds none."""
    try:
        with grpc.insecure_channel(c.addresses[k]) as ch:
            r = admin_pb2_grpc.AdminStub(ch).Placement(apb.PlacementRequest(layer=0, version=version), timeout=2.0)
    except grpc.RpcError:
        return None
    return bytes(r.table.content_hash) if r.table.version == version else None


def store_of(c: LocalCluster, k: int) -> Path:
    return c.base / c.ids[k] / "data" / LOG_NAME


def v2_on_disk(c: LocalCluster, k: int) -> tuple[cpb.Commit | None, bool]:
    """(the v2 commit in agent k's store log or None, whether the log holds acceptor state for v2)."""
    try:
        rec = parse(store_of(c, k).read_bytes())[0]
    except FileNotFoundError:
        return None, False
    mine = [cm for cm in rec.commits if cm.table.version == 2]
    assert len({bytes(cm.table.content_hash) for cm in mine}) <= 1, f"{c.ids[k]}'s log holds two tables for v2"
    return (mine[0] if mine else None), 2 in rec.acceptor


def v2_hash(c: LocalCluster, k: int) -> bytes | None:
    cm = v2_on_disk(c, k)[0]
    return None if cm is None else bytes(cm.table.content_hash)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=45)


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LocalCluster, str]]:
    faults = str(tmp_path / "faults.json")
    write_faults(faults, {})
    # each agent's transport drops the links the file lists (chaos.agentproc)
    c = LocalCluster(3, tmp_path, SHAPE, profile="test", sections=SECTIONS, ports=stable_ports(3), faults_file=faults)
    with c.running(timeout=30):
        yield c, faults


def test_wiped_voter_cannot_help_choose_a_second_table_for_v2(cluster: tuple[LocalCluster, str]) -> None:
    c, faults = cluster
    owner = c.ids.index(round0_owner(2, c.ids))
    a, b = [k for k in range(3) if k != owner]
    OWN, A, B = c.ids[owner], c.ids[a], c.ids[b]

    # a new cluster votes once every founder has heard from the other two
    for k in range(3):
        wait_for(f"{c.ids[k]} votes", lambda k=k: (s := status(c, k)) is not None and s.role == "voter")

    # B cut off from both others: v2's round-0 accept (and any Learn or catch-up of it) reaches A only
    write_faults(faults, {B: [OWN, A], OWN: [B], A: [B]})
    # an agent re-reads the file (a new inode at each write) at its first call 50 ms or more after its last
    # look: every call from 50 ms after the write on sees the partition, whatever the load
    time.sleep(0.3)
    r = cli("propose", "--agent", c.addresses[owner], "--json", "--force", *X_OP)
    assert r.returncode == 0, f"X through {OWN}: {r.stdout} {r.stderr}"
    doc = json.loads(r.stdout)
    assert doc["committed"] is True and int(doc["version"]) == 2, doc
    cx = wait_for(f"{OWN}'s store log holds its commit of v2", lambda: v2_on_disk(c, owner)[0])
    c.kill(owner)  # after its commit of X is durable, before any Learn reached B
    x = bytes(cx.table.content_hash)
    assert cx.qc.ballot.round == 0 and sorted(cx.qc.voters) == sorted([OWN, A]), cx.qc  # OWNER's round 0, with A
    assert v2_on_disk(c, a)[1], f"{A}'s log holds no acceptor state for v2"

    c.kill(a)
    shutil.rmtree(c.base / A / "data")  # A's whole data_dir, IDENTITY marker included
    st_b = status(c, b)
    assert st_b is not None and st_b.committed_version == 1, st_b
    assert v2_on_disk(c, b) == (None, False), f"{B} must hold no commit and no acceptor state for v2"

    write_faults(faults, {})  # heal: OWNER is down, so A's rebuild hears from B alone
    time.sleep(0.3)
    c.start(a)
    c.wait_healthy(timeout=30, which=[a])
    # A has B's answer: a voter again (the bug), or a learner B knew
    role = wait_for(f"{A} has heard from {B}", lambda: (s := status(c, a)) is not None
                    and (s.role == "voter" or (s.role.startswith("learner") and B in s.role)) and s.role)

    t0 = time.monotonic()
    r = cli("propose", "--agent", c.addresses[b], "--json", "--force", *Y_OP)
    took = time.monotonic() - t0
    if r.returncode == 0:
        y = table_hash(c, b, 2)
        pytest.fail(f"I1: the forced proposal through {B} committed v2 with {A}'s vote ({A}'s role was {role!r}): "
                    f"{B} holds {y.hex() if y else None} at v2, {OWN}'s log holds {x.hex()}: two tables for v2\n"
                    f"{r.stdout}")
    assert "refused" in r.stderr, r.stderr
    st_a = status(c, a)
    assert st_a is not None and st_a.role.startswith("learner") and st_a.committed_version == 1, st_a
    assert table_hash(c, b, 2) is None and v2_hash(c, b) is None

    c.start(owner)
    c.wait_healthy(timeout=30, which=[owner])

    def converged() -> bool:
        return all(table_hash(c, k, 2) == x for k in range(3))

    wait_for("every node holds X at v2", converged, timeout=30)
    for k in range(3):
        st = status(c, k)
        assert st is not None and st.committed_version == 2, st
    c.stop()
    for k in range(3):  # and on disk: X, the one table for v2 in every store log
        assert v2_hash(c, k) == x, f"{c.ids[k]}'s log does not hold X at v2"
    print(f"\nforced proposal through {B} refused in {took:.1f} s: {r.stderr.strip()}")
