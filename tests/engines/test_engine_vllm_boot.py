"""The vLLM plugin at vLLM's boot, against vLLM's real code (from .venv-engine, made by `make test`):
1. A real `vllm.LLM` on CPU with a tiny Qwen3-MoE loads the plugin in its worker process and generates.
2. The adapters round-trip through vLLM's own map functions and import its DeepSeek EPLB placements.
3. An engine that booted off the agents' genesis is refused at add_model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from chaos.localcluster import ROOT, free_ports
from tests.engines import rankprocs
from tests.engines.test_engine_vllm import HARNESS, engine_python

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_vllm_llm_loads_the_plugin_in_its_worker(tmp_path: Path) -> None:
    py = engine_python()
    r = rankprocs.run([py, str(HARNESS / "vllm_llm.py"), str(tmp_path)], cwd=ROOT, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-3000:]
    doc = json.loads(lines[-1][len("RESULT "):])
    assert [len(t) for t in doc["tokens"]] == [8, 8]
    (worker,) = doc["workers"]
    assert worker["patched"] and worker["pid"] == worker["pid_now"] != doc["driver"]["pid"]
    assert worker["eplb_state"] is False  # vLLM on CPU builds no EplbState: nothing to attach to


def test_formats_round_trip_through_vllms_own_functions() -> None:
    py = engine_python()
    r = rankprocs.run([py, str(HARNESS / "vllm_formats.py")], cwd=ROOT, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-3000:]
    doc = json.loads(lines[-1][len("RESULT "):])
    assert doc["round_trips"] == 50
    # DeepSeek EPLB (vLLM's default policy) stacks replicas on one rank in most layers at DeepSeek-V3 shape
    assert doc["dsv3_layers_with_same_rank_duplicates"] > 0


def test_vllm_plugin_refuses_an_engine_that_booted_off_genesis(tmp_path: Path) -> None:
    """The agents' genesis is declared 'static' (blocks with empty slots); vLLM boots with arange(P) % E: the
    plugin stops the worker at add_model, naming both placements' digests."""

    py = engine_python()
    out = tmp_path / "ranks"
    out.mkdir()
    r = rankprocs.run([py, str(HARNESS / "vllm_ranks.py"), "--out", str(out), "--port", str(free_ports(1)[0]),
                       "--sockets", f"{tmp_path}/a.sock,{tmp_path}/b.sock", "--max-s", "5"], cwd=ROOT,
                      timeout=300, env={**os.environ, "EMOE_GENESIS": "static"})
    assert r.returncode != 0
    assert "GENESIS_MISMATCH: the engine booted with placement" in r.stderr and "genesis 'static' is" in r.stderr
    assert not list(out.glob("rank*.json"))  # no step ran
