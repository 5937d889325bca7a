"""The pause switch as cluster state with real agent processes (chaos.localcluster; partitions through the
transport's fault file, chaos.faults): `emoe pause` on one node, every agent restarted, still paused and
`emoe status` says so on every node, with who paused it and when and who plans; across a partition that cuts
off the node that paused, the other side keeps the pause it learned, and a node cut off from the quorum cannot
change the switch (`emoe pause` exits 1 naming who did not answer)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

import agent
from chaos.localcluster import ROOT, LocalCluster, stable_ports
from tests.adminclient import emoe, status
from tests.conftest import until

pytestmark = pytest.mark.slow

SHAPE = {"nodes": 3, "ranks_per_node": 2, "slots_per_rank": 4, "layers": 2, "experts": 8, "top_k": 2}


def _switch(c: LocalCluster, k: int) -> tuple[int, str, bool] | None:
    try:
        r = status(c.addresses[k])
    except grpc.RpcError:
        return None
    return (int(r.pause.record.seq), r.pause.record.node_id, r.pause.record.paused) if r.HasField("pause") else None


def _cut(faults: Path, alone: str, others: list[str]) -> None:
    doc = {"drop": {alone: others, **{o: [alone] for o in others}}}
    tmp = faults.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, faults)


def _heal(faults: Path) -> None:
    _cut(faults, "nobody", [])


@pytest.fixture
def cluster(tmp_path: Path) -> Any:
    faults = tmp_path / "faults.json"
    _heal(faults)
    # ports below the ephemeral range: every agent is restarted on its own port
    c = LocalCluster(3, tmp_path, SHAPE, ports=stable_ports(3), faults_file=str(faults), log_level="INFO")
    c.faults = faults  # type: ignore[attr-defined]
    with c.running():
        yield c


def test_the_agents_run_this_tree() -> None:
    assert Path(agent.__file__).resolve().parent.parent == ROOT  # (the subprocesses run `-m` from ROOT too)


def test_a_pause_survives_a_restart_of_every_agent_and_status_says_so_everywhere(cluster: LocalCluster) -> None:
    c = cluster
    r = emoe("pause", "--agent", c.addresses[0])
    assert r.returncode == 0 and "paused cluster-wide" in r.stdout, r.stderr
    until("every node holds the pause", lambda: all(_switch(c, k) == (1, "node1", True) for k in range(3)))
    c.stop()
    c.start()
    c.wait_healthy(timeout=60)
    for k in range(3):  # from each agent's own store, at once
        assert _switch(c, k) == (1, "node1", True)
        doc = json.loads(emoe("status", "--json", "--agent", c.addresses[k]).stdout)
        assert doc["paused"] is True and doc["pause"]["record"]["node_id"] == "node1"
        assert int(doc["pause"]["record"]["at_ms"]) > 1.6e12  # wall-clock milliseconds
        assert doc["planner"] in c.ids
        text = emoe("status", "--agent", c.addresses[k]).stdout
        assert "paused cluster-wide by node1" in text and "planner: node" in text, text
    planners = {status(c.addresses[k]).planner for k in range(3)}
    assert len(planners) == 1  # every node names the same planner
    r = emoe("resume", "--agent", c.addresses[2], "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True, r.stderr
    until("every node holds the resume", lambda: all(_switch(c, k) == (2, "node3", False) for k in range(3)))


def test_across_a_partition_that_cuts_off_the_node_that_paused(cluster: LocalCluster) -> None:
    c = cluster
    faults: Path = c.faults  # type: ignore[attr-defined]
    assert emoe("pause", "--agent", c.addresses[0]).returncode == 0
    until("every node holds the pause", lambda: all(_switch(c, k) == (1, "node1", True) for k in range(3)))
    # a new cluster's voter finishes enrolling once both others answered (agent/consensus/rebuild.py); one that
    # restarts before that resumes asking, and with node1 cut off it would stay a learner until the heal
    until("every node enrolled", lambda: all(status(c.addresses[k]).role == "voter" for k in range(3)))
    _cut(faults, "node1", ["node2", "node3"])
    for k in (1, 2):  # the majority side restarts during the partition: still paused
        c.signal(k, 15)
        proc = c.procs[k]
        assert proc is not None
        proc.wait(timeout=30)
        c.start(k)
    c.wait_healthy(timeout=60, which=[1, 2])
    assert all(_switch(c, k) == (1, "node1", True) for k in (1, 2))
    # the node that paused, cut off from the quorum, cannot resume: a clear error, and nothing changes
    r = emoe("resume", "--agent", c.addresses[0])
    assert r.returncode == 1 and "not committed" in r.stderr and "no reply from node2, node3" in r.stderr, r.stderr
    assert _switch(c, 0) == (1, "node1", True)
    # the majority resumes; after the partition heals the cut-off node learns it (anti-entropy)
    assert emoe("resume", "--agent", c.addresses[1]).returncode == 0
    until("the majority side holds the resume", lambda: all(_switch(c, k) == (2, "node2", False) for k in (1, 2)))
    assert _switch(c, 0) == (1, "node1", True)
    _heal(faults)
    until("node1 learns the resume", lambda: _switch(c, 0) == (2, "node2", False), timeout=30)
    # a pause tried while cut off never takes effect, on either side, after the heal
    _cut(faults, "node1", ["node2", "node3"])
    r = emoe("pause", "--agent", c.addresses[0])
    assert r.returncode == 1 and "did not change" in r.stderr, r.stderr
    _heal(faults)
    time.sleep(4.0)  # several anti-entropy rounds (consensus.sync_interval_ms = 1 s) and finish deadlines
    assert all(_switch(c, k) == (2, "node2", False) for k in range(3))
