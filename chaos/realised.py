"""Invariant I6's rule on a change's realised effect, the one both chaos runners apply: the simulator's
(chaos.invariants.check_i6) and the process runner's (chaos.proccheck.Checks.realised). They differ only in
how they pick a change's windows and its deadline (the simulator's windows close on its clock, the engines' in
the process runner on a fixed wall clock); what counts as realised worse, and as no longer worse by the
deadline, is decided here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from controlplane.load import table_step_imbalance
from controlplane.table import RoutingTable


@dataclass(frozen=True)
class Realised:
    real: float       # the change's mean step imbalance over the observed windows
    cf: float         # its parent's, on the same load (the counterfactual)
    real_late: float  # the same over the last windows before the deadline (nan: none held)
    cf_late: float

    def message(self, version: int, n: int, grace: int) -> str:
        return (f"I6: version {version} realised step imbalance {self.real:.3f} vs {self.cf:.3f} without it over "
                f"{n} windows ({self.real_late:.3f} vs {self.cf_late:.3f} over the last {n} before the deadline), "
                f"not rolled back within {n + grace} windows")


def _mean(table: RoutingTable, windows: Sequence[npt.NDArray[np.integer]]) -> float:
    """Mean step imbalance over the windows' rows: each window a total [L, E] (one row) or the rows the
    controller saw of it [S, L, E] (its sampled steps: agent.decision.pipeline.window_rows)."""
    rows = [np.atleast_1d(table_step_imbalance(table, np.asarray(w).astype(np.int64))) for w in windows]
    return float(np.mean(np.concatenate(rows)))


def realised_worse(table: RoutingTable, parent: RoutingTable, observed: Sequence[npt.NDArray[np.integer]],
                   late: Sequence[npt.NDArray[np.integer]], margin: float = 0.05) -> Realised | None:
    """The change `table` must be superseded by its deadline when, over the `observed` windows (its first n
    fault-free ones), it is worse than its `parent` by more than `margin`, and still is over the `late` ones
    (the last n before the deadline: if the load moved so that it no longer is, rolling it back would be the
    change that replay shows worse, which the controller refuses). The judgement, or None when not due."""
    real, cf = _mean(table, observed), _mean(parent, observed)
    if real <= cf * (1.0 + margin):
        return None
    if not late:
        return Realised(real, cf, float("nan"), float("nan"))
    real_late, cf_late = _mean(table, late), _mean(parent, late)
    if real_late <= cf_late * (1.0 + margin):
        return None
    return Realised(real, cf, real_late, cf_late)
