"""The agent on the etcd backend: 3 agent processes commit through a real etcd (transaction
compare(version == v) -> put(v + 1)) and every node's shim link streams the certified table."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from chaos.etcdserver import EtcdProcess
from chaos.localcluster import LocalCluster
from tests.agent.test_e2e_cluster import SHAPE, W, first_commit_on_every_shim

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
