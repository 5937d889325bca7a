"""The agent on the etcd backend: 3 agent processes commit through a real etcd (transaction
compare(version == v) -> put(v + 1)) and every node's shim link streams the certified table."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator

import numpy as np
import pytest

from agent.cluster import LocalCluster
from agent.etcd_backend import EtcdProcess
from tests.test_e2e_cluster import SHAPE, W, _drive

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd binary not found (Debian: apt-get install etcd-server, or `make etcd`)")
    etcd = EtcdProcess(binary, str(tmp_path_factory.mktemp("etcd")))
    try:
        etcd.wait_ready()
        c = LocalCluster(3, tmp_path_factory.mktemp("etcdcluster"), SHAPE, profile="test", sections={
            "decision": {"window": W, "budget_windows": 1, "theta": 1.05, "tau": 0.01},
            "consensus": {"backend": "etcd", "etcd_endpoints": [etcd.endpoint]},
        })
        c.start()
        try:
            c.wait_healthy(timeout=60)
            yield c
        finally:
            c.stop()
    finally:
        etcd.stop()


def test_etcd_backend_commit_reaches_every_shim(etcd_cluster: LocalCluster) -> None:
    seen = asyncio.run(_drive(etcd_cluster, windows=30))
    firsts = {i: seen[i][0].commit for i in seen if seen[i]}
    assert len(firsts) == etcd_cluster.n, f"not every shim got a new version: {[len(v) for v in seen.values()]}"
    assert len({c.table.content_hash for c in firsts.values()}) == 1
    c = firsts[0]
    assert c.table.version == 2 and c.table.parent == 1
    phy = np.frombuffer(c.table.phy2log, "<i8").reshape(SHAPE["layers"], -1)
    assert (phy == 0).sum(axis=1).max() >= 2, "the hot expert 0 was not replicated"
