"""End to end: 3 agent processes, and one plugin core per EP rank (dataplane_shim.plugin.PluginCore, the engine
side of vLLM's and SGLang's plugins) on its node's unix-socket link, stepping together: each step reports its
load (with the version it runs), agrees on the newest version every rank holds (the MIN all-reduce, done here
over the cores' vectors) and installs it. One rank is held on an old version (its installs stop, as an engine
whose rearrangement silently stalled): `emoe status` flags it LAGGING within engine.install_lag_s while the
others show installed == committed, and `emoe propose --wait` times out naming it; released, it catches up
and the next `propose --wait` returns once every rank installed."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from chaos.localcluster import ROOT, LocalCluster
from controlplane.topology import Topology
from dataplane_shim.genesis import genesis_table
from dataplane_shim.link import LinkThread
from dataplane_shim.plugin import PluginCore
from tests.conftest import until

pytestmark = pytest.mark.slow

L, E, NODES, RPN, S = 2, 8, 3, 2, 4
SHAPE = {"nodes": NODES, "ranks_per_node": RPN, "slots_per_rank": S, "layers": L, "experts": E, "top_k": 2}
BOUND = 1.5  # engine.install_lag_s for this test
HELD = 3     # a rank of node2


class Ranks:
    """Every EP rank's plugin core, stepped on a thread every `step_s`; ranks in `held` install nothing."""

    def __init__(self, cluster: LocalCluster, step_s: float = 0.05) -> None:
        topo = Topology(NODES, RPN, S)
        boot = genesis_table("static", topo, L, E).phy2log
        self.links = [LinkThread(cluster.shim_socket(g // RPN), 1, shim_id=f"rank{g}", ranks=[g])
                      for g in range(topo.ranks)]
        self.cores = [PluginCore(link, topo, L, E, g, boot, genesis="static")  # type: ignore[arg-type]
                      for g, link in enumerate(self.links)]
        self.held: set[int] = set()
        self.step_s, self.stop = step_s, threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rng = np.random.default_rng(0)
        try:
            while not self.stop.is_set():
                for core in self.cores:
                    core.add_load(rng.integers(0, 20, size=(L, E)))
                    core.maybe_report()
                red = np.min([core.agreement_vector() for core in self.cores], axis=0)  # the EP all-reduce MIN
                for core in self.cores:
                    target = core.decide(red)
                    if target is not None and core.rank not in self.held:
                        core.installed(target.version)
                time.sleep(self.step_s)
        except BaseException as e:  # noqa: BLE001 - surfaced by the test
            self.errors.append(e)

    def __enter__(self) -> Ranks:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)
        for link in self.links:
            link.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(NODES, tmp_path_factory.mktemp("installs"), SHAPE, profile="test",
                     sections={"engine": {"install_lag_s": BOUND}, "decision": {"window": 10}})
    with c.running(timeout=60):
        yield c


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def status(c: LocalCluster, k: int) -> dict[str, Any]:
    """`emoe status --json` of agent k: its own ranks under "ranks" (rank -> fields), as a test reads them."""
    r = _cli("status", "--json", "--agent", c.addresses[k])
    assert r.returncode == 0, r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    doc["by_rank"] = {int(i["rank"]): i for i in doc.get("ranks", [])}
    return doc



def _replicate_op(c: LocalCluster) -> list[str]:
    """A valid replicate: an expert of layer 0 onto a rank that has a free slot and no replica of it."""
    lay = json.loads(_cli("placement", "--agent", c.addresses[0], "--json", "--layer", "0").stdout)["layers"]["0"]
    for g, row in enumerate(lay["ranks"]):
        if -1 in row:
            e = next(e for e in range(E) if e not in row)
            return ["replicate", "0", str(e), str(g)]
    raise AssertionError(f"no free slot in layer 0: {lay['ranks']}")


def _all_at(c: LocalCluster, version: int) -> bool:
    return all(int(i["installed_version"]) >= version for k in range(NODES) for i in status(c, k)["ranks"])


def test_a_held_rank_is_flagged_and_named_and_the_others_show_the_head(cluster: LocalCluster) -> None:
    for k in range(NODES):  # no automatic rebalancing: the versions are the ones this test proposes
        assert _cli("pause", "--agent", cluster.addresses[k]).returncode == 0
    with Ranks(cluster) as ranks:
        until("every rank reports version 1", lambda: _all_at(cluster, 1))
        ranks.held.add(HELD)
        r = _cli("propose", "--agent", cluster.addresses[0], "--force", "--wait", "--install-timeout", "4",
                 *_replicate_op(cluster))
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert "rank 3 (on node2) runs version 1" in r.stderr and "not installed after" in r.stderr, r.stderr
        assert "rank 2 " not in r.stderr and r.stderr.count("rank ") == 1, r.stderr  # the others installed it
        head = int(status(cluster, 0)["committed_version"])
        assert head == 2

        # the wait took 4 s > the 1.5 s bound: node2's agent flags rank 3, the others show the head
        s2 = status(cluster, 1)
        assert s2["node_id"] == "node2" and s2["install_lag_bound_s"] == BOUND and sorted(s2["by_rank"]) == [2, 3]
        held, ok = s2["by_rank"][HELD], s2["by_rank"][2]
        assert held["lagging"] is True and int(held["installed_version"]) == 1 and held["lag_s"] > BOUND
        assert held["attached"] is True and held["active"] is True and 0 <= held["report_age_s"] < 1.0
        assert ok["lagging"] is False and int(ok["installed_version"]) == head and ok["lag_s"] == 0
        for k in (0, 2):
            assert all(int(i["installed_version"]) == head and not i["lagging"] for i in status(cluster, k)["ranks"])
        human = _cli("status", "--agent", cluster.addresses[1]).stdout
        assert "engine ranks of node2" in human and "LAGGING " in human, human
        assert "LAGGING " not in _cli("status", "--agent", cluster.addresses[0]).stdout

        ranks.held.clear()  # released: it installs v2, and the next wait returns once all six run v3
        until("rank 3 catches up", lambda: not status(cluster, 1)["by_rank"][HELD]["lagging"], timeout=10)
        r = _cli("propose", "--agent", cluster.addresses[2], "--force", "--wait", "--json", *_replicate_op(cluster))
        assert r.returncode == 0, (r.stdout, r.stderr)
        doc = json.loads(r.stdout)
        assert doc["committed"] is True and doc["install"]["done"] is True
        assert sorted(i["rank"] for i in doc["install"]["installed"]) == list(range(NODES * RPN))
        assert all(i["installed_version"] >= int(doc["version"]) for i in doc["install"]["installed"])
        assert not ranks.errors, ranks.errors


def test_drain_and_restore_return_once_installed(cluster: LocalCluster) -> None:
    with Ranks(cluster) as ranks:
        until("every rank reports the head", lambda: _all_at(cluster, int(status(cluster, 0)["committed_version"])))
        r = _cli("drain", "5", "--agent", cluster.addresses[0])
        assert r.returncode == 0 and "installed: version" in r.stdout, (r.stdout, r.stderr)
        assert "runs on 5 engine rank(s)" in r.stdout  # rank 5 is drained: not waited for
        r = _cli("restore", "5", "--agent", cluster.addresses[0])
        assert r.returncode == 0 and "runs on 6 engine rank(s)" in r.stdout, (r.stdout, r.stderr)
        assert not ranks.errors, ranks.errors
