"""`kill -9` a real process that is committing to a Store; recovery keeps every acknowledged commit (I7)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from agent.storage.store import Store

ROOT = Path(__file__).resolve().parents[2]

WRITER = r"""
import sys
from agent.storage.store import Store
from elasticmoe.v1 import consensus_pb2 as pb
s = Store(sys.argv[1]); rec = s.open()
v = rec.commits[-1].table.version if rec.commits else 1
big = bytes(range(256)) * 64  # 16 KiB tables, so that a kill often lands mid-write
while True:
    v += 1
    s.save_acceptor(pb.AcceptorState(version=v + 1, promised=pb.Ballot(round=1, node_id="w")))
    s.append_commit(pb.Commit(table=pb.RoutingTable(version=v, parent=v - 1, phy2log=big)))
    print(v, flush=True)  # acknowledged only after append_commit returned: written and fsync'd
"""


def _run_and_kill(log: Path, acks: int) -> int:
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(log)], cwd=ROOT, stdout=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    last = 0
    try:
        assert p.stdout is not None
        deadline = time.monotonic() + 60
        while last < acks and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            last = int(line)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.wait(timeout=10)
        if p.stdout is not None:
            p.stdout.close()
    assert p.returncode == -signal.SIGKILL
    return last


def test_kill9_keeps_every_committed_version(tmp_path: Path) -> None:
    log = tmp_path / "consensus.log"
    expect_from = 2
    for round_ in range(3):  # kill, recover, write on, kill again
        acked = _run_and_kill(log, acks=40 * (round_ + 1))
        assert acked > 0, "the writer acknowledged nothing"
        rec = Store(log).open()
        versions = [c.table.version for c in rec.commits]
        assert versions[: acked - 1] == list(range(2, acked + 1)), f"round {round_}: lost an acknowledged commit"
        assert versions == list(range(2, versions[-1] + 1)), "recovered log has a gap"
        assert versions[0] == expect_from
