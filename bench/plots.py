"""Plots of an `emoe bench` run (matplotlib, Agg): imbalance over time, cumulative bytes, step-time CDF."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]


def draw(out: Path, series: dict[str, tuple[F64, F64, F64]], drift_steps: list[int], window: int) -> list[Path]:
    """series: policy -> (step imbalance [T], step ms [T], bytes started per step [T]). Returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.traces import moving_average

    files = []
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for name, (imb, _, _) in series.items():
        ax.plot(moving_average(imb, window), label=name, lw=1.2)
    for d in drift_steps:
        ax.axvline(d, color="k", ls="--", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"step imbalance ({window}-step moving average)")
    ax.set_title("Step imbalance over time (dashed: drift points)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    files.append(_save(fig, out / "imbalance.png"))

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for name, (_, _, moved) in series.items():
        ax.plot(np.cumsum(moved) / 1e9, label=name, lw=1.2)
    for d in drift_steps:
        ax.axvline(d, color="k", ls="--", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("cumulative weight bytes moved (GB)")
    ax.set_title("Cumulative bytes moved")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    files.append(_save(fig, out / "bytes_moved.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (_, ms, _) in series.items():
        x = np.sort(ms)
        ax.plot(x, np.arange(1, x.size + 1) / x.size, label=name, lw=1.2)
    ax.set_xscale("log")
    ax.set_xlabel("decode step time (ms, log)")
    ax.set_ylabel("fraction of steps")
    ax.set_title("Step-time CDF")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    files.append(_save(fig, out / "step_time_cdf.png"))
    return files


def _save(fig: object, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110, bbox_inches="tight")  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return path
