"""What a change's copies cost the steps they overlapped, measured: the installs are natural experiments.

Between a commit and its install the engines serve the old table while the new one's weights are copied, over
the links the all-to-all also uses (and, on a real engine, the memory bandwidth the experts read). The plugins
report each sampled step's wall time and the table version it ran on (LoadWindow.step_version; a plugin reports
the steps before an install apart from those after it). A step that ran on an older version than the head,
once the head was committed, is one the copies overlapped (or one still waiting for every rank to hold the
table: the change's cost too). Its excess over the step-time fit's prediction under the table that served it
(controlplane.steptime: a + b x m + c x n) is what the change cost it; summed over the change's pending sampled
steps, each standing for the steps of its window it samples, it is the change's realised cost in serving
milliseconds. A sum, not a mean times a count: a step counted pending that no copy overlapped (the window the
commit fell in) adds noise, not bias.

The cost-benefit test charged the change cost_s / ranks (controlplane.worth: copies into different ranks run side
by side). `slowdown` is realised over charged, pooled over the last KEEP measured changes (the sum of one over
the sum of the other: one change's few sampled steps are noisy), the factor the next changes' charge is scaled
by. It is used once MIN_CHANGES changes were measured and its standard error (the fit's per-step noise over the
pending steps) is within MAX_REL_SE of it, clipped to [LO, HI]; until then the charge stands as modelled (factor
1) and `why` says which. Every voter holds the same gossiped windows and the same committed tables, so it
derives the same figure. No IO, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from controlplane.steptime import StepFit

F64 = npt.NDArray[np.float64]

KEEP = 8  # the newest measured changes the factor pools
MIN_CHANGES = 2  # measured changes before the factor is used
# the pooled factor's standard error must be within this fraction of it: ten sampled steps of a 10% jitter
# leave about +-30% of a step's time on a change's realised cost, more than a decode change's copies cost
MAX_REL_SE = 0.5
LO, HI = 0.5, 4.0  # the factor's bounds: a measurement is trusted to move the charge this far, no further


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


MODELLED = CopySlowdown(1.0, CopyCostSource.MODELLED, "modelled: no change measured yet")


@dataclass
class _Change:
    version: int
    charged_ms: float
    t: list[F64] = field(default_factory=list)  # pending sampled steps' wall times (ms)
    m: list[F64] = field(default_factory=list)  # their busiest load under the table that served them
    n: list[F64] = field(default_factory=list)  # their batch
    w: list[F64] = field(default_factory=list)  # the steps each stands for

    @property
    def points(self) -> int:
        return sum(len(x) for x in self.t)


class CopyCostEstimator:
    """The changes committed (their charge) and the sampled steps their copies overlapped."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._changes: dict[int, _Change] = {}

    def committed(self, version: int, charged_ms: float) -> None:
        """A change to `version` was committed; the cost-benefit test charged its copies `charged_ms` of serving."""
        if not charged_ms >= 0.0:
            raise ValueError(f"charged_ms={charged_ms!r}: expected >= 0")
        self._changes[version] = _Change(version, float(charged_ms))
        for old in sorted(self._changes)[:-4 * self.keep]:
            del self._changes[old]

    def knows(self, version: int) -> bool:
        return version in self._changes

    def pending(self, version: int, t_ms: npt.ArrayLike, busiest: npt.ArrayLike, tokens: npt.ArrayLike,
                stands_for: float) -> None:
        """Sampled steps that ran on an older table while `version` was committed: wall times (ms), busiest load
        and batch under the table that served them, each standing for `stands_for` steps."""
        c = self._changes.get(version)
        if c is None:
            return
        t = np.asarray(t_ms, dtype=np.float64).reshape(-1)
        c.t.append(t)
        c.m.append(np.asarray(busiest, dtype=np.float64).reshape(-1))
        c.n.append(np.asarray(tokens, dtype=np.float64).reshape(-1))
        c.w.append(np.full(t.shape, float(stands_for)))

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
        realised = charged = var = 0.0
        for c in measured:
            t, m, n, w = (np.concatenate(x) for x in (c.t, c.m, c.n, c.w))
            realised += float((w * (t - fit.predict(m, n))).sum())
            var += float((w * w).sum()) * fit.scale_ms ** 2
            charged += c.charged_ms
        ratio = realised / charged
        se = float(np.sqrt(var)) / charged
        said = (f"{len(measured)} change(s) measured: their copies cost the steps they overlapped {realised:.4g} ms "
                f"of serving against {charged:.4g} ms charged, x{ratio:.3g} +- {se:.2g}")
        if len(measured) < MIN_CHANGES or not ratio > 0 or se > MAX_REL_SE * ratio:
            rule = (f"fewer than {MIN_CHANGES}" if len(measured) < MIN_CHANGES else
                    f"its standard error past {MAX_REL_SE:g} of it" if ratio > 0 else "not positive")
            return CopySlowdown(1.0, CopyCostSource.MODELLED, f"modelled: {said} ({rule})", realised, charged,
                                len(measured), ratio)
        factor = min(max(ratio, LO), HI)
        bound = f", bounded to {factor:.3g}" if factor != ratio else ""
        return CopySlowdown(factor, CopyCostSource.MEASURED, f"measured: {said}{bound}", realised, charged,
                            len(measured), ratio)
