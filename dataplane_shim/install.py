"""The install lifecycle of a collective engine's plugin, engine-independent (no torch, no engine imports).

Per EP rank the engine's glue (dataplane_shim.vllm_plugin, dataplane_shim.sglang_plugin, and bench.live's replay
engine) calls, at every step, in this order:

    table = inst.begin_step(collective)     # 1. take the agreement in flight, 2. start the one due, 3. to_arm
    if table is not None: <hand table.phy2log to the engine's own rearrangement>
    ... the engine's step (it may start, continue or finish moving weights; the load goes to inst.core) ...
    inst.after_step(moving=<engine still moving>, matched=<engine's map == inst.inflight's>)

`begin_step` holds the order: the agreement started at an earlier step is taken first (`collective`, the
engine's MIN all-reduce over the EP CPU group, `dataplane_shim.agreement.Collective`; vLLM overlaps it with its
step and takes it at the next one, SGLang's is synchronous and taken at once); at an agreement step
(`step % agree_every == 0`, alike on every rank) this rank's `Agreement` (its core's versions, its step, its
agent's go-on step: `dataplane_shim.agreement`) is started; `agreed` decodes the reduced one on every rank alike:
it checks the ranks are at the same step, renumbers the load steps when every rank's agent said to go on from a
later one (`renumber`), and queues the version every rank holds (`PluginCore.decide`); `to_arm` then hands
out the queued table when nothing is in flight.

An install is done only when the engine says every layer moved (`moving` false after it started), never when
the maps merely look equal mid-move. A version agreed while a move is in flight is queued and armed the step
after the move ends: never dropped, never armed over a move (vLLM's async `step()` returns early then).
Every wait is bounded: a move that outlives `stall_steps` is logged and counted (`stats.stalls`, again at
each doubling) while the engine's worker keeps it; an engine rearrangement that ends on another map is
counted (`stats.install_failures`) and the version re-armed after 1, 2, 4 ... `MAX_BACKOFF` steps.

Every decision depends only on the shared step counter, the reduced agreement vector and the engine's own
state (which the engine keeps equal on every rank), so all ranks arm at the same step: an engine
rearrangement is a collective.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from controlplane.table import RoutingTable
from dataplane_shim.agreement import Agreement, Collective
from dataplane_shim.errors import BadInput, ShimError
from dataplane_shim.plugin import PluginCore

log = logging.getLogger(__name__)

MAX_BACKOFF = 1024  # steps between re-arms of a version the engine did not install (about 30 s of decode)


class Phase(enum.Enum):
    IDLE = "idle"          # nothing in flight
    MOVING = "moving"      # the engine is moving weights for `inflight`


@dataclass
class InstallStats:
    armed: int = 0                # engine rearrangements started
    install_failures: int = 0     # rearrangements that ended on a map other than the armed table
    stalls: int = 0               # bound crossings of a move (stall_steps, then each doubling)
    agreed_while_moving: int = 0  # versions agreed while an earlier one was still moving (queued, not dropped)
    last_install_steps: int = 0   # steps from arming to done, of the last install
    max_install_steps: int = 0


class Installer:
    """One rank's install schedule and lifecycle around a `PluginCore`."""

    def __init__(self, core: PluginCore, *, agree_every: int, stall_steps: int, rank: int = 0) -> None:
        if agree_every < 1 or stall_steps < 1:
            raise BadInput(f"agree_every={agree_every}, stall_steps={stall_steps}: expected >= 1")
        self.core, self.agree_every, self.stall_steps, self.rank = core, agree_every, stall_steps, rank
        self.step = 0                                # steps since attach: the same on every rank
        self.phase = Phase.IDLE
        self.inflight: RoutingTable | None = None    # armed in the engine, not yet done
        self.queued: RoutingTable | None = None      # agreed, waiting for the engine to be free
        self.stats = InstallStats()
        self._since = 0          # step the inflight table was armed
        self._retry_at = 0       # no re-arm before this step (backoff after a failed install)
        self._failed_in_row = 0
        self._stall_at = stall_steps
        # renumbering (a restarted engine): the step at which an agent's answer was first agreed, while waiting
        # for every rank's agent to answer; at most go_on_wait steps (two reports of every rank, one agreement)
        self._go_on_since: int | None = None
        self.go_on_wait = 2 * core.report_every + agree_every

    # ---- the step boundary -------------------------------------------------------------------------
    def begin_step(self, collective: Collective) -> RoutingTable | None:
        """The glue's first call at every step, before the engine's step (every engine's glue runs this order,
        one place for it): take the agreement `collective` has in flight from an earlier step, start the one due
        at this step (and take it now if it completed at once), then the table to hand the engine's own
        rearrangement at this step, or None. `after_step` closes the step."""
        reduced = collective.take_agreement()
        if reduced is not None:
            self.agreed(reduced)
        if self.agreement_due():
            reduced = collective.start_agreement(self.agreement_vector())
            if reduced is not None:
                self.agreed(reduced)
        return self.to_arm()

    # ---- schedule ----------------------------------------------------------------------------------
    def agreement_due(self) -> bool:
        return self.step % self.agree_every == 0

    def agreement(self) -> Agreement:
        """This rank's agreement (`dataplane_shim.agreement`): what its core holds, its step (the MIN then proves
        every rank is at the same step of the schedule), and the step its agent said to go on from (every rank
        learns the largest, and whether every rank's agent has answered, and renumbers its load steps from it at
        the same step: `renumber`)."""
        return Agreement.of_rank(self.core.held(), self.step, self.core.link.next_step)

    def agreement_vector(self) -> npt.NDArray[np.int64]:
        """int64 [6]: `agreement()` encoded (`Agreement.encode`), this rank's input to the MIN all-reduce."""
        return self.agreement().encode()

    def agreed(self, reduced: npt.ArrayLike | Agreement) -> RoutingTable | None:
        """From the MIN-reduced agreement (int64 [6], or decoded): queue the agreed table (if newer than what is
        in flight)."""
        red = reduced if isinstance(reduced, Agreement) else Agreement.decode(reduced)
        if red.step_lo != red.step_hi:  # a broken invariant: the ranks are not in lockstep; fail loudly
            raise ShimError(f"rank {self.rank}: the EP ranks disagree on the plugin's step ({red.step_lo}.."
                            f"{red.step_hi}): the agreement schedule is not shared")
        self.renumber(red.go_on, red.go_on_said)
        table = self.core.decide(red.versions)
        if table is None:
            return None
        newest = max((t.version for t in (self.inflight, self.queued) if t is not None), default=0)
        if table.version <= newest:
            return None
        if self.phase is Phase.MOVING:
            self.stats.agreed_while_moving += 1
            log.info("rank %d: version %d agreed while version %d is moving: queued", self.rank, table.version,
                     self.inflight.version if self.inflight is not None else -1)
        self.queued = table
        return table

    def renumber(self, go_on: int, everyone: bool) -> None:
        """The largest step any rank's agent said to go on from (`go_on`; its engine restarted and counts from 0
        while the agents' windows are past that), and whether every rank's agent has said one: renumber once
        every rank's agent has answered, or `go_on_wait` steps after the first answer was agreed (an agent that
        never answers: its windows are not past the count). Agents on different nodes may answer different
        steps (one has closed a window the other has not); renumbering at the first answer and again at a
        larger one would jump twice. Every rank decides from the same reduced vector at the same step."""
        if go_on <= self.core.next_step_number:
            self._go_on_since = None
            return
        if self._go_on_since is None:
            self._go_on_since = self.step
        if everyone or self.step - self._go_on_since >= self.go_on_wait:
            self.core.go_on_from(go_on)
            self._go_on_since = None

    def to_arm(self) -> RoutingTable | None:
        """The table to hand the engine's rearrangement at this step, or None (busy, nothing queued, backoff)."""
        if self.inflight is not None or self.queued is None or self.step < self._retry_at:
            return None
        self.inflight, self.queued = self.queued, None
        self._since, self._stall_at = self.step, self.stall_steps
        self.stats.armed += 1
        return self.inflight

    def after_step(self, *, moving: bool, matched: bool) -> bool:
        """After the engine's step: `moving` whether it still moves weights for the armed table, `matched`
        whether its map equals that table. Returns True when a version was installed at this step."""
        done = False
        if self.inflight is not None:
            if moving:
                self.phase = Phase.MOVING
                self._check_stall()
            else:
                done = self._finish(matched)
        self.step += 1
        return done

    # ---- pieces ------------------------------------------------------------------------------------
    def _finish(self, matched: bool) -> bool:
        t = self.inflight
        if t is None:
            return False
        took = self.step - self._since + 1  # steps from arming to done, both counted
        self.inflight, self.phase = None, Phase.IDLE
        if matched:
            self.core.installed(t.version)
            self._failed_in_row, self._retry_at = 0, 0
            self.stats.last_install_steps = took
            self.stats.max_install_steps = max(self.stats.max_install_steps, took)
            log.info("rank %d installed version %d through the engine (%d steps after arming)", self.rank,
                     t.version, took)
            return True
        self.stats.install_failures += 1
        self._failed_in_row += 1
        wait = min(2 ** (self._failed_in_row - 1), MAX_BACKOFF)
        self._retry_at = self.step + 1 + wait
        if self.queued is None:  # re-arm this version unless a newer one was agreed meanwhile
            self.queued = t
        log.warning("rank %d: the engine's rearrangement ended without version %d's map (failure %d in a row); "
                    "re-arming in %d steps", self.rank, t.version, self._failed_in_row, wait)
        return False

    def _check_stall(self) -> None:
        moving = self.step - self._since
        if moving < self._stall_at:
            return
        self.stats.stalls += 1
        self._stall_at *= 2
        v = self.inflight.version if self.inflight is not None else -1
        log.warning("rank %d: version %d still moving after %d steps (bound %d): the engine's worker holds it; "
                    "%s", self.rank, v, moving, self.stall_steps,
                    f"version {self.queued.version} queued behind it" if self.queued is not None else "none queued")

    def status(self) -> dict[str, int | str]:
        """What the agent side may read (through the engine's RPC to its workers): installed version, what is
        in flight, queued, and the counters."""
        s = self.stats
        return {"installed": self.core.version, "phase": self.phase.value,
                "inflight": self.inflight.version if self.inflight is not None else 0,
                "queued": self.queued.version if self.queued is not None else 0,
                "moving_steps": self.step - self._since if self.inflight is not None else 0,
                "step": self.step, "armed": s.armed, "install_failures": s.install_failures, "stalls": s.stalls,
                "agreed_while_moving": s.agreed_while_moving, "last_install_steps": s.last_install_steps,
                "max_install_steps": s.max_install_steps}
