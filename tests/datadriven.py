"""The scenario-file format of the datadriven tests (etcd-raft `testdata` style), one parser for all of them.

A file is blocks separated by blank lines: `#` comment lines, a command line, a `----` line and the output
the command must print (no blank lines inside). `EMOE_REWRITE=1 pytest ...` rewrites every file's expected
outputs from what the code prints.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REWRITE_ENV = "EMOE_REWRITE"


@dataclass
class Block:
    comments: list[str]
    command: str
    expected: str
    line: int  # of the command, 1-based


def parse(text: str) -> list[Block]:
    blocks: list[Block] = []
    lines = text.splitlines()
    i, comments = 0, []
    while i < len(lines):
        ln = lines[i].rstrip()
        if not ln.strip():
            i += 1
            continue
        if ln.startswith("#"):
            comments.append(ln)
            i += 1
            continue
        if i + 1 >= len(lines) or lines[i + 1].strip() != "----":
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
    parts = ["\n".join([*b.comments, b.command, "----", *([out] if out else [])])
             for b, out in zip(blocks, outputs, strict=True)]
    return "\n\n".join(parts) + "\n"


def check_file(path: Path, run: Callable[[str], str]) -> None:
    """Run every command of `path` through `run` and compare with the expected outputs (or rewrite them)."""
    blocks = parse(path.read_text())
    assert blocks, f"{path} has no commands"
    outputs = [run(b.command) for b in blocks]
    if os.environ.get(REWRITE_ENV) == "1":
        path.write_text(render(blocks, outputs))
        return
    for b, out in zip(blocks, outputs, strict=True):
        assert out == b.expected, (f"{path.name}:{b.line}: {b.command}\n--- expected\n{b.expected}\n--- got\n{out}\n"
                                   f"({REWRITE_ENV}=1 rewrites the file)")
