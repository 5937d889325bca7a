"""controlplane.copycost: what a change's copies cost the steps they overlapped, measured against the step-time fit,
over what the cost model charged; the rule that uses it; and the controller measuring its own installs from the
versions the engines say each step ran on (LoadWindow.step_version)."""

from __future__ import annotations

import numpy as np
import pytest

from controlplane.copycost import HI, MIN_CHANGES, CopyCostEstimator, CopyCostSource
from controlplane.steptime import Points, StepFit, StepTimeEstimator, step_points
from controlplane.table import initial_table
from controlplane.topology import Topology

FIT = StepFit(a_ms=2.0, b_ms=0.001, c_ms=0.0, load_ms=1.0, points=500, busiest=1000.0, scale_ms=0.1)


def _pending(est: CopyCostEstimator, version: int, rng: np.random.Generator, excess_ms: float, points: int,
             stands_for: float, noise: float = 0.1) -> None:
    """`points` sampled steps the copies of `version` overlapped, each `excess_ms` over the fit (plus noise)."""
    m = rng.uniform(900, 1100, points)
    t = FIT.predict(m, np.zeros(points)) + excess_ms + noise * rng.standard_normal(points)
    est.pending(version, t, m, np.zeros(points), stands_for)


def test_the_copies_excess_over_the_fit_is_measured_against_their_charge() -> None:
    """Three changes, each charged 10 ms, whose copies slowed 8 sampled steps (each standing for 10) by 0.25 ms:
    20 ms realised each, twice the charge."""
    rng = np.random.default_rng(0)
    est = CopyCostEstimator()
    for v in (2, 3, 4):
        est.committed(v, 10.0)
        _pending(est, v, rng, 0.25, 8, 10.0)
    got = est.estimate(FIT)
    assert got.source is CopyCostSource.MEASURED and got.changes == 3, got
    assert got.factor == pytest.approx(2.0, rel=0.2) and got.ratio == got.factor, got
    assert "3 change(s) measured" in got.why and "30 ms charged" in got.why


def test_steps_no_copy_overlapped_add_noise_not_bias() -> None:
    """The window a commit fell in holds steps run on the old table before the commit, which no copy slowed:
    their excess is 0, and the realised cost is a sum, so they do not dilute it."""
    rng = np.random.default_rng(1)
    est = CopyCostEstimator()
    for v in (2, 3, 4):
        est.committed(v, 10.0)
        _pending(est, v, rng, 0.25, 8, 10.0, noise=0.02)
        _pending(est, v, rng, 0.0, 8, 10.0, noise=0.02)  # before the commit: not slowed
    assert est.estimate(FIT).factor == pytest.approx(2.0, rel=0.1)


def test_until_enough_changes_are_measured_precisely_the_charge_stands_as_modelled() -> None:
    rng = np.random.default_rng(2)
    est = CopyCostEstimator()
    assert est.estimate(FIT).source is CopyCostSource.MODELLED  # nothing committed
    assert est.estimate(None).source is CopyCostSource.MODELLED and "no step-time fit" in est.estimate(None).why
    est.committed(2, 10.0)
    _pending(est, 2, rng, 0.25, 8, 10.0)
    one = est.estimate(FIT)
    assert one.factor == 1.0 and one.source is CopyCostSource.MODELLED and f"fewer than {MIN_CHANGES}" in one.why
    assert one.ratio is not None and one.ratio > 1.5  # (said, not used)
    noisy = CopyCostEstimator()
    loose = StepFit(2.0, 0.001, 0.0, 1.0, 500, 1000.0, scale_ms=5.0)  # a step's noise far past the copies' excess
    for v in (2, 3, 4):
        noisy.committed(v, 10.0)
        _pending(noisy, v, rng, 0.25, 8, 10.0)
    got = noisy.estimate(loose)
    assert got.factor == 1.0 and "standard error" in got.why, got


def test_the_factor_is_bounded_and_a_change_not_committed_here_is_not_measured() -> None:
    rng = np.random.default_rng(3)
    est = CopyCostEstimator()
    for v in (2, 3):
        est.committed(v, 1.0)
        _pending(est, v, rng, 1.0, 8, 10.0, noise=0.01)  # 80 ms against 1 ms charged
    got = est.estimate(FIT)
    assert got.factor == HI and got.ratio is not None and got.ratio > 50 and "bounded" in got.why
    est.pending(9, [5.0], [1000.0], [0.0], 10.0)  # no commit of v9 known: nothing to charge it against
    assert est.estimate(FIT).changes == 2 and not est.knows(9)
    with pytest.raises(ValueError, match="charged_ms"):
        est.committed(5, -1.0)


def _control(rng: np.random.Generator, off_ms: float, points: int, noise: float = 0.05,
             strides: bool = False) -> Points:
    """`points` steps the old table served before the commit, `off_ms` over the fit (its error at that load)."""
    m = rng.uniform(900, 1100, points)
    t = FIT.predict(m, np.zeros(points)) + off_ms + noise * rng.standard_normal(points)
    return Points(t, m, np.zeros(points), t.copy() if strides else None)


def test_the_fits_error_at_the_load_the_old_table_served_is_taken_out_by_the_control() -> None:
    """The fit under-reads the drifted load the old table serves by 0.3 ms a step (a line through an engine that
    is not one), the copies slow 8 sampled steps (each standing for 10) by 0.25 ms on each of two changes charged
    10 ms: 20 ms realised each. Against the fit alone that reads 44 ms (x4.4); against the same table's steps
    just before the commit it reads x2."""
    rng = np.random.default_rng(5)
    with_control, fit_only = CopyCostEstimator(), CopyCostEstimator()
    for v in (2, 3):
        control = _control(rng, 0.3, 40)
        with_control.committed(v, 10.0, [control])
        fit_only.committed(v, 10.0)
        m = rng.uniform(900, 1100, 8)
        t = FIT.predict(m, np.zeros(8)) + 0.3 + 0.25 + 0.05 * rng.standard_normal(8)
        for est in (with_control, fit_only):
            est.pending(v, t, m, np.zeros(8), 10.0)
    got, naive = with_control.estimate(FIT), fit_only.estimate(FIT)
    assert got.source is CopyCostSource.MEASURED and got.factor == pytest.approx(2.0, rel=0.15), got
    assert naive.ratio == pytest.approx(4.4, rel=0.1), naive  # (without the control: the fit's error x 80 steps)


def test_a_copy_that_slowed_the_steps_between_the_sampled_ones_is_measured_from_their_strides() -> None:
    """The copies slow steps no sampled step is: the sampled steps run as before the commit, their strides'
    means are 0.25 ms over (20 ms over 80 steps, twice the charge). Measured from the strides, where the engines
    timed them; a change whose control was not timed falls back to the sampled steps (nothing over)."""
    rng = np.random.default_rng(6)
    est, untimed = CopyCostEstimator(), CopyCostEstimator()
    for v in (2, 3):
        est.committed(v, 10.0, [_control(rng, 0.0, 40, strides=True)])
        untimed.committed(v, 10.0, [_control(rng, 0.0, 40)])
        m = rng.uniform(900, 1100, 8)
        t = FIT.predict(m, np.zeros(8)) + 0.05 * rng.standard_normal(8)
        for e in (est, untimed):
            e.pending(v, t, m, np.zeros(8), 10.0, stride_ms=t + 0.25)
    got = est.estimate(FIT)
    assert got.source is CopyCostSource.MEASURED and got.factor == pytest.approx(2.0, rel=0.15), got
    assert untimed.estimate(FIT).source is CopyCostSource.MODELLED  # (the sampled steps: x0 +- noise)


def test_the_installs_stride_is_counted_at_both_ends_and_the_factor_is_the_least_when_that_is_over_1() -> None:
    """The copies slow only the install's stride, which the install may have cut short: it stands for 1 to 10
    steps. A stride 2 ms over against 10 ms charged reads x0.2 to x2: the model is within that, and the charge
    stands. 15 ms over reads x1.5 to x15: at least x1.5, what the copies are charged. 0.4 ms over reads x0.04
    to x0.4, but a measure never lowers the charge (where it reads low is where it errs): the model stands."""
    rng = np.random.default_rng(8)

    def change(est: CopyCostEstimator, v: int, over_ms: float) -> None:
        est.committed(v, 10.0, [_control(rng, 0.0, 40, noise=0.01, strides=True)])
        m = rng.uniform(900, 1100, 4)
        t = FIT.predict(m, np.zeros(4))
        stride = t.copy()
        stride[-1] += over_ms  # the newest stride's mean: all the copies' excess
        est.pending(v, t, m, np.zeros(4), 10.0, stride_ms=stride)

    within, over, under = CopyCostEstimator(), CopyCostEstimator(), CopyCostEstimator()
    for v in (2, 3):
        change(within, v, 2.0)
        change(over, v, 15.0)
        change(under, v, 0.4)
    got = within.estimate(FIT)
    assert got.source is CopyCostSource.MODELLED and "its low end not over x1" in got.why, got
    assert got.ratio_low == pytest.approx(0.2, abs=0.01) and got.ratio == pytest.approx(2.0, rel=0.05), got
    dear = over.estimate(FIT)
    assert dear.source is CopyCostSource.MEASURED and dear.factor == pytest.approx(1.5, rel=0.05), dear
    cheap = under.estimate(FIT)
    assert cheap.source is CopyCostSource.MODELLED and cheap.factor == 1.0 and cheap.ratio == pytest.approx(0.4, rel=0.1)


def test_the_control_spread_sets_the_standard_error() -> None:
    """Control steps that scatter 2 ms about the fit leave the copies' 0.25 ms a step within their noise: the
    charge stands as modelled and says why."""
    rng = np.random.default_rng(7)
    est = CopyCostEstimator()
    for v in (2, 3):
        est.committed(v, 10.0, [_control(rng, 0.0, 40, noise=2.0)])
        _pending(est, v, rng, 0.25, 8, 10.0, noise=0.05)
    got = est.estimate(FIT)
    assert got.source is CopyCostSource.MODELLED and "standard error" in got.why, got


def test_the_estimator_places_each_step_under_the_table_that_served_it() -> None:
    """A window whose first sampled steps ran on v1 while v2 was committed: those go to the copy measurement,
    under v1 (what served them); the rest are fit points under v2; a version never held is dropped."""
    topo = Topology(1, 2, 2)
    v1 = initial_table(topo, 1, 3)
    spread = v1.phy2log.copy()
    spread[0, 3] = 0  # a replica of expert 0: v2 halves its rank's load
    v2 = v1.successor(spread)
    copies = CopyCostEstimator()
    est = StepTimeEstimator(copies=copies)
    est.know(v1)
    copies.committed(v2.version, 5.0)
    rows = np.array([[[40, 10, 10]]] * 4)
    est.observe(7, v2, rows, np.array([3000, 3000, 2000, 2000]), np.array([1, 1, 2, 9]), span=40)
    [(seq, held)] = est._windows
    t, busiest = held.t, held.m
    want_v2, _ = step_points(v2, rows[2:3])
    assert seq == 7 and t.tolist() == [2.0] and busiest.tolist() == want_v2.tolist()  # v9: unknown, dropped
    change = copies._changes[v2.version]
    want_v1, _ = step_points(v1, rows[:2])
    [(points, stands_for)] = change.pending
    assert points.m.tolist() == want_v1.tolist() and stands_for == 10.0
    assert want_v1[0] != want_v2[0]  # (the two tables give the steps different loads)


def test_the_controller_measures_its_installs_and_charges_the_next_change_with_the_measure() -> None:
    """Windows of measured steps on the head (a fit), then two changes, each committed while the engines still
    ran the old table for 4 of the next window's 10 sampled steps, slowed by twice what the change was charged:
    with decision.copy_cost_measured (the default) the cost-benefit test now charges copies x2 and says where
    that came from; without it the measure is said and the model charged."""
    from controlplane.controller import Controller, DecisionParams, TableCommitted, WindowClosed

    head = initial_table(Topology(2, 2, 3), 4, 8)
    ctl = Controller(DecisionParams(window=100, theta=1e6, fast_theta=1e6, load_ms=12.0), head)  # the default
    off = Controller(DecisionParams(window=100, theta=1e6, fast_theta=1e6, load_ms=12.0, copy_cost_measured=False),
                     head)
    rng = np.random.default_rng(4)
    a, b = 2.0, 0.01
    rows = np.full((10, head.layers, head.experts), 40, np.uint32)
    tables = {head.version: head}

    def window(seq: int, slow: int = 0, excess_ms: float = 0.0) -> None:
        r = rows.copy()
        r[:, :, 0] = rng.integers(100, 400, size=(10, 1))  # the busiest load varies: a fit
        ran = np.full(10, ctl.head.version, np.uint32)
        ran[:slow] = ctl.head.version - 1  # the first `slow` sampled steps ran on the old table
        busiest = np.array([step_points(tables[int(v)], r[i:i + 1])[0][0] for i, v in enumerate(ran)])
        t = (a + b * busiest) * (1 + 0.002 * rng.standard_normal(10))
        t[:slow] += excess_ms
        for c in (ctl, off):
            c.step(WindowClosed(seq, seq * 100, r, span=100, step_us=np.rint(t * 1e3).astype(np.uint32),
                                step_version=ran))
            c.advance()

    for seq in range(30):
        window(seq)
    assert ctl.params.copy_slowdown == 1.0 and ctl.measures.copy_slowdown.source == "modelled"
    seq = 30
    for _ in range(2):
        spread = ctl.head.phy2log.copy()
        spread[:, 5] = 0  # a replica of expert 0 in the free slot of rank 1: copies
        t = ctl.head.successor(spread if (spread != ctl.head.phy2log).any() else np.roll(spread, 1, axis=1))
        tables[t.version] = t
        for c in (ctl, off):
            c.step(TableCommitted(t, "rebalance"))
            c.advance()
        charged = ctl.measures.copycost._changes[t.version].charged_ms
        assert charged > 0
        window(seq, slow=4, excess_ms=2.0 * charged / (4 * 10))  # 4 sampled steps, each standing for 10
        window(seq + 1)
        seq += 2
    cs = ctl.measures.copy_slowdown
    assert cs.source == "measured" and cs.factor == pytest.approx(2.0, rel=0.25), cs
    w = ctl.params.worth()
    assert w.copy_x == cs.factor and w.charge_s(1.0, 4) == pytest.approx(cs.factor / 4)
    assert "measured: 2 change(s)" in w.explain(0.1, 1.0, 4)
    # off: measured and said, the model charged
    assert off.measures.copy_slowdown.factor == cs.factor and off.params.worth().copy_x == 1.0
    assert "not used: decision.copy_cost_measured is off" in off.params.worth().explain(0.1, 1.0, 4)
