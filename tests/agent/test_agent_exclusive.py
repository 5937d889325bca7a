"""One agent per port and per data_dir: a second one refuses to start with one line naming what is taken,
instead of sharing the port (SO_REUSEPORT split connections between two clusters) or the store (one
acceptor with two states)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent.datadir import DataDirError, DataDirLock
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
