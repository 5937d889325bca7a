"""Real disks under real agent processes: a full disk (a small tmpfs) fail-stops a node's votes and loses
nothing it acknowledged; a byte flipped mid-log makes the agent refuse to start, naming the offset; the
operator's repair moves the log aside and the node rebuilds from its peers as a learner."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.storage.store import parse
from chaos.localcluster import ROOT, LocalCluster
from tests.conftest import until as _until

pytestmark = pytest.mark.slow

SHAPE = {"nodes": 3, "ranks_per_node": 2, "slots_per_rank": 4, "layers": 2, "experts": 8, "top_k": 2}
SECTIONS = {"consensus": {"disk_retry_ms": 200, "sync_interval_ms": 300},
            "decision": {"window": 10, "theta": 100.0}}  # no rebalancing of its own: only the operator's commits


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def _status(c: LocalCluster, k: int) -> dict[str, object]:
    r = _cli("status", "--agent", c.addresses[k], "--json")
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def _head(c: LocalCluster, k: int) -> int:
    return int(str(_status(c, k)["committed_version"]))


def _caught_up(c: LocalCluster, k: int, ref: int) -> Callable[[], bool]:
    """Agent k holds what agent `ref` holds (other commits, say a repair after a long kill, may come too)."""
    return lambda: _head(c, k) == _head(c, ref)



def _commit_pair(c: LocalCluster, via: int, rank: int) -> int:
    """Two operator commits (drain then restore a rank); returns the version of the second. A drain refused for
    room is tried again for a while: on a loaded machine a restarted agent can be declared dead meanwhile and
    its ranks repaired away until its rejoin restores them."""
    deadline = time.monotonic() + 30
    while True:
        r = _cli("drain", "--agent", c.addresses[via], str(rank), "--json")
        if "DRAIN_REFUSED" not in r.stdout or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stdout + r.stderr
    r = _cli("restore", "--agent", c.addresses[via], str(rank), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stdout + r.stderr
    return int(json.loads(r.stdout)["version"])


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "small"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_disk_full_fail_stops_then_resumes_and_loses_nothing(tmp_path: Path, tmpfs: Path) -> None:
    c = LocalCluster(3, tmp_path / "c", SHAPE, sections=SECTIONS)
    node3_data = tmp_path / "c" / "node3" / "data"
    node3_data.symlink_to(tmpfs)  # node3's data_dir lives on the 1 MiB tmpfs
    with c.running(timeout=60):
        v = _commit_pair(c, 0, 1)
        _until("node3 holds the first commits", lambda: _head(c, 2) >= v)
        filler = tmpfs / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:  # fill the disk to the last byte
            while True:
                os.write(fd, b"\0" * 512)
        except OSError as e:
            assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)
        # two voters still make a quorum; node3's next write fails (the first records may still fit in the
        # last page of its log file, which the filler cannot take: commit until one does not)
        for _ in range(8):
            v = _commit_pair(c, 0, 1)
            time.sleep(0.5)
            if not c.healthy(2):
                break
        _until("node3 reports NOT_SERVING", lambda: not c.healthy(2))
        st = _status(c, 2)
        assert str(st["health"]).startswith("NOT_SERVING: store failed") and "No space left" in str(st["health"])
        assert int(str(st["committed_version"])) < v  # it acknowledged nothing it could not write
        r = _cli("drain", "--agent", c.addresses[2], "3")
        assert r.returncode != 0 and "NOT_SERVING" in r.stderr  # no mutating call through it meanwhile
        log = (node3_data / "consensus").read_bytes()
        assert parse(log)[1] == len(log)  # no partial record left mid-file
        os.unlink(filler)  # space returns
        _until("node3 serves again", lambda: c.healthy(2))
        _until("node3 caught up", _caught_up(c, 2, 0))
        v = _head(c, 2)
        c.kill(2)  # kill -9, then a restart: everything it acknowledged is on its disk
        c.start(2)
        c.wait_healthy(which=[2])
        assert _head(c, 2) >= v
        log = (node3_data / "consensus").read_bytes()
        rec, end = parse(log)
        assert end == len(log) and sorted(int(x.table.version) for x in rec.commits)[-1] >= v


def test_corrupt_log_refuses_to_start_then_repair_rebuilds_as_learner(tmp_path: Path) -> None:
    c = LocalCluster(3, tmp_path / "c", SHAPE, sections=SECTIONS)
    with c.running(timeout=60):
        v = 0
        for rank in (1, 2, 3):
            v = _commit_pair(c, 0, rank)
        _until("node2 holds every commit", lambda: _head(c, 1) >= v)
        c.kill(1)
        log_path = tmp_path / "c" / "node2" / "data" / "consensus"
        data = bytearray(log_path.read_bytes())
        at = len(data) // 3
        data[at] ^= 0x5A
        log_path.write_bytes(bytes(data))
        c.start(1)
        proc = c.procs[1]
        assert proc is not None and proc.wait(timeout=30) == 2
        out = c.log(1).read_text()
        assert "corrupt record at offset" in out and "emoe store repair" in out and "Traceback" not in out
        assert log_path.read_bytes() == bytes(data)  # nothing truncated
        r = _cli("store", "check", "--config", str(c.configs[1]))
        assert r.returncode == 1 and "corrupt: bad record at offset" in r.stderr
        r = _cli("store", "repair", "--config", str(c.configs[1]))
        assert r.returncode == 0 and "moved the log to" in r.stdout, r.stderr
        assert not log_path.exists() and list(log_path.parent.glob("consensus.corrupt-*"))
        c.start(1)
        c.wait_healthy(which=[1])
        _until("node2 rebuilt its log from its peers", _caught_up(c, 1, 0))
        role = str(_status(c, 1)["role"])  # a learner until the others commit one past what it may have voted on
        assert role == "voter" or "learner" in role, role
        _commit_pair(c, 0, 1)  # the others commit without it; it learns and votes again
        _until("node2 is a voter again", lambda: _status(c, 1)["role"] == "voter")
        c.kill(0)  # now its vote is needed for a quorum, and given
        v = _head(c, 2)  # (node1 may be declared dead meanwhile, and its ranks repaired away: use node3's own)
        assert _commit_pair(c, 2, 4) >= v + 2


def test_a_log_cut_at_a_record_boundary_is_noticed_and_rebuilt(tmp_path: Path) -> None:
    """The last records of a killed agent's log are cut (an older copy of the file): it still parses, so only
    the high-water mark beside it tells. The agent says how many acknowledged bytes are missing, rejoins as a
    learner, and votes again once the others have committed past it."""
    c = LocalCluster(3, tmp_path / "c", SHAPE, sections=SECTIONS)
    with c.running(timeout=60):
        v = 0
        for rank in (1, 2):
            v = _commit_pair(c, 0, rank)
        _until("node2 holds every commit", lambda: _head(c, 1) >= v)
        c.kill(1)
        log_path = tmp_path / "c" / "node2" / "data" / "consensus"
        data = log_path.read_bytes()
        ends = parse(data)[0].ends
        log_path.write_bytes(data[:ends[-3]])  # its last two records gone
        r = _cli("store", "check", "--config", str(c.configs[1]))
        assert r.returncode == 1 and "cut: the log ends at byte" in r.stderr, r.stdout + r.stderr
        c.start(1)
        c.wait_healthy(which=[1])
        out = c.log(1).read_text()
        assert f"{len(data) - ends[-3]} bytes of acknowledged records are missing" in out, out[-2000:]
        assert "learner" in str(_status(c, 1)["role"])
        _commit_pair(c, 0, 1)  # the others commit without it; it learns and votes again
        _until("node2 is a voter again", lambda: _status(c, 1)["role"] == "voter")
        r = _cli("store", "check", "--config", str(c.configs[1]))
        assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
