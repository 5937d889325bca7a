"""The install lifecycle of the collective-engine plugins (dataplane_shim.install), against a fake engine that
moves one layer per step as vLLM's async EPLB does (`rebalanced` true until the last layer is committed)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from controlplane.table import RoutingTable
from dataplane_shim.certify import certified_commit
from dataplane_shim.errors import BadInput, ShimError
from dataplane_shim.install import Installer, Phase
from dataplane_shim.plugin import Settings
from tests.shim.test_shim_plugin import FakeLink, chain, core


class FakeEngine:
    """One rank's engine: `arm(table)` starts a move of `layers` steps (0: done within the step, sync mode);
    `policy` is what its policy returns for an armed table (the table's map unless overridden)."""

    def __init__(self, boot: np.ndarray, layers: int) -> None:
        self.map, self.layers = boot.copy(), layers
        self.new: np.ndarray | None = None
        self.layer = 0
        self.override: np.ndarray | None = None

    def arm(self, t: RoutingTable) -> None:
        self.new = (t.phy2log if self.override is None else self.override).copy()
        self.layer = 0

    def step(self) -> bool:
        """One engine step; returns whether it is still moving."""
        if self.new is None:
            return False
        if self.layers == 0:
            self.map, self.new = self.new, None
            return False
        if self.layer < len(self.map):  # a longer move than the table's layers: the rest moves nothing
            self.map[self.layer] = self.new[self.layer]
        self.layer += 1
        if self.layer == self.layers:
            self.new = None
        return self.new is not None


class Ranks:
    def __init__(self, n: int = 2, *, agree_every: int = 1, stall_steps: int = 100, move_layers: int = 2) -> None:
        self.links = [FakeLink() for _ in range(n)]
        self.cores = [core(r, self.links[r]) for r in range(n)]
        self.inst = [Installer(c, agree_every=agree_every, stall_steps=stall_steps, rank=r)
                     for r, c in enumerate(self.cores)]
        self.eng = [FakeEngine(c.current.phy2log, move_layers) for c in self.cores]
        self.armed: list[int] = []

    def deliver(self, t: RoutingTable, *ranks: int) -> None:
        for r in ranks or range(len(self.links)):
            self.links[r].inbox.append(certified_commit(t, ["a", "b"], 2))

    def step(self) -> None:
        if self.inst[0].agreement_due():
            red = np.min([i.agreement_vector() for i in self.inst], axis=0)
            for i in self.inst:
                i.agreed(red)
        for i, e in zip(self.inst, self.eng, strict=True):
            t = i.to_arm()
            if t is not None:
                e.arm(t)
                self.armed.append(t.version)
            moving = e.step()
            i.after_step(moving=moving, matched=i.inflight is not None and np.array_equal(e.map, i.inflight.phy2log))

    def versions(self) -> list[int]:
        return [c.version for c in self.cores]


def test_an_install_is_done_when_the_engine_moved_every_layer_not_when_the_maps_match() -> None:
    rk = Ranks(move_layers=4)
    v2, v3 = chain(2)  # both change layer 0 only: the maps match after the first layer of 4
    rk.deliver(v2)
    rk.step()  # agreed and armed: layer 0 moved
    assert all(np.array_equal(e.map, v2.phy2log) for e in rk.eng) and rk.versions() == [1, 1]
    assert [i.phase for i in rk.inst] == [Phase.MOVING] * 2
    rk.deliver(v3)
    rk.step()  # v3 agreed mid-move: queued, not armed over the move
    assert [i.queued.version if i.queued else 0 for i in rk.inst] == [3, 3]
    assert all(i.stats.agreed_while_moving == 1 for i in rk.inst)
    for _ in range(2):
        rk.step()
    assert rk.versions() == [2, 2]  # the engine said every layer moved
    for _ in range(5):
        rk.step()
    assert rk.versions() == [3, 3] and rk.armed == [2, 2, 3, 3]
    assert all(i.stats.max_install_steps == 4 for i in rk.inst)


def test_agreement_runs_on_the_shared_schedule_and_checks_it() -> None:
    rk = Ranks(agree_every=4, move_layers=0)
    (v2,) = chain(1)
    rk.step()
    rk.deliver(v2)
    for _ in range(3):  # steps 1..3: no agreement, nothing armed
        rk.step()
    assert rk.armed == [] and rk.versions() == [1, 1]
    rk.step()  # step 4: agreed, armed and installed (sync)
    assert rk.versions() == [2, 2]
    rk.inst[1].step += 1  # a rank out of step: a broken invariant, loud
    red = np.min([i.agreement_vector() for i in rk.inst], axis=0)
    with pytest.raises(ShimError, match="disagree on the plugin's step"):
        rk.inst[0].agreed(red)


def test_a_long_move_is_logged_and_counted_as_a_stall_at_the_bound_and_each_doubling(
        caplog: pytest.LogCaptureFixture) -> None:
    rk = Ranks(stall_steps=3, move_layers=2)
    (v2,) = chain(1)
    rk.deliver(v2)
    for e in rk.eng:  # an engine whose worker does not progress
        e.step = lambda: True  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, "dataplane_shim.install"):
        for _ in range(13):
            rk.step()
    assert [i.stats.stalls for i in rk.inst] == [3, 3]  # at 3, 6 and 12 steps
    assert "version 2 still moving after 3 steps" in caplog.text
    assert rk.inst[0].status()["moving_steps"] == 13 and rk.versions() == [1, 1]


def test_a_rearrangement_that_ends_on_another_map_is_rearmed_with_backoff() -> None:
    rk = Ranks(move_layers=0)
    v2, v3 = chain(2)
    for e in rk.eng:
        e.override = e.map.copy()  # a policy that returns the boot map: nothing moves
    rk.deliver(v2)
    for _ in range(8):
        rk.step()
    # armed at steps 0, 2 (after 1), 5 (after 2): 3 failures so far, then 4 steps of backoff
    assert rk.armed == [2, 2] * 3 and all(i.stats.install_failures == 3 for i in rk.inst)
    rk.deliver(v3)
    for e in rk.eng:
        e.override = None
    for _ in range(6):
        rk.step()
    assert rk.versions() == [3, 3] and rk.armed[-2:] == [3, 3]  # the newer version replaced the retried one


def test_settings_from_env() -> None:
    s = Settings.from_env({"EMOE_SOCKET": "/s", "EMOE_AGREE_EVERY": "8"})
    assert s is not None and (s.agree_every, s.report_every, s.stall_steps) == (8, 25, 0)
    with pytest.raises(BadInput, match="EMOE_AGREE_EVERY='0'"):
        Settings.from_env({"EMOE_SOCKET": "/s", "EMOE_AGREE_EVERY": "0"})
    with pytest.raises(BadInput, match="EMOE_STALL_STEPS='x'"):
        Settings.from_env({"EMOE_SOCKET": "/s", "EMOE_STALL_STEPS": "x"})
    with pytest.raises(BadInput, match="stall_steps=0"):
        Installer(core(0, FakeLink()), agree_every=1, stall_steps=0)
