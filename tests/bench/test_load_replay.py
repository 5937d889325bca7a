"""`emoe load replay` (issue 33): a hand-started cluster fed from a trace through the engines' real link, one
plugin core per rank: the agents' windows fill, they commit, and a second feed continues past the windows the
first one closed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from agent.cli import exits
from bench.cli_load import _Interrupt
from chaos.localcluster import ROOT, LocalCluster, free_ports
from controlplane.tracefile import Trace

pytestmark = pytest.mark.slow

L, E, W = 4, 16, 20
SHAPE = {"nodes": 3, "ranks_per_node": 2, "slots_per_rank": 4, "layers": L, "experts": E, "top_k": 2}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(3, tmp_path_factory.mktemp("cluster"), SHAPE, profile="test",
                     sections={"decision": {"window": W, "budget_windows": 1, "theta": 1.05, "tau": 0.01}})
    with c.running(timeout=60):
        yield c


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(7)
    p = np.ones(E)
    p[[0, 1]] = 10.0  # experts 0 and 1 (both on rank 0 in the static genesis) are hot in every layer
    p /= p.sum()
    counts = np.stack([rng.multinomial(128, p, size=L) for _ in range(300)]).astype(np.uint32)
    path = tmp_path_factory.mktemp("trace") / "skewed.npz"
    Trace(counts, "test", 2, "synthetic", "synthetic").save(path)
    return path


def _emoe(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _status(c: LocalCluster, k: int = 0) -> dict[str, object]:
    r = _emoe("status", "--json", "--agent", c.addresses[k])
    assert r.returncode == 0, r.stderr
    doc: dict[str, object] = json.loads(r.stdout)
    return doc


def test_a_replay_fills_the_windows_and_the_agents_commit(cluster: LocalCluster, trace: Path) -> None:
    pairs = [x for i in range(3) for x in ("--agent", cluster.addresses[i], "--shim-socket", cluster.shim_socket(i))]
    r = _emoe("load", "replay", str(trace), *pairs, "--rate", "300", "--steps", "600", "--json")
    assert r.returncode == 0, (r.stdout, r.stderr)
    doc = json.loads(r.stdout)
    assert doc["steps"] == 600 and doc["ranks"] == list(range(6)) and doc["nodes"] == ["node1", "node2", "node3"]
    assert doc["reports_sent"] > 0 and doc["reports_dropped"] == 0
    assert "step 600/600" in r.stderr  # progress, once a second and at the end
    st = _status(cluster)
    assert float(st["step_imbalance"]) >= 1.0 and int(st["window_seq"]) >= 10, st  # type: ignore[arg-type]
    assert int(st["committed_version"]) >= 2, st  # type: ignore[arg-type]
    assert max(doc["installed_versions"]) >= 2  # the ranks' plugin cores installed what the agents committed
    hist = json.loads(_emoe("history", "--json", "--agent", cluster.addresses[1]).stdout)
    assert any(int(e["version"]) >= 2 and e["plan"]["ops"] for e in hist["entries"])
    # the ranks run the committed head (their reports say so), and are not waited for once the feed has gone
    ranks = {g["rank"]: g for g in st["ranks"]}  # type: ignore[union-attr]
    assert {int(g["installed_version"]) for g in ranks.values()} == {max(doc["installed_versions"])}

    # a second feed, the agents taken from their configs: it starts past the newest window, so it counts
    before = int(st["window_seq"])  # type: ignore[arg-type]
    cfgs = [x for p in cluster.configs for x in ("--config", str(p))]
    r = _emoe("load", "replay", str(trace), *cfgs, "--rate", "300", "--seconds", "1.5", "--json")
    assert r.returncode == 0, (r.stdout, r.stderr)
    doc2 = json.loads(r.stdout)
    assert doc2["first_step"] >= (before + 1) * W and doc2["steps"] < 600
    assert int(_status(cluster)["window_seq"]) > before  # type: ignore[arg-type]
    assert all(cluster.healthy(k) for k in range(3))


def test_bad_input_is_named(cluster: LocalCluster, trace: Path, tmp_path: Path) -> None:
    a, s = cluster.addresses[0], cluster.shim_socket(0)
    r = _emoe("load", "replay", str(trace), "--agent", a)
    assert r.returncode == 2 and "1 --agent and 0 --shim-socket" in r.stderr, r.stderr
    r = _emoe("load", "replay", str(trace), "--agent", a, "--shim-socket", str(tmp_path / "none.sock"))
    assert r.returncode == 2 and "none.sock" in r.stderr and "No such file" in r.stderr, r.stderr
    r = _emoe("load", "replay", str(trace), "--agent", "127.0.0.1", "--shim-socket", s)
    assert r.returncode == 2 and "bad address '127.0.0.1'" in r.stderr, r.stderr
    other = tmp_path / "wide.npz"
    Trace(np.ones((5, L, E + 1), np.uint32), "x", 2, "x", "x").save(other)
    r = _emoe("load", "replay", str(other), "--agent", a, "--shim-socket", s)
    assert r.returncode == 2 and f"{L} layers x {E + 1} experts; the cluster has {L} x {E}" in r.stderr, r.stderr
    r = _emoe("load", "replay", str(tmp_path / "missing.npz"), "--agent", a, "--shim-socket", s)
    assert r.returncode == 2 and "missing.npz" in r.stderr, r.stderr
    r = _emoe("load", "replay", str(trace), "--agent", f"127.0.0.1:{free_ports(1)[0]}", "--shim-socket", s)
    assert r.returncode == 3 and "unreachable" in r.stderr, r.stderr


def test_ctrl_c_stops_the_feed_and_still_prints_the_summary(cluster: LocalCluster, trace: Path) -> None:
    """SIGINT (Ctrl-C, or a harness ending the load) stops the feed: the replay flushes its last reports and prints
    its summary, and exits 130. The chaos soak read no summary once, with the signal landing in the flush."""
    cfgs = [x for p in cluster.configs for x in ("--config", str(p))]
    p = subprocess.Popen([sys.executable, "-m", "agent.cli", "load", "replay", str(trace), *cfgs, "--rate", "100",
                          "--steps", "100000", "--json"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        assert p.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not p.stderr.readline().strip().startswith("step "):
            pass
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == exits.INTERRUPTED, (p.returncode, err)
    doc = json.loads(out)
    assert 0 < doc["steps"] < 100000 and doc["reports_sent"] > 0 and doc["reports_dropped"] == 0, doc


def test_the_first_sigint_asks_the_second_interrupts() -> None:
    """The rule behind the summary: inside the feed, the first SIGINT only asks (whatever code it lands in, the
    flush included); a second one interrupts at once; the handler before it is back afterwards."""
    before = signal.getsignal(signal.SIGINT)
    with _Interrupt() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs between bytecodes of the main thread
        assert stop.asked
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    assert signal.getsignal(signal.SIGINT) is before
