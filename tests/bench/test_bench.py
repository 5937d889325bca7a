"""`emoe bench`: a short run writes every key; recovery and regression metrics on hand-made cases."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agent.cli import main
from bench.metrics import Install, PolicyRun, recovery_steps, regressions
from bench.policies import controller_available, make_policy
from chaos.synthetic import synthetic_trace
from controlplane.table import initial_table
from controlplane.topology import Topology

KEYS = {"mean_step_imbalance", "p50_step_ms", "p99_step_ms", "recovery_steps", "bytes_moved", "replica_slots",
        "stall_ms_total", "commits", "regressions"}


def test_short_bench_run_writes_results_with_every_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    rc = main(["bench", "--synthetic", "4x16", "--segment-steps", "600", "--segments", "2", "--nodes", "2",
               "--ranks-per-node", "2", "--slots-per-rank", "5", "--window", "20", "--top-k", "2",
               "--batch", "256", "--seed", "1", "--no-progress", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert {"trace", "step_model", "drift_steps", "policies"} <= set(res)
    assert res["step_model"] == "synthetic" and res["drift_steps"] == [600]
    names = ["static", "eplb", "craft", "craft-periodic", "elastic", "hindsight"]
    assert list(res["policies"]) == names
    for name in names:
        entry = res["policies"][name]
        if name == "elastic" and controller_available() is not None:
            assert "unavailable" in entry
            continue
        assert KEYS <= set(entry), name
        assert len(entry["recovery_steps"]) == 1
    pol = res["policies"]
    assert pol["static"]["bytes_moved"] == 0 and pol["static"]["commits"] == 0
    assert pol["eplb"]["stall_ms_total"] > 0 and pol["eplb"]["bytes_moved"] > 0
    assert pol["hindsight"]["stall_ms_total"] == 0 and pol["hindsight"]["commits"] == 2
    assert pol["hindsight"]["mean_step_imbalance"] < pol["static"]["mean_step_imbalance"]
    for f in ("imbalance.png", "bytes_moved.png", "step_time_cdf.png"):
        assert (out / f).stat().st_size > 0
    assert "| eplb |" in capsys.readouterr().out


def test_bench_rejects_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--synthetic", "4x16", "--policies", "static,nope", "--out", str(tmp_path)]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["bench", "--synthetic", "4by16", "--out", str(tmp_path)]) == 2
    assert main(["bench", "--out", str(tmp_path)]) == 2
    with pytest.raises(ValueError, match="PERIOD"):
        make_policy("static:5", 100, 1, 1.0, 3)


def test_recovery_steps_counts_until_the_average_stays_near_the_reference() -> None:
    W = 10
    ref = np.ones(100)
    imb = np.ones(100)
    imb[50:65] = 2.0  # drift at 50: bad for 15 steps
    # the trailing 10-step average is within 1.1 once at most one of its steps is bad: 9 + 14 steps in
    assert recovery_steps(imb, ref, [50], W) == [23]
    assert recovery_steps(np.ones(100), ref, [50], W) == [0]
    never = np.ones(100)
    never[50:] = 1.5
    assert recovery_steps(never, ref, [50], W) == [50]


def test_regressions_count_installs_worse_than_the_table_they_replaced() -> None:
    topo = Topology(1, 2, 2)
    good = initial_table(topo, 1, 4)  # experts 0,1 on rank 0; 2,3 on rank 1
    bad = good.successor(np.array([[0, 2, 1, 3]]))  # 0,2 on rank 0
    counts = np.tile(np.array([[[10, 1, 10, 1]]], dtype=np.uint32), (20, 1, 1))
    run = PolicyRun(np.ones(20), np.ones(20), np.zeros(20), np.zeros(20))
    run.installs = [Install(5, good, bad, 0.0, "x"), Install(12, bad, good, 0.0, "x")]
    assert regressions(run, counts, 4) == 1
    # rank 1 dies at step 3: the install at 5 replaces a table that still uses it (a repair), and is not
    # compared; the one at 12 replaces `bad`, which uses rank 1 too
    from bench.rankloss import Kill

    assert regressions(run, counts, 4, [Kill(1, 3)]) == 0
    assert regressions(run, counts, 4, [Kill(1, 6)]) == 1  # dead only after the first install


def test_synthetic_trace_is_skewed_drifting_and_labelled() -> None:
    tr = synthetic_trace(3, 32, 50, 3, top_k=4, batch=128, seed=2, ramp_steps=10)
    assert tr.counts.shape == (150, 3, 32) and tr.step_model == "synthetic" and tr.drift_steps == [50, 100]
    seg = [tr.counts[a:a + 50].sum(axis=0) for a in (0, 50, 100)]
    assert (seg[0].max(axis=1) > 3 * seg[0].mean(axis=1)).all()  # skewed
    assert (seg[0].argmax(axis=1) != seg[1].argmax(axis=1)).any()  # the hot set moves


def test_esft_shortcuts_play_intent_then_law_as_segments() -> None:
    import argparse

    from bench.cli_bench import load_traces
    from tests.conftest import need_shared_traces

    need_shared_traces()
    args = argparse.Namespace(synthetic=None, trace=["esft:intent", "esft:law"], batch=64, segment_steps=40,
                              seed=0, cold_start=False, ramp_steps=0)
    tr = load_traces(args)
    assert tr.counts.shape == (80, 26, 64) and tr.drift_steps == [40]
    assert tr.source == "esft:intent -> esft:law" and "staggered" in tr.step_model
    assert (tr.counts.sum(axis=2) == 64 * 6).all()  # every lane routes one token to top-6 experts per layer


def test_ramp_mixes_the_new_segment_in_linearly() -> None:
    from bench.traces import Trace, ramp

    a = Trace(np.tile(np.array([[[100, 0]]], dtype=np.uint32), (10, 1, 1)), "m", 1, "a", "synthetic")
    b = Trace(np.tile(np.array([[[0, 100]]], dtype=np.uint32), (10, 1, 1)), "m", 1, "b", "synthetic")
    tr = ramp([a, b], 10, 4)
    assert tr.drift_steps == [10] and tr.counts.shape == (20, 1, 2)
    assert tr.counts[10:14, 0, 1].tolist() == [25, 50, 75, 100]
    assert (tr.counts.sum(axis=2) == 100).all()
    assert (tr.counts[:10, 0, 0] == 100).all() and (tr.counts[14:, 0, 1] == 100).all()
    with pytest.raises(ValueError, match="ramp_steps"):
        ramp([a, b], 10, 11)


def _kill_run(tmp_path: Path) -> dict:
    out = tmp_path / "kill"
    rc = main(["bench", "--synthetic", "4x16", "--segment-steps", "600", "--segments", "2", "--nodes", "2",
               "--ranks-per-node", "2", "--slots-per-rank", "8", "--window", "20", "--top-k", "2", "--batch", "256",
               "--seed", "1", "--policies", "static,eplb:200,elastic,hindsight", "--kill-rank", "1@300",
               "--detect-steps", "40", "--no-progress", "--no-plots", "--out", str(out)])
    assert rc == 0
    return json.loads((out / "results.json").read_text())


def test_kill_rank_elastic_holds_and_repairs_eplb_sends_to_the_dead_rank_until_its_rebalance(tmp_path: Path) -> None:
    if controller_available() is not None:
        pytest.skip("controlplane.controller unavailable")
    res = _kill_run(tmp_path)
    assert res["rank_loss"]["kills"] == [{"rank": 1, "step": 300}]
    pol = {n: p["rank_loss"] for n, p in res["policies"].items()}
    el, ep, st, hs = pol["elastic"], pol["eplb:200"], pol["static"], pol["hindsight"]
    # elastic: detected 40 steps after the kill, repaired after commit + host reload, nothing sent or lost
    assert el["detect_step"] == [340] and len(el["repair_step"]) == 1 and el["repair_step"][0] >= 343
    assert el["sent_to_dead_rank"] == 0 and el["dropped_tokens"] == 0 and el["delayed_tokens"] > 0
    assert 0 < el["max_delay_steps"] <= el["repair_step"][0] - 300
    assert el["unserved_steps"] == el["repair_step"][0] - 300
    assert el["recovery_steps"][0] >= el["repair_step"][0] - 300
    # eplb: no reaction until its next periodic rebalance (step 400), every pair meanwhile sent and lost
    assert ep["repair_step"] == [400] and ep["delayed_tokens"] == 0
    assert ep["dropped_tokens"] == ep["sent_to_dead_rank"] > 0 and ep["unserved_steps"] == 100
    assert ep["recovery_steps"][0] >= 100
    # static never reacts; the oracle re-plans at the kill
    assert st["unserved_steps"] == 900 and st["recovery_steps"] == [300] and st["dropped_tokens"] > ep["dropped_tokens"]
    assert hs["recovery_steps"] == [0] and hs["dropped_tokens"] == hs["delayed_tokens"] == 0 and hs["repair_step"] == [300]
    elastic = res["policies"]["elastic"]
    assert [d["kind"] for d in elastic["decisions"] if d["step"] == 340] == ["repair"]
    assert elastic["delayed_tokens"] == el["delayed_tokens"] and "recovery_steps_after_kill" in elastic


def test_kill_rank_arguments_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.rankloss import Kill, parse_kills

    assert parse_kills(["3@10", "1@5"], 4, 100) == [Kill(1, 5), Kill(3, 10)]
    for bad, why in ((["x@1"], "R@STEP"), (["4@1"], "rank 4"), (["1@100"], "step 100"), (["1@5", "1@6"], "once"),
                     (["0@1", "1@1", "2@1", "3@1"], "no live rank")):
        with pytest.raises(ValueError, match=why):
            parse_kills(bad, 4, 100)
    args = ["bench", "--synthetic", "4x16", "--segment-steps", "50", "--nodes", "2", "--ranks-per-node", "2",
            "--slots-per-rank", "5", "--policies", "static", "--no-progress", "--no-plots", "--out", str(tmp_path)]
    assert main([*args, "--kill-rank", "1@20"]) == 1  # 16 experts do not fit on 3 ranks of 5 slots
    assert "surviving ranks" in capsys.readouterr().err


def test_outage_counts_held_pairs_as_delayed_until_a_chunk_serves_their_expert() -> None:
    from bench.rankloss import Outage

    lost = np.zeros((3, 1, 2), dtype=np.int64)
    lost[:, 0, 0] = 5  # expert 0: 5 pairs held at steps 10, 11, 12
    lost[2, 0, 1] = 7  # expert 1: 7 pairs at step 12, never served again
    o = Outage(holds=True)
    o.record(0, None, None)
    o.record(10, lost, np.array([[False, False]]))
    o.record(13, np.zeros((4, 1, 2), dtype=np.int64), np.array([[False, False]]))
    o.record(17, np.zeros((3, 1, 2), dtype=np.int64), np.array([[True, False]]))
    f = o.finish(20)
    assert f["delayed_tokens"] == 15 and f["dropped_tokens"] == 7 and f["sent_to_dead_rank"] == 0
    assert f["max_delay_steps"] == 7 and f["mean_delay_steps"] == pytest.approx((7 + 6 + 5) * 5 / 15)
    assert o.lost_at is not None and o.lost_at[10:13].tolist() == [5, 5, 12] and o.lost_at.sum() == 22
    sent = Outage(holds=False)
    sent.record(10, lost, None)
    assert sent.finish(20)["dropped_tokens"] == sent.finish(20)["sent_to_dead_rank"] == 22


def test_recovery_after_a_kill_needs_every_pair_served_and_the_average_near_the_oracle() -> None:
    from bench.rankloss import recovery_after

    imb, ref = np.ones(200), np.ones(200)
    lost = np.zeros(200, dtype=np.int64)
    lost[100:130] = 1  # pairs unserved for 30 steps after the kill at 100, imbalance fine throughout
    assert recovery_after(imb, lost, ref, 100, 200, 10) == 30
    assert recovery_after(imb, np.zeros(200, dtype=np.int64), ref, 100, 200, 10) == 0
    imb[100:] = 1.5
    assert recovery_after(imb, lost, ref, 100, 200, 10) == 100


def test_eplb_over_survivors_leaves_dead_ranks_empty_and_inactive() -> None:
    from bench.rankloss import eplb_surviving, masked

    topo = Topology(2, 2, 6)
    base = initial_table(topo, 2, 16)
    totals = np.arange(32, dtype=np.int64).reshape(2, 16) + 1
    t = eplb_surviving(base, totals, {1})
    assert t.active_ranks == (0, 2, 3) and (t.phy2log.reshape(2, 4, 6)[:, 1] == -1).all()
    assert t.version == base.version + 1 and t.is_valid()
    m = masked(base, np.array([False, True, False, False]))
    assert m.active_ranks == (0, 2, 3) and (m.logcnt[:, 4:8] == 0).all() and not m.is_valid()


def test_a_named_case_sets_the_serving_shape_and_a_flag_overrides_it() -> None:
    import argparse

    from bench.cli_bench import apply_case

    def args(**kw: object) -> argparse.Namespace:
        base = dict(case=None, trace=[], synthetic=None, initial=None, nodes=None, ranks_per_node=None,
                    slots_per_rank=None, batch=None, expert_groups=None)
        return argparse.Namespace(**{**base, **kw})

    a = args(case="deepseek-prefill-ep32")
    apply_case(a)
    assert (a.nodes, a.ranks_per_node, a.slots_per_rank, a.batch, a.expert_groups) == (4, 8, 9, 131072, 1)
    assert a.trace == ["sglang:prefill_in512", "sglang:prefill_in4096"] and a.initial == "eplb:sglang:prefill_in512"
    a = args(case="deepseek-decode-ep144", slots_per_rank=3, trace=["esft:law"])
    apply_case(a)
    assert (a.nodes, a.slots_per_rank, a.batch, a.trace) == (18, 3, 18432, ["esft:law"])
    a = args()
    apply_case(a)
    assert (a.nodes, a.ranks_per_node, a.slots_per_rank, a.batch, a.initial) == (2, 8, 5, 2048, "static")
