"""The plugins' engine version check against the installed engines and their own plugin loaders
(tests/engine_harness/engine_version.py in .venv-engine): the installed releases are the tested ones; a faked
other release is refused through vLLM's `load_general_plugins()` (which lets it stop the process) and through
SGLang's `load_plugins()` (which logs it and goes on, so its EPLB manager raises it); EMOE_ALLOW_UNTESTED_ENGINE=1
runs vLLM's with one warning."""

from __future__ import annotations

import json
import os

import pytest

from chaos.localcluster import ROOT
from tests.engines import rankprocs
from tests.engines.test_engine_vllm import HARNESS, engine_python

pytestmark = pytest.mark.engine


def test_the_engines_own_loaders_refuse_an_untested_release() -> None:
    py = engine_python()
    r = rankprocs.run([py, str(HARNESS / "engine_version.py")], cwd=ROOT, timeout=300,
                      env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-3000:]
    doc = json.loads(lines[-1][len("RESULT "):])
    for engine in ("vllm", "sglang"):  # what .venv-engine holds is what pyproject.toml pins
        assert doc[engine]["running"] == doc[engine]["tested"] and doc[engine]["check"] == "TESTED", doc
    vllm, sglang = doc["vllm"], doc["sglang"]
    assert vllm["refused"].startswith("UntestedEngine: UNTESTED_ENGINE: vllm 0.31.9 is running; the elasticmoe "
                                      f"plugin was tested with vllm {vllm['tested']}"), vllm
    assert "EMOE_ALLOW_UNTESTED_ENGINE=1" in vllm["refused"] and not vllm["patched_when_refused"], vllm
    assert vllm["allowed"] == "" and vllm["patched_when_allowed"], vllm
    assert sglang["refused"] == "", sglang  # SGLang's loader swallows it (and logs it) ...
    assert "Failed to execute general plugin: elasticmoe" in r.stderr and "sglang 0.5.22 is running" in r.stderr
    assert sglang["eplb_manager_refuses"].startswith(  # ... so the EPLB manager refuses in its place
        f"UntestedEngine: UNTESTED_ENGINE: sglang 0.5.22 is running; the elasticmoe plugin was tested with sglang "
        f"{sglang['tested']}"), sglang
    (warning,) = doc["warnings"]  # one, for vLLM's run under the override, though it checked twice
    assert warning.startswith(f"vllm 0.31.9 is running; the elasticmoe plugin was tested with vllm {vllm['tested']}")
