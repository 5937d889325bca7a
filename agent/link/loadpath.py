"""The load path: shim reports -> this node's windows -> gossip -> cluster windows for the controller."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from agent.link.reportguard import ReportGuard
from controlplane.topology import Topology
from dataplane_shim.link import check_load_report
from elasticmoe.loadcodec import rows_from_bytes, sample_steps
from elasticmoe.v1 import dataplane_pb2 as dpb

log = logging.getLogger(__name__)

U32 = npt.NDArray[np.uint32]
# a closed window's sampled steps' wall times [S], the versions they ran on [S] and their strides' mean times [S]
Timing = tuple[U32 | None, U32 | None, U32 | None]


class LoadReportError(ValueError):
    """A load report that cannot be used; the message names the field."""


@dataclass
class _Partial:
    counts: npt.NDArray[np.uint64]
    steps: dict[str, int]  # shim id -> steps reported into this window
    rows: dict[int, npt.NDArray[np.uint64]]  # sampled step -> its counts, summed over the shims
    sampled: bool = True  # every report into this window came with its sampled steps
    times: dict[int, int] | None = None  # sampled step -> its longest wall time over the shims (us); None: one unmeasured
    ran: dict[int, int] | None = None  # sampled step -> the oldest version a shim ran it on; None: one did not say
    strides: dict[int, int] | None = None  # sampled step -> its stride's longest mean time over the shims (us)


@dataclass(frozen=True)
class ClosedWindow:
    """One node's closed window: its totals [L, E] and its sampled steps' counts [S, L, E] (None: some report
    into it came without them), and their wall times [S] in microseconds (the longest over the node's engine
    ranks; None: some report into it came without them)."""

    seq: int
    first_step: int
    counts: U32
    samples: U32 | None
    step_us: U32 | None = None
    # shims that reported some of its steps but not all (a link that came back mid-window after its agent
    # restarted, or an engine that stopped mid-window): the window holds part of their ranks' load
    short: tuple[str, ...] = ()
    step_version: U32 | None = None  # [S]: the oldest table version the node's ranks ran each sampled step on
    stride_us: U32 | None = None  # [S]: each sampled step's stride's mean wall time, the longest over the ranks


class LocalWindows:
    """Sums the reports of this node's shims into windows of `window` steps.

    A window closes once every shim seen so far has reported all of its steps (or a later window; a shim that
    reported only some of them is named in its `short`: the window lacks part of its load). A report
    that crosses a window boundary (an engine plugin reports every EMOE_REPORT_EVERY steps, 25 by default, which
    an operator may set to one that does not divide the window) is split between the windows by its steps, its
    counts in proportion (rounded down, the remainder to the last part, so nothing is lost or counted twice).
    """

    def __init__(self, layers: int, experts: int, window: int, sample_every: int = 0) -> None:
        self.L, self.E, self.W, self.every = layers, experts, window, sample_every
        self._open: dict[int, _Partial] = {}
        self._shims: set[str] = set()
        self._closed_upto = -1

    def next_open_step(self, first_step: int, steps: int) -> int:
        """The first step of the first window no report has reached yet, when a report of `steps` steps from
        `first_step` ends more than a window before the newest window closed here (its engine restarted and
        counts from 0 again: it should go on from there); else 0 (a report a window late is only dropped). Not
        an open window: it holds the steps the engine ran before it restarted, which the new count would add
        to (a window of 20 steps counting 31); it closes once the new count is a window past it."""
        if first_step + steps > self._closed_upto * self.W:
            return 0
        return (max([self._closed_upto, *self._open]) + 1) * self.W

    def add(self, shim_id: str, first_step: int, steps: int, counts: U32,
            rows: npt.NDArray[np.uint32] | None = None, step_us: U32 | None = None,
            version: int = 0, stride_us: U32 | None = None) -> list[ClosedWindow]:
        """Add a report covering steps [first_step, first_step + steps); `rows`: the counts of its sampled steps
        (elasticmoe.loadcodec.sample_steps with this node's sample_every), None if it came without them;
        `step_us`, `stride_us`: their wall times and their strides' means (LoadReport; None: not measured);
        `version`: the table version its engine ran them on (LoadReport.version; 0: not said).

        Returns the windows that closed, in order."""
        if steps < 1:
            raise LoadReportError(f"steps = {steps}: expected >= 1")
        if steps > self.W:  # (a report crosses one window boundary at most: its split is bounded)
            raise LoadReportError(f"steps = {steps}: expected at most decision.window = {self.W} (set the engine "
                                  f"plugin's EMOE_REPORT_EVERY to at most the agents' window)")
        if counts.shape != (self.L, self.E):
            raise LoadReportError(f"counts shape {counts.shape}: expected [{self.L}, {self.E}]")
        sampled = sample_steps(first_step, steps, self.every)
        if rows is not None and rows.shape != (len(sampled), self.L, self.E):
            raise LoadReportError(f"sampled rows shape {rows.shape}: expected {(len(sampled), self.L, self.E)}")
        by_step = dict(zip(sampled, rows, strict=True)) if rows is not None else None
        took = dict(zip(sampled, (int(t) for t in step_us), strict=True)) if (
            rows is not None and step_us is not None and len(step_us) == len(sampled)) else None
        strode = dict(zip(sampled, (int(t) for t in stride_us), strict=True)) if (
            took is not None and stride_us is not None and len(stride_us) == len(sampled)) else None
        if rows is not None and not sampled:  # no sampled step to time (a short report, flushed before an install)
            took, strode = {}, {}
        closed: list[ClosedWindow] = []
        left, at, rest = steps, first_step, counts.astype(np.uint64)
        while left:
            n = min(left, self.W - at % self.W)  # this window's share of the report's steps
            part = rest if n == left else (counts.astype(np.uint64) * n) // steps
            mine = None if by_step is None else {s: r for s, r in by_step.items() if at <= s < at + n}
            timed = None if took is None else {s: t for s, t in took.items() if at <= s < at + n}
            strides = None if strode is None else {s: t for s, t in strode.items() if at <= s < at + n}
            closed += self._add(shim_id, at, n, part, mine, timed, version, strides)
            rest = rest - part
            left, at = left - n, at + n
        return closed

    def _add(self, shim_id: str, first_step: int, steps: int, counts: npt.NDArray[np.uint64],
             rows: dict[int, U32] | None, took: dict[int, int] | None = None, version: int = 0,
             strides: dict[int, int] | None = None) -> list[ClosedWindow]:
        seq = first_step // self.W
        self._shims.add(shim_id)
        if seq <= self._closed_upto:
            return []  # late report for a window already published: dropped, counted by the caller
        part = self._open.setdefault(seq, _Partial(np.zeros((self.L, self.E), np.uint64), {}, {}, True, {}, {}, {}))
        part.counts += counts
        part.steps[shim_id] = part.steps.get(shim_id, 0) + steps
        if rows is None:
            part.sampled = False
        else:
            for s, r in rows.items():
                have = part.rows.get(s)
                part.rows[s] = r.astype(np.uint64) if have is None else have + r
        timed = took is not None and rows is not None
        part.times = _merge(part.times, took if timed else None, max)
        part.strides = _merge(part.strides, strides if timed else None, max)
        part.ran = _merge(part.ran, {s: version for s in took or {}} if timed and version >= 1 else None, min)
        closed = []
        for k in sorted(self._open):
            p = self._open[k]
            later = any(j > k for j in self._open)
            if all(p.steps.get(s, 0) >= self.W for s in self._shims) or (later and k < seq - 1):
                closed.append(self._close(k, p))
                del self._open[k]
                self._closed_upto = max(self._closed_upto, k)
            else:
                break
        return closed

    def _close(self, k: int, p: _Partial) -> ClosedWindow:
        top = np.iinfo(np.uint32).max
        want = sample_steps(k * self.W, self.W, self.every)
        samples = None
        if p.sampled and self.every > 0 and all(s in p.rows for s in want):
            samples = (np.minimum(np.stack([p.rows[s] for s in want]), top).astype(np.uint32) if len(want)
                       else np.zeros((0, self.L, self.E), np.uint32))
        times = _per_step(p.times, want) if samples is not None else None
        ran = _per_step(p.ran, want) if times is not None else None
        strides = _per_step(p.strides, want) if times is not None else None
        short = tuple(sorted(s for s, n in p.steps.items() if n < self.W))
        return ClosedWindow(k, k * self.W, np.minimum(p.counts, top).astype(np.uint32), samples, times, short, ran,
                            strides)


class ClusterWindows:
    """Per-node windows from gossip, summed into cluster windows.

    Window k closes once every live node has reported it, or, so that one lagging or restarted node cannot
    stall the windows after it, once some live node is `lag` windows past k: then it closes with the reports at
    hand (a partial sum, which names the live nodes missing from it; `partial` counts how often). Windows at or
    before the last closed one are ignored. A cluster window's sampled steps are the sum of its nodes' (None
    when one of them came without them).
    """

    def __init__(self, keep: int = 8, lag: int = 2) -> None:
        self.keep = keep
        self.lag = lag
        self._by_node: dict[str, dict[int, tuple[U32, U32 | None]]] = {}
        self.last_closed = -1
        self.partial = 0
        self._count: dict[int, int] = {}  # window seq -> nodes holding it (any node, live or not)
        self._newest = -1  # the newest window seq added (an upper bound of the live nodes' newest)
        self._times: dict[str, dict[int, U32]] = {}  # node -> window seq -> its sampled steps' wall times [S] (us)
        self.step_us: dict[int, U32] = {}  # closed window seq -> its sampled steps' wall times [S], the longest over
        #                                    the nodes summed (only where every one measured them), the newest `keep`
        self._ran: dict[str, dict[int, U32]] = {}  # node -> window seq -> the version each sampled step ran on [S]
        self.step_version: dict[int, U32] = {}  # closed window seq -> the oldest version over those nodes [S]
        self._strides: dict[str, dict[int, U32]] = {}  # node -> window seq -> its sampled steps' strides' mean times
        self.stride_us: dict[int, U32] = {}  # closed window seq -> the longest over those nodes [S] (us)

    def add(self, node: str, window_seq: int, counts: U32, samples: U32 | None = None,
            step_us: U32 | None = None, step_version: U32 | None = None, stride_us: U32 | None = None) -> None:
        if window_seq <= self.last_closed:
            return
        times, ran, strides = (d.setdefault(node, {}) for d in (self._times, self._ran, self._strides))
        _hold(times, window_seq, step_us, None if samples is None else samples.shape[:1])
        shape = times[window_seq].shape if window_seq in times else None  # (the others only beside the times)
        _hold(ran, window_seq, step_version, shape)
        _hold(strides, window_seq, stride_us, shape)
        for d in (times, ran, strides):
            for k in [k for k in d if k <= self.last_closed]:
                del d[k]
        w = self._by_node.setdefault(node, {})
        if window_seq not in w:
            self._count[window_seq] = self._count.get(window_seq, 0) + 1
        w[window_seq] = (counts, samples)
        self._newest = max(self._newest, window_seq)
        for k in sorted(w)[:-self.keep]:
            self._forget(w, k)

    def timing(self, seq: int) -> Timing:
        """Closed window `seq`'s sampled steps' wall times, versions run on and strides' mean times (None: not held)."""
        took = self.step_us.get(seq)
        return (None, None, None) if took is None else (took, self.step_version.get(seq), self.stride_us.get(seq))

    def _forget(self, w: dict[int, tuple[U32, U32 | None]], k: int) -> None:
        del w[k]
        c = self._count[k] - 1
        if c:
            self._count[k] = c
        else:
            del self._count[k]

    def newest_reported(self) -> int:
        """The newest window seq reported, as far as this node can vouch for it: no more than `lag` + 1 past the
        last closed window (a live node `lag` windows ahead closes it, so a newer seq came from a dead node, a
        skewed clock or a forged window); -1 before the first window closed."""
        if self.last_closed < 0:
            return -1
        return min(self._newest, self.last_closed + self.lag + 1)

    def ready(self, live_nodes: list[str]) -> list[tuple[int, npt.NDArray[np.uint64], U32 | None, tuple[str, ...]]]:
        """Cluster windows newly closed, in order: (seq, sum over live nodes uint64 [L, E], the sum of their
        sampled steps uint32 [S, L, E] or None, the live nodes whose window is missing from the sum)."""
        # called on every window arrival: first a check that nothing can close (no window held by as many
        # nodes as are live, and none old enough for the lag rule), without touching every node's windows
        ks = [k for k in self._count if k > self.last_closed]
        if not ks or (self._newest < min(ks) + self.lag and all(self._count[k] < len(live_nodes) for k in ks)):
            return []
        by = self._by_node
        held = [by[n] for n in live_nodes if by.get(n)]
        if not held:
            return []
        newest = max(max(w) for w in held)
        pending = sorted({k for w in held for k in w if k > self.last_closed})
        out = []
        for k in pending:
            complete = len(held) == len(live_nodes) and all(k in w for w in held)
            if not complete and newest < k + self.lag:
                break
            parts = [w[k] for w in held if k in w]
            missing = () if complete else tuple(n for n in live_nodes if k not in by.get(n, {}))
            if not complete:
                self.partial += 1
            total = np.asarray(sum(c.astype(np.uint64) for c, _ in parts), dtype=np.uint64)
            rows = [r for _, r in parts]
            samples = None
            if all(r is not None for r in rows) and len({r.shape for r in rows if r is not None}) == 1:
                summed = sum(r.astype(np.uint64) for r in rows if r is not None)
                samples = np.minimum(summed, np.iinfo(np.uint32).max).astype(np.uint32)
            out.append((k, total, samples, missing))
            holders = [n for n in live_nodes if k in by.get(n, {})]
            if samples is not None and self._over(self._times, holders, k, samples.shape[:1], np.max, self.step_us):
                self._over(self._ran, holders, k, samples.shape[:1], np.min, self.step_version)
                self._over(self._strides, holders, k, samples.shape[:1], np.max, self.stride_us)
            self.last_closed = k
        for w in held:
            for k in [k for k in w if k <= self.last_closed]:
                self._forget(w, k)
        return out

    def _over(self, per_node: dict[str, dict[int, U32]], nodes: list[str], k: int, shape: tuple[int, ...],
              op: Callable[..., npt.NDArray[Any]], into: dict[int, U32]) -> bool:
        """Window k's per-sampled-step figures reduced over `nodes` by `op` into `into` (where every one sent them)."""
        got = [per_node.get(n, {}).get(k) for n in nodes]
        if not got or not all(v is not None and v.shape == shape for v in got):
            return False
        into[k] = op(np.stack([v for v in got if v is not None]), axis=0).astype(np.uint32)
        for old in sorted(into)[:-self.keep]:
            del into[old]
        return True


def _merge(into: dict[int, int] | None, new: dict[int, int] | None, op: Callable[..., int]) -> dict[int, int] | None:
    """A report's per-sampled-step figures folded into a window's by `op`; None once a report came without them."""
    if into is None or new is None:
        return None
    for s, v in new.items():
        into[s] = op(into[s], v) if s in into else v
    return into


def _per_step(d: dict[int, int] | None, want: Iterable[int]) -> U32 | None:
    """A closed window's per-sampled-step figures in step order; None unless every sampled step has one."""
    steps = list(want)
    if d is None or not all(s in d for s in steps):
        return None
    return np.array([min(d[s], 0xFFFFFFFF) for s in steps], dtype=np.uint32)


def _hold(d: dict[int, U32], seq: int, v: U32 | None, shape: tuple[int, ...] | None) -> None:
    """Hold a node's per-sampled-step figures for window `seq` where they have `shape`, else drop what was held."""
    if v is not None and shape is not None and v.shape == shape:
        d[seq] = v
    else:
        d.pop(seq, None)


# a closed cluster window's consumer: (seq, total, sampled steps, the nodes missing from it: live ones that lag, and
# those holding active ranks whose load no window in the sum carries, LoadPath.absent)
CloseWindow = Callable[[int, npt.NDArray[np.uint64], U32 | None, tuple[str, ...]], None]


class LoadGossip(Protocol):
    """What the load path needs of gossip (agent.gossip.gossip_node.GossipNode)."""

    def suspect_ranks(self, ranks: Iterable[int]) -> list[str]: ...

    def publish_window(self, window_seq: int, first_step: int, steps: int, counts: npt.NDArray[np.integer],
                       learner: bool = False, samples: U32 | None = None, sample_every: int = 0,
                       step_us: U32 | None = None, step_version: U32 | None = None,
                       stride_us: U32 | None = None) -> None: ...

    def live_nodes(self) -> list[str]: ...


def _nobody(contributors: Sequence[str]) -> tuple[str, ...]:
    return ()


def _ignore(ranks: tuple[int, ...]) -> None:
    return None


class LoadPath:
    """One node's load path, whole: its engines' reports (the shim link's sink, `on_report`) -> this node's
    windows (LocalWindows) -> gossip (signed, with whether this node abstains from consensus) -> every node's
    windows (`on_window`, gossip's callback; this node's own included) -> the cluster windows (ClusterWindows),
    each closed one handed to `close_window` (agent.decision.pipeline.DecisionPipeline.close_window).
    `engine_ran(rank, version)`: the version a rank's engine reported it runs (agent.link.installs);
    `abstains()`: why this node may not vote now ("" when it may; agent.commit.CommitBackend.abstains);
    `guard`: what no engine of this node can say (agent.link.reportguard: another node's rank, a version past the
    head, counts past the engine's batch): such a report is refused before anything of it counts;
    `engine_failed(rank, error)`: the fatal error a rank's plugin reported before it stopped (agent.link.installs);
    `absent(contributors)`: the nodes that hold ranks active in the committed head which none of the nodes whose
    windows a cluster window sums holds (agent.decision.reactions.MembershipReactions.absent): a closed window names them
    among its missing nodes beside the live ones that lag, so that a node whose agent is dead, restarting or not
    yet heard is not taken for a node whose ranks are idle (default: none);
    `unreachable(ranks)`: the engine's evidence in an accepted report, the ranks its EP group could not reach
    (agent.decision.reactions.MembershipReactions.unreachable: whether they are lost), besides the suspicion it raises."""

    def __init__(self, node_id: str, topology: Topology, layers: int, experts: int, window: int,
                 gossip: LoadGossip, close_window: CloseWindow,
                 engine_ran: Callable[[int, int], None], abstains: Callable[[], str], guard: ReportGuard,
                 sample_every: int = 0,
                 engine_failed: Callable[[int, str], None] = lambda rank, error: None,
                 absent: Callable[[Sequence[str]], tuple[str, ...]] = _nobody,
                 unreachable: Callable[[tuple[int, ...]], None] = _ignore) -> None:
        """`sample_every`: the sampled steps the engines' reports carry (decision.sample_every)."""
        self.node_id, self.topology, self.layers, self.experts, self.window = node_id, topology, layers, experts, window
        self.gossip, self.close_window, self.engine_ran, self.abstains = gossip, close_window, engine_ran, abstains
        self.guard = guard
        self.sample_every, self.engine_failed = sample_every, engine_failed
        self.absent, self.unreachable = absent, unreachable
        self.local = LocalWindows(layers, experts, window, sample_every)
        self.cluster = ClusterWindows()
        self.unsampled = 0  # reports used for their totals only (no sampled steps, or another sample_every)
        self.dropped: dict[str, int] = {}  # reports each shim dropped before they left it (its own count)
        self.behind: set[str] = set()  # shims told to go on at a later step (each said once in the log)
        self.withheld = 0  # own windows not published: some shim reported only part of their steps

    def on_report(self, r: dpb.LoadReport) -> int | None:
        """One engine rank's report; LoadReportError names the field of one this node cannot use (before
        anything is counted). Returns the step its engine should continue counting from when the report is for
        a window this node already closed (an engine restarted and counts from 0 again: its reports would be
        dropped until its count caught up), else None."""
        why = check_load_report(r, self.layers, self.experts)
        if not why:
            refused = self.guard.check(r)  # (counted by its code there)
            why = str(refused) if refused is not None else ""
        if why:
            raise LoadReportError(f"load report from {r.shim_id or r.rank}: {why}")
        if r.error:  # the plugin's last word before it stops (GENESIS_MISMATCH: ...): no load
            log.error("rank %d's plugin stopped: %s", r.rank, r.error)
            self.engine_failed(int(r.rank), r.error)
            return None
        if r.unreachable_ranks:  # the engine's own evidence (Lifeguard)
            who = self.gossip.suspect_ranks(r.unreachable_ranks)
            log.warning("rank %d could not reach ranks %s: suspecting %s", r.rank, list(r.unreachable_ranks), who)
            self.unreachable(tuple(int(g) for g in r.unreachable_ranks))
        self.engine_ran(int(r.rank), int(r.version))
        shim = r.shim_id or f"rank{r.rank}"
        self.dropped[shim] = max(self.dropped.get(shim, 0), int(r.dropped_reports))
        if r.steps == 0:  # evidence only (a peer the engine lost), no load
            return None
        go_on = self.local.next_open_step(int(r.first_step), int(r.steps))
        if go_on:
            if shim not in self.behind:
                self.behind.add(shim)
                log.warning("load report from %s for steps from %d, a window this node closed (its engine restarted?): "
                            "dropped; its engine is told to go on from step %d", shim, r.first_step, go_on)
            return go_on
        self.behind.discard(shim)
        counts = np.frombuffer(r.counts, dtype="<u4").reshape(self.layers, self.experts)
        rows, took, strides = None, None, None
        if r.sample_every == self.sample_every > 0:
            n = len(sample_steps(r.first_step, r.steps, r.sample_every))
            rows = rows_from_bytes(r.samples, n, self.layers, self.experts)
            if r.step_us:  # (check_load_report: one per sampled step; the guard: each plausible)
                took = np.frombuffer(r.step_us, dtype="<u4")
                strides = np.frombuffer(r.stride_us, dtype="<u4") if r.stride_us else None
        else:
            self.unsampled += 1
            if r.sample_every and self.unsampled == 1:
                log.warning("load report from %s samples every %d steps, this agent every %d (decision.sample_every):"
                            " its totals are used, its sampled steps are not (set the engine plugin's "
                            "EMOE_SAMPLE_EVERY to %d)", r.shim_id or r.rank, r.sample_every, self.sample_every,
                            self.sample_every)
        for w in self.local.add(shim, r.first_step, r.steps, counts, rows, took, int(r.version), strides):
            if w.short:  # part of some ranks' load: published, it would read as those ranks idle (issue 49, finding 5)
                self.withheld += 1
                log.info("window %d not published: %s reported only part of its steps (a link back mid-window, or "
                         "an engine stopped in it); the cluster's window lacks this node's load", w.seq, list(w.short))
                continue
            self.gossip.publish_window(w.seq, w.first_step, self.window, w.counts, bool(self.abstains()),
                                       w.samples, self.sample_every if w.samples is not None else 0, w.step_us,
                                       w.step_version, w.stride_us)
            self.on_window(self.node_id, w.seq, w.counts, w.first_step, self.window, w.samples, w.step_us,
                           w.step_version, w.stride_us)
        return None

    def on_window(self, node: str, window_seq: int, counts: npt.NDArray[np.integer], first_step: int = 0,
                  steps: int = 0, samples: U32 | None = None, step_us: U32 | None = None,
                  step_version: U32 | None = None, stride_us: U32 | None = None) -> None:
        """A node's window (gossip's callback, and this node's own as it publishes one); `step_us` [S]: the wall
        times of its sampled steps, `step_version` [S] the versions they ran on, `stride_us` [S] their strides'
        mean times (ClusterWindows.step_us, .step_version and .stride_us keep the closed windows')."""
        self.cluster.add(node, window_seq, np.asarray(counts, dtype=np.uint32), samples, step_us, step_version,
                         stride_us)
        live = self.gossip.live_nodes()
        if self.node_id not in live:  # we count ourselves live (a node declared dead still reports)
            live = sorted([*live, self.node_id])
        for seq, total, rows, missing in self.cluster.ready(live):
            gone = self.absent([n for n in live if n not in missing])  # whose active ranks no window covers
            self.close_window(seq, total, rows, missing + tuple(n for n in gone if n not in missing))

    def newest_reported(self) -> int:
        return self.cluster.newest_reported()
