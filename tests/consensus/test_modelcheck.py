"""The exhaustive check of rebuild plus Paxos (chaos/modelcheck.py) on bounds that finish in seconds."""

from __future__ import annotations

import logging

import pytest

from chaos.mccanon import fingerprint, snapshot
from chaos.mcworld import Bound, World
from chaos.modelcheck import HAZARD, explore, mutant


@pytest.fixture(autouse=True)
def _quiet() -> object:
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def test_a_copy_has_the_same_fingerprint_and_is_independent() -> None:
    w = World(Bound(founded=True))
    fp = fingerprint(w)
    c = snapshot(w)
    assert fingerprint(c) == fp
    c.do("propose", "n2")
    assert fingerprint(c) != fp and fingerprint(w) == fp and not w.msgs


def test_one_proposal_without_faults_is_explored_completely() -> None:
    r = explore(Bound(founded=True, proposals=1, crashes=0, wipes=0, fires=0))
    assert r.complete and not r.violations and r.states == 102 and r.quiescent > 0


def test_every_continuation_of_the_wiped_voter_hazard_keeps_one_table_per_version() -> None:
    r = explore(Bound(founded=True, proposals=2, crashes=1, fires=0), prefix=HAZARD)
    assert r.complete and not r.violations, r.trace
    assert r.states > 1000


def test_the_rebuild_before_the_fix_chooses_two_tables_for_v2() -> None:
    with mutant():
        r = explore(Bound(founded=True, proposals=2, crashes=1, fires=0), prefix=HAZARD)
    assert r.violations and r.violations[0].startswith("I1: version 2"), r.violations
    print("\n".join(r.trace))
    assert any("reply Consensus/CatchUp" in ln for ln in r.trace) and r.trace[-1].startswith("n1->n0: Consensus/Accept")
