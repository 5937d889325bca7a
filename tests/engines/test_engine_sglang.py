"""The SGLang side against SGLang 0.5.23's own code (in .venv-engine, installed without its dependencies by
`make test`), as far as it runs on CPU.

1. Two gloo processes (tests/engine_harness/sglang_ranks.py) run the plugin's `ElasticMoeEplbManager` as
   SGLang's `ModelRunner` would build it under `--enable-eplb`, on SGLang's real `ServerArgs`/`publish`,
   process groups (`init_distributed_environment`, `initialize_model_parallel`: the MoE EP CPU group the
   plugin's version agreement all-reduces over), `load_plugins()` (our entry point replaces
   `model_runner.EPLBManager`), boot placement (`compute_initial_expert_location_metadata`), stat recorder
   (`ExpertDistributionRecorder`, fed through its `on_select_experts` hook) and `ExpertLocationUpdater`. A
   certified commit (v2, moving experts across the two ranks) is installed by SGLang's own `rebalance()` ->
   `init_by_mapping` -> `update_expert_location_with_recovery` -> `ExpertLocationUpdater.update`, whose P2P
   ops move the toy expert weights over gloo; both ranks then hold, in every physical slot, the weights of the
   logical expert the table names, SGLang's map equals the table, the plugin reports v2 installed, and rank 0's
   load reports carry the recorder's dumps summed over the ranks, every pass once: the pass before the
   install is reported before SGLang's rebalance() empties the recorder, and the reports add up to the tokens
   fed. Stubs and stand-ins: the harness docstring
   (torchvision stubbed; `torch.cpu.empty_cache`, the recorder's accelerator probe, the model's
   `routed_experts_weights_of_layer`, the weight updater, the agent link stood in for).
2. The adapters against `_compute_logical_to_all_physical_map` (what `init_by_mapping` builds), over
   `num_hidden_layers` with dense layers; SGLang's treatment of a -1 slot (a replica of the last expert), which
   the export refuses; SGLang's plugin loader finding our entry point.

Not run: SGLang's scheduler and `ModelRunner` themselves (model load, forward passes, CUDA graphs, the MoE
kernels that call the recorder): they need a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from chaos.localcluster import ROOT, free_ports
from tests.conftest import engine_missing
from tests.engine_harness.vllm_llm import CONFIG  # the vLLM test's tiny Qwen3-MoE: 2 layers, 8 experts
from tests.engines import rankprocs

if TYPE_CHECKING:
    from controlplane.table import RoutingTable

pytestmark = pytest.mark.engine

ENGINE_PY = ROOT / ".venv-engine" / "bin" / "python"
HARNESS = ROOT / "tests" / "engine_harness"
L, E, HOT, PASSES = 2, 8, 3, 6


@cache
def _engine_problem() -> str:
    if not ENGINE_PY.exists():
        return f"{ENGINE_PY} does not exist: `make .venv-engine/.installed` (part of `make test`) makes it"
    probe = subprocess.run([str(ENGINE_PY), "-c", "import sglang.srt.eplb.expert_location"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        return f"SGLang's EPLB modules do not import in {ENGINE_PY}: {probe.stderr.strip().splitlines()[-1:]}"
    return ""


def _engine_python() -> str:
    problem = _engine_problem()
    if problem:
        engine_missing(problem)
    return str(ENGINE_PY)


def _run_ranks(tmp_path: Path, *extra: str, timeout: int = 400) -> tuple[list[dict], RoutingTable]:
    """Write v2's certified commit for both ranks, run the two SGLang ranks (harness options `extra`), and
    return their rank files and v2."""
    from controlplane.topology import Topology
    from dataplane_shim.certify import certified_commit
    from dataplane_shim.genesis import genesis_table

    py = _engine_python()
    model = tmp_path / "tinymoe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    g = genesis_table("sglang", Topology(1, 2, 5), L, E)  # SGLang's trivial boot placement, 2 redundant slots
    # every layer moves experts across ranks (rank 0 takes 7, 6, 5 from rank 1 and gives it 1, 2, 3)
    v2 = g.successor(np.array([[7, 6, 5, 0, 4, 3, 2, 1, 0, 7], [1, 0, 3, 2, 6, 5, 4, 7, 1, 2]]))
    v2.validate()
    out, cdir = tmp_path / "ranks", tmp_path / "commits"
    for d in (out, cdir / "rank0", cdir / "rank1"):
        d.mkdir(parents=True)
        if d.parent == cdir:
            (d / f"v{v2.version}.commit").write_bytes(certified_commit(v2, ["a", "b"], 2).SerializeToString())
    t0 = time.monotonic()
    r = rankprocs.run([py, str(HARNESS / "sglang_ranks.py"), "--out", str(out), "--model", str(model),
                       "--commits", str(cdir), "--port", str(free_ports(1)[0]), *extra],
                      cwd=ROOT, timeout=timeout,
                      env={**os.environ, "PYTHONPATH": str(ROOT)})  # this tree's plugin, whatever is installed
    assert r.returncode == 0 and "RANKS_DONE" in r.stdout, (r.stdout + r.stderr)[-4000:]
    print(f"\ntwo SGLang ranks, boot to installed v2: {time.monotonic() - t0:.1f} s")
    return [json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1)], v2


def _assert_installed(ranks: list[dict], v2: RoutingTable, passes: int) -> None:
    """Both ranks installed v2 once, through SGLang's updater: its map is v2's, every local slot holds the weights
    of the logical expert v2 names."""
    for i, doc in enumerate(ranks):
        assert doc["manager"] == "ElasticMoeEplbManager" and doc["ep_group"] == [i, 2]
        assert (doc["version"], doc["installs"]) == (2, 1), doc
        st = doc["install"]  # armed once, done when rebalance() returned on v2's map
        assert (st["installed"], st["armed"], st["install_failures"], st["phase"], st["inflight"], st["queued"],
                st["step"], st["last_install_steps"]) == (2, 1, 0, "idle", 0, 0, passes, 1), st
        assert doc["p2l"] == v2.phy2log.tolist(), doc  # SGLang's own map, after its updater
        for layer in range(L):
            want = [float(layer * 100 + e) for e in v2.phy2log[layer, i * 5:(i + 1) * 5]]
            w13, w2 = doc["weights"][str(layer)]
            assert w13 == want and w2 == [2 * x for x in want], (i, layer, doc["weights"])


def test_sglang_eplb_manager_installs_a_certified_table(tmp_path: Path) -> None:
    ranks, v2 = _run_ranks(tmp_path)
    _assert_installed(ranks, v2, PASSES)  # armed at the first pass
    # reports from EP rank 0 only, of the dump SGLang's recorder sums over both ranks: v2 is agreed at the first
    # pass, so its pass is reported under v1 right before SGLang's rebalance() empties the recorder, then every
    # 2 passes (the first of them 1 pass long); the last covers 2 passes x 2 ranks x HOT tokens on logical
    # expert 0 in each layer
    assert ranks[0]["reports"] == 1 + PASSES // 2 and ranks[1]["reports"] == 0 and ranks[1]["offered"] == []
    assert ranks[0]["last_report"] == [[2 * 2 * HOT] + [0] * (E - 1)] * L
    offered = ranks[0]["offered"]
    assert [(r["first_step"], r["steps"], r["version"]) for r in offered] == [
        (0, 1, 1), (1, 1, 2), (2, 2, 2), (4, 2, 2)], offered
    # over the whole run, across the install, every pass is counted once: the reported counts are exactly the
    # tokens the harness fed (PASSES passes x 2 ranks x HOT tokens on logical expert 0 in each layer)
    assert sum(r["steps"] for r in offered) == PASSES
    total = np.sum([r["counts"] for r in offered], axis=0)
    assert total.tolist() == [[PASSES * 2 * HOT] + [0] * (E - 1)] * L, total


@pytest.mark.parametrize("agree_every", [1, 4])
def test_sglang_installs_only_the_version_every_rank_holds(tmp_path: Path, agree_every: int) -> None:
    """Rank 1 receives v2 LAG passes after rank 0: the ranks agree on the newest version every one of them holds
    (the MIN of the newest held), so v2 is installed at the first agreement pass from LAG on (LAG itself when
    they agree every pass; pass 4 when every 4, EMOE_AGREE_EVERY), never while only rank 0 holds it (a rank that
    agreed on a version it does not hold fails the run: the harness's processes end with it)."""
    passes, lag = 8, 3
    first = -(-lag // agree_every) * agree_every  # the first agreement pass at or after `lag`
    ranks, v2 = _run_ranks(tmp_path, "--passes", str(passes), "--lag", f"1:{lag}", "--agree-every",
                           str(agree_every), timeout=240)
    _assert_installed(ranks, v2, passes)
    for doc in ranks:  # the plugin's version after each pass: v2 from the agreement pass after rank 1 got it
        assert doc["versions"] == [1] * first + [2] * (passes - first), doc["versions"]
    # rank 0's reports: the passes up to the install (pass `first`, run on v1's map) under v1, the rest under v2,
    # each pass once
    offered = ranks[0]["offered"]
    spans = [(r["first_step"], r["steps"], r["version"]) for r in offered]
    if agree_every == 1:
        assert spans == [(0, 2, 1), (2, 2, 1), (4, 2, 2), (6, 2, 2)], offered
    else:
        assert spans == [(0, 2, 1), (2, 2, 1), (4, 1, 1), (5, 1, 2), (6, 2, 2)], offered
    assert sum(r["steps"] for r in offered) == passes
    total = np.sum([r["counts"] for r in offered], axis=0)
    assert total.tolist() == [[passes * 2 * HOT] + [0] * (E - 1)] * L, total


def test_sglang_formats_and_entry_point() -> None:
    py = _engine_python()
    r = rankprocs.run([py, str(HARNESS / "sglang_formats.py")], cwd=ROOT, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-3000:]
    doc = json.loads(lines[-1][len("RESULT "):])
    assert doc == {"round_trips": 20, "sglang_takes_hole_as_last_expert": True, "export_refuses_hole": True,
                   "entry_point": "dataplane_shim.sglang_plugin.register"}
