"""The demo's baselines (static EP, periodic EPLB), its report figures and its plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bench.traces import Trace
from controlplane.load import table_step_imbalance
from controlplane.table import RoutingTable, initial_table
from controlplane.topology import Topology


def _timeline(trace: Trace, tables: list[tuple[int, RoutingTable]]) -> np.ndarray:
    """[T] step imbalance when tables[i] is in force from step tables[i][0] on."""
    T = trace.shape[0]
    out = np.empty(T)
    bounds = [s for s, _ in tables] + [T]
    for (start, table), end in zip(tables, bounds[1:], strict=True):
        if end > start:
            out[start:end] = table_step_imbalance(table, trace.counts[start:end].astype(np.int64))
    return out


def baselines(trace: Trace, topo: Topology, eplb_period: int, expert_bytes: int) -> dict[str, Any]:
    """Static EP and EPLB (full rebalance every `eplb_period` steps from the last `eplb_period`)."""
    from controlplane.baselines.eplb import eplb_table

    T, L, E = trace.shape
    static = initial_table(topo, L, E)
    eplb: list[tuple[int, RoutingTable]] = [(0, static)]
    for start in range(eplb_period, T, eplb_period):
        totals = trace.counts[start - eplb_period:start].sum(axis=0, dtype=np.int64)
        eplb.append((start, eplb_table(eplb[-1][1], totals)))
    return {
        "static": _timeline(trace, [(0, static)]),
        "eplb": _timeline(trace, eplb),
        "eplb_bytes": moved_bytes([t for _, t in eplb], expert_bytes),
        "eplb_rebalances": len(eplb) - 1,
    }


def report(trace: Trace, window: int, elastic: np.ndarray, versions: int, bytes_moved: int,
           base: dict[str, Any]) -> dict[str, Any]:
    T = trace.shape[0]
    bounds = [0, *trace.drift_steps, T]
    sources = trace.source.split(" -> ")
    segs = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        seg: dict[str, Any] = {"segment": k, "source": sources[k] if k < len(sources) else "?", "start": a, "end": b}
        for name, series in (("elastic", elastic), ("static", base["static"]), ("eplb", base["eplb"])):
            seg[name] = {"first": float(series[a:a + window].mean()), "last": float(series[b - window:b].mean()),
                         "mean": float(series[a:b].mean())}
        segs.append(seg)
    return {
        "trace": trace.source, "step_model": trace.step_model, "steps": T, "drift_steps": trace.drift_steps,
        "versions_committed": versions,
        "imbalance_before": float(elastic[:window].mean()), "imbalance_after": float(elastic[-window:].mean()),
        "segments": segs,
        "mean": {"elastic": float(elastic.mean()), "static": float(base["static"].mean()),
                 "eplb": float(base["eplb"].mean())},
        "bytes_moved": {"elastic": bytes_moved, "eplb": int(base["eplb_bytes"])},
        "eplb_rebalances": base["eplb_rebalances"],
    }


def write_plot(path: Path, trace: Trace, elastic: np.ndarray, base: dict[str, Any], log: Any) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(x: np.ndarray, w: int = 10) -> np.ndarray:
        return np.convolve(x, np.ones(w) / w, mode="valid")

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for name, series, style in (("static EP", base["static"], ":"), ("EPLB (periodic)", base["eplb"], "--"),
                                ("ElasticMoE", elastic, "-")):
        ax.plot(smooth(series), style, label=name)
    for d in trace.drift_steps:
        ax.axvline(d, color="grey", lw=1)
        ax.text(d, ax.get_ylim()[1], " drift", va="top", color="grey")
    for _, step in sorted(log.installed_at.items())[1:]:
        ax.axvline(step, color="tab:green", lw=0.5, alpha=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("step imbalance (max/mean rank load)")
    ax.set_title(f"{trace.source} ({trace.step_model})\ngreen lines: new table versions installed", fontsize=10)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def moved_bytes(tables: list[RoutingTable], expert_bytes: int) -> int:
    """Bytes copied to go through `tables` in order: each slot that gains a new expert costs one expert."""
    total = 0
    for a, b in zip(tables, tables[1:], strict=False):
        total += int(((b.phy2log != a.phy2log) & (b.phy2log >= 0)).sum()) * expert_bytes
    return total
