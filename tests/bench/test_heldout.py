"""bench.heldout: the acceptance cases and the held-out runs, judged in one table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench import heldout
from bench.traces import OLMOE_DIR


def test_an_unknown_run_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        heldout.main(["--out", str(tmp_path), "--only", "r99"])
    assert "--only ['r99']" in capsys.readouterr().err


def test_every_run_names_its_trace_and_boot() -> None:
    for name, flags in heldout.HELD_OUT.items():
        assert "--trace" in flags or "--seed" in flags, name  # a run the cases are not: other data or seed
    assert len(set(heldout.CASES) | set(heldout.HELD_OUT)) == 19


def test_every_case_and_held_out_run_is_played_in_both_constructions() -> None:
    names = [*heldout.CASES, *heldout.HELD_OUT]
    runs = heldout.plan(names, list(heldout.CONSTRUCTIONS))
    assert {(r.name, r.construction) for r in runs} == {(n, c) for n in names for c in ("steady", "cold-start")}
    for r in runs:
        assert ("--cold-start" in r.flags.split()) == (r.construction == "cold-start"), r
    assert len({r.label for r in runs}) == len(runs) == 38  # each written to its own OUT/construction/name


@pytest.mark.skipif(not OLMOE_DIR.is_dir(), reason=f"needs the OLMoE traces in {OLMOE_DIR}")
def test_a_short_held_out_run_is_benched_and_judged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = heldout.main(["--out", str(tmp_path), "--jobs", "1", "--only", "r5-olmoe-arxiv-github", "--",
                       "--segment-steps", "300", "--policies", "eplb,craft,craft-periodic,static,hindsight,elastic"])
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| r5-olmoe-arxiv-github |")]
    assert [row.split(" | ")[1] for row in rows] == ["steady", "cold-start"]  # one table, both constructions
    for construction in ("steady", "cold-start"):
        res = json.loads((tmp_path / construction / "r5-olmoe-arxiv-github" / "results.json").read_text())
        assert res["policies"]["elastic"]["mean_step_imbalance"] >= 1.0
        assert res["construction"]["name"] == construction  # results.json says how its steps were built
        assert ("burst" in res["construction"]["counts_only"]["construction"]) == (construction == "cold-start")
    assert rc == (0 if all(row.rstrip().endswith("| yes |") for row in rows) else 1)


# ---- the cold-start constructions (issue 49: both constructions everywhere) ----------------------------------

def _cv(x: np.ndarray) -> float:
    return float(x.std() / x.mean())


def test_a_zipf_trace_is_built_from_its_description() -> None:
    """zipf:EXPERTS/TOP_K/HOT/LAYERS/MIX_SEED: each layer's hottest expert takes HOT of its tokens, the shares
    fall with rank, which expert is hot is the mix seed's (another seed: a drift), the steps are drawn as for
    counts-only data (a cold start in burst waves); a bad spec is refused naming the form."""
    from bench.traces import import_zipf, zipf_totals

    t = zipf_totals(6, 128, 0.25, 7)
    share = t / t.sum(axis=1, keepdims=True)
    assert t.shape == (6, 128) and np.allclose(share.max(axis=1), 0.25, atol=1e-6)
    assert len({int(np.argmax(r)) for r in share}) > 1  # permuted per layer
    other = zipf_totals(6, 128, 0.25, 107)
    assert (t == zipf_totals(6, 128, 0.25, 7)).all() and not (t == other).all()
    assert np.allclose(np.sort(share, axis=1), np.sort(other / other.sum(axis=1, keepdims=True), axis=1))
    steady = import_zipf("128/1/0.25/6/7", batch=256, steps=300, seed=0)
    cold = import_zipf("128/1/0.25/6/7", batch=256, steps=300, seed=0, burst=True)
    assert steady.counts.shape == cold.counts.shape == (300, 6, 128) and steady.top_k == 1
    assert (steady.counts.sum(axis=2) == 256).all() and _cv(cold.counts[:, 0, :].sum(axis=1)) > 0.25
    for bad in ("128/1/0.25/6", "128/1/0.005/6/7", "8/9/0.5/2/1", "x/1/0.2/2/1"):
        with pytest.raises(ValueError, match="zipf"):
            import_zipf(bad)


def test_the_burst_construction_is_seeded_and_deterministic() -> None:
    from bench.traces import burst_steps

    totals = np.array([[50, 20, 10, 5, 5, 4, 3, 3], [8, 8, 8, 8, 8, 8, 8, 8]])
    a, b = burst_steps(totals, 2, 64, 400, seed=3), burst_steps(totals, 2, 64, 400, seed=3)
    assert a.shape == (400, 2, 8) and (a == b).all()
    assert not (a == burst_steps(totals, 2, 64, 400, seed=4)).all()  # the seed is what fixes it


def test_a_burst_cold_start_is_burstier_than_steady_state_on_the_same_source() -> None:
    from bench.traces import BURST_FLOOR, burst_steps, sample_steps

    totals = np.array([[50, 20, 10, 5, 5, 4, 3, 3], [8, 8, 8, 8, 8, 8, 8, 8]])
    cold, steady = burst_steps(totals, 2, 64, 600, seed=0), sample_steps(totals, 2, 64, 600, seed=0)
    tokens_cold, tokens_steady = cold[:, 0, :].sum(axis=1) / 2, steady[:, 0, :].sum(axis=1) / 2
    assert _cv(tokens_steady) == 0.0 and _cv(tokens_cold) > 0.25  # the batch fills and drains in waves
    assert tokens_cold.min() >= np.ceil(BURST_FLOOR * 64) and tokens_cold.max() == 64
    # fewer tokens in a step draw a noisier top expert: its share varies more from step to step
    top = lambda c: c[:, 0, :].max(axis=1) / c[:, 0, :].sum(axis=1)  # noqa: E731
    assert _cv(top(cold)) > _cv(top(steady))
    # every layer of a step carries the same batch (tokens pick top_k experts in every layer)
    assert (cold.sum(axis=2) == cold[:, :1, :].sum(axis=2)).all()


def test_lockstep_lanes_are_burstier_than_staggered_ones_on_the_same_esft_task() -> None:
    from bench.traces import ESFT_DIR, pseudo_decode, read_esft_task
    from tests.conftest import need_shared_traces

    need_shared_traces()
    samples = read_esft_task(ESFT_DIR / "intent")[:24]
    cold = pseudo_decode(samples, 64, batch=32, steps=200, seed=0, stagger=False)
    steady = pseudo_decode(samples, 64, batch=32, steps=200, seed=0, stagger=True)
    assert (cold == pseudo_decode(samples, 64, batch=32, steps=200, seed=0, stagger=False)).all()
    top = lambda c: c[:, 0, :].max(axis=1) / c[:, 0, :].sum(axis=1)  # noqa: E731
    assert _cv(top(cold)) > _cv(top(steady))  # lanes in step through the shared prompt template


@pytest.mark.skipif(not OLMOE_DIR.is_dir(), reason=f"needs the OLMoE traces in {OLMOE_DIR}")
def test_trace_import_writes_a_burst_cold_start_on_request(tmp_path: Path) -> None:
    from agent.cli import main
    from bench.traces import load_trace

    for flags, name in (([], "steady.npz"), (["--burst"], "cold.npz")):
        assert main(["trace", "import", "olmoe", "--domain", "arxiv", "--batch", "64", "--steps", "300", *flags,
                     "--out", str(tmp_path / name)]) == 0
    steady, cold = load_trace(tmp_path / "steady.npz"), load_trace(tmp_path / "cold.npz")
    assert "burst" in cold.step_model and "burst" not in steady.step_model
    assert _cv(steady.counts[:, 0, :].sum(axis=1)) == 0.0 and _cv(cold.counts[:, 0, :].sum(axis=1)) > 0.25
