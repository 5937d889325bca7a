"""The gossip benchmarks print the JSON the issue specifies (small sizes here; the full runs are
`python -m bench.gossip --nodes 128 --json` and `python -m bench.detect --nodes 64 --json`), and a
1024-node simulation runs faster than real time."""

from __future__ import annotations

import json
import time

import pytest

from bench import detect, gossip
from chaos.gossipsim import GossipSim, profile_gossip


def test_bench_gossip_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert gossip.main(["--nodes", "16", "--duration-s", "4", "--layers", "8", "--experts", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["nodes", "interval_ms", "t999_s", "bytes_per_node_per_s", "overhead_ratio",
                         "window_bytes_ep144"]
    assert out["nodes"] == 16 and out["interval_ms"] == 200
    assert 0 < out["t999_s"] <= 1.6
    assert out["bytes_per_node_per_s"] > 0 and out["overhead_ratio"] >= 1.0
    ep = out["window_bytes_ep144"]  # a node's window with its sampled steps at DeepSeek-V3's EP144 shape
    if "skipped" not in ep:
        assert ep["windows"] == 4 * 18 and ep["sample_every"] == 10
        assert 58 * 256 * 4 < ep["median"] <= ep["max"] < ep["signed_max"] <= ep["budget"] == 4 * 59392
        assert ep["within_budget"] is True


def test_bench_gossip_signed_windows_carry_their_signature_and_certificate(capsys: pytest.CaptureFixture[str]) -> None:
    """--signed: as under mTLS, windows are signed at their origin and verified at every hop; the window's bytes
    (and so every byte figure) include the signature and certificate."""
    sizes = {}
    for flag in ([], ["--signed"]):
        assert gossip.main(["--nodes", "8", "--duration-s", "4", "--layers", "8", "--experts", "16", "--detail",
                            *flag]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["incomplete"] == 0
        sizes[bool(flag)] = out["window_bytes"]
    assert 8 * 16 * 4 < sizes[False] < 8 * 16 * 4 + 64
    assert 400 < sizes[True] - sizes[False] < 1000  # an ECDSA P-256 signature and a DER certificate


def test_bench_detect_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert detect.main(["--nodes", "16", "--trials", "1", "--crashes", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["nodes", "detect_p99_s", "false_deaths"]
    assert out["nodes"] == 16 and 0 < out["detect_p99_s"] <= 3.0 and out["false_deaths"] == 0


@pytest.mark.slow
def test_1024_agents_in_one_process() -> None:
    """Steady state after the join (the join storm itself is O(N^2 log N) rumours: `warm` skips it). The
    speed (CPU seconds per simulated second) is printed, not asserted: it is a figure, not a property."""
    sim = GossipSim(seed=1, cfg=profile_gossip("lan"))
    sim.record_events = False
    sim.add_nodes(1024, warm=True)
    sim.run(2.0)
    assert sim.converged()
    cpu = time.process_time()
    sim.run(3.0)
    used = time.process_time() - cpu
    assert sim.converged()
    print(f"1024 agents: {used / 3.0:.2f} CPU s per simulated s")
