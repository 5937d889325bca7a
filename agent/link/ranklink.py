"""First-hand evidence of a rank's engine process leaving: its link to this node's agent closes.

Every EP rank's shim holds a `WatchTables` stream open to its own node's agent for as long as the rank's
process lives (dataplane_shim.link). When the process exits, by a crash (kill -9, an Xid, OOM) or
otherwise, the kernel closes its socket and the stream ends at once, so the agent beside it knows within
milliseconds which of its ranks is gone, where membership needs seconds (suspicion, then the Lifeguard
timeout's floor) and learns only of whole nodes. A stalled process (SIGSTOP, a long GC pause) keeps its
socket open and is not taken for gone.

`RankPresence` counts the open streams of each of this node's ranks. A rank whose count drops to zero
and stays there for `grace_s` (a shim that reconnects at once, e.g. after a link error, is not a loss) is
reported once through `on_lost`; a rank that attaches again after that is reported through `on_back`.
Ranks that never attached are never reported: an engine that has not started is not a loss.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from functools import partial

from agent.clock import Clock, Timer

GRACE_S = 0.25  # a link that reopens within this is the same process reconnecting (the shim retries after 50 ms)


class RankPresence:
    def __init__(self, clock: Clock, ranks: Iterable[int], on_lost: Callable[[tuple[int, ...]], None],
                 on_back: Callable[[tuple[int, ...]], None], grace_s: float = GRACE_S) -> None:
        self.clock, self.ranks, self.grace_s = clock, frozenset(int(r) for r in ranks), grace_s
        self.on_lost, self.on_back = on_lost, on_back
        self.open: Counter[int] = Counter()
        self.lost: set[int] = set()  # ranks reported lost and not back since
        self._timers: dict[int, Timer] = {}
        self.closed = False

    def attach(self, ranks: Iterable[int]) -> None:
        back = []
        for r in self._mine(ranks):
            self.open[r] += 1
            t = self._timers.pop(r, None)
            if t is not None:
                t.cancel()
            if r in self.lost:
                self.lost.discard(r)
                back.append(r)
        if back and not self.closed:
            self.on_back(tuple(sorted(back)))

    def detach(self, ranks: Iterable[int]) -> None:
        for r in self._mine(ranks):
            self.open[r] -= 1
            if self.open[r] <= 0 and r not in self._timers:
                self._timers[r] = self.clock.call_later(self.grace_s, partial(self._expire, r))

    def close(self) -> None:
        """The agent is stopping: its own server ends every stream, which is no evidence of anything."""
        self.closed = True
        for t in self._timers.values():
            t.cancel()
        self._timers.clear()

    def _expire(self, r: int) -> None:
        self._timers.pop(r, None)
        if self.closed or self.open[r] > 0 or r in self.lost:
            return
        self.lost.add(r)
        self.on_lost((r,))

    def _mine(self, ranks: Iterable[int]) -> list[int]:
        return sorted({int(r) for r in ranks} & self.ranks)
