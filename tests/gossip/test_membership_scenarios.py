"""Membership and load-gossip scenarios in etcd-raft `testdata` style (tests/scenarios/membership/*.txt).

Each block is a command, a `----` line and the output it must print, then a blank line; `#` lines are
comments. The first line of a file may be `# seed N` (default 0). Commands: see chaos.gossipsim.Scenario
(add-nodes, tick, run, partition, heal, crash, pause, resume, leave, loss, publish, stabilize, members,
view, history, config). The format and EMOE_REWRITE=1: tests/datadriven.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from chaos.gossipsim import Scenario
from tests.datadriven import check_file, parse, render

DIR = Path(__file__).resolve().parents[1] / "scenarios" / "membership"


def _scenario(path: Path) -> Scenario:
    m = re.match(r"#\s*seed\s+(\d+)", path.read_text())
    return Scenario(seed=int(m.group(1)) if m else 0)


FILES = sorted(DIR.glob("*.txt"))


def test_scenarios_exist() -> None:
    names = {p.stem for p in FILES}
    assert {"join", "leave", "crash", "pause_refute", "partition_heal"} <= names, names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_scenario(path: Path) -> None:
    check_file(path, _scenario(path).run)


def test_parse_render_round_trip() -> None:
    text = "# seed 3\n# a comment\nadd-nodes 2\n----\nadded n1-n2\n\nmembers\n----\nn1: x\nn2: y\n"
    blocks = parse(text)
    assert [b.command for b in blocks] == ["add-nodes 2", "members"]
    assert render(blocks, [b.expected for b in blocks]) == text
    with pytest.raises(ValueError, match="----"):
        parse("add-nodes 2\nmembers\n")
