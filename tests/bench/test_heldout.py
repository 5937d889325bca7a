"""bench.heldout: the acceptance cases and the held-out runs, judged in one table."""

from __future__ import annotations

import json
from pathlib import Path

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
    assert len(set(heldout.CASES) | set(heldout.HELD_OUT)) == 15


@pytest.mark.skipif(not OLMOE_DIR.is_dir(), reason=f"needs the OLMoE traces in {OLMOE_DIR}")
def test_a_short_held_out_run_is_benched_and_judged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = heldout.main(["--out", str(tmp_path), "--jobs", "1", "--only", "r5-olmoe-arxiv-github", "--",
                       "--segment-steps", "300", "--policies", "eplb,craft,craft-periodic,static,hindsight,elastic"])
    res = json.loads((tmp_path / "r5-olmoe-arxiv-github" / "results.json").read_text())
    assert res["policies"]["elastic"]["mean_step_imbalance"] >= 1.0
    table = capsys.readouterr().out
    assert "| r5-olmoe-arxiv-github |" in table
    assert rc == (0 if table.rstrip().endswith("| yes |") else 1)
