"""Load monitor: error budget with a tolerance band, in-flight counting, replay buffer caching."""

from __future__ import annotations

import numpy as np
import pytest

from controlplane import load, verify
from controlplane.errors import InvalidShape
from controlplane.monitor import ErrorBudget, LoadMonitor, ReplayBuffer
from controlplane.ops import Replicate, apply_ops
from controlplane.table import initial_table
from controlplane.topology import Topology


def test_error_budget_counts_consecutive_windows() -> None:
    b = ErrorBudget(theta=1.15, band=0.05, windows=2)
    assert [b.observe(x) for x in (1.2, 1.0, 1.2, 1.3)] == [False, False, False, True]


def test_tolerance_band_holds_the_count_and_cannot_flap() -> None:
    b = ErrorBudget(theta=1.15, band=0.05, windows=3)
    # hovering around theta: above, inside the band, above, ... counts up instead of resetting
    seq = [b.observe(x) for x in (1.16, 1.14, 1.16, 1.12, 1.16)]
    assert seq == [False, False, False, False, True] and b.count == 3
    b.reset()
    # inside the band from below never starts a count
    assert not any(b.observe(x) for x in (1.11, 1.14, 1.149, 1.13)) and b.count == 0
    # a dip under theta - band resets
    b.observe(1.2)
    b.observe(1.09)
    assert b.count == 0


def _counts(rng: np.random.Generator, W: int, L: int, E: int, hot: int) -> np.ndarray:
    p = np.ones(E)
    p[hot] = 8.0
    p /= p.sum()
    return np.stack([rng.multinomial(800, p, size=W) for _ in range(L)], axis=1).astype(np.uint32)


def test_monitor_measures_under_the_in_flight_table() -> None:
    """Counting in-flight operations: windows are judged under the proposal that will be in force."""
    rng = np.random.default_rng(0)
    topo = Topology(1, 4, 2)
    head = initial_table(topo, 2, 4)
    fix = apply_ops(head, [Replicate(0, 0, 1), Replicate(0, 0, 2), Replicate(1, 0, 1), Replicate(1, 0, 2)])
    m = LoadMonitor(2, 4, replay_windows=3, theta=2.0, band=0.1, budget_windows=2)
    c0 = _counts(rng, 10, 2, 4, hot=0)
    r0 = m.observe(0, 0, c0, head)
    assert r0.imbalance == pytest.approx(load.replay_imbalance(head, c0)) and r0.budget == 1
    c1 = _counts(rng, 10, 2, 4, hot=0)
    r1 = m.observe(1, 10, c1, fix, base=head)
    assert r1.imbalance == pytest.approx(load.replay_imbalance(fix, c1))
    assert r1.imbalance < 1.9 < r0.imbalance and not r1.fired and r1.budget == 0


def test_monitor_gap_and_stale_windows() -> None:
    rng = np.random.default_rng(1)
    head = initial_table(Topology(1, 2, 2), 1, 4)
    m = LoadMonitor(1, 4, replay_windows=2, theta=1.01, band=0.0, budget_windows=3)
    m.observe(0, 0, _counts(rng, 5, 1, 4, 0), head)
    m.observe(1, 5, _counts(rng, 5, 1, 4, 0), head)
    assert m.budget.count == 2 and m.is_stale(1) and not m.is_stale(2)
    m.observe(5, 25, _counts(rng, 5, 1, 4, 0), head)  # windows 2-4 missing: the count restarts
    assert m.budget.count == 1


def test_replay_buffer_caches_by_content_and_replays_changed_layers() -> None:
    rng = np.random.default_rng(2)
    topo = Topology(2, 2, 2)
    head = initial_table(topo, 3, 6)
    buf = ReplayBuffer(3, 6, capacity=2, block=3)
    windows = [_counts(rng, 7, 3, 6, hot=1) for _ in range(3)]
    for i, c in enumerate(windows):
        buf.push(i, 7 * i, c)
    assert [w.seq for w in buf.windows] == [1, 2] and buf.steps == 14
    allc = np.concatenate(windows[1:], axis=0)
    assert np.array_equal(buf.counts(), allc)
    assert np.array_equal(buf.window_totals(), np.stack([c.sum(axis=0) for c in windows[1:]]).astype(np.int64))
    bt = buf.block_totals()
    assert bt.shape == (6, 3, 6) and np.array_equal(bt.sum(axis=0), allc.sum(axis=0))
    prop = apply_ops(head, [Replicate(1, 1, 3)])
    s_head = buf.stats(head)
    s_prop = buf.stats(prop, base=head)
    assert np.array_equal(s_prop.layer_max, verify.replay_stats(prop, allc).layer_max)
    assert np.array_equal(s_head.layer_max, verify.replay_stats(head, allc).layer_max)
    same = prop.with_version(9, 8)  # same content, other version: served from the cache
    assert buf.stats(same).layer_max is not s_prop.layer_max
    assert np.array_equal(buf.stats(same).layer_max, s_prop.layer_max)
    assert buf.stats(head, last=1).layer_max.shape == (7, 3)


def test_replay_buffer_rejects_bad_windows() -> None:
    buf = ReplayBuffer(2, 3, capacity=2)
    with pytest.raises(InvalidShape):
        buf.push(0, 0, np.zeros((4, 3, 3), dtype=np.uint32))
    with pytest.raises(InvalidShape):
        buf.push(0, 0, np.zeros((0, 2, 3), dtype=np.uint32))
    with pytest.raises(InvalidShape):
        buf.push(0, 0, -np.ones((1, 2, 3), dtype=np.int64))
    assert buf.steps == 0 and buf.counts().shape == (0, 2, 3)


def test_same_mix_counts_the_windows_since_a_drift() -> None:
    rng = np.random.default_rng(11)
    buf = ReplayBuffer(2, 8, 4)
    assert buf.same_mix(0.05) == 0
    for w in range(3):
        buf.push(w, w * 10, _counts(rng, 10, 2, 8, hot=1))
    assert buf.same_mix(0.05) == 3  # one mix: multinomial noise stays far below 0.05
    buf.push(3, 30, _counts(rng, 10, 2, 8, hot=6))  # the hot expert changes: a drift
    assert buf.same_mix(0.05) == 1 and buf.same_mix(1.0) == 4
    assert buf.block_totals(1).shape == (1, 2, 8) and buf.steps_of(1) == 10 and buf.steps_of() == 40


def test_a_large_breach_spends_the_budget_at_once() -> None:
    b = ErrorBudget(theta=1.15, band=0.05, windows=3, fast=1.5)
    assert [b.observe(x) for x in (1.2, 1.6)] == [False, True] and b.count == 3
    b.reset()
    assert b.observe(1.6) and not ErrorBudget(1.15, 0.05, 3).observe(1.6)
