"""One agent per port and per data_dir: a second one refuses to start with one line naming what is taken,
instead of sharing the port (SO_REUSEPORT split connections between two clusters) or the store (one
acceptor with two states). A start that fails leaves no LOCK file; one a killed agent left is taken over."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import AgentConfig, from_dict
from agent.process import AgentProcess, StartupError
from agent.storage.datadir import DataDirError, DataDirLock
from chaos.localcluster import ROOT, LocalCluster, free_ports, write_config

pytestmark = pytest.mark.slow

SHAPE = {"nodes": 1, "ranks_per_node": 2, "slots_per_rank": 4, "layers": 2, "experts": 8, "top_k": 2}


def _second(tmp_path: Path, listen: str, data_dir: str, shim: str) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "second.toml"
    write_config(cfg, {"node_id": "node1", "profile": "test", "listen": listen, "seeds": [f"node1@{listen}"],
                       "data_dir": data_dir, "shim_socket": shim}, {"cluster": SHAPE})
    return subprocess.run([sys.executable, "-m", "agent.cli", "agent", "--config", str(cfg)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_second_agent_on_the_same_port_or_data_dir_refuses(tmp_path: Path) -> None:
    c = LocalCluster(1, tmp_path / "c", SHAPE)
    with c.running(timeout=60):
        first_dir = str(tmp_path / "c" / "node1" / "data")
        r = _second(tmp_path, c.addresses[0], str(tmp_path / "other"), str(tmp_path / "other.sock"))
        assert r.returncode == 2, r.stderr
        assert f"listen = '{c.addresses[0]}': cannot bind" in r.stderr and "Traceback" not in r.stderr
        port = free_ports(1)[0]
        r = _second(tmp_path, f"127.0.0.1:{port}", first_dir, str(tmp_path / "other2.sock"))
        assert r.returncode == 2, r.stderr
        pid = c.procs[0].pid if c.procs[0] is not None else -1
        assert f"is in use by another agent (pid {pid})" in r.stderr and "Traceback" not in r.stderr
        r = _second(tmp_path, f"127.0.0.1:{port}", str(tmp_path / "other3"), c.shim_socket(0))
        assert r.returncode == 2 and "shim_socket" in r.stderr and "in use" in r.stderr, r.stderr
        assert c.healthy(0)  # the first one never noticed


def test_lock_is_released_by_the_holder_and_refused_to_others(tmp_path: Path) -> None:
    with DataDirLock(tmp_path):
        with pytest.raises(DataDirError, match="in use by another agent"):
            DataDirLock(tmp_path).acquire()
    DataDirLock(tmp_path).acquire().release()  # released on exit


def test_unusable_data_dir_is_named(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(DataDirError, match="data_dir = .*file.*cannot be used"):
        DataDirLock(f / "sub").acquire()


# ---- no stale LOCK (issue 33): removed on release and after every failed start; a dead holder's is taken over

def test_release_removes_the_lock_file(tmp_path: Path) -> None:
    lock = DataDirLock(tmp_path).acquire()
    assert (tmp_path / "LOCK").read_text() == f"{os.getpid()}\n"
    lock.release()
    assert not (tmp_path / "LOCK").exists()
    lock.release()  # idempotent


_HOLD = """
import sys, time
from agent.storage.datadir import DataDirLock
DataDirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(60)
"""


def test_a_lock_left_by_a_killed_holder_is_taken_over_with_a_log_line(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    with subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                          text=True) as p:
        assert p.stdout is not None and p.stdout.readline().strip() == "locked"
        with pytest.raises(DataDirError, match=f"in use by another agent \\(pid {p.pid}\\)"):
            DataDirLock(tmp_path).acquire()  # alive: refused, named
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
    assert (tmp_path / "LOCK").read_text() == f"{p.pid}\n"  # kill -9 leaves the file (not the flock)
    with caplog.at_level(logging.WARNING, logger="agent"):
        lock = DataDirLock(tmp_path).acquire()
    assert [r.getMessage() for r in caplog.records] == [
        f"data_dir {tmp_path}: took over the LOCK file left by pid {p.pid}, which no longer holds it (it was "
        f"killed or crashed without stopping cleanly)"]
    assert (tmp_path / "LOCK").read_text() == f"{os.getpid()}\n"
    lock.release()


def test_a_lock_file_removed_between_open_and_flock_is_not_taken(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A opens LOCK; its holder releases (removes it) and C takes a new LOCK; A's flock on the removed file
    succeeds, and must not count: A checks the path still names its file, opens the new one, and is refused."""
    import agent.storage.datadir as datadir

    first = DataDirLock(tmp_path).acquire()
    stale = os.open(tmp_path / "LOCK", os.O_RDWR)  # A's open, before the holder lets go
    first.release()
    c = DataDirLock(tmp_path).acquire()
    real_open, calls = os.open, []

    def open_(path: object, flags: int, mode: int = 0o777) -> int:
        calls.append(path)
        return stale if len(calls) == 1 else real_open(path, flags, mode)  # type: ignore[arg-type]

    monkeypatch.setattr(datadir.os, "open", open_)
    with pytest.raises(DataDirError, match=f"pid {os.getpid()}"):
        DataDirLock(tmp_path).acquire()
    assert len(calls) == 2
    monkeypatch.undo()
    c.release()


def test_no_lock_file_after_a_failed_start(tmp_path: Path) -> None:
    """Every way `emoe agent` fails after taking its data_dir's lock leaves no LOCK behind: a listen port,
    a shim socket held by another process; and the in-process start says the same."""
    taken = socket.create_server(("127.0.0.1", 0))
    sock_path = tmp_path / "held.sock"
    held = socket.socket(socket.AF_UNIX)
    held.bind(str(sock_path))
    held.listen()
    try:
        busy = f"127.0.0.1:{taken.getsockname()[1]}"
        free = f"127.0.0.1:{free_ports(1)[0]}"
        for name, listen, shim in (("port", busy, str(tmp_path / "a.sock")), ("shim", free, str(sock_path))):
            data = tmp_path / name
            r = _second(tmp_path, listen, str(data), shim)
            assert r.returncode == 2 and ("cannot bind" in r.stderr or "in use" in r.stderr), r.stderr
            assert data.is_dir() or name == "shim"  # the port case took the lock, then failed
            assert not (data / "LOCK").exists(), (name, r.stderr)
        cfg = _cfg(tmp_path, busy, str(tmp_path / "inproc"), str(tmp_path / "b.sock"))
        with pytest.raises(StartupError, match="cannot bind"):
            asyncio.run(AgentProcess(cfg).start())
        assert (tmp_path / "inproc").is_dir() and not (tmp_path / "inproc" / "LOCK").exists()
    finally:
        taken.close()
        held.close()


def _cfg(tmp_path: Path, listen: str, data_dir: str, shim: str) -> AgentConfig:
    return from_dict({"node_id": "node1", "profile": "test", "listen": listen, "seeds": [f"node1@{listen}"],
                      "data_dir": data_dir, "shim_socket": shim, "cluster": SHAPE})
