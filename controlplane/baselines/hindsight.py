"""Hindsight reference: for each workload segment, EPLB on that segment's exact load totals, installed at
no cost at the segment's first step. Not a policy anyone can run (it reads the future); a bound to
measure against."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from controlplane.baselines.eplb import eplb_table
from controlplane.errors import InvalidShape
from controlplane.table import RoutingTable


def segment_bounds(steps: int, drift_steps: list[int]) -> list[tuple[int, int]]:
    """[(start, end)] of the segments that `drift_steps` cut `steps` steps into."""
    cuts = sorted({d for d in drift_steps if 0 < d < steps})
    edges = [0, *cuts, steps]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def hindsight_tables(
    base: RoutingTable, counts: npt.NDArray[np.integer], drift_steps: list[int], num_groups: int = 1
) -> list[tuple[int, RoutingTable]]:
    """counts: [T, L, E] -> [(first step of segment, its EPLB table)], one per segment, in order."""
    c = np.asarray(counts)
    if c.ndim != 3 or c.shape[1:] != (base.layers, base.experts):
        raise InvalidShape(f"counts shape {c.shape}: expected [T, {base.layers}, {base.experts}]")
    out: list[tuple[int, RoutingTable]] = []
    prev = base
    for a, b in segment_bounds(int(c.shape[0]), drift_steps):
        prev = eplb_table(prev, c[a:b].sum(axis=0, dtype=np.int64), num_groups)
        out.append((a, prev))
    return out
