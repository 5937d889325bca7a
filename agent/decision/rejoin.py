"""A rank that a repair drained comes back when its own node can vouch for it again.

A repair drains the ranks of a node declared dead or of an engine process that left. Declared dead is a
judgement from afar: a partition that healed, a network slow for longer than the suspicion timeout, an agent
restarted while its engine kept running all leave a healthy rank drained, its GPUs idle until an operator
notices and runs `emoe restore`. Only the rank's own node knows first-hand that it is back: its engine
process holds the local link open (agent.link.ranklink) or its load reports arrive, and the node itself is
serving and sees a quorum. That node proposes the restore, `wait` after the repair committed; a rank
repaired again within `FLAP_S` of coming back waits twice as long the next time (up to `MAX_MULT` x
`wait`), so that a flapping node costs a table change per `wait` at most, not one per suspicion. A rank an
operator drained is never restored here (its drain is not a repair); `gossip.rejoin_ms = 0` turns this
off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from agent.clock import Clock
from agent.wire import plan_kind
from controlplane.table import RoutingTable
from elasticmoe.v1 import consensus_pb2 as cpb

log = logging.getLogger(__name__)

FLAP_S = 60.0  # repaired again within this long of a restore: the next wait doubles
MAX_MULT = 64
RETRY_S = 1.0  # a restore proposal that did not commit (a concurrent table won the version) is retried


class Rejoin:
    def __init__(self, clock: Clock, ranks: Iterable[int], wait_s: float, propose_restore: Callable[[int], str]) -> None:
        """`propose_restore(rank)` proposes a restore (not awaited: the commit, seen in `committed`, says it
        worked) and returns "" or why the decision core refused it."""
        self.clock, self.ranks, self.wait_s = clock, frozenset(int(r) for r in ranks), wait_s
        self.propose_restore = propose_restore
        self.active: set[int] | None = None  # this node's ranks active in the last table seen (None: none yet)
        self.version = 0
        self.repaired_at: dict[int, float] = {}  # rank -> when its repair committed here (or this node started)
        self.mult: dict[int, int] = {}  # rank -> current multiple of wait_s
        self.restored_at: dict[int, float] = {}
        self.next_try: dict[int, float] = {}
        self.refused: set[int] = set()  # ranks whose last restore was refused (said once, not every retry)

    def recovered(self, commits: Iterable[cpb.Commit], head: RoutingTable) -> None:
        """The log this node recovered at start, oldest first, and its head: a rank a repair drained before
        the restart is due `wait_s` from now (a log that starts after genesis sets the scene with its first
        commit: what drained a rank before that is unknown)."""
        for c in commits:
            if self.active is None and c.table.parent == 1:  # the whole history: genesis has every rank
                self.active, self.version = set(self.ranks), 1
            self.committed(c.table.version, c.table.parent, c.table.active_ranks, plan_kind(c.plan), replay=True)
        if self.active is None:
            self.active, self.version = {int(r) for r in head.active_ranks} & self.ranks, int(head.version)

    def committed(self, version: int, parent: int, active_ranks: Iterable[int], kind: str,
                  replay: bool = False) -> None:
        """Every table this node commits, in order, with its plan's kind."""
        now = self.clock.now()
        active = {int(r) for r in active_ranks} & self.ranks
        before, gap = self.active, parent != self.version  # a gap: commits this node never saw (a snapshot)
        self.active, self.version = active, version
        if before is None:
            return
        for r in before - active:
            if kind == "repair" and not gap:
                back = self.restored_at.get(r)
                flapped = not replay and back is not None and now - back < FLAP_S
                self.mult[r] = min(self.mult.get(r, 1) * 2, MAX_MULT) if flapped else 1
                self.repaired_at[r] = now
                self.next_try.pop(r, None)
            else:  # an operator's drain (or one this node cannot attribute): the operator restores it
                self.repaired_at.pop(r, None)
        for r in active - before:
            if self.repaired_at.pop(r, None) is not None and not replay:
                self.restored_at[r] = now

    def due(self, live: Callable[[int], bool], able: bool) -> None:
        """Called each window: propose the restore of every repaired rank of this node that is due, whose
        engine is `live`, while this node is `able` (serving, a quorum in view)."""
        if not able or self.wait_s <= 0 or not self.repaired_at:
            return
        now = self.clock.now()
        for r, t in sorted(self.repaired_at.items()):
            wait = self.wait_s * self.mult.get(r, 1)
            if now - t < wait or now < self.next_try.get(r, 0.0) or not live(r):
                continue
            self._try(r, now, f"drained by a repair {now - t:.1f} s ago, its engine is here")

    def back(self, rank: int, able: bool) -> bool:
        """Its engine process attached to this node's link again (first-hand, at once): a rank a repair drained
        is restored now, without waiting `wait_s` (also with rejoin off), unless it flaps (repaired again soon
        after its last restore: then `due` restores it after its longer wait). True if a restore was proposed."""
        now = self.clock.now()
        if not able or rank not in self.repaired_at or self.mult.get(rank, 1) > 1 or now < self.next_try.get(rank, 0.0):
            return False
        return self._try(rank, now, "its engine process attached again")

    def _try(self, r: int, now: float, why_now: str) -> bool:
        why = self.propose_restore(r)
        self.next_try[r] = now + RETRY_S
        if not why:
            self.refused.discard(r)
            log.warning("rank %d: %s: restoring it", r, why_now)
            return True
        if r not in self.refused:
            self.refused.add(r)
            log.warning("rank %d is back but its restore was refused (retried every %.0f s): %s", r, RETRY_S, why)
        return False
