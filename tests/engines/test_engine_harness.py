"""No rank process outlives its engine harness (tests/engines/rankprocs.py): a harness that runs past its
timeout is killed with its whole process group, the rank processes it spawned included, checked by their pids.
Before, a timed-out harness (subprocess.run's timeout kills only the harness's own process) left both ranks
running, holding their ports and CPU for the rest of the suite."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from chaos.localcluster import ROOT, free_ports
from tests.engines import rankprocs
from tests.engines.test_engine_vllm import HARNESS, _ranks, _wait, engine_python

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_no_rank_process_outlives_a_harness_timeout(tmp_path: Path) -> None:
    """Two vLLM ranks (no agents, no commits) step until told to stop; the harness is given 1 s more once
    both step, and runs past it: both rank pids are gone when the timeout is raised."""
    py = engine_python()
    out, cdir = tmp_path / "ranks", tmp_path / "commits"
    for d in (out, cdir / "rank0", cdir / "rank1"):
        d.mkdir(parents=True)
    with open(tmp_path / "ranks.log", "wb") as log:
        proc = rankprocs.start(
            [py, str(HARNESS / "vllm_ranks.py"), "--out", str(out), "--port", str(free_ports(1)[0]), "--sockets",
             f"{tmp_path}/none0.sock,{tmp_path}/none1.sock", "--commits", str(cdir), "--max-s", "600"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            _wait("both ranks stepping", lambda: _ranks(out), 180, proc)
            pids = [int((out / f"pid{r}").read_text()) for r in (0, 1)]
            assert rankprocs.alive(pids) == pids and proc.pid not in pids, (pids, proc.pid)
            with pytest.raises(rankprocs.HarnessTimeout, match="vllm_ranks.py ran past 1 s"):
                rankprocs.finish(proc, timeout=1)
            assert rankprocs.alive(pids) == [], f"rank processes {rankprocs.alive(pids)} outlived the harness"
            assert rankprocs.alive(rankprocs.group(proc.pid)) == []
        finally:
            rankprocs.stop(proc)
