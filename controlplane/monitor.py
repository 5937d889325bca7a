"""Load monitor: the replay buffer of recent windows, per-window imbalance, and the error-budget trigger.

A window is `W` consecutive steps of cluster-wide counts `uint32 [T, L, E]` in T rows (the agents' pipeline
gives one row, the window's total; tests may give one row a step). The replay buffer
keeps the last `replay_windows` windows; for any table it derives (and caches, keyed by the table's
content, so a proposal and the table committed from it share one entry) the per-step figures that step
imbalance needs (`verify.ReplayStats`). Counts are logical, so the same windows can be replayed against
the head, an in-flight proposal or a rolled-back parent.

Error budget: act only after `B` consecutive windows with imbalance above `theta` (at once above `fast_theta`,
a breach no band could be flapping around), measured under the table
that will be in force (the head, or the in-flight proposal: operations still in flight are counted, so the
trigger neither schedules twice nor fires for a problem already being fixed). Tolerance band: once above,
the count is held (not reset) while imbalance stays within `band` below theta, and resets only under
`theta - band`, so a signal hovering at theta cannot flap the trigger on and off.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from controlplane.errors import InvalidShape
from controlplane.table import RoutingTable
from controlplane.verify import RankLoadKernel, ReplayStats, changed_layers, layer_totals, same_mix

I64 = npt.NDArray[np.int64]
U32 = npt.NDArray[np.uint32]


def content_key(table: RoutingTable) -> bytes:
    """What determines loads (active ranks and phy2log), hashed once per table object."""
    return table.content_digest


@dataclass(frozen=True)
class Window:
    """One closed window: counts uint32 [T, L, E] (T rows, each one step's counts: the window's sampled steps,
    or every step), tokens per row and layer [T, L], totals [L, E] and totals per block of `block` rows
    [nb, L, E] (what the planner estimates on), all over the rows; `span`: the steps the window covers."""

    seq: int
    first_step: int
    counts: U32
    totals: I64
    expert_totals: I64
    block_totals: I64
    span: int


class ErrorBudget:
    """B consecutive windows above theta, with a tolerance band below theta that holds the count. A window
    above `fast` (a large breach: a drift) spends the whole budget at once."""

    def __init__(self, theta: float, band: float, windows: int, fast: float = float("inf")) -> None:
        self.theta, self.low, self.windows, self.fast = theta, theta - band, windows, fast
        self.count = 0

    def observe(self, imbalance: float) -> bool:
        """Count one window; True when the budget is spent (count >= B)."""
        if imbalance > self.fast:
            self.count = max(self.count + 1, self.windows)
        elif imbalance > self.theta:
            self.count += 1
        elif imbalance < self.low:
            self.count = 0
        # inside the band [theta - band, theta]: hold the count, neither add nor reset
        return self.count >= self.windows

    def reset(self) -> None:
        self.count = 0


@dataclass(frozen=True)
class WindowReport:
    """What the monitor saw in one window (an event for telemetry)."""

    window_seq: int
    first_step: int
    steps: int
    imbalance: float  # mean step imbalance under the evaluated table
    evaluated_version: int  # head version, or the in-flight proposal's
    budget: int  # consecutive windows counted against the error budget
    fired: bool


class ReplayBuffer:
    """The last `capacity` windows and, per table content, their per-step layer maxima."""

    def __init__(self, layers: int, experts: int, capacity: int, block: int = 0, cached_tables: int = 4) -> None:
        self.layers, self.experts, self.capacity, self.block = layers, experts, capacity, block
        self.windows: deque[Window] = deque()
        self._cache: OrderedDict[bytes, dict[int, I64]] = OrderedDict()  # content key -> seq -> [W, L]
        self._cached_tables = cached_tables
        self._counts: U32 | None = None

    def push(self, seq: int, first_step: int, steps: npt.NDArray[np.integer], span: int = 0) -> Window:
        """Keep a window of per-step rows `steps` [T, L, E] covering `span` steps (0: T)."""
        c = np.asarray(steps)
        if c.ndim != 3 or c.shape[1:] != (self.layers, self.experts) or c.shape[0] < 1:
            raise InvalidShape(f"window steps shape {c.shape}: expected [W >= 1, {self.layers}, {self.experts}]")
        if c.dtype != np.uint32:
            if c.size and (int(c.min()) < 0 or int(c.max()) > np.iinfo(np.uint32).max):
                raise InvalidShape("window counts out of uint32 range")
            c = c.astype(np.uint32)
        c = np.ascontiguousarray(c)
        c.setflags(write=False)
        W = c.shape[0]
        b = W if self.block < 1 else min(self.block, W)
        edges = np.arange(0, W, b)
        w = Window(seq, first_step, c, layer_totals(c), c.sum(axis=0, dtype=np.int64),
                   np.add.reduceat(c, edges, axis=0, dtype=np.int64) if edges.size > 1 else c.sum(
                       axis=0, dtype=np.int64)[None], span if span > 0 else W)
        self.windows.append(w)
        while len(self.windows) > self.capacity:
            old = self.windows.popleft()
            for per in self._cache.values():
                per.pop(old.seq, None)
        self._counts = None
        return w

    def snapshot(self) -> ReplayBuffer:
        """A copy that a planner may read on another thread while this one takes new windows: the same
        windows (their arrays are read-only) and figures cached so far, in containers of its own."""
        snap = ReplayBuffer(self.layers, self.experts, self.capacity, self.block, self._cached_tables)
        snap.windows = deque(self.windows)
        snap._cache = OrderedDict((k, dict(per)) for k, per in self._cache.items())
        return snap

    @property
    def steps(self) -> int:
        return sum(int(w.counts.shape[0]) for w in self.windows)

    def counts(self) -> U32:
        """[T, L, E] every buffered step, oldest first (concatenated once per push)."""
        if self._counts is None:
            if self.windows:
                self._counts = np.concatenate([w.counts for w in self.windows], axis=0)
            else:
                self._counts = np.zeros((0, self.layers, self.experts), dtype=np.uint32)
        return self._counts

    def _recent(self, last: int | None) -> list[Window]:
        """The last `last` windows (all when None or 0), oldest first."""
        return list(self.windows)[-last:] if last else list(self.windows)

    def window_totals(self, last: int | None = None) -> I64:
        """[nw, L, E] tokens per window of the last `last` windows (default all)."""
        ws = self._recent(last)
        if not ws:
            return np.zeros((0, self.layers, self.experts), dtype=np.int64)
        return np.stack([w.expert_totals for w in ws])

    def block_totals(self, last: int | None = None) -> I64:
        """[nb, L, E] tokens per planning block of the last `last` windows (default all), oldest first."""
        ws = self._recent(last)
        if not ws:
            return np.zeros((0, self.layers, self.experts), dtype=np.int64)
        return np.concatenate([w.block_totals for w in ws], axis=0)

    def rows_per_window(self, last: int | None = None) -> list[int]:
        """The rows each of the last `last` windows (default all) holds, oldest first."""
        return [int(w.counts.shape[0]) for w in self._recent(last)]

    def span(self, last: int | None = None) -> tuple[int, int]:
        """[first, end) steps of the last `last` windows (default all); (0, 0) when empty."""
        ws = self._recent(last)
        if not ws:
            return 0, 0
        return ws[0].first_step, ws[-1].first_step + ws[-1].span

    def tokens_per_step(self) -> npt.NDArray[np.float64]:
        """[L, E] mean tokens a step per expert over the buffered windows' rows (what a copy's downtime costs)."""
        return np.asarray(self.window_totals().sum(axis=0) / max(self.steps, 1), dtype=np.float64)

    def steps_of(self, last: int | None = None) -> int:
        ws = self._recent(last)
        return sum(int(w.counts.shape[0]) for w in ws)

    def same_mix(self, tv: float) -> int:
        """How many trailing windows share the latest one's expert mix (`verify.same_mix` on their totals):
        1 right after a drift; all in steady state."""
        if not self.windows:
            return 0
        return same_mix(np.stack([w.expert_totals for w in self.windows]), tv)

    def _maxima(self, table: RoutingTable, ws: list[Window], base: RoutingTable | None) -> list[I64]:
        key = content_key(table)
        per = self._cache.setdefault(key, {})
        self._cache.move_to_end(key)
        missing = [w for w in ws if w.seq not in per]
        if missing:
            bkey = content_key(base) if base is not None else b""
            bper = self._cache.get(bkey, {})
            same_active = base is not None and base.active_ranks == table.active_ranks
            if same_active and base is not None and all(w.seq in bper for w in missing):
                ls = changed_layers(base, table)
                kern = RankLoadKernel(table, ls) if ls.size else None
                for w in missing:
                    mx = bper[w.seq].copy()
                    if kern is not None:
                        mx[:, ls] = kern.layer_max(w.counts)
                    per[w.seq] = mx
            else:
                full = RankLoadKernel(table)
                for w in missing:
                    per[w.seq] = full.layer_max(w.counts)
        while len(self._cache) > self._cached_tables:
            self._cache.popitem(last=False)
        return [per[w.seq] for w in ws]

    def stats(self, table: RoutingTable, base: RoutingTable | None = None, last: int | None = None) -> ReplayStats:
        """Per-step stats of the last `last` windows (default all) under `table`. With `base`, a table whose
        stats are cached, only the layers that differ from it are replayed."""
        ws = self._recent(last)
        if not ws:
            z = np.zeros((0, self.layers), dtype=np.int64)
            return ReplayStats(z, z, len(table.active_ranks))
        mx = self._maxima(table, ws, base)
        return ReplayStats(
            np.concatenate(mx, axis=0), np.concatenate([w.totals for w in ws], axis=0), len(table.active_ranks)
        )


class LoadMonitor:
    """Replay buffer + error budget. `observe` takes one closed window and the table in force."""

    def __init__(
        self, layers: int, experts: int, replay_windows: int, theta: float, band: float, budget_windows: int,
        block: int = 0, fast_theta: float = float("inf"),
    ) -> None:
        self.buffer = ReplayBuffer(layers, experts, replay_windows, block)
        self.budget = ErrorBudget(theta, band, budget_windows, fast_theta)
        self.last_seq: int | None = None
        self.history: deque[float] = deque(maxlen=64)  # recent window imbalances, for explain and admin

    def is_stale(self, seq: int) -> bool:
        return self.last_seq is not None and seq <= self.last_seq

    def observe(self, seq: int, first_step: int, steps: npt.NDArray[np.integer], table: RoutingTable,
                base: RoutingTable | None = None, span: int = 0) -> WindowReport:
        """Buffer the window, measure it under `table` (the head, or the in-flight proposal, with `base` the
        head), count it against the budget. A gap in window numbers restarts the count."""
        w = self.buffer.push(seq, first_step, steps, span)  # validates first: a bad window changes nothing
        if self.last_seq is not None and seq != self.last_seq + 1:
            self.budget.reset()
        self.last_seq = seq
        if base is not None:
            self.buffer.stats(base, last=1)  # the head's figures first: the proposal reuses them
        imb = self.buffer.stats(table, base=base, last=1).mean_imbalance()
        self.history.append(imb)
        fired = self.budget.observe(imb)
        return WindowReport(seq, first_step, int(w.counts.shape[0]), imb, table.version, self.budget.count, fired)
