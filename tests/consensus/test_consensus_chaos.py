"""chaos/checkers.py on hand-made histories, and a few chaos.safety schedules (clean and with a bug)."""

from __future__ import annotations

import math

import pytest

from chaos import safety
from chaos.checkers import Op, check, linearizable
from chaos.quorumsim import HistoryEvent

A, B = b"A" * 32, b"B" * 32


def ev(kind: str, node: str, seq: int, **kw: object) -> HistoryEvent:
    return HistoryEvent(kind, node, float(seq), seq, **kw)  # type: ignore[arg-type]


def test_wing_gong_register() -> None:
    w_ok = Op("write", A, 1, 3, "ok")
    assert linearizable([w_ok, Op("read", A, 4, 4)])
    assert not linearizable([w_ok, Op("read", B, 4, 4)])
    # a read may see a concurrent write's value before the write responds
    assert linearizable([Op("write", A, 1, 10, "ok"), Op("read", A, 5, 5)])
    # a read of a value that no write had been invoked for
    assert not linearizable([Op("read", A, 1, 1), Op("write", A, 2, 3, "ok")])
    # two successful writes of different values
    assert not linearizable([Op("write", A, 1, 2, "ok"), Op("write", B, 3, 4, "ok")])
    # a failed write needs another value in place; unknown writes may or may not take effect
    assert linearizable([Op("write", A, 1, math.inf, "unknown"), Op("write", B, 2, 3, "fail"), Op("read", A, 4, 4)])
    assert not linearizable([Op("write", B, 2, 3, "fail")])
    assert linearizable([Op("write", A, 1, math.inf, "unknown"), Op("write", B, 2, 3, "ok")])


def test_checker_finds_each_invariant() -> None:
    clean = [
        ev("invoke", "n0", 1, version=2, parent=1, digest=A, op=1),
        ev("accept", "n0", 2, version=2, digest=A, ballot=(0, "n0"), quorum=2),
        ev("accept", "n1", 3, version=2, digest=A, ballot=(0, "n0"), quorum=2),
        ev("install", "n0", 4, version=2, parent=1, digest=A),
        ev("respond", "n0", 5, version=2, digest=A, result="ok", op=1),
        ev("install", "n1", 6, version=2, parent=1, digest=A),
        ev("crash", "n1", 7, versions=(2,)),
        ev("recover", "n1", 8, versions=(2,), version=2),
    ]
    assert check(clean) == []
    i1 = clean + [ev("accept", "n1", 9, version=2, digest=B, ballot=(1, "n2"), quorum=2),
                  ev("accept", "n2", 10, version=2, digest=B, ballot=(1, "n2"), quorum=2)]
    assert any(m.startswith("I1") for m in check(i1))
    i2 = clean + [ev("install", "n0", 9, version=4, parent=3, digest=B)]
    assert any(m.startswith("I2") for m in check(i2))
    i3 = clean[:5] + [ev("install", "n1", 6, version=2, parent=1, digest=A, valid=False)]
    assert any(m.startswith("I3") for m in check(i3))
    i7 = clean[:7] + [ev("recover", "n1", 8, versions=(), version=1)]
    assert any(m.startswith("I7") for m in check(i7))
    lin = clean[:3] + [ev("install", "n2", 0, version=2, parent=1, digest=A)]  # read before the write's invoke
    assert any(m.startswith("linearizability") for m in check(lin))


def test_safety_schedules_clean() -> None:
    total = 0
    for i in range(6):
        r = safety.run_schedule(7_000 + i, nodes=16)
        assert r.violations == [], (r.seed, r.actions)
        total += r.commits
    assert total > 0, "no schedule committed anything: the schedules test nothing"


def test_safety_finds_a_proposer_that_ignores_accepted_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation check: a proposer that proposes its own value after phase 1 must be caught."""
    from agent.consensus import paxos

    real = paxos.BallotAttempt.on_promise

    def own_value(self: paxos.BallotAttempt, src: str, m: object) -> str:
        mine = self.value
        out = real(self, src, m)  # type: ignore[arg-type]
        if out == "accept" and mine is not None:
            self.value = mine
        return out

    monkeypatch.setattr(paxos.BallotAttempt, "on_promise", own_value)
    found = [safety.run_schedule(1_000_003 + i, nodes=16).violations for i in range(8)]
    assert any(found), "the broken proposer went unnoticed"


def test_safety_schedules_with_crashes_right_after_votes_clean() -> None:
    """Voters killed as their vote leaves (and restarted by a supervisor), proposers cut off as their commit
    leaves: the restarted voters' stores must answer for those votes."""
    total = vote_crashes = 0
    for seed in (7_000, 7_001, 7_002, 7_003, 7_043, 7_062, 7_253):
        r = safety.run_schedule(seed, nodes=16, vote_crashes=0.5)
        assert r.violations == [], (r.seed, r.actions)
        total += r.commits
        vote_crashes += sum("after its next vote" in a for a in r.actions)
    assert total > 0 and vote_crashes > 0


def test_safety_finds_an_acceptor_that_forgets_its_votes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation check: an acceptor that replies without making its promise or accept durable must be caught
    by the schedules above (these seeds crash a voter right after a vote that chose a table)."""
    from agent.consensus.recovery import Recovery

    monkeypatch.setattr(Recovery, "persist", lambda self, st: True)
    found = [safety.run_schedule(seed, nodes=16, vote_crashes=0.5).violations for seed in (7_043, 7_062, 7_253)]
    assert any(found), "the forgetful acceptor went unnoticed"
