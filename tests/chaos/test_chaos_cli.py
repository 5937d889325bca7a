"""The chaos CLI's bookkeeping for long runs: --resume keeps the reports of an interrupted run, --tally sums
them without running anything, --recheck refuses to resume from code that does not reproduce them, and one
schedule that raises is reported while the others run on."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from chaos.__main__ import main

logging.getLogger("agent").setLevel(logging.ERROR)


def test_resume_keeps_the_reports_of_an_interrupted_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--runner", "sim", "--nodes", "4", "--schedules", "3", "--seed", "5", "--json", "--jobs", "1",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (tmp_path / "run-00001.json").unlink()  # "interrupted" before schedule 1 was written
    r2 = json.loads((tmp_path / "run-00002.json").read_text())
    r2["config"]["faults"] = 99  # written by another command: not reused
    (tmp_path / "run-00002.json").write_text(json.dumps(r2))
    assert main([*argv, "--resume"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["resumed"] == 1 and first["resumed"] == 0
    assert (again["commits"], again["violations"]) == (first["commits"], first["violations"])  # seeded: same runs
    assert json.loads((tmp_path / "run-00002.json").read_text())["config"]["faults"] == 3
    assert main(["run", "--runner", "sim", "--schedules", "1", "--resume"]) == 2  # needs --out


def test_tally_sums_a_partial_run_without_running_anything(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A 1000-schedule run outlives a session: --tally gives its figures so far from the reports on disk."""
    argv = ["run", "--runner", "sim", "--nodes", "4", "--seed", "7", "--json", "--jobs", "1", "--out", str(tmp_path)]
    assert main([*argv, "--schedules", "2"]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    r1 = json.loads((tmp_path / "run-00001.json").read_text())
    assert main([*argv, "--schedules", "5", "--resume", "--tally"]) == 0
    part = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(p.name for p in tmp_path.glob("run-*.json")) == ["run-00000.json", "run-00001.json"]  # ran none
    assert (part["schedules"], part["done"], part["resumed"]) == (5, 2, 2)
    assert part["seeds"] == [7 * 1_000_003, r1["seed"]] and part["commits"] == first["commits"]
    assert part["tokens"]["sent"] == sum(json.loads(f.read_text())["tokens"]["sent"]
                                         for f in tmp_path.glob("run-*.json")) > 0
    assert sum(part["faults"].values()) >= 2 and "tick" not in part["faults"]
    assert json.loads((tmp_path / "tally.json").read_text()) == part
    assert main([*argv, "--schedules", "2", "--tally"]) == 2  # needs --resume
    assert "--tally needs --resume" in capsys.readouterr().err


def test_recheck_resumes_only_where_this_tree_reproduces_the_kept_reports(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A long run resumed from other code (a later commit) would mix two programs' figures: --recheck re-runs
    kept schedules first and refuses to resume when a report differs."""
    argv = ["run", "--runner", "sim", "--nodes", "4", "--seed", "7", "--json", "--jobs", "1", "--out", str(tmp_path)]
    assert main([*argv, "--schedules", "2"]) == 0
    capsys.readouterr()
    assert main([*argv, "--schedules", "3", "--resume", "--recheck", "2"]) == 0
    err = capsys.readouterr().err
    assert err.count(": identical") >= 1 and (tmp_path / "run-00002.json").exists()
    f = max(tmp_path.glob("run-*.json"), key=lambda f: json.loads(f.read_text())["commits"])
    r = json.loads(f.read_text())
    assert r["commits"] > 0
    r["violations"]["I1"] = ["a report this code would not write"]  # "another program wrote it"
    f.write_text(json.dumps(r))
    assert main([*argv, "--schedules", "4", "--resume", "--recheck", "3"]) == 2
    err = capsys.readouterr().err
    assert "differs in violations" in err and "not resuming" in err
    assert not (tmp_path / "run-00003.json").exists()  # nothing more run
    assert main([*argv, "--schedules", "4", "--recheck", "1"]) == 2  # needs --resume


def test_a_schedule_that_raises_is_reported_and_the_others_run_on(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """An exception in one schedule (a planner defect raised InvalidOperation out of a rollback; the error did
    not even unpickle in the pool's parent) killed the whole 1000-schedule run with BrokenProcessPool."""
    import pickle

    import chaos.simrun
    from controlplane.errors import InvalidOperation

    e = pickle.loads(pickle.dumps(InvalidOperation("RANK_INACTIVE", "rank 28 is not active")))
    assert (e.reason, str(e)) == ("RANK_INACTIVE", "INVALID_OPERATION: RANK_INACTIVE: rank 28 is not active")
    real = chaos.simrun.run_schedule

    def flaky(nodes: int, seed: int, *a: object, **kw: object) -> object:
        if seed % 1_000_003 == 1:  # the second schedule
            raise InvalidOperation("RANK_INACTIVE", "planted")
        return real(nodes, seed, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(chaos.simrun, "run_schedule", flaky)
    assert main(["run", "--runner", "sim", "--nodes", "3", "--schedules", "3", "--json", "--jobs", "1",
                 "--faults", "1"]) == 1
    res = capsys.readouterr()
    summary = json.loads(res.out.strip().splitlines()[-1])
    assert summary["errors"] == 1 and summary["error_seeds"] == [1_000_004] and summary["commits"] > 0
    assert "RANK_INACTIVE: planted" in res.err
