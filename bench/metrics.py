"""A bench run's record (PolicyRun: what bench.run.simulate served, step by step, and each install) and what its
figures are (results.json's entry for its policy).

Per policy: mean step imbalance; p50/p99 step time (the whole decode step, stalls included); recovery steps after
each drift point (steps until the W-step moving average of step imbalance is within 10% of hindsight's mean for
that segment and stays there for W steps; the segment's length if never); bytes moved (every slot whose content
changed, hindsight included though it is charged nothing); replica slots (the most filled slots beyond one per
expert, summed over layers, at any time); stall (blocking moves); commits (tables installed); regressions
(installed changes whose realised step imbalance, over the W steps after install or until the next one, was worse
than the replaced table's on those steps; a change replacing a table that still uses a dead rank is not compared:
that table cannot serve); modelled tokens/s; and, with rank loss, each kill's recovery and the pairs it delayed
or dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.rankloss import Kill, Outage, recovery_after
from bench.traces import moving_average
from controlplane.load import table_step_imbalance
from controlplane.table import RoutingTable

F64 = npt.NDArray[np.float64]


@dataclass
class Install:
    step: int
    old: RoutingTable
    new: RoutingTable
    bytes: float
    kind: str


@dataclass
class PolicyRun:
    imbalance: F64
    step_ms: F64
    stall_ms: F64
    bytes_at: F64  # bytes whose copy started at each step
    installs: list[Install] = field(default_factory=list)
    replica_slots: int = 0
    outage: Outage = field(default_factory=lambda: Outage(False))
    # each overlapped change's copies: (the step its copy started, steps it overlapped, the serving milliseconds
    # it added to them: the steps as served minus the same steps with no copy in flight)
    copies: list[tuple[int, int, float]] = field(default_factory=list)


def recovery_steps(imb: F64, ref: F64, drift_steps: list[int], window: int) -> list[int]:
    """Per drift point d (segment [d, next)): steps until the trailing W-step average of `imb` (within
    the segment) is <= 1.1 x the mean of `ref` over the segment and stays so for W steps."""
    T = imb.size
    edges = [*drift_steps, T]
    out = []
    for d, nxt in zip(edges[:-1], edges[1:], strict=True):
        seg = imb[d:nxt]
        ok = moving_average(seg, window) <= 1.1 * float(ref[d:nxt].mean())
        bad = np.concatenate([np.flatnonzero(~ok), [seg.size]])
        # first t with ok[t : t + W] all true (truncated at the segment end)
        nxt_bad = bad[np.searchsorted(bad, np.arange(seg.size))]
        good = np.flatnonzero(ok & ((nxt_bad - np.arange(seg.size) >= window) | (nxt_bad == seg.size)))
        out.append(int(good[0]) if good.size else int(seg.size))
    return out


def regressions(run: PolicyRun, counts: npt.NDArray[np.uint32], window: int, kills: list[Kill] | None = None) -> int:
    """Installed changes whose realised imbalance over the next W steps (or until the next install) was
    worse than the replaced table's on the same steps. A change that replaces a table still using a rank
    that is dead by then (a repair, or any policy's first table after a kill) is not compared: the replaced
    table cannot serve those steps at all, so its figure is no baseline."""
    n = 0
    T = counts.shape[0]
    steps = [i.step for i in run.installs] + [T]
    for k, ins in enumerate(run.installs):
        b = min(ins.step + window, steps[k + 1], T)
        if b <= ins.step or any(x.step <= ins.step and x.rank in ins.old.active_ranks for x in kills or []):
            continue
        c = counts[ins.step:b]
        if float(table_step_imbalance(ins.new, c).mean()) > float(table_step_imbalance(ins.old, c).mean()) + 1e-12:
            n += 1
    return n


def summarize(run: PolicyRun, counts: npt.NDArray[np.uint32], ref: F64, drift: list[int], window: int,
              counted_commits: int | None = None, kills: list[Kill] | None = None, top_k: int = 8) -> dict[str, Any]:
    edges = [0, *drift, run.imbalance.size]
    tokens = float(counts[:, 0, :].sum(dtype=np.int64)) / max(top_k, 1)  # each token picks top_k experts a layer
    seconds = float(run.step_ms.sum()) / 1e3
    return {
        "mean_step_imbalance": float(run.imbalance.mean()),
        "segment_imbalance": [float(run.imbalance[a:b].mean()) for a, b in zip(edges[:-1], edges[1:], strict=True)],
        "p50_step_ms": float(np.percentile(run.step_ms, 50)),
        "p99_step_ms": float(np.percentile(run.step_ms, 99)),
        "recovery_steps": recovery_steps(run.imbalance, ref, drift, window),
        "bytes_moved": float(run.bytes_at.sum()),
        "replica_slots": int(run.replica_slots),
        "stall_ms_total": float(run.stall_ms.sum()),
        "commits": len(run.installs) if counted_commits is None else counted_commits,
        "regressions": regressions(run, counts, window, kills),
        # modelled, not measured: the trace's tokens over the step-time model's total (bench.engine), stalls
        # included; every policy serves the same tokens, so ratios of these are ratios of total time
        "modelled_tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "modelled_seconds": seconds,
    }


def rank_loss_entry(run: PolicyRun, ref: PolicyRun, kills: list[Kill], drift: list[int], window: int) -> dict[str, Any]:
    """Per-kill recovery (bench.rankloss.recovery_after), delayed / dropped pairs, detection and repair steps."""
    T = run.imbalance.size
    figures = run.outage.finish(T)
    lost_at = run.outage.lost_at if run.outage.lost_at is not None else np.zeros(T, dtype=np.int64)
    rec = []
    for k in kills:
        end = min([d for d in drift if d > k.step] + [T])
        rec.append(recovery_after(run.imbalance, lost_at, ref.imbalance, k.step, end, window))
    return {"recovery_steps": rec, **figures, "detect_step": run.outage.detect_steps,
            "repair_step": run.outage.repair_steps, "unserved_steps": int((lost_at > 0).sum())}
