"""What a change's copies cost the steps they overlapped, measured: the installs are natural experiments.

Between a commit and its install the engines serve the old table while the new one's weights are copied, over
the links the all-to-all also uses (and, on a real engine, the memory bandwidth the experts read). The plugins
report each sampled step's wall time, the mean time of its stride (itself and the steps up to the next sampled
one: LoadWindow.stride_us) and the table version it ran on (LoadWindow.step_version; a plugin reports the steps
before an install apart from those after it, so a stride never spans one). A step that ran on an older version
than the head, once the head was committed, is one the copies overlapped (or one still waiting for every rank to
hold the table: the change's cost too). Its excess over what the same table's steps took before the commit is
what the change cost it; summed over the change's pending strides, each standing for the steps it holds, it is
the change's realised cost in serving milliseconds. A sum, not a mean times a count: a step counted pending that
no copy overlapped (the window the commit fell in) adds noise, not bias.

What the same table's steps took is read off the step-time fit (controlplane.steptime: a + b x m + c x n) at
each stride's load, plus the fit's own error there: the mean residual of the strides the engines ran on that
table in the windows just before the commit (the control, `committed(..., control=...)`). The fit is a line
through an engine that is not one (docs/benchmarks.md: its slope is 10-20% off at a drifted load), and its error
times the 5-40 steps between a commit and its install was several times the copies' own cost; the control takes
it out, since the pending steps run the same table on the same load. Strides, not the sampled steps alone: a
copy overlaps a step or two, which a sampled step catches one time in `sample_every`, while a stride's mean
holds every step up to the next sampled one. Not quite every step: those of a report before its first sampled
step are in no stride (a plugin reports every 25 steps and samples every 10th), and copies that end there go
unmeasured. Where the engines do not time strides the sampled steps stand in.

The cost-benefit test charged the change cost_s / ranks (controlplane.worth: copies into different ranks run side
by side). The slowdown is realised over charged, pooled over the last KEEP measured changes (the sum of one over
the sum of the other: one change's few strides are noisy), as the least and the most the strides allow (the
install's stride, which holds the copies' last steps, may be cut short: `realised`). The factor the next
changes' charge is scaled by is the least where even that is over 1 (the copies cost more than charged: at
least that much more), else 1. A measure never lowers the charge: where it reads under 1 the model stands, since
that is where it errs (bench.heldout: from a cold start the lockstep waves put the control and the pending steps
on different phases, and every miss read low, several below 0; docs/benchmarks.md). Its standard error is the
control strides' spread carried through the sum. It is used once MIN_CHANGES changes were measured and its
standard error is within MAX_REL_SE of it, bounded to HI; until then the charge stands as modelled (factor 1)
and `why` says which. Every node holds the same gossiped windows and the same committed tables; it reads a
change's control when it learns of the commit, so two nodes that learn of it a window apart read controls a
window apart. Only a proposer's cost-benefit test uses the factor (a voter does not judge copies), so that
moves which node proposes what, never a vote. No IO, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from controlplane.steptime import Points, StepFit

F64 = npt.NDArray[np.float64]

KEEP = 8  # the newest measured changes the factor pools
MIN_CHANGES = 2  # measured changes before the factor is used
# the pooled factor's standard error must be within this fraction of it (a factor two standard errors from 0)
MAX_REL_SE = 0.5
HI = 4.0  # the factor's bound: a measurement is trusted to raise the charge this far, no further


class CopyCostSource(StrEnum):
    MEASURED = "measured"  # from the steps the copies overlapped
    MODELLED = "modelled"  # the cost model's charge as it stands (factor 1): too few changes measured, or too noisy


@dataclass(frozen=True)
class CopySlowdown:
    """The factor a change's modelled copy charge is scaled by, where it came from, and the figures behind it."""

    factor: float
    source: CopyCostSource
    why: str
    realised_ms: float = 0.0  # pooled over the measured changes
    charged_ms: float = 0.0
    changes: int = 0
    ratio: float | None = None  # realised / charged, before the rule that uses it (None: nothing measured)
    ratio_low: float | None = None  # the least the strides allow (the install's stride counted as one step)


MODELLED = CopySlowdown(1.0, CopyCostSource.MODELLED, "modelled: no change measured yet")


@dataclass
class _Change:
    version: int
    charged_ms: float
    control: list[Points]  # the old table's steps in the windows just before the commit
    pending: list[tuple[Points, float]] = field(default_factory=list)  # the steps it overlapped, each standing for

    @property
    def points(self) -> int:
        return sum(len(p.t) for p, _ in self.pending)


def _pick(parts: list[Points], strides: bool) -> tuple[F64, F64, F64]:
    """The points' times (their strides' means where `strides`), loads and batches, concatenated."""
    t = np.concatenate([p.stride if strides and p.stride is not None else p.t for p in parts])
    return t, np.concatenate([p.m for p in parts]), np.concatenate([p.n for p in parts])


MIN_CONTROL = 5  # control strides a change's baseline needs; with fewer, the fit alone is the baseline


def realised(c: _Change, fit: StepFit) -> tuple[float, float, float]:
    """What `c`'s copies cost the steps they overlapped (serving ms), as the least and the most the strides allow,
    and that figure's variance: each pending stride's excess over the fit, less the fit's mean error on the same
    table just before the commit (the control), times the steps it stands for. The newest pending stride is the
    one the install may have cut short (a plugin reports the steps before an install apart from those after
    it): it holds the copies' last steps and stands for 1 to its window's share of steps, which the window does
    not say, so it is counted at both ends. Where the steps are not timed in strides each sampled step stands
    for its share (one in `sample_every` catches a copy: unbiased, noisier) and the two ends are the same. The
    variance is the control's spread carried through both sums; without a control, the fit's noise about one
    step (its `scale_ms`) with no bias removed."""
    parts = [p for p, _ in c.pending]
    strides = all(p.stride is not None for p in parts + c.control)
    t, m, n = _pick(parts, strides)
    w = np.concatenate([np.full(len(p.t), sf) for p, sf in c.pending])
    excess = t - fit.predict(m, n)
    control = sum(len(p.t) for p in c.control)
    if control < MIN_CONTROL:
        bias, var = 0.0, float((w * w).sum()) * fit.scale_ms ** 2
    else:
        ct, cm, cn = _pick(c.control, strides)
        r = ct - fit.predict(cm, cn)
        bias = float(r.mean())
        var = float(r.var(ddof=1)) * (float((w * w).sum()) + float(w.sum()) ** 2 / control)
    full = float((w * (excess - bias)).sum())
    if not strides:
        return full, full, var
    short = full - (w[-1] - 1.0) * float(excess[-1] - bias)  # the newest stride counted as one step
    return min(full, short), max(full, short), var


class CopyCostEstimator:
    """The changes committed (their charge and control) and the sampled steps their copies overlapped."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._changes: dict[int, _Change] = {}

    def committed(self, version: int, charged_ms: float, control: list[Points] | None = None) -> None:
        """A change to `version` was committed; the cost-benefit test charged its copies `charged_ms` of serving.
        `control`: the steps the old table served in the windows just before the commit (StepTimeEstimator.held)."""
        if not charged_ms >= 0.0:
            raise ValueError(f"charged_ms={charged_ms!r}: expected >= 0")
        self._changes[version] = _Change(version, float(charged_ms), list(control or []))
        for old in sorted(self._changes)[:-4 * self.keep]:
            del self._changes[old]

    def knows(self, version: int) -> bool:
        return version in self._changes

    def pending(self, version: int, t_ms: npt.ArrayLike, busiest: npt.ArrayLike, tokens: npt.ArrayLike,
                stands_for: float, stride_ms: npt.ArrayLike | None = None) -> None:
        """Sampled steps that ran on an older table while `version` was committed: wall times (ms), busiest load
        and batch under the table that served them, each standing for `stands_for` steps, and their strides'
        mean times (ms; None: not timed)."""
        c = self._changes.get(version)
        if c is None:
            return
        t = np.asarray(t_ms, dtype=np.float64).reshape(-1)
        st = None if stride_ms is None else np.asarray(stride_ms, dtype=np.float64).reshape(-1)
        c.pending.append((Points(t, np.asarray(busiest, dtype=np.float64).reshape(-1),
                                 np.asarray(tokens, dtype=np.float64).reshape(-1),
                                 st if st is not None and st.shape == t.shape else None), float(stands_for)))

    def estimate(self, fit: StepFit | None) -> CopySlowdown:
        """The factor from the changes measured so far, read against `fit` (None: no step-time fit, nothing to
        measure an excess against: modelled)."""
        if fit is None:
            return CopySlowdown(1.0, CopyCostSource.MODELLED, "modelled: no step-time fit to measure the copies' "
                                                              "excess against")
        measured = [c for c in sorted(self._changes.values(), key=lambda c: c.version)
                    if c.charged_ms > 0 and c.points][-self.keep:]
        if not measured:
            return MODELLED
        got = [realised(c, fit) for c in measured]
        low, high, var = (sum(g[i] for g in got) for i in range(3))
        charged = sum(c.charged_ms for c in measured)
        lo, hi = float(low) / charged, float(high) / charged
        se = float(np.sqrt(var)) / charged
        span = f"x{hi:.3g}" if lo == hi else f"x{lo:.3g} to x{hi:.3g}"
        said = (f"{len(measured)} change(s) measured: their copies cost the steps they overlapped "
                f"{low:.4g}{'' if lo == hi else f' to {high:.4g}'} ms of serving against {charged:.4g} ms charged, "
                f"{span} +- {se:.2g}")
        # what the measurement rules out: copies dearer than charged by at least `lo` (never cheaper: see above)
        ratio = lo if lo > 1.0 else None
        if len(measured) < MIN_CHANGES or ratio is None or se > MAX_REL_SE * ratio:
            rule = (f"fewer than {MIN_CHANGES}" if len(measured) < MIN_CHANGES else "not positive" if not hi > 0.0
                    else "its low end not over x1" if ratio is None else f"its standard error past {MAX_REL_SE:g} of it")
            return CopySlowdown(1.0, CopyCostSource.MODELLED, f"modelled: {said} ({rule})", high, charged,
                                len(measured), hi, lo)
        factor = min(ratio, HI)
        bound = f", bounded to {factor:.3g}" if factor != ratio else ""
        return CopySlowdown(factor, CopyCostSource.MEASURED, f"measured: {said}{bound}", high, charged,
                            len(measured), hi, lo)
