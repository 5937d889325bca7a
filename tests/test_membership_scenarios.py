"""Membership and load-gossip scenarios in etcd-raft `testdata` style (tests/scenarios/membership/*.txt).

Each block is a command, a `----` line and the output it must print, then a blank line; `#` lines are
comments. The first line of a file may be `# seed N` (default 0). Commands: see agent.gossip_sim.Scenario
(add-nodes, tick, run, partition, heal, crash, pause, resume, leave, loss, publish, stabilize, members,
view, history, config). EMOE_REWRITE=1 rewrites the expected outputs from what the code prints.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.gossip_sim import Scenario

DIR = Path(__file__).resolve().parent / "scenarios" / "membership"


@dataclass
class Block:
    comments: list[str]
    command: str
    expected: str
    line: int


def parse(text: str) -> list[Block]:
    blocks: list[Block] = []
    lines = text.splitlines()
    i, comments = 0, []
    while i < len(lines):
        ln = lines[i]
        if not ln.strip():
            i += 1
            continue
        if ln.startswith("#"):
            comments.append(ln)
            i += 1
            continue
        if i + 1 >= len(lines) or lines[i + 1] != "----":
            raise ValueError(f"line {i + 1}: command {ln!r} is not followed by a '----' line")
        start, i = i + 1, i + 2
        out = []
        while i < len(lines) and lines[i].strip():
            out.append(lines[i])
            i += 1
        blocks.append(Block(comments, ln, "\n".join(out), start))
        comments = []
    return blocks


def render(blocks: list[Block], outputs: list[str]) -> str:
    parts = []
    for b, out in zip(blocks, outputs, strict=True):
        parts.append("\n".join([*b.comments, b.command, "----", out]))
    return "\n\n".join(parts) + "\n"


def run_file(path: Path) -> tuple[list[Block], list[str]]:
    text = path.read_text()
    m = re.match(r"#\s*seed\s+(\d+)", text)
    scenario = Scenario(seed=int(m.group(1)) if m else 0)
    blocks = parse(text)
    return blocks, [scenario.run(b.command) for b in blocks]


FILES = sorted(DIR.glob("*.txt"))


def test_scenarios_exist() -> None:
    names = {p.stem for p in FILES}
    assert {"join", "leave", "crash", "pause_refute", "partition_heal"} <= names, names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_scenario(path: Path) -> None:
    blocks, outputs = run_file(path)
    if os.environ.get("EMOE_REWRITE") == "1":
        path.write_text(render(blocks, outputs))
        return
    for b, out in zip(blocks, outputs, strict=True):
        assert out == b.expected, (f"{path.name}:{b.line}: {b.command}\n--- expected\n{b.expected}\n"
                                   f"--- got\n{out}\n(EMOE_REWRITE=1 rewrites the file)")


def test_parse_render_round_trip() -> None:
    text = "# seed 3\n# a comment\nadd-nodes 2\n----\nadded n1-n2\n\nmembers\n----\nn1: x\nn2: y\n"
    blocks = parse(text)
    assert [b.command for b in blocks] == ["add-nodes 2", "members"]
    assert render(blocks, [b.expected for b in blocks]) == text
    with pytest.raises(ValueError, match="----"):
        parse("add-nodes 2\nmembers\n")
