"""`emoe bench --live`: the elastic policy as real agent processes fed by one engine plugin core per rank.
A short synthetic drift on 2 agents x 2 ranks: the agents commit, every rank installs the same versions at
the same steps, and the bench serves the trace under them like any policy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agent.cli import main
from bench.agentfeed import node_shares, rank_shares
from bench.live import behind_warning
from bench.policies import install_step
from controlplane.baselines.eplb import eplb_table
from controlplane.table import initial_table
from controlplane.topology import Topology


def test_a_live_run_commits_installs_and_reports_like_the_in_process_bench(tmp_path: Path) -> None:
    out = tmp_path / "live"
    # segments of 400 steps: the agents hold their first rebalance until they fit their step time from the
    # engines' measured steps (20 sampled steps: 200 of a 300-step segment, controlplane.steptime WARMING_UP)
    rc = main(["bench", "--synthetic", "4x16", "--segment-steps", "400", "--segments", "2", "--nodes", "2",
               "--ranks-per-node", "2", "--slots-per-rank", "6", "--window", "20", "--top-k", "2", "--batch", "512",
               "--seed", "3", "--policies", "static,elastic", "--live", "--live-step-ms", "5", "--agree-every", "4",
               "--no-progress", "--no-plots", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    el = res["policies"]["elastic"]
    live = el["live"]
    assert live["agents"] == 2 and live["plugin_cores"] == 4
    assert live["replay_s"] >= 800 * 0.005 and live["behind"] == pytest.approx(live["replay_s"] / 4.0 - 1, abs=0.05)
    steps = [i["step"] for i in live["installs"]]
    versions = [i["version"] for i in live["installs"]]
    assert versions and versions == sorted(set(versions)) and versions[0] >= 2  # committed, in order
    assert all(s % 4 == 1 for s in steps)  # served from the step after an agreement step (every 4)
    assert el["commits"] == len(versions) and el["bytes_moved"] > 0
    assert el["mean_step_imbalance"] < res["policies"]["static"]["mean_step_imbalance"]
    # what `emoe explain` says each rebalance was decided with, for every version the engines installed: a step
    # time from the steps the plugin cores timed (their fit, or where they are too even to fit, their median
    # step), not one handed in nor the configured default
    said = live["explained"]
    assert sorted(int(v) for v in said) == versions, said
    assert all(("fitted from" in s["step_time"] or "the engines' median measured step" in s["step_time"])
               and "configured default" not in s["step_time"] for s in said.values()), said


def test_a_replay_that_falls_behind_its_schedule_says_so() -> None:
    """The replay cannot step faster than the machine: more than 10% late, the live figures are of an
    overloaded cluster (DeepSeek-V3 decode 8x8 at 10 ms a step on 2 cores: 24-71% late; at 30 ms, 3% late and
    1.2617 mean step imbalance against 1.2595 in-process)."""
    assert behind_warning(4000, 0.03, 123.1, 8, 64) is None  # 3% late
    warn = behind_warning(4000, 0.01, 72.5, 8, 64)
    assert warn is not None and "81% behind" in warn and "8 agents and 64 engine ranks" in warn
    assert "--live-step-ms (now 10;" in warn


def test_the_live_engines_and_the_bench_feed_split_load_alike() -> None:
    """Each rank serves its replicas' share of an expert's tokens; a node, its ranks' sum (bench.agentfeed)."""
    topo = Topology(2, 2, 3)
    rng = np.random.default_rng(0)
    base = eplb_table(initial_table(topo, 2, 8), rng.integers(1, 100, (2, 8)))
    per_rank, _ = rank_shares(base)
    per_node = node_shares(base)
    assert np.allclose(per_rank.reshape(2, 2, 2, 8).sum(axis=1), per_node)
    assert np.allclose(per_rank.sum(axis=0), 1.0)


@pytest.mark.parametrize(("arrival", "every", "served"), [(2103, 32, 2113), (2112, 32, 2113), (2113, 32, 2145),
                                                           (7, 1, 8)])
def test_a_commit_is_served_from_the_step_after_the_next_agreement(arrival: int, every: int, served: int) -> None:
    assert install_step(arrival, every) == served


def test_the_bench_feed_delivers_exactly_the_cluster_counts_through_every_nodes_load_path() -> None:
    """bench.agentfeed: 3 nodes' engine reports -> their LoadPaths -> windows as gossip bytes -> the deciding
    node's cluster windows: each closed window's totals and sampled steps are the trace's, to the token."""
    from bench.agentfeed import LoadFeed

    topo = Topology(3, 2, 4)
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 200, (300, 2, 16)).astype(np.uint32)
    table = eplb_table(initial_table(topo, 2, 16), counts.sum(axis=0, dtype=np.int64))
    got: list[tuple[int, np.ndarray, np.ndarray | None]] = []
    feed = LoadFeed(topo, 2, 16, 100, 10, lambda seq, total, samples, missing: got.append((seq, total, samples)))
    for k in range(3):
        feed.feed(100 * k, counts[100 * k:100 * (k + 1)], table)
    assert [seq for seq, *_ in got] == [0, 1, 2]
    for seq, total, samples in got:
        window = counts[100 * seq:100 * (seq + 1)]
        assert np.array_equal(total, window.sum(axis=0, dtype=np.uint64))
        assert samples is not None and np.array_equal(samples, window[::10])
    assert len(feed.window_bytes) == 3 * 3 and feed.bytes_per_window()["max"] > 2 * 16 * 4


def test_the_live_bench_passes_every_decision_setting_of_the_agents_config() -> None:
    """`--live --elastic-param K=V` reaches the agents through their [decision] config: the keys it accepts
    are exactly that section's fields (a new knob is not silently in-process only)."""
    from agent.config import DecisionConfig
    from bench.live import DECISION_KEYS

    assert set(DECISION_KEYS) == set(DecisionConfig.__struct_fields__)
