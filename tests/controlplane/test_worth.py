"""Cost-benefit (controlplane.worth): a plan must repay its copies over the horizon; under theta a window is
planned on when a plan could, and an attempt that finds nothing worth it backs off."""

from __future__ import annotations

import numpy as np
import pytest

from controlplane.controller import Controller, DecisionParams, Ready, TableCommitted, WindowClosed
from controlplane.params import InvalidParams
from controlplane.table import initial_table
from controlplane.topology import Topology
from controlplane.worth import Worth, WorthTrigger

W = 20


def test_a_plan_repays_its_copies_over_the_horizon() -> None:
    w = Worth(load_ms=10.0, horizon_steps=1000, margin=1.0, tau=0.02)
    assert w.gain_s(0.05) == pytest.approx(0.5)  # 1000 steps x 5% x 10 ms
    assert w.repays(0.05, cost_s=0.25 * 8, ranks=8)  # 0.25 s of serving per rank: exactly (1 + 1) x 0.25
    assert not w.repays(0.05, cost_s=0.26 * 8, ranks=8)
    assert w.repays(0.05, cost_s=0.26 * 8, ranks=16)  # twice the ranks copy side by side: half the serving cost
    assert "saves 500.0 ms" in w.explain(0.05, 2.0, 8)
    off = Worth(0.0, 1000, 1.0, 0.02)
    assert not off.enabled and not off.worth_planning(5.0)
    # a perfect plan from 1.02 gains 1.96% < tau; from 1.021, 2.06%
    assert not w.worth_planning(1.02) and w.worth_planning(1.021) and not w.worth_planning(0.9)


def test_the_trigger_backs_off_after_a_refusal_and_looks_again_when_the_load_moves() -> None:
    t = WorthTrigger(Worth(10.0, 1000, 1.0, 0.02), budget_windows=2, band=0.05)
    assert not t.observe(0, 1.05) and t.observe(1, 1.05)  # two worth windows in a row
    t.refused(1, 1.05)
    assert [seq for seq in range(2, 6) if t.observe(seq, 1.05)][0] == 3  # 2 windows' back-off (and the budget)
    t.refused(3, 1.05)
    assert [seq for seq in range(4, 9) if t.observe(seq, 1.05)][0] == 7  # then 4: not 5, when the budget is spent
    t.refused(7, 1.05)
    assert not t.observe(8, 1.07) and t.waiting(8) == 7  # still backing off (8 windows from 7)
    assert t.observe(9, 1.10)  # 0.05 above the refused imbalance: the load moved, look now
    t.refused(9, 1.10)
    t.reset()  # a commit
    assert not t.observe(10, 1.10) and t.observe(11, 1.10)
    assert not t.observe(12, 1.01)  # nothing a plan could gain: the count restarts
    assert t.count == 0


def skewed(seed: int, n: int, hot: float) -> list[np.ndarray]:
    """Windows of 4 layers x 16 experts where experts 0 and 5 (both on rank 0 and 2 of a static table) carry
    `hot` times an ordinary expert's share."""
    rng = np.random.default_rng(seed)
    p = np.ones((4, 16))
    p[:, [0, 5]] = hot
    p /= p.sum(axis=1, keepdims=True)
    return [np.stack([rng.multinomial(3000, p[i], size=W) for i in range(4)], axis=1).astype(np.uint32)
            for _ in range(n)]


def run(c: Controller, ws: list[np.ndarray]) -> list[Ready]:
    out = []
    for seq, counts in enumerate(ws):
        out.append(c.step(WindowClosed(seq, seq * W, counts)))
        c.advance()
    return out


def controller(**kw: object) -> Controller:
    head = initial_table(Topology(2, 4, 3), 4, 16)  # 8 ranks x 3 slots, 2 experts per rank, 1 spare
    params = DecisionParams(window=W, expert_bytes=1 << 24, theta=1.5, fast_theta=3.0, **kw)  # type: ignore[arg-type]
    return Controller(params, head)


def test_under_theta_the_cost_benefit_trigger_acts_where_the_theta_trigger_does_not() -> None:
    ws = skewed(1, 6, hot=1.6)  # step imbalance ~1.2: under theta 1.5
    theta_only = controller(load_ms=0.0)
    assert not any(r.proposals for r in run(theta_only, ws))
    assert theta_only.last_explain().outcome == "BELOW_THETA"  # type: ignore[union-attr]
    cb = controller(load_ms=10.0)
    props = [p for r in run(cb, ws) for p in r.proposals]
    assert len(props) == 1 and props[0].kind == "rebalance" and "cost-benefit" in props[0].trigger
    assert props[0].verified_gain >= cb.params.tau


def test_a_plan_that_does_not_repay_its_copies_is_refused_and_the_trigger_backs_off() -> None:
    ws = skewed(2, 12, hot=1.6)
    c = controller(load_ms=1e-6)  # a step with almost nothing that scales with load: no copy pays
    rs = run(c, ws)
    assert not any(r.proposals for r in rs)
    outcomes = [c_.outcome for r in rs for c_ in r.events if type(c_).__name__ == "Explain"]
    assert outcomes.count("NOT_WORTH") >= 2  # attempts, not one a window: backed off in between
    assert outcomes.count("NOT_WORTH") < len(ws) // 2
    ex = [c_ for r in rs for c_ in r.events if type(c_).__name__ == "Explain" and c_.outcome == "NOT_WORTH"][0]
    assert "x2 needed" in ex.detail and "saves" in ex.detail


def test_a_commit_ends_the_back_off() -> None:
    c = controller(load_ms=1e-6)
    run(c, skewed(3, 4, hot=1.6))
    assert c.worth.backoff > 0
    head = c.head
    from controlplane.ops import Replicate, apply_ops

    c.step(TableCommitted(apply_ops(head, [Replicate(0, 0, 1)]), kind="manual"))
    assert c.worth.backoff == 0 and c.worth.retry_at == -1


def test_bad_cost_benefit_knobs_are_named() -> None:
    with pytest.raises(InvalidParams, match="load_ms=-1"):
        DecisionParams(load_ms=-1.0)
    with pytest.raises(InvalidParams, match="horizon_windows=0"):
        DecisionParams(horizon_windows=0)
