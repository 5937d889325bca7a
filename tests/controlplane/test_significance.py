"""Trust what replay can tell (issue 49, finding 3): a rebalance is proposed only when its replayed gain holds
across the replay's rows beyond their own spread (controlplane.verify.gain_bound, DecisionParams.gain_confidence),
so that a periodic burst is not chased; a steady gain still is."""

from __future__ import annotations

import numpy as np
import pytest

from controlplane.controller import Controller, DecisionParams, Ready
from controlplane.table import initial_table
from controlplane.topology import Topology
from tests.controlplane.test_worth import W, run  # windows of W steps, stepped through a controller


def windows(n: int, burst_every: int = 0, hot: int = 0, seed: int = 0) -> list[np.ndarray]:
    """`n` windows of W steps, 4 layers x 16 experts: about 100 tokens an expert a step, expert 0 `hot`; with
    `burst_every`, expert 0 takes 30000 tokens on one step in every `burst_every` (a periodic burst: a batch
    of requests arriving together), nothing otherwise."""
    rng = np.random.default_rng(seed)
    out = []
    for w in range(n):
        c = np.full((W, 4, 16), 100, np.uint32) + rng.integers(0, 5, size=(W, 4, 16), dtype=np.uint32)
        c[:, :, 0] = hot
        for t in range(W):
            if burst_every and (w * W + t) % burst_every == burst_every - 1:
                c[t, :, 0] = 30000
        out.append(c)
    return out


def controller(**kw: object) -> Controller:
    head = initial_table(Topology(2, 4, 3), 4, 16)  # 8 ranks x 3 slots: 2 experts a rank and a spare slot
    return Controller(DecisionParams(window=W, expert_bytes=1 << 24, **kw), head)  # type: ignore[arg-type]


def explains(rs: list[Ready]) -> list[object]:
    return [e for r in rs for e in r.events if type(e).__name__ == "Explain"]


def test_a_periodic_burst_is_not_chased() -> None:
    """A burst every 60 steps (one in each 3 windows) puts expert 0 on top of rank 0 for one step: the window
    that holds it is 1.41 times an even split, over fast_theta, and a replica of expert 0 gains 0.23 on its
    replay on average, far above tau. But all of it comes from that one step (the other 19 replay no better):
    replay cannot tell it from the noise of the rows, and it is refused, every time the burst comes back."""
    rs = run(controller(), windows(9, burst_every=60))
    assert not [p for r in rs for p in r.proposals], "a plan that only gains on the burst step was proposed"
    burst = [e for e in explains(rs) if e.imbalance > 1.3]  # type: ignore[attr-defined]
    assert len(burst) == 3
    for e in burst:
        assert e.outcome == "GAIN_NOT_SIGNIFICANT", e  # type: ignore[attr-defined]
        assert e.verified_gain >= DecisionParams().tau  # type: ignore[attr-defined]  # the mean alone passes tau
        assert "over 20 replay rows" in e.detail and "lower bound -" in e.detail  # type: ignore[attr-defined]
    # the rule is what refuses it: without the bound (0.5: the mean), the same windows get the replica
    off = run(controller(gain_confidence=0.5), windows(9, burst_every=60))
    props = [p for r in off for p in r.proposals]
    assert props and props[0].kind == "rebalance" and props[0].verified_gain >= DecisionParams().tau


def test_a_steady_gain_is_proposed() -> None:
    """Expert 0 hot on every step: every replayed row gains alike, the bound is close to the mean."""
    rs = run(controller(), windows(3, hot=1000))
    props = [p for r in rs for p in r.proposals]
    assert len(props) == 1 and props[0].kind == "rebalance" and props[0].verified_gain > 0.5


def test_the_bound_and_its_quantiles() -> None:
    from controlplane.verify import gain_bound, t_quantile

    for p, df, ref in [(0.9, 1, 3.078), (0.9, 4, 1.533), (0.9, 14, 1.345), (0.95, 14, 1.761), (0.975, 30, 2.042),
                       (0.99, 5, 3.365)]:
        assert t_quantile(p, df) == pytest.approx(ref, abs=1e-3)  # Student's t tables
    assert t_quantile(0.9, 10**6) == pytest.approx(1.2816, abs=2e-3)  # the normal quantile, from above
    steady = np.array([0.05, 0.051, 0.049, 0.05, 0.05])
    assert gain_bound(steady, 0.9) == pytest.approx(0.05 - 1.533 * np.std(steady, ddof=1) / np.sqrt(5), abs=1e-6)
    burst = np.array([1.0] + [0.0] * 19)  # mean 0.05, all of it one row
    assert gain_bound(burst, 0.9) < 0 < gain_bound(burst, 0.5) == pytest.approx(0.05)
    assert gain_bound(np.array([0.3]), 0.9) == 0.3  # one row: no spread to judge by, the mean
    assert gain_bound(np.zeros(0), 0.9) == 0.0


def test_gain_confidence_is_validated() -> None:
    from controlplane.params import InvalidParams

    for bad in (0.4, 1.0, float("nan")):
        with pytest.raises(InvalidParams, match="gain_confidence"):
            DecisionParams(gain_confidence=bad)
    assert DecisionParams(gain_confidence=0.5).gain_confidence == 0.5


def test_verify_decision_applies_the_bound_only_when_asked() -> None:
    """The voters' re-verification (verify_decision) with the bound: the same burst replay is refused with the
    code; without it (a rollback, a repair), only the mean counts."""
    from controlplane.verify import GAIN_NOT_SIGNIFICANT, OK, verify_decision

    c = controller()
    head = c.head
    rs = run(controller(gain_confidence=0.5), windows(3, burst_every=60))
    proposed = [p for r in rs for p in r.proposals][0].table
    replay = windows(3, burst_every=60)[2]  # the window with the burst: what the proposer planned on
    ok, g, why = verify_decision(head, proposed, replay, 0.02, confidence=0.9)
    assert not ok and why == GAIN_NOT_SIGNIFICANT and g >= 0.02
    ok, g2, why = verify_decision(head, proposed, replay, 0.02)
    assert ok and why == OK and g2 == g
