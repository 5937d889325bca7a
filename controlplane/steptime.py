"""The step time the cost-benefit test uses (controlplane.worth `load_ms`), fitted from what the engines measured.

The plugins report the engine's wall time of each sampled step (LoadReport.step_us). A step waits, layer by
layer, for its busiest rank, so its time is

    t_s = a + b x m_s + c x n_s + noise,

m_s = sum over layers of the busiest rank's load of step s under the table that served it (verify.replay_stats
layer_max), n_s the step's tokens (the batch-dependent part that is not MoE: attention, dense layers, the LM
head), a what does not scale with either. `load_ms` is the part that grows with the busiest rank's load at its
typical value, b x mean(m): a plan that lowers the mean step imbalance by the relative gain g saves g x load_ms
a step (controlplane.worth). A decision reads the fit at the load it judges, b x the busiest load of its
windows (`resolve`).

Each sampled step also carries the mean time of the steps it stands for (LoadReport.stride_us: itself and those
up to the next sampled one). Where the windows' mean load varies beyond the sampling of their few steps (drifts,
installs: a slow part), the same line is fitted to the windows' means (`fit_window_means`), which have a
fraction of one step's noise; where the load moves mostly from step to step, a stride's mean is not set by its
sampled step's load, and the steps are fitted one by one (`fit_step_time`).

The fit is a robust M-estimate (iteratively reweighted least squares, Huber then Tukey's bisquare weights, a
fixed number of rounds, scale from the median absolute residual): one step stalled by a copy or a garbage collection does not move it, and the same
points always give the same figure, so every voter that holds the same gossiped windows derives the same
value. The batch term is left out when the batch does not vary. Too few points, a slope that is not positive, or one
whose standard error is past MAX_REL_SE of it (a load that varies too little, or only in step with the batch,
where b and c cannot be told apart) give no fit: the
configured figure applies, capped at the engines' median measured step (a step's load part is at most all of
it) and, where the load varied too little, at the fit's upper bound (its slope + BOUND_SE standard errors: what
the measurements rule out), and `StepTime.why` says so. A figure the operator sets (decision.load_ms) wins.

No IO, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Protocol

import numpy as np
import numpy.typing as npt

from controlplane.table import RoutingTable
from controlplane.verify import replay_stats

F64 = npt.NDArray[np.float64]

MIN_POINTS = 20  # sampled steps a fit needs: 2 windows of 100 steps sampled every 10th
MAX_POINTS = 2000  # the newest points a fit uses (the load path keeps a few windows' worth)
# the fitted load part's standard error must be within this fraction of it (2.5 standard errors from 0): a fit
# that loose is still nearer than any configured constant can be across shapes (a decode step's load part is
# a few ms, a prefill step's over a second, a small model's a tenth of a ms: 12 ms is 100x off either end), and
# it tightens as installs and drifts (the natural experiments) spread the load. At 0.05 the three bench cases'
# first decisions (the busiest load varying 0.1-1.1% under a 10% jitter: standard errors 8-16%) fell back to
# 12 ms against engine figures of 3.6, 80 and 1240 ms; at 0.25 they use 2.8, 54 and 1200 ms, but Mixtral's 3
# layers on 8 ranks (bench, 0.126 ms of load) still decided on 12 ms (its fit 0.135 +- 0.046: 34%); at 0.4 it
# decides on 0.146 ms steady, 0.079 from a cold start, and the other bench cases do not change. A load that
# varies too little for even that still gives no fit
MAX_REL_SE = 0.4
# A fit of window means (each window's stride times' mean against its sampled steps' mean load) needs this many
# windows, and the windows' spread in the busiest load (and in the batch, where it varies) must be at least
# RELIABLE their own, not their few sampled steps': a window's mean time covers all its steps, its mean load only
# the sampled ones, and where the load varies from step to step more than from window to window (no slow part to
# average) the two do not line up: the fit would flatten (errors in variables) and the steps one by one are fitted
MIN_WINDOWS = 8
RELIABLE = 0.9
# Where the fit is too loose to use, its slope plus this many standard errors bounds the load part from above (the
# same 2.5 as MAX_REL_SE's): what the measurements rule out. A small model's load part that the batch's sampling
# noise hides (top-2 of 32 on 4 ranks, 128 tokens a step: 0.012 +- 0.026 ms against the engine's 0.029) was
# judged on the whole measured step, 0.46 ms, 16 times the engine's figure; the bound says 0.08
BOUND_SE = 2.5
HUBER_K = 1.345  # the usual Huber constant: 95% efficiency at Gaussian noise
TUKEY_C = 4.685  # the usual bisquare constant: 95% efficiency at Gaussian noise
ROUNDS = 20  # IRLS rounds (fixed: the same points give the same figure on every voter)


class StepTimeSource(StrEnum):
    FITTED = "fitted"      # from the engines' measured step times
    OVERRIDE = "override"  # decision.load_ms, set by the operator
    DEFAULT = "default"    # the configured figure: nothing measured, or too flat measurements to fit
    STEP_CAPPED = "capped at the measured step"  # too flat to fit, and the configured figure is more than the
    #                                              engines' whole measured step: that step (the load part of a
    #                                              step is at most all of it)
    BOUNDED = "bounded by the fit"  # too loose to fit, but the fit's upper bound (BOUND_SE standard errors above
    #                                 its slope) is under the configured figure and the measured step: that bound
    WARMING_UP = "warming up"  # the engines measure their steps, too few so far to fit: the configured figure
    #                            stands in, and the controller holds rebalances until the fit (controller.py)


@dataclass(frozen=True)
class StepFit:
    """t = a + b x m + c x n over `points` sampled steps; `load_ms` = b x mean(m); c 0 where left out."""

    a_ms: float
    b_ms: float  # milliseconds per token of the busiest ranks' load (summed over layers)
    c_ms: float  # milliseconds per token of the step's batch
    load_ms: float
    points: int
    busiest: float = 0.0  # mean(m) over the fitted steps
    scale_ms: float = 0.0  # the residuals' robust scale (1.4826 x their median absolute deviation): one step's noise
    means: int = 0  # the windows whose means it fitted (their strides' times: `fit_window_means`); 0: step by step
    not_means: str = ""  # step by step although the strides were timed: why not their window means

    def at(self, busiest: float) -> float:
        """The load part of a step whose busiest ranks carry `busiest` tokens (summed over layers): b x busiest."""
        return self.b_ms * busiest

    def predict(self, busiest: npt.ArrayLike, tokens: npt.ArrayLike) -> F64:
        """The fitted time (ms) of steps with these busiest loads and batches: a + b x m + c x n."""
        out: F64 = (self.a_ms + self.b_ms * np.asarray(busiest, dtype=np.float64)
                    + self.c_ms * np.asarray(tokens, dtype=np.float64))
        return out


@dataclass(frozen=True)
class Loose:
    """No fit, the load varying too little to tell its part of the step from the rest: why, and the most the data
    allow the load part to be (slope + BOUND_SE standard errors, at the fitted steps' mean busiest load)."""

    why: str
    upper_ms: float
    busiest: float

    def __str__(self) -> str:
        return self.why


@dataclass(frozen=True)
class StepTime:
    """The step time a decision uses, and where it came from."""

    load_ms: float
    source: StepTimeSource
    why: str
    fit: StepFit | None = None


def _robust(x: F64, y: F64) -> tuple[F64, F64, float]:
    """M-estimate of y ~ x (x [n, k] with its constant column) by IRLS from the least-squares start: Huber
    weights first (a convex start), then Tukey's bisquare, which gives a stalled step no weight at all.
    Returns the coefficients [k], their standard errors [k] (the residuals' robust scale, the final weights) and
    that scale (1.4826 x the residuals' median absolute deviation: one step's noise)."""
    beta = np.asarray(np.linalg.lstsq(x, y, rcond=None)[0], dtype=np.float64)
    w = np.ones_like(y)
    for k in range(2 * ROUNDS):
        r = y - x @ beta
        s = 1.4826 * float(np.median(np.abs(r - np.median(r))))
        if s <= 0:
            break
        if k < ROUNDS:
            u = np.abs(r) / (HUBER_K * s)
            w = np.where(u <= 1.0, 1.0, 1.0 / np.maximum(u, 1e-12))
        else:
            u = r / (TUKEY_C * s)
            w = np.where(np.abs(u) < 1.0, (1.0 - u * u) ** 2, 0.0)
        sw = np.sqrt(w)
        beta = np.asarray(np.linalg.lstsq(x * sw[:, None], y * sw, rcond=None)[0], dtype=np.float64)
    r = y - x @ beta
    s = 1.4826 * float(np.median(np.abs(r - np.median(r))))
    xtwx = (x * w[:, None]).T @ x
    try:
        cov = s * s * np.linalg.inv(xtwx)
    except np.linalg.LinAlgError:
        return beta, np.full_like(beta, np.inf), s
    return beta, np.sqrt(np.maximum(np.diag(cov), 0.0)), s


def _spread(v: F64) -> float:
    lo, hi = np.percentile(v, [10, 90])
    mean = float(v.mean())
    return float(hi - lo) / mean if mean > 0 else 0.0


def fit_step_time(t_ms: npt.ArrayLike, busiest: npt.ArrayLike, tokens: npt.ArrayLike) -> StepFit | Loose | str:
    """Fit from sampled steps: t_ms [S] their wall times, busiest [S] the sum over layers of the busiest rank's
    load, tokens [S] the tokens of each step. Returns the fit, or why there is none (`Loose` where the load
    varies too little: with the bound the data put on its part)."""
    t = np.asarray(t_ms, dtype=np.float64).reshape(-1)[-MAX_POINTS:]
    m = np.asarray(busiest, dtype=np.float64).reshape(-1)[-MAX_POINTS:]
    n = np.asarray(tokens, dtype=np.float64).reshape(-1)[-MAX_POINTS:]
    if not t.shape == m.shape == n.shape:
        raise ValueError(f"t_ms {t.shape}, busiest {m.shape}, tokens {n.shape}: expected one figure a step each")
    ok = np.isfinite(t) & (t > 0) & (m > 0)
    t, m, n = t[ok], m[ok], n[ok]
    if t.size < MIN_POINTS:
        return f"{t.size} measured steps: a fit needs {MIN_POINTS}"
    if float(m.std()) <= 1e-9 * float(m.mean()):
        return f"the busiest rank's load is the same in all {t.size} steps: its slope cannot be told from the rest"
    cols = [np.ones_like(m), m / m.mean()]
    with_batch = float(n.std()) > 1e-3 * float(n.mean())
    if with_batch:
        cols.append(n / n.mean())
    beta, se, scale = _robust(np.stack(cols, axis=1), t)
    load_ms = float(beta[1])  # (m scaled by its mean: its coefficient is b x mean(m))
    if not load_ms > 0 or not se[1] <= MAX_REL_SE * load_ms:
        why = (f"the busiest rank's load varies too little over {t.size} steps (spread {_spread(m):.3f} of its mean) "
               f"to tell its part of the step from the rest: {load_ms:.3g} +- {float(se[1]):.2g} ms, a fit needs its "
               f"standard error within {MAX_REL_SE:g} of it")
        upper = max(load_ms, 0.0) + BOUND_SE * float(se[1])
        return Loose(why, upper, float(m.mean())) if np.isfinite(upper) and upper > 0 else why
    b = load_ms / float(m.mean())
    c = float(beta[2]) / float(n.mean()) if with_batch else 0.0
    return StepFit(float(beta[0]), b, c, load_ms, int(t.size), float(m.mean()), scale)


def _reliability(v: list[F64]) -> tuple[float, float]:
    """Of per-window samples `v`: the share of their window means' spread that is the windows' own, not the
    sampling of a few steps of each (1 - the pooled within-window variance over each window's steps, averaged
    with the windows' steps as weights, over the weighted variance of the means), and that spread relative to
    the mean (0 where the means do not vary)."""
    k = np.array([len(x) for x in v], dtype=np.float64)
    means = np.array([float(x.mean()) for x in v])
    grand = float((k * means).sum() / k.sum())
    between = float((k * (means - grand) ** 2).sum() / k.sum())
    if between <= (1e-6 * grand) ** 2:
        return 0.0, 0.0
    dof = float((k - 1).sum())
    within = float(sum(((x - x.mean()) ** 2).sum() for x in v)) / dof if dof > 0 else float("inf")
    noise = within * len(v) / float(k.sum())  # the mean over windows, weighted by steps, of within / k
    return 1.0 - noise / between, float(np.sqrt(between)) / abs(grand) if grand else 0.0


def fit_window_means(t_ms: list[F64], busiest: list[F64], tokens: list[F64]) -> StepFit | str:
    """Fit from window means: per window, its sampled steps' strides' mean times (LoadReport.stride_us: each
    covers the steps up to the next sampled one, so their mean is the window's mean step time with a fraction
    of one step's noise), busiest loads and batches. Each window weighs by its sampled steps. No fit where the
    windows are too few, or their mean load (or batch) varies from window to window too little beside its
    sampling (`_reliability` under RELIABLE): then the steps one by one tell more (`fit_step_time`)."""
    if len(t_ms) < MIN_WINDOWS:
        return f"{len(t_ms)} windows with their strides timed: a fit of window means needs {MIN_WINDOWS}"
    lam, _ = _reliability(busiest)
    if lam < RELIABLE:
        return (f"the windows' mean busiest load varies {lam:.2f} of its spread beyond the sampling of their steps: "
                f"a fit of window means needs {RELIABLE:g}")
    lam_n, spread_n = _reliability(tokens)
    with_batch = spread_n > 1e-3
    if with_batch and lam_n < RELIABLE:
        return (f"the windows' mean batch varies {lam_n:.2f} of its spread beyond the sampling of their steps: a fit "
                f"of window means needs {RELIABLE:g}")
    k = np.array([len(x) for x in t_ms], dtype=np.float64)
    t, m, n = (np.array([float(x.mean()) for x in v]) for v in (t_ms, busiest, tokens))
    m_bar, n_bar = float((k * m).sum() / k.sum()), float((k * n).sum() / k.sum())
    cols = [np.ones_like(m), m / m_bar]
    if with_batch:
        cols.append(n / n_bar)
    w = np.sqrt(k)
    # (the robust scale here is the window means'; one step's, StepFit.scale_ms, is the caller's to set from the
    # steps: StepTimeEstimator.fit)
    beta, se, _ = _robust(np.stack(cols, axis=1) * w[:, None], t * w)
    load_ms = float(beta[1])
    if not load_ms > 0 or not se[1] <= MAX_REL_SE * load_ms:
        return (f"the windows' mean busiest load varies too little over {len(t)} windows to tell its part of the "
                f"step from the rest: {load_ms:.3g} +- {float(se[1]):.2g} ms, a fit needs its standard error within "
                f"{MAX_REL_SE:g} of it")
    c = float(beta[2]) / n_bar if with_batch else 0.0
    return StepFit(float(beta[0]), load_ms / m_bar, c, load_ms, int(k.sum()), m_bar, means=len(t))


def step_points(table: RoutingTable, rows: npt.NDArray[np.integer]) -> tuple[F64, F64]:
    """Of sampled steps' counts rows [S, L, E] under the table that served them: the sum over layers of each
    step's busiest rank's load [S], and its token-expert pairs over layers [S] (the batch, times layers x top_k)."""
    st = replay_stats(table, rows)
    return st.layer_max.sum(axis=1).astype(np.float64), st.totals.sum(axis=1).astype(np.float64)


def resolve(override_ms: float | None, fit: StepFit | Loose | str | None, default_ms: float,
            step_ms: float | None = None, busiest: float | None = None) -> StepTime:
    """The step time to decide with: the operator's override, else the fit, else the configured default, but
    never more than `step_ms`, the engines' median measured step (the part of a step that scales with its
    load is at most the whole step: a small model's 0.1 ms step is not judged on DeepSeek-V3's 12 ms), nor more
    than a loose fit's upper bound (`Loose`: what the measurements rule out), read at the judged load.

    A fit is read at `busiest`, the busiest ranks' load (summed over layers, mean over steps) of the windows a
    decision judges, where given: a plan's relative gain g is a fraction of that load, so it saves g x b x
    busiest a step (controlplane.worth), not g x b x the fitted steps' mean. Right after a drift the two differ
    by the drift: the fitted steps are mostly the old load."""
    if override_ms is not None:
        return StepTime(override_ms, StepTimeSource.OVERRIDE, "set by the operator (decision.load_ms)")
    if isinstance(fit, StepFit):
        if busiest is not None and busiest > 0 and fit.busiest > 0:
            return StepTime(fit.at(busiest), StepTimeSource.FITTED,
                            f"fitted from {fit.points} measured steps{_as_means(fit)}, at the judged windows' busiest "
                            f"load ({busiest / fit.busiest:.3g} x the fitted steps': {fit.load_ms:.4g} ms there)", fit)
        return StepTime(fit.load_ms, StepTimeSource.FITTED, f"fitted from {fit.points} measured steps{_as_means(fit)}",
                        fit)
    why = str(fit) if fit is not None else "no measured step times"
    if isinstance(fit, Loose):
        upper = fit.upper_ms * (busiest / fit.busiest if busiest is not None and busiest > 0 and fit.busiest > 0
                                else 1.0)
        if upper < min(default_ms, step_ms if step_ms is not None and step_ms > 0 else default_ms):
            return StepTime(upper, StepTimeSource.BOUNDED,
                            f"the fit's upper bound (its slope + {BOUND_SE:g} standard errors) at the judged windows' "
                            f"busiest load, under the engines' median measured step"
                            + (f" ({step_ms:.4g} ms)" if step_ms else "") + f" and the configured {default_ms:g} ms: "
                            f"{why}")
    if step_ms is not None and 0 < step_ms < default_ms:
        return StepTime(step_ms, StepTimeSource.STEP_CAPPED,
                        f"the engines' median measured step, {step_ms:.4g} ms, under the configured {default_ms:g} "
                        f"ms (a step's load part is at most all of it): {why}")
    return StepTime(default_ms, StepTimeSource.DEFAULT, f"the configured default: {why}")


def _as_means(fit: StepFit) -> str:
    if fit.means:
        return f" as {fit.means} window means of their strides' times"
    return f" one by one ({fit.not_means})" if fit.not_means else ""


def agrees(proposed_ms: float, own: StepTime, rel_tol: float = 0.25) -> bool:
    """Whether a proposer's step time is one this voter would use: within `rel_tol` of its own (which comes from
    the same gossiped windows, so it differs only where the two hold different windows of the buffer)."""
    if not proposed_ms >= 0:
        return False
    return abs(proposed_ms - own.load_ms) <= rel_tol * max(own.load_ms, 1e-9)


@dataclass(frozen=True)
class Points:
    """Sampled steps: wall times (ms), the busiest load and batch under the table that served them, and the mean
    times of their strides (ms; None where the engines did not time them)."""

    t: F64
    m: F64
    n: F64
    stride: F64 | None = None


class PendingSteps(Protocol):
    """Where the steps a change's copies overlapped go (controlplane.copycost.CopyCostEstimator)."""

    def knows(self, version: int) -> bool: ...

    def pending(self, version: int, t_ms: npt.ArrayLike, busiest: npt.ArrayLike, tokens: npt.ArrayLike,
                stands_for: float, stride_ms: npt.ArrayLike | None = None) -> None: ...


TABLES_KEPT = 8  # the newest tables the estimator can place a reported step under (by version)


class StepTimeEstimator:
    """The measured steps of the last `keep` windows, each with the busiest-rank load and batch of its counts
    under the table that served it; `current` fits them (the same windows give the same figure on every node).
    Where the engines say which version each step ran on (LoadWindow.step_version), a step that ran on an older
    table than the head goes to `copies` (the head's copies overlapped it), not to the fit."""

    def __init__(self, keep: int = 50, copies: PendingSteps | None = None) -> None:
        self.keep = keep
        self.copies = copies
        self._windows: list[tuple[int, Points]] = []  # (window seq, its fit points)
        self._version: int | None = None  # the table the last window was observed under
        self._tables: dict[int, RoutingTable] = {}  # the newest tables by version

    def know(self, table: RoutingTable) -> None:
        """A table the engines may report steps under (the head, and each one committed)."""
        self._tables[table.version] = table
        for old in sorted(self._tables)[:-TABLES_KEPT]:
            del self._tables[old]

    def observe(self, seq: int, table: RoutingTable, rows: npt.NDArray[np.integer],
                step_us: npt.NDArray[np.integer] | None, step_version: npt.NDArray[np.integer] | None = None,
                span: int = 0, stride_us: npt.NDArray[np.integer] | None = None) -> None:
        """A closed window's sampled steps rows [S, L, E], their wall times step_us [S] (None: unmeasured), the
        versions they ran on step_version [S] (None: not said) and the mean times of the steps each stands for
        stride_us [S] (None: not measured); `table` is the head, `span` the steps of the window (each sampled
        step stands for span / S of them)."""
        self.know(table)
        changed = self._version is not None and table.version != self._version
        self._version = table.version
        if step_us is None or len(step_us) == 0 or np.shape(step_us) != np.shape(rows)[:1]:
            return
        t = np.asarray(step_us, dtype=np.float64) / 1e3
        st = (np.asarray(stride_us, dtype=np.float64) / 1e3 if stride_us is not None
              and np.shape(stride_us) == np.shape(t) else None)
        if step_version is None or np.shape(step_version) != np.shape(t):
            if changed:  # the first window under a new table ran partly under the old one (engines install it later)
                return
            busiest, tokens = step_points(table, rows)
            self._windows = (self._windows + [(seq, Points(t, busiest, tokens, st))])[-self.keep:]
            return
        ran = np.asarray(step_version, dtype=np.int64)
        stands_for = span / len(t) if span > 0 else 1.0
        parts: list[Points] = []
        for v in np.unique(ran).tolist():
            served = self._tables.get(int(v))
            if served is None:  # a version this node does not hold: the step cannot be placed
                continue
            sel = ran == v
            busiest, tokens = step_points(served, np.asarray(rows)[sel])
            if v < table.version:  # run on an older table once the head was committed: the head's copies overlapped it
                if self.copies is not None and self.copies.knows(table.version):
                    self.copies.pending(table.version, t[sel], busiest, tokens, stands_for,
                                        None if st is None else st[sel])
                continue  # (not a point of the fit: the copies slowed it)
            parts.append(Points(t[sel], busiest, tokens, None if st is None else st[sel]))
        if parts:
            strides = None if st is None else np.concatenate([p.stride for p in parts if p.stride is not None])
            held = Points(np.concatenate([p.t for p in parts]), np.concatenate([p.m for p in parts]),
                          np.concatenate([p.n for p in parts]), strides)
            self._windows = (self._windows + [(seq, held)])[-self.keep:]

    def held(self, seqs: Iterable[int]) -> list[Points]:
        """The fit points of the windows held among `seqs` (the steps the head of the time served there)."""
        want = set(seqs)
        return [p for seq, p in self._windows if seq in want]

    def latest_fit(self) -> StepFit | None:
        """The fit of the windows held, None where there is none."""
        f = self.fit()
        return f if isinstance(f, StepFit) else None

    @property
    def points(self) -> int:
        return sum(len(p.t) for _, p in self._windows)

    def fit(self) -> StepFit | Loose | str | None:
        """The fit of the windows held, why there is none, or None when no window was measured: of their means
        where the engines timed the strides and the windows vary more than their sampling (`fit_window_means`),
        else of their sampled steps one by one (`fit_step_time`). Its `scale_ms` is one step's noise about it."""
        if not self._windows:
            return None
        held = [p for _, p in self._windows]
        cat = [np.concatenate([p.t for p in held]), np.concatenate([p.m for p in held]),
               np.concatenate([p.n for p in held])]
        timed = [p for p in held if p.stride is not None]
        why = ""
        if len(timed) >= MIN_WINDOWS:
            means = fit_window_means([p.stride for p in timed if p.stride is not None], [p.m for p in timed],
                                     [p.n for p in timed])  # (the filter again: for the type checker)
            if isinstance(means, StepFit):
                r = cat[0] - means.predict(cat[1], cat[2])
                return replace(means, scale_ms=1.4826 * float(np.median(np.abs(r - np.median(r)))))
            why = means
        steps = fit_step_time(cat[0], cat[1], cat[2])
        return replace(steps, not_means=why) if isinstance(steps, StepFit) and why else steps

    def current(self, configured_ms: float, override: bool, busiest: float | None = None) -> StepTime:
        """The step time to decide with: `configured_ms` when the operator set it (`override`), else the fit
        (read at `busiest`, the judged windows' busiest load: `resolve`), else `configured_ms` as the default;
        WARMING_UP while the windows held are measured but fewer than MIN_POINTS steps."""
        fit = None if override else self.fit()
        if isinstance(fit, (str, Loose)) and 0 < self.points < MIN_POINTS:
            return StepTime(configured_ms, StepTimeSource.WARMING_UP, f"the configured default until the fit: {fit}")
        return resolve(configured_ms if override else None, fit, configured_ms, self.median_step_ms(), busiest)

    def median_step_ms(self) -> float | None:
        """The median measured step time of the windows held (ms), None when none was measured."""
        if not self._windows:
            return None
        t = np.concatenate([p.t for _, p in self._windows])
        t = t[np.isfinite(t) & (t > 0)]
        return float(np.median(t)) if t.size else None
