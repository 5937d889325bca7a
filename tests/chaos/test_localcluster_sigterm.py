"""A harness that runs real agents (`emoe bench --live`, `emoe demo`) and is sent SIGTERM stops its agents:
they run in sessions of their own, so without the handler they outlived it, serving on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chaos.localcluster import ROOT

pytestmark = pytest.mark.slow

SCRIPT = """
import sys, time
from pathlib import Path
from chaos.localcluster import LocalCluster
shape = {"nodes": 2, "ranks_per_node": 2, "slots_per_rank": 4, "layers": 4, "experts": 16, "top_k": 2}
c = LocalCluster(2, Path(sys.argv[1]), shape, profile="test")
with c.running(timeout=60):
    print(" ".join(str(p.pid) for p in c.procs if p is not None), flush=True)
    for _ in range(1200):  # a harness's loop, as the live bench's steps (a signal that another thread takes
        time.sleep(0.1)    # runs its handler when the main thread next wakes: not during one long sleep)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_the_harness_stops_its_agents(tmp_path: Path) -> None:
    agents: list[int] = []
    with subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stderr is not None
            line = proc.stdout.readline()  # once every agent serves (running() waits for health, up to 60 s)
            agents = [int(x) for x in line.split()]
            assert agents, f"the harness printed no agent pid: {line!r}; stderr: {proc.stderr.read()}"
            assert all(_alive(p) for p in agents)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)  # the agents get 10 s to drain, then are killed
            assert proc.returncode != 0 and "KeyboardInterrupt" in err, err  # interrupted, as by Ctrl-C
            deadline = time.monotonic() + 5
            while any(_alive(p) for p in agents) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not [p for p in agents if _alive(p)], "agents outlived the harness that SIGTERM stopped"
        finally:
            if proc.poll() is None:
                proc.kill()
            for p in agents:
                if _alive(p):
                    os.killpg(p, signal.SIGKILL)
