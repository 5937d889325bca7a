"""The native trace format: an `.npz` with `counts` uint32 [T, L, E] (tokens routed to each logical expert
per step) and metadata strings `model`, `top_k`, `source`, `step_model` (`recorded`, `pseudo-decode batch B`,
`sampled`, `synthetic`), plus `drift_steps` when segments were concatenated.

What `emoe profile` reads and the benchmark importers (bench.traces) write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt


@dataclass
class Trace:
    counts: npt.NDArray[np.uint32]  # [T, L, E]
    model: str
    top_k: int
    source: str
    step_model: str
    drift_steps: list[int] = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, int, int]:
        t, n_layers, e = self.counts.shape
        return int(t), int(n_layers), int(e)

    def save(self, path: str | Path) -> None:
        np.savez_compressed(
            path,
            counts=self.counts.astype(np.uint32),
            model=np.array(self.model),
            top_k=np.array(self.top_k),
            source=np.array(self.source),
            step_model=np.array(self.step_model),
            drift_steps=np.array(self.drift_steps, dtype=np.int64),
        )


def load_trace(path: str | Path) -> Trace:
    """Load a native `.npz`; raises ValueError naming the file and the missing or malformed field."""
    p = Path(path)
    with np.load(p, allow_pickle=False) as z:
        if "counts" not in z:
            raise ValueError(f"{p}: no 'counts' array (expected uint32 [T, L, E])")
        counts = z["counts"]
        if counts.ndim != 3:
            raise ValueError(f"{p}: counts has shape {counts.shape}, expected [T, L, E]")
        meta = {k: str(z[k]) if k in z else "" for k in ("model", "source", "step_model")}
        top_k = int(z["top_k"]) if "top_k" in z else 0
        drift = [int(x) for x in z["drift_steps"]] if "drift_steps" in z else []
    return Trace(counts.astype(np.uint32), meta["model"], top_k, meta["source"], meta["step_model"], drift)
