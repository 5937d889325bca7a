"""Clock: the only way protocol code learns the time or waits.

`Clock` has a real implementation (the asyncio loop's monotonic clock) and a fake one (virtual time,
advanced by the simulator), so that protocol tests never sleep on a wall clock. `NodeClock` is one node's
view of a shared FakeClock that the simulator can pause (timers due meanwhile run late, at resume, as in a
process that was stopped) or stop for good (a crash: no timer of the node ever runs again).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Protocol, cast


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

    def schedule(self, when: float, timer: Timer, fn: Callable[[], None]) -> None:
        """Run `fn` at `when` unless `timer.cancelled` by then (for clocks layered on this one)."""
        heapq.heappush(self._queue, (when, next(self._seq), cast(_FakeTimer, timer), fn))

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


class _NodeTimer:
    __slots__ = ("cancelled", "due", "fn", "clock")

    def __init__(self, clock: NodeClock, due: float, fn: Callable[[], None]) -> None:
        self.cancelled = False
        self.clock = clock
        self.due = due
        self.fn = fn

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        c = self.clock
        if self.cancelled or c._stopped:
            return
        if c._paused:
            c._held.append(self)
            return
        self.fn()


class NodeClock:
    """One simulated node's clock over a shared FakeClock: pausable and stoppable.

    While paused, timers that fall due are held and run in due order at `resume` (late, as in a process
    woken from SIGSTOP); `now()` keeps advancing. After `stop`, no timer of this node runs again.
    `set_rate(r)` skews it: from then on it counts r local seconds per real one (a fast or slow oscillator)
    and a delay asked for in local seconds takes 1/r as long in real ones; timers already set keep their
    real due time. The local time stays continuous across rate changes.
    """

    def __init__(self, base: FakeClock) -> None:
        self._base = base
        self._paused = False
        self._stopped = False
        self._held: list[_NodeTimer] = []
        self._rate = 1.0
        self._anchor = (0.0, 0.0)  # (base time, local time) at the last rate change; unused at rate 1

    @property
    def rate(self) -> float:
        return self._rate

    def set_rate(self, rate: float) -> None:
        if not rate > 0.0:
            raise ValueError(f"clock rate {rate}: expected > 0")
        if rate == self._rate:
            return
        b = self._base._now
        self._anchor = (b, self.now())
        self._rate = rate

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def running(self) -> bool:
        return not (self._paused or self._stopped)

    def now(self) -> float:
        if self._anchor == (0.0, 0.0) and self._rate == 1.0:
            return self._base._now
        b, local = self._anchor
        return local + (self._base._now - b) * self._rate

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer:
        due = self._base._now + ((delay if self._rate == 1.0 else delay / self._rate) if delay > 0.0 else 0.0)
        t = _NodeTimer(self, due, fn)
        if not self._stopped:
            self._base.schedule(due, t, t.fire)
        return t

    def pause(self) -> None:
        if not self._stopped:
            self._paused = True

    def resume(self) -> None:
        """Run the timers held while paused (in due order, each as its own event), then carry on."""
        if not self._paused or self._stopped:
            return
        self._paused = False
        held, self._held = self._held, []
        now = self._base._now
        for t in held:  # already in due order: the base clock fired them in that order
            if not t.cancelled:
                self._base.schedule(now, t, t.fire)

    def stop(self) -> None:
        self._stopped = True
        self._paused = False
        self._held.clear()
