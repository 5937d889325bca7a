"""chaos.soak, shortened so that it cannot rot: 3 agent processes beside 12 live plugin ranks fed by `emoe load
replay`, one agent killed with SIGKILL 30 s in and restarted 5 s later (longer than its death takes to be declared,
~2.5 s), 72 s in all: the report says what the 25-minute soak says (kills, commits, memory), and no commit
follows the kill (issue 49, finding 5: at 67b8e70 the survivors repaired the absent node's serving ranks and
rebalanced onto them as if idle)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.localcluster import ROOT

pytestmark = pytest.mark.slow


def test_a_short_soak_reports_a_kill_and_no_commit_after_it(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "chaos.soak", "--minutes", "1.2", "--kill-every", "30", "--down", "5",
                        "--sample-every", "5", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    print(r.stdout[-6000:], r.stderr[-3000:])
    doc = json.loads((tmp_path / "soak.json").read_text())
    assert r.returncode == (0 if doc["ok"] else 1), (r.returncode, doc["failures"])
    assert "Kills" in r.stdout and "Commits" in r.stdout and "Memory and open files" in r.stdout

    [kill] = doc["kills"]
    assert kill["node"] == "node1" and kill["at_s"] >= 30 and kill["down_s"] >= 5
    assert kill["dead_after_s"] is not None, "the survivors never declared the killed agent dead: no real absence"
    assert kill["serving_s"] is not None and kill["reach_s"] >= kill["down_s"] + doc["dead_timeout_s"]

    assert doc["replay"].get("steps", 0) > 0.8 * doc["args"]["rate"] * 60, doc["replay"]  # the ranks served throughout
    for cm in doc["commits"]:
        assert {"version", "at_s", "kind", "ops", "bytes", "trigger", "after_kill"} <= set(cm)
        assert cm["at_s"] is not None
    assert doc["commits_after_kills"] == sum(1 for cm in doc["commits"] if cm["after_kill"])
    assert doc["commits_after_kills"] == 0, [cm for cm in doc["commits"] if cm["after_kill"]]

    mem = doc["memory"]
    assert set(mem) == {"node1", "node2", "node3"}
    assert mem["node1"]["lives"] == 2 and mem["node2"]["lives"] == 1
    for m in mem.values():
        assert m["warm"]["rss_kb"] > 10_000 and m["warm"]["fds"] > 5
        assert {"rss_growth", "fds_growth", "rss_max_kb", "fds_max", "end"} <= set(m)
    pids = {s["pid"] for s in doc["samples"]["node1"]}
    assert len(pids) == 2, "the restarted agent's series restarts with its process"
    assert not doc["failures"] or not doc["ok"]
