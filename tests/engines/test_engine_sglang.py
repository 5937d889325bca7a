"""The SGLang side against SGLang's own code, as far as it runs on CPU (SGLang 0.5.23 in .venv-engine,
installed without its dependencies by `make test`).

Run: the adapters against `_compute_logical_to_all_physical_map` (what `init_by_mapping` builds), over
`num_hidden_layers` with dense layers; SGLang's treatment of a -1 slot (a replica of the last expert), which
the export refuses; SGLang's plugin loader finding our entry point. Not run: `ElasticMoeEplbManager` inside
SGLang's model runner (its recorder, EPLB manager and model runner import torchvision and need a GPU).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from chaos.localcluster import ROOT
from tests.conftest import engine_missing

pytestmark = pytest.mark.engine

ENGINE_PY = ROOT / ".venv-engine" / "bin" / "python"


def test_sglang_formats_and_entry_point() -> None:
    if not ENGINE_PY.exists():
        engine_missing(f"{ENGINE_PY} does not exist: `make .venv-engine/.installed` (part of `make test`) makes it")
    probe = subprocess.run([str(ENGINE_PY), "-c", "import sglang.srt.eplb.expert_location"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        engine_missing(f"SGLang's EPLB modules do not import in {ENGINE_PY}: {probe.stderr.strip().splitlines()[-1:]}")
    r = subprocess.run([str(ENGINE_PY), str(ROOT / "tests" / "engine_harness" / "sglang_formats.py")], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-3000:]
    doc = json.loads(lines[-1][len("RESULT "):])
    assert doc == {"round_trips": 20, "sglang_takes_hole_as_last_expert": True, "export_refuses_hole": True,
                   "entry_point": "dataplane_shim.sglang_plugin.register"}
