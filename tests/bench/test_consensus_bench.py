"""bench/commit.py end to end, small: three real `bench.consensus_serve` processes over gRPC."""

from __future__ import annotations

from pathlib import Path

from bench.commit import percentile, run_backend, summarize


def test_percentile() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 50) in (50.0, 51.0) and percentile(xs, 99) == 99.0 and percentile([3.0], 99) == 3.0


def test_three_processes_commit_every_version(tmp_path: Path) -> None:
    res = run_backend("quorum", agents=3, versions=12, workdir=tmp_path, etcd="", timeout=90, interval_ms=0)
    results = res["results"]
    assert len(results) == 3 and all(r["head"] >= 13 for r in results)
    assert sum(len(r["latencies_ms"]) for r in results) == 12  # every version committed by its owner
    assert all(not r["failures"] for r in results)
    s = summarize(results, warmup=3)
    assert s["samples"] > 0 and 0 < s["p50_ms"] <= s["p99_ms"]
