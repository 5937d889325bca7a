"""The reference engine's step times as its plugins report them, and the agents' fit of them, for `emoe bench`.

The engines' plugins report the wall time of each sampled step (LoadReport.step_us); the agents fit from them the
part of a step that grows with its busiest rank's load (controlplane.steptime). Here the reference engine
(bench.engine.EPCluster) reports its step model's time with a seeded jitter (STEP_JITTER) and, where the model
has no non-MoE part, a batch-dependent one (BATCH_TERM), so that the agents fit a measurement, not the model's
formula; results.json's elastic entry sets the agents' figure at each decision beside the model's over the same
steps and table (`step_time_entry`). No wall-clock time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from bench.agentfeed import StepModel
from bench.engine import EPCluster
from bench.policies import Elastic
from controlplane.table import RoutingTable

F64 = npt.NDArray[np.float64]


# The reference engine's measured step time: its step model's, with this much seeded jitter (relative, Gaussian)
# so that the agents fit a measurement, not the model's formula
STEP_JITTER = 0.10
# Where the step model has no non-MoE part (a shape without its whole model, ModelShape.layers_total 0), one that
# grows with the step's batch is added: this fraction of the mean MoE step of the first window at its mean batch
BATCH_TERM = 0.3


def measured_steps(cluster: EPCluster, base: RoutingTable, first: npt.NDArray[np.integer], seed: int) -> StepModel:
    """The wall times [S] (ms) the reference engine's plugins report for steps counts [S, L, E] under a table:
    its step model's, plus a batch-dependent non-MoE term where the model has none, times a seeded jitter."""
    rng = np.random.default_rng([seed, 49])
    c = np.asarray(first)
    per_token = 0.0
    if not cluster.shape.layers_total and c.size:
        per_token = BATCH_TERM * float(cluster.run(base, c).step_ms.mean()) / max(float(c[:, 0, :].sum(axis=1).mean()), 1.0)

    def step_ms(table: RoutingTable, counts: npt.NDArray[np.integer]) -> F64:
        ms = cluster.run(table, counts).step_ms + per_token * np.asarray(counts)[:, 0, :].sum(axis=1)
        out: F64 = ms * np.clip(1.0 + STEP_JITTER * rng.standard_normal(ms.shape), 0.5, 1.5)
        return out

    return step_ms


def step_time_entry(pol: Elastic, cluster: EPCluster, counts: npt.NDArray[np.integer],
                    sample_every: int) -> dict[str, Any]:
    """The agents' fitted step time at each decision beside the reference engine's figure over the same steps
    and tables (the sampled steps of the windows the fit held, each under the table that served it;
    EPCluster.load_ms: what the step saves per fraction of load taken off), and their median relative error;
    beside them the whole MoE part (`moe_ms_engine`, weight reads included) and the error against it."""
    est, eng, moe = [], [], []
    for d, held in zip(pol.decisions, pol.fits, strict=True):
        by_table: dict[int, tuple[RoutingTable, list[int]]] = {}  # the sampled steps of the held windows, by table
        for lo, hi, table in held:
            if table is None:
                continue
            steps = [s for s in range(lo, min(hi, counts.shape[0])) if s % max(sample_every, 1) == 0]
            by_table.setdefault(table.version, (table, []))[1].extend(steps)
        n = sum(len(steps) for _, steps in by_table.values())
        if not n:
            continue
        load = moe_ms = 0.0
        for table, steps in by_table.values():  # each step under the table that served it: means weighted by steps
            c = np.asarray(counts[steps], dtype=np.int64)
            load += cluster.load_ms(table, c) * len(steps) / n
            # the whole MoE part of the step, weight reads included (what does not scale with the load, too)
            moe_ms += float(cluster.moe_ms(table, c).mean() - cluster.moe_ms(table, 0 * c[:1]).mean()) * len(steps) / n
        d["load_ms_engine"], d["moe_ms_engine"] = round(load, 4), round(moe_ms, 4)
        est.append(float(d["load_ms_estimated"]))
        eng.append(float(d["load_ms_engine"]))
        moe.append(float(d["moe_ms_engine"]))
    ctl = pol.pipeline.controller
    out: dict[str, Any] = {"load_ms_source": str(ctl.step_time.source), "load_ms_why": ctl.step_time.why}
    if est:
        err = [abs(a - b) / b for a, b in zip(est, eng, strict=True) if b > 0]
        err_moe = [abs(a - b) / b for a, b in zip(est, moe, strict=True) if b > 0]
        out.update(load_ms_estimated=round(float(np.median(est)), 4), load_ms_engine=round(float(np.median(eng)), 4),
                   load_ms_median_rel_error=round(float(np.median(err)), 4) if err else None,
                   moe_ms_engine=round(float(np.median(moe)), 4),
                   moe_ms_median_rel_error=round(float(np.median(err_moe)), 4) if err_moe else None)
    else:  # no decision: the fit at the end of the run
        out.update(load_ms_estimated=round(float(ctl.step_time.load_ms), 4))
    return out
