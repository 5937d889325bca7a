"""`emoe demo`: a local cluster of agent processes, one reference engine per node replaying the bundled
real trace with a drift (ESFT intent -> law), live progress, and a report against static EP and EPLB."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.traces import BUNDLED, Trace, concat, load_trace
from chaos.localcluster import LocalCluster
from controlplane.load import table_step_imbalance
from controlplane.table import RoutingTable, initial_table
from controlplane.topology import Topology


@dataclass
class DemoSpec:
    agents: int = 3
    ranks_per_node: int = 4
    slots_per_rank: int = 6
    window: int = 50
    sample_every: int = 10  # the engines send every 10th step's counts too (decision.sample_every, loadcodec)
    segment_steps: int = 600
    step_ms: float = 10.0
    eplb_period: int = 300
    out: Path = field(default_factory=lambda: Path("out/demo"))
    traces: tuple[Path, ...] = (BUNDLED / "esft-intent-b256.npz", BUNDLED / "esft-law-b256.npz")


@dataclass
class EngineLog:
    versions: np.ndarray  # [T] table version in force at each step
    tables: dict[int, RoutingTable]
    installed_at: dict[int, int]  # version -> first step it ran
    final_version: int = 0  # the head once the replay ended and the last commits arrived


def split_counts(counts: np.ndarray, n: int, i: int) -> np.ndarray:
    """Node i's share of a step's global counts: an integer split that sums back exactly."""
    return (counts // n + (i < counts % n)).astype(np.uint32)


async def run_engine(i: int, n: int, sock: str, trace: Trace, spec: DemoSpec, topo: Topology,
                     progress: list[int]) -> EngineLog:
    """One node's reference engine: serves the trace step by step through the shim, installing each
    certified table at a step boundary and reporting its load every window, with its sampled steps' counts
    (every `spec.sample_every`-th step, as the engine plugins send them)."""
    from dataplane_shim.certify import table_from_commit
    from dataplane_shim.link import ShimLink, make_load_report

    T, L, E = trace.shape
    head = initial_table(topo, L, E)
    tables = {head.version: head}
    installed = {head.version: 0}
    pending: list[RoutingTable] = []
    link = ShimLink(sock, shim_id=f"engine{i}")

    async def watch() -> None:
        # the shim's check: only certified tables (a quorum certificate over the table's digest) install
        async for commit in link.watch_tables(head.version):
            pending.append(table_from_commit(commit, topo))

    watcher = asyncio.create_task(watch())
    versions = np.zeros(T, dtype=np.int64)
    acc = np.zeros((L, E), dtype=np.uint32)
    rows: list[np.ndarray] = []
    try:
        for t in range(T):
            if pending:
                newest = max(pending, key=lambda tb: tb.version)
                pending.clear()
                if newest.version > head.version:
                    head = newest
                    tables[head.version] = head
                    installed[head.version] = t
            versions[t] = head.version
            mine = split_counts(trace.counts[t], n, i)
            acc += mine
            if spec.sample_every and t % spec.sample_every == 0:
                rows.append(mine)
            if (t + 1) % spec.window == 0:
                samples = np.stack(rows) if rows else np.zeros((0, L, E), np.uint32)
                await link.report_load(make_load_report(f"engine{i}", i * topo.ranks_per_node,  # its first rank
                                                        t + 1 - spec.window, spec.window,
                                                        head.version, acc, samples=samples,
                                                        sample_every=spec.sample_every))
                acc[:] = 0
                rows.clear()
            if i == 0:
                progress[0] = t + 1
            await asyncio.sleep(spec.step_ms / 1e3)
        await asyncio.sleep(1.0)  # let the last commits arrive, so that every engine ends on the head
        if pending:
            newest = max(pending, key=lambda tb: tb.version)
            if newest.version > head.version:
                tables[newest.version] = newest
                head = newest
    finally:
        watcher.cancel()
        await link.close()
    return EngineLog(versions, tables, installed, head.version)


def imbalance_timeline(trace: Trace, log: EngineLog) -> np.ndarray:
    """[T] step imbalance of each step under the table the engine ran it with."""
    out = np.empty(trace.shape[0])
    for v, table in log.tables.items():
        idx = np.flatnonzero(log.versions == v)
        if idx.size:
            out[idx] = table_step_imbalance(table, trace.counts[idx].astype(np.int64))
    return out


async def _drive(cluster: LocalCluster, trace: Trace, spec: DemoSpec, topo: Topology) -> list[EngineLog]:
    progress = [0]
    tasks = [asyncio.create_task(run_engine(i, cluster.n, cluster.shim_socket(i), trace, spec, topo, progress))
             for i in range(cluster.n)]
    T = trace.shape[0]
    t0 = time.monotonic()
    tty = sys.stderr.isatty()
    last_tenth = -1
    while not all(t.done() for t in tasks):
        done = progress[0]
        bar = "#" * int(40 * done / T)
        line = f"  replaying [{bar:<40}] step {done}/{T}  {time.monotonic() - t0:5.1f} s"
        if tty:
            sys.stderr.write("\r" + line)
        elif done * 10 // T > last_tenth:  # a log file gets one line per 10%
            last_tenth = done * 10 // T
            sys.stderr.write(line + "\n")
        sys.stderr.flush()
        await asyncio.sleep(0.25)
    if tty:
        sys.stderr.write("\n")
    return [t.result() for t in tasks]


def run_demo(spec: DemoSpec, as_json: bool = False) -> dict[str, Any]:
    from bench.demo_report import baselines, moved_bytes, report, write_plot

    parts = [load_trace(p) for p in spec.traces]
    trace = concat(parts, spec.segment_steps)
    T, L, E = trace.shape
    topo = Topology(spec.agents, spec.ranks_per_node, spec.slots_per_rank)
    cluster_cfg = {"nodes": spec.agents, "ranks_per_node": spec.ranks_per_node,
                   "slots_per_rank": spec.slots_per_rank, "layers": L, "experts": E, "top_k": trace.top_k}
    sections = {"decision": {"window": spec.window, "budget_windows": 2, "theta": 1.10, "tau": 0.02,
                             "sample_every": spec.sample_every}}
    say = (lambda *a: None) if as_json else print
    say(f"ElasticMoE demo: {spec.agents} agents x {spec.ranks_per_node} ranks x {spec.slots_per_rank} slots, "
        f"trace {trace.source} ({T} steps, {L} layers x {E} experts, {trace.step_model}), drift at {trace.drift_steps}")
    with tempfile.TemporaryDirectory(prefix="emoe-demo-") as tmp:
        cluster = LocalCluster(spec.agents, Path(tmp), cluster_cfg, profile="local", sections=sections)
        say("  starting agents ...")
        with cluster.running(timeout=60):
            say(f"  agents serving on {', '.join(cluster.addresses)}")
            logs = asyncio.run(_drive(cluster, trace, spec, topo))
            placement = _placement_text(cluster.addresses[0])
    log = logs[0]
    elastic = imbalance_timeline(trace, log)
    ordered = [log.tables[v] for v in sorted(log.tables)]
    expert_bytes = 3 * 2048 * 1408 * 2
    base = baselines(trace, topo, spec.eplb_period, expert_bytes)
    result = report(trace, spec.window, elastic, len(ordered) - 1, moved_bytes(ordered, expert_bytes), base)
    result["final_versions"] = [lg.final_version for lg in logs]
    result["agreement"] = len(set(result["final_versions"])) == 1
    spec.out.mkdir(parents=True, exist_ok=True)
    try:
        result["plot"] = str(write_plot(spec.out / "demo.png", trace, elastic, base, log))
    except ImportError:  # matplotlib comes with the dev extra only
        result["plot"] = None
        print("emoe demo: no plot (matplotlib is not installed: pip install 'elasticmoe[dev]' or matplotlib)",
              file=sys.stderr)
    (spec.out / "report.json").write_text(json.dumps(result, indent=2))
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(placement)
        _print_report(result)
    return result


def _placement_text(address: str) -> str:
    import subprocess

    r = subprocess.run([sys.executable, "-m", "agent.cli", "placement", "--agent", address, "--layer", "0"],
                       capture_output=True, text=True, timeout=30)
    return r.stdout if r.returncode == 0 else f"(placement unavailable: {r.stderr.strip()})"


def _print_report(r: dict[str, Any]) -> None:
    print("\nReport")
    print("  step imbalance (max/mean rank load), first window -> last window of each segment:")
    for seg in r["segments"]:
        cells = "   ".join(f"{p} {seg[p]['first']:.3f} -> {seg[p]['last']:.3f}" for p in ("elastic", "static", "eplb"))
        print(f"  segment {seg['segment']} ({seg['source']}): {cells}")
    print(f"  versions committed: {r['versions_committed']}")
    print(f"  step imbalance before/after: {r['imbalance_before']:.3f} -> {r['imbalance_after']:.3f}")
    print(f"  mean step imbalance: elastic {r['mean']['elastic']:.3f}, static {r['mean']['static']:.3f}, "
          f"eplb {r['mean']['eplb']:.3f}")
    print(f"  bytes moved: elastic {r['bytes_moved']['elastic'] / 1e9:.2f} GB, eplb {r['bytes_moved']['eplb'] / 1e9:.2f} GB")
    print(f"  every engine ends on the same version: {r['agreement']} {r['final_versions']}")
    if r['plot']:
        print(f"  plot: {r['plot']}")
