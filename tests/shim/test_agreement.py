"""The EP ranks' agreement (dataplane_shim.agreement): its encoding round-trips, the element-wise MIN of the
ranks' encodings decodes to their merge field by field (checked against a plain reference over random ranks),
its wire layout is the one the plugins have always sent, and the glue's step order (Installer.begin_step)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dataplane_shim.agreement import Agreement, Versions, check_agree_every
from dataplane_shim.certify import certified_commit
from dataplane_shim.errors import BadInput, ShimError
from dataplane_shim.install import Installer
from tests.shim.test_shim_plugin import FakeLink, chain, core

versions = st.builds(lambda a, b: Versions(max(a, b), min(a, b)), st.integers(0, 10**9), st.integers(0, 10**9))
ranks = st.builds(Agreement.of_rank, versions, st.integers(0, 10**9), st.integers(0, 10**9))


@given(ranks)
def test_one_ranks_agreement_round_trips(a: Agreement) -> None:
    assert Agreement.decode(a.encode()) == a
    assert Agreement.decode(a.encode().tolist()) == a
    assert Versions.decode(a.versions.encode()) == a.versions


@given(st.lists(ranks, min_size=1, max_size=8))
def test_the_min_of_the_encodings_is_the_merge_field_by_field(rs: list[Agreement]) -> None:
    red = Agreement.decode(np.min([a.encode() for a in rs], axis=0))
    assert red == Agreement.merged(rs)
    # the meaning of each field, against a plain reference
    assert red.versions.newest == min(a.versions.newest for a in rs)   # the newest version EVERY rank holds
    assert red.versions.oldest == max(a.versions.oldest for a in rs)   # the floor: the largest oldest held
    assert red.step_lo == min(a.step_lo for a in rs) and red.step_hi == max(a.step_hi for a in rs)
    assert (red.step_lo == red.step_hi) == (len({a.step_lo for a in rs}) == 1)  # lockstep proved by the MIN
    assert red.go_on == max(a.go_on for a in rs)                       # the largest step any agent asked
    assert red.go_on_said == all(a.go_on > 0 for a in rs)             # every rank's agent has answered
    vred = Versions.decode(np.min([a.versions.encode() for a in rs], axis=0))
    assert vred == red.versions


def test_the_wire_layout_is_the_plugins_int64_6() -> None:
    """The slots and their order are the all-reduce's wire format: (newest, -oldest, step, -step, -go_on, said)."""
    a = Agreement.of_rank(Versions(newest=7, oldest=5), step=64, go_on=300)
    assert a.encode().dtype == np.int64 and a.encode().tolist() == [7, -5, 64, -64, -300, 1]
    assert Agreement.of_rank(Versions(3, 3), 0, 0).encode().tolist() == [3, -3, 0, 0, 0, 0]
    assert Versions(4, 2).encode().tolist() == [4, -2]


def test_a_reduced_vector_of_another_length_is_a_broken_invariant() -> None:
    with pytest.raises(ShimError, match=r"expected int64 \[6\]"):
        Agreement.decode([1, -1])
    with pytest.raises(ShimError, match=r"expected int64 \[2\]"):
        Versions.decode([1, -1, 0, 0, 0, 0])


def test_the_installer_sends_and_reads_the_agreement_by_name() -> None:
    link = FakeLink()
    inst = Installer(core(0, link), agree_every=1, stall_steps=10)
    assert inst.agreement() == Agreement.of_rank(Versions(1, 1), 0, 0)
    assert inst.agreement_vector().tolist() == inst.agreement().encode().tolist()
    link.next_step = 500
    inst.step = 3
    assert inst.agreement() == Agreement(Versions(1, 1), 3, 3, 500, True)


class Scripted:
    """A `Collective` that records the glue's calls and answers as told."""

    def __init__(self, in_flight: np.ndarray | None = None, at_once: bool = False) -> None:
        self.in_flight, self.at_once, self.calls = in_flight, at_once, list[str]()

    def start_agreement(self, vector: np.ndarray) -> np.ndarray | None:
        self.calls.append("start")
        return vector if self.at_once else None

    def take_agreement(self) -> np.ndarray | None:
        self.calls.append("take")
        out, self.in_flight = self.in_flight, None
        return out


def test_begin_step_takes_the_agreement_in_flight_then_starts_the_due_one_then_arms() -> None:
    link = FakeLink()
    c = core(0, link)
    inst = Installer(c, agree_every=2, stall_steps=10)
    v2, v3 = chain(2)
    link.inbox.append(certified_commit(v2, ["a", "b"], 2))
    # step 0: nothing in flight, the due agreement completes at once (a group of one): v2 armed at this step
    col = Scripted(at_once=True)
    t = inst.begin_step(col)
    assert col.calls == ["take", "start"] and t is not None and t.version == 2
    inst.after_step(moving=False, matched=True)
    # step 1: not due; an overlapped agreement started earlier is taken and its version armed now
    link.inbox.append(certified_commit(v3, ["a", "b"], 2))
    c.receive()
    col = Scripted(in_flight=Agreement.of_rank(Versions(3, 3), 1, 0).encode())
    t = inst.begin_step(col)
    assert col.calls == ["take"] and t is not None and t.version == 3
    inst.after_step(moving=False, matched=True)
    # step 2: due, overlapped: started, nothing to arm yet
    col = Scripted()
    assert inst.begin_step(col) is None and col.calls == ["take", "start"]


def test_the_agreement_period_check_names_the_spread() -> None:
    check_agree_every(32, lambda v: v, 0)
    with pytest.raises(BadInput, match=r"EMOE_AGREE_EVERY differs across the EP ranks \(16 \.\. 32; rank 1 has 32\)"):
        check_agree_every(32, lambda v: np.minimum(v, np.array([16, -32])), 1)
