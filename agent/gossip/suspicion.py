"""Lifeguard's suspicion timer (agent/gossip/membership.py): a member suspected by this node is declared dead when it
expires; its timeout starts at the maximum and shrinks (log) to the minimum as independent confirmations of the
suspicion arrive, and a timer that fell due while this node was not running waits one grace period first."""

from __future__ import annotations

import math
from collections.abc import Callable

from agent.clock import Clock, Timer


class Suspicion:
    """Lifeguard's suspicion timer: max at first, min after K independent confirmations (log in between)."""

    def __init__(self, clock: Clock, first: str, k: int, lo: float, hi: float, grace: float,
                 on_expire: Callable[[], None]) -> None:
        self.clock, self.k, self.lo, self.hi, self.grace = clock, k, lo, hi, grace
        self.start = clock.now()
        self.confirmers = {first}
        self.on_expire = on_expire
        self._graced = False
        self._timer: Timer | None = None
        self._arm()

    def timeout(self) -> float:
        n = len(self.confirmers) - 1
        if self.k < 1:
            return self.lo
        frac = math.log(n + 1) / math.log(self.k + 1)
        return max(self.lo, self.hi - frac * (self.hi - self.lo))

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        due = self.start + self.timeout()
        self._timer = self.clock.call_later(max(0.0, due - self.clock.now()), lambda: self._fire(due))

    def confirm(self, node: str) -> bool:
        """Count an independent suspicion; False if already counted or no more are needed."""
        if node in self.confirmers or len(self.confirmers) - 1 >= self.k:
            return False
        self.confirmers.add(node)
        self._arm()
        return True

    def _fire(self, due: float) -> None:
        self._timer = None
        late = self.clock.now() - due
        if late > self.grace and not self._graced:
            # We were not running when it fell due (paused, stalled loop): refutations may be waiting for
            # us; give them one grace period before accusing anyone.
            self._graced = True
            self._timer = self.clock.call_later(self.grace, lambda: self._fire(self.clock.now()))
            return
        self.on_expire()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
