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


class ReferenceSteps:
    """The wall times (ms) the reference engine's plugins report: its step model's, plus a batch-dependent non-MoE
    term where the model has none, times a seeded jitter. Called with (table, counts [S, L, E]): the model's steps
    under `table` (what `emoe bench --live` feeds); `served(ms, counts)`: steps as the bench served them (`ms`
    [S], copies in flight included: bench.run.simulate), which is what an in-process run reports."""

    def __init__(self, cluster: EPCluster, base: RoutingTable, first: npt.NDArray[np.integer], seed: int) -> None:
        self.cluster = cluster
        self.rng = np.random.default_rng([seed, 49])
        c = np.asarray(first)
        self.per_token = 0.0
        if not cluster.shape.layers_total and c.size:
            self.per_token = (BATCH_TERM * float(cluster.run(base, c).step_ms.mean())
                              / max(float(c[:, 0, :].sum(axis=1).mean()), 1.0))

    def __call__(self, table: RoutingTable, counts: npt.NDArray[np.integer]) -> F64:
        return self.served(self.cluster.run(table, counts).step_ms, counts)

    def served(self, ms: npt.ArrayLike, counts: npt.NDArray[np.integer]) -> F64:
        t = np.asarray(ms, dtype=np.float64) + self.per_token * np.asarray(counts)[:, 0, :].sum(axis=1)
        out: F64 = t * np.clip(1.0 + STEP_JITTER * self.rng.standard_normal(t.shape), 0.5, 1.5)
        return out


def measured_steps(cluster: EPCluster, base: RoutingTable, first: npt.NDArray[np.integer], seed: int) -> ReferenceSteps:
    """The reference engine's reported step times (`ReferenceSteps`), its batch term set from `first` under `base`."""
    return ReferenceSteps(cluster, base, first, seed)


def copy_entry(pol: Elastic, run: Any, ranks: int) -> dict[str, Any]:
    """Each commit's copies: the serving time the cost model charges them (controlplane.worth: the copies' cost
    over the ranks, which copy side by side) beside what they cost the reference engine (the steps they
    overlapped as served, minus the same steps with no copy in flight: link bandwidth shared with the all-to-all,
    and every layer waits for its slowest rank), the median and pooled ratios of the two, and the agents' own
    measure of that ratio at the end of the run (controlplane.copycost: `copy_slowdown_measured`, and the least
    the strides allow `copy_slowdown_measured_low`, from the steps the copies overlapped as the engines reported
    them; `copy_slowdown_estimated` is the factor they charge with, 1 until the measure passes its rule)."""
    charged = [float(d["cost_s"]) / max(ranks, 1) * 1e3 for d in pol.decisions]
    engine = [(steps, extra) for _, steps, extra in run.copies]
    for d, c, (steps, extra) in zip(pol.decisions, charged, engine, strict=False):  # a commit's copy, then the next
        d["copy_ms_charged"], d["copy_ms_engine"], d["copy_steps_engine"] = round(c, 3), round(extra, 3), steps
    ratios = [e / c for c, (_, e) in zip(charged, engine, strict=False) if c > 0]
    pooled = (sum(e for _, e in engine[:len(charged)]) / sum(charged[:len(engine)])
              if engine and charged and sum(charged[:len(engine)]) > 0 else None)
    cs = pol.pipeline.controller.measures.copy_slowdown  # the agents' own, from the steps the copies overlapped, at the end
    return {"copy_ms_charged": round(float(np.median(charged)), 3) if charged else None,
            "copy_ms_engine": round(float(np.median([e for _, e in engine])), 3) if engine else None,
            "copy_engine_over_charged": round(float(np.median(ratios)), 2) if ratios else None,
            "copy_engine_over_charged_pooled": None if pooled is None else round(pooled, 2),
            "copy_slowdown_estimated": round(cs.factor, 3), "copy_slowdown_measured":
                None if cs.ratio is None else round(cs.ratio, 3), "copy_slowdown_measured_low":
                None if cs.ratio_low is None else round(cs.ratio_low, 3), "copy_slowdown_source": str(cs.source),
            "copy_slowdown_why": cs.why}


def _engine_over(cluster: EPCluster, counts: npt.NDArray[np.integer], windows: list[tuple[int, int, Any]],
                 sample_every: int) -> tuple[float, float] | None:
    """The reference engine's load part (EPCluster.load_ms) and whole MoE part of the sampled steps of
    `windows` ((start, end, table that served them)), each step under its table, means weighted by steps."""
    by_table: dict[int, tuple[RoutingTable, list[int]]] = {}
    for lo, hi, table in windows:
        if table is None:
            continue
        steps = [s for s in range(lo, min(hi, counts.shape[0])) if s % max(sample_every, 1) == 0]
        by_table.setdefault(table.version, (table, []))[1].extend(steps)
    n = sum(len(steps) for _, steps in by_table.values())
    if not n:
        return None
    load = moe_ms = 0.0
    for table, steps in by_table.values():
        c = np.asarray(counts[steps], dtype=np.int64)
        load += cluster.load_ms(table, c) * len(steps) / n
        # the whole MoE part of the step, weight reads included (what does not scale with the load, too)
        moe_ms += float(cluster.moe_ms(table, c).mean() - cluster.moe_ms(table, 0 * c[:1]).mean()) * len(steps) / n
    return load, moe_ms


def _median_error(est: list[float], ref: list[float]) -> float | None:
    err = [abs(a - b) / b for a, b in zip(est, ref, strict=True) if b > 0]
    return round(float(np.median(err)), 4) if err else None


def step_time_entry(pol: Elastic, cluster: EPCluster, counts: npt.NDArray[np.integer],
                    sample_every: int) -> dict[str, Any]:
    """The agents' step time at each decision beside the reference engine's figure over the same steps and
    tables, and their median relative error. The agents read their fit at the busiest load of the windows the
    decision judged (controlplane.steptime.resolve), so `load_ms_engine` is EPCluster.load_ms (what the step
    saves per fraction of load taken off) over those windows' sampled steps, each under the table that served
    it. Beside it: the same figure over all the windows the fit held (`load_ms_engine_held`, what a figure at the
    fit's mean load would be judged against) and the whole MoE part over the judged steps (`moe_ms_engine`,
    weight reads included)."""
    est, eng, held, moe = [], [], [], []
    for d, fit_windows, judged in zip(pol.decisions, pol.fits, pol.judged, strict=True):
        now = _engine_over(cluster, counts, judged, sample_every)
        over_held = _engine_over(cluster, counts, fit_windows, sample_every)
        if now is None or over_held is None:
            continue
        d["load_ms_engine"], d["moe_ms_engine"] = round(now[0], 4), round(now[1], 4)
        d["load_ms_engine_held"] = round(over_held[0], 4)
        est.append(float(d["load_ms_estimated"]))
        eng.append(now[0])
        held.append(over_held[0])
        moe.append(now[1])
    ctl = pol.pipeline.controller
    out: dict[str, Any] = {"load_ms_source": str(ctl.measures.step_time.source), "load_ms_why": ctl.measures.step_time.why}
    if est:
        out.update(load_ms_estimated=round(float(np.median(est)), 4), load_ms_engine=round(float(np.median(eng)), 4),
                   load_ms_median_rel_error=_median_error(est, eng),
                   load_ms_engine_held=round(float(np.median(held)), 4),
                   moe_ms_engine=round(float(np.median(moe)), 4),
                   moe_ms_median_rel_error=_median_error(est, moe))
    else:  # no decision: the fit at the end of the run
        out.update(load_ms_estimated=round(float(ctl.measures.step_time.load_ms), 4))
    return out
