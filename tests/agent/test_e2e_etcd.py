"""The agent on the etcd backend: 3 agent processes commit through a real etcd (transaction
compare(version == v) -> put(v + 1)) and every node's shim link streams the certified table."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from chaos.etcdserver import EtcdProcess
from chaos.localcluster import ROOT, LocalCluster
from tests.agent.test_e2e_cluster import SHAPE, W, first_commit_on_every_shim
from tests.conftest import until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def etcd_cluster(etcd_server: EtcdProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(3, tmp_path_factory.mktemp("etcdcluster"), SHAPE, profile="test", sections={
        "decision": {"window": W, "budget_windows": 1, "theta": 1.05, "tau": 0.01},
        "consensus": {"backend": "etcd", "etcd_endpoints": [etcd_server.endpoint]},
    })
    with c.running(timeout=60):
        yield c


def test_etcd_backend_commit_reaches_every_shim(etcd_cluster: LocalCluster) -> None:
    first_commit_on_every_shim(etcd_cluster)


def test_etcd_backend_pause_is_cluster_state(etcd_cluster: LocalCluster) -> None:
    """`emoe pause` on one agent writes etcd's switch key (agent/etcd/etcd_pause.py); every agent reads it."""
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)

    a = etcd_cluster.addresses
    r = cli("pause", "--agent", a[1])
    assert r.returncode == 0 and "committed by etcd" in r.stdout, r.stderr

    def switch(k: int) -> tuple[bool, str]:
        doc = json.loads(cli("status", "--json", "--agent", a[k]).stdout)
        rec = doc.get("pause", {}).get("record", {})
        return bool(doc["paused"]), str(rec.get("node_id", ""))

    until("every agent reads the pause", lambda: all(switch(k) == (True, "node2") for k in range(3)))
    assert cli("resume", "--agent", a[0]).returncode == 0
    until("every agent reads the resume", lambda: all(switch(k) == (False, "node1") for k in range(3)))
