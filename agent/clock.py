"""Clock: the only way protocol code learns the time or waits.

`Clock` has a real implementation (the asyncio loop's monotonic clock) and a fake one (virtual time,
advanced by the simulator), so that protocol tests never sleep on a wall clock.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic clock."""
        ...

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer:
        """Run `fn` after `delay` seconds (>= 0)."""
        ...


class RealClock:
    """The running asyncio loop's clock."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop or asyncio.get_running_loop()

    def now(self) -> float:
        return self.loop.time()

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer:
        return self.loop.call_later(max(0.0, delay), fn)


class _FakeTimer:
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """Virtual time: callbacks run in (time, insertion) order as `run_until` advances the clock."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._queue: list[tuple[float, int, _FakeTimer, Callable[[], None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer:
        t = _FakeTimer()
        heapq.heappush(self._queue, (self._now + max(0.0, delay), next(self._seq), t, fn))
        return t

    def pending(self) -> int:
        return sum(1 for _, _, t, _ in self._queue if not t.cancelled)

    def run_until(self, deadline: float, max_events: int = 50_000_000) -> int:
        """Run every callback due at or before `deadline`, then set the clock to it. Returns events run."""
        n = 0
        while self._queue and self._queue[0][0] <= deadline:
            when, _, t, fn = heapq.heappop(self._queue)
            if t.cancelled:
                continue
            self._now = when
            fn()
            n += 1
            if n >= max_events:
                raise RuntimeError(f"more than {max_events} events before t={deadline}: runaway simulation")
        self._now = max(self._now, deadline)
        return n

    def advance(self, seconds: float) -> int:
        return self.run_until(self._now + seconds)
