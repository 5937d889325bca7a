"""Engine-independent core of the plugin that runs in every EP rank of a collective engine (vLLM, SGLang).

Each rank's `PluginCore` holds the certified tables its agent sent (`receive`, verified by
`dataplane_shim.certify`), the version the engine runs (`current`), and the load not yet reported. The engine's
glue drives it through two doors:

- tables in, through `dataplane_shim.install.Installer` (the glue calls `inst.begin_step(collective)` and
  `inst.after_step(...)` at every step, in the order install.py gives): at an agreement step the Installer
  sends `held()` (this rank's `Versions`, slots 0-1 of the `dataplane_shim.agreement.Agreement` the EP ranks
  MIN-reduce), hands the reduced versions to `decide` (the table every rank holds and installs now, alike on
  every rank, or None), renumbers the load steps by `go_on_from` when the agents asked, and calls `installed`
  once the engine's own path has moved the weights and its map equals the table;
- load out, from the glue at its own points of the step:

    core.step_took(offset, us)           # the wall time of a step not added yet (sampled: its own and its stride's mean)
    core.add_load(counts, steps, rows)   # int [L, E] logical load of `steps` steps; rows: the sampled ones
    core.maybe_report()                  # every `report_every` steps: one LoadReport offered to the link
    core.flush()                         # before an install empties the engine's counters: report them now
    core.peer_unreachable(rank); core.report_evidence()   # a collective failed: name the lost peers at once

`decide` is the collective form of the version counters: the MIN all-reduce gives the newest version every rank
has received and the largest of the ranks' oldest versions held (the floor); a version is installed only when
every rank holds it, and all ranks decide the same thing from the same reduced vector. numpy only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from controlplane.table import RoutingTable
from controlplane.topology import Topology
from dataplane_shim.agreement import Versions
from dataplane_shim.certify import table_from_commit
from dataplane_shim.errors import BadInput, ShimError
from dataplane_shim.genesis import content_hex, genesis_table
from dataplane_shim.link import make_load_report
from elasticmoe.loadcodec import sample_steps, stride_means
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.v1 import dataplane_pb2 as dpb

log = logging.getLogger(__name__)

I64 = npt.NDArray[np.int64]


class GenesisMismatch(ShimError):
    """The engine booted with a placement other than the agents' genesis: the plugin refuses to run."""

    code = "GENESIS_MISMATCH"


class Link(Protocol):
    """What the core needs of `dataplane_shim.link.LinkThread` (a fake in unit tests)."""

    @property
    def dropped(self) -> int: ...

    @property
    def next_step(self) -> int:
        """The step the agent said to go on from (ReportLoadAck.next_step; 0: none)."""
        ...

    def drain(self) -> list[cpb.Commit]: ...

    def offer(self, report: dpb.LoadReport) -> None: ...

    def go_on_from(self, step: int) -> None:
        """The engine renumbered its load steps from `step`: acks of reports numbered before it are stale."""
        ...

    def report(self, report: dpb.LoadReport, timeout: float) -> object: ...


# Reports every 25 steps: a divisor of the agents' default window (50), so a window's last report leaves at
# its last step and the window closes then (at 32, up to 28 steps later). Agreement every 32 steps (~1 s of
# 30 ms decode steps): the plugin's own work, agreement and report together, is then about
# 0.8/1000 of a 30 ms step (bench.plugin_step: 24 us a step here, against 46 us at 16 and 15 us at 64), and
# the overlapped agreement (taken one step after it starts) delays an install by at most 32 + 1 steps
REPORT_EVERY = 25  # steps per load report: one host copy and one message per 25 decode steps
AGREE_EVERY = 32   # steps per version agreement: one async all-reduce launch (~150 us here) per 32 steps
SAMPLE_EVERY = 10  # every 10th step's counts go to the agent besides the totals (elasticmoe.loadcodec)
MAX_TIMED = 4096  # step times held between reports (report_every steps); past it, steps go untimed


@dataclass
class Settings:
    socket: str
    genesis: str = "vllm"
    report_every: int = REPORT_EVERY
    agree_every: int = AGREE_EVERY
    stall_steps: int = 0
    sample_every: int = SAMPLE_EVERY

    """The plugin's settings, from the engine process's environment: EMOE_SOCKET (the agent's unix socket;
    `{rank}` is replaced by the EP rank; unset: the plugin stays off), EMOE_GENESIS (default `vllm`),
    EMOE_REPORT_EVERY (steps per load report, default 25, a divisor of the agents' window), EMOE_AGREE_EVERY (steps per version agreement,
    default 32; it must be the same on every EP rank, which the plugin checks at start: a collective only
    some ranks enter hangs), EMOE_STALL_STEPS (steps a weight move may take before it is logged and counted
    as a stall; 0, the default: 8 per MoE layer, at least 256), EMOE_SAMPLE_EVERY (the per-step counts of every
    N-th step go to the agent besides the totals, default 10, 0: none; it must equal the agents'
    decision.sample_every)."""

    @staticmethod
    def from_env(env: dict[str, str] | None = None) -> Settings | None:
        e = dict(os.environ) if env is None else env
        if not e.get("EMOE_SOCKET"):
            return None

        def integer(name: str, default: int, least: int) -> int:
            raw = e.get(name, str(default))
            try:
                v = int(raw)
            except ValueError:
                v = least - 1
            if v < least:
                raise BadInput(f"{name}={raw!r}: expected an integer >= {least}")
            return v

        return Settings(e["EMOE_SOCKET"], e.get("EMOE_GENESIS", "vllm"), integer("EMOE_REPORT_EVERY", REPORT_EVERY, 1),
                        integer("EMOE_AGREE_EVERY", AGREE_EVERY, 1), integer("EMOE_STALL_STEPS", 0, 0),
                        integer("EMOE_SAMPLE_EVERY", SAMPLE_EVERY, 0))


@dataclass
class PluginStats:
    steps: int = 0
    reports: int = 0            # load reports offered to the link
    refused: int = 0            # commits refused (uncertified, wrong shape, not newer)
    agreed: int = 0             # the last agreed version (MIN over the EP ranks)
    installs: int = 0           # versions installed through the engine's path
    waits: int = 0              # steps where this rank held a newer version than a peer


class PluginCore:
    """One EP rank's view: the certified tables received, the version installed, the load to report."""

    def __init__(self, link: Link, topo: Topology, layers: int, experts: int, rank: int, boot_phy2log: I64,
                 *, genesis: str = "vllm", report_every: int = 1, shim_id: str = "", sample_every: int = 0,
                 first_step: int = 0, max_batch_tokens: int = 0) -> None:
        """`first_step`: the number of the first step added (the agents' windows are numbered by the engines'
        steps: a feed that starts after earlier ones starts past the agents' newest window). `max_batch_tokens`:
        the most tokens one step of the engine carries into this rank's counts, which its reports say (the agent
        refuses counts past it, LoadReport.max_batch_tokens); 0: not known (the agent's own bound applies)."""
        if report_every < 1 or sample_every < 0 or first_step < 0 or max_batch_tokens < 0:
            raise BadInput(f"report_every={report_every}, sample_every={sample_every}, first_step={first_step}, "
                           f"max_batch_tokens={max_batch_tokens}: expected >= 1, >= 0, >= 0 and >= 0")
        self.max_batch_tokens = max_batch_tokens
        self.sample_every = sample_every
        if not 0 <= rank < topo.ranks:
            raise BadInput(f"rank={rank}: expected 0..{topo.ranks - 1}")
        self.link, self.topo, self.rank, self.report_every = link, topo, rank, report_every
        self.shim_id = shim_id or f"rank{rank}"
        boot = np.asarray(boot_phy2log, dtype=np.int64)
        if boot.shape != (layers, topo.slots):
            raise BadInput(f"the engine's physical_to_logical_map has shape {boot.shape}: expected "
                           f"[{layers}, {topo.slots}]")
        want = genesis_table(genesis, topo, layers, experts)
        engine = RoutingTable(topo, experts, boot, version=1, parent=0)
        if not engine.content_equal(want):
            layer, slot = (int(x) for x in np.argwhere(engine.phy2log != want.phy2log)[0])
            e = GenesisMismatch(
                f"the engine booted with placement {content_hex(engine)}, the agents' genesis {genesis!r} is "
                f"{content_hex(want)} (first difference: layer {layer} slot {slot}: engine expert "
                f"{int(engine.phy2log[layer, slot])}, genesis expert {int(want.phy2log[layer, slot])})")
            try:  # the agent's `emoe status` names it for the rank (LoadReport.error), then the plugin stops
                link.report(make_load_report(shim_id or f"rank{rank}", rank, 0, 0, 0, np.zeros((layers, experts),
                                             np.uint32), error=str(e)), timeout=2.0)
            except Exception:  # noqa: BLE001 - an absent agent: the engine's own error still says it
                log.warning("rank %d: could not tell the agent of %s", rank, e.code)
            raise e
        self.current: RoutingTable = want
        self.tables: dict[int, RoutingTable] = {}
        self.stats = PluginStats()
        self._load = np.zeros((layers, experts), dtype=np.int64)
        self._first_step = first_step
        self._steps = 0
        self._rows: list[npt.NDArray[np.int64]] = []  # the sampled steps' counts since the last report
        self._sampled = True  # every chunk since the last report came with its sampled rows
        self._took: dict[int, float] = {}  # global step -> its wall time (us), every step not reported yet
        self._unreachable: set[int] = set()

    # ---- tables in ---------------------------------------------------------------------------------
    def receive(self, commits: Iterable[cpb.Commit] | None = None) -> int:
        """Verify and keep the commits newer than the installed version; returns how many were kept."""
        kept = 0
        for c in self.link.drain() if commits is None else commits:
            try:
                t = table_from_commit(c, self.topo)
            except ShimError:
                self.stats.refused += 1
                continue
            if (t.layers, t.experts) != (self.current.layers, self.current.experts) or t.version <= self.version:
                self.stats.refused += 1
                continue
            self.tables[t.version] = t
            kept += 1
        return kept

    @property
    def version(self) -> int:
        return self.current.version

    @property
    def steps_pending(self) -> int:
        """Steps of load added since the last report."""
        return self._steps

    def held(self) -> Versions:
        """What this rank holds, for the agreement (after taking the link's commits in): the newest version and
        the oldest newer than the installed one; a rank that holds nothing newer holds (installed, installed)."""
        self.receive()
        return Versions(max(self.tables, default=self.version), min(self.tables, default=self.version))

    def agreement_vector(self) -> I64:
        """int64 [2]: `held()` encoded (`Versions.encode`: newest, -oldest), this rank's input to the MIN."""
        return self.held().encode()

    def decide(self, reduced: npt.ArrayLike | Versions) -> RoutingTable | None:
        """From the MIN-reduced agreement (int64 [2], or decoded): the table to install now, the same on every
        rank, or None.

        agreed = min over ranks of the newest held; floor = max over ranks of the oldest held. Streams
        deliver versions in order, so every rank holds every version in [floor, agreed] when agreed >= floor."""
        red = reduced if isinstance(reduced, Versions) else Versions.decode(reduced)
        agreed, floor = red.newest, red.oldest
        self.stats.agreed = agreed
        mine = max(self.tables, default=self.version)
        if mine > agreed:
            self.stats.waits += 1
        if agreed <= self.version or agreed < floor:
            return None
        if agreed not in self.tables:  # a stream that skipped a version: a broken invariant, fail loudly
            raise ShimError(f"rank {self.rank}: agreed version {agreed} is not among the versions held "
                            f"{sorted(self.tables)}")
        return self.tables[agreed]

    @property
    def next_step_number(self) -> int:
        """The number the next step added will have (the agents' windows are numbered by it)."""
        return self._first_step + self._steps

    def go_on_from(self, step: int) -> bool:
        """Number the next step `step` when that is ahead (every rank does it at the same agreement step, with
        the largest step any rank's agent asked for: ReportLoadAck.next_step). The load added since the last
        report is dropped: its agent drops windows it has closed. True if renumbered."""
        if step <= self.next_step_number:
            return False
        log.warning("rank %d: load steps renumbered from %d to %d (the agents' windows are past this engine's "
                    "count: it restarted)", self.rank, self.next_step_number, step)
        self._first_step, self._steps = step, 0
        self.link.go_on_from(step)
        self._load[:] = 0
        self._rows, self._sampled = [], True
        self._took = {}
        return True

    def installed(self, version: int) -> None:
        """The engine now runs `version`: forget it and everything older."""
        self.current = self.tables[version]
        self.tables = {v: t for v, t in self.tables.items() if v > version}
        self.stats.installs += 1

    # ---- load out ----------------------------------------------------------------------------------
    def sampled(self, steps: int) -> list[int]:
        """Which of the next `steps` steps are sampled, as offsets from the first of them (the rows `add_load`
        wants: every `sample_every`-th global step, elasticmoe.loadcodec)."""
        start = self._first_step + self._steps
        return [s - start for s in sample_steps(start, steps, self.sample_every)]

    def is_sampled(self, offset: int) -> bool:
        """Whether the step `offset` steps after the last one added is sampled (`sampled`, for one step)."""
        return self.sample_every > 0 and (self._first_step + self._steps + offset) % self.sample_every == 0

    def step_took(self, offset: int, us: float) -> None:
        """The engine's wall time of the step `offset` steps after the last one added, in microseconds (vLLM:
        between consecutive calls of its step hook). Each sampled step reports its own time (LoadReport.step_us)
        and the mean of its stride's (itself and the steps after it up to the next sampled one, within the
        report: LoadReport.stride_us, elasticmoe.loadcodec.stride_means), so that the agents can fit the part of a
        step that grows with its busiest rank's load from the steps one by one and from window means that have a
        fraction of one step's noise."""
        if us > 0 and len(self._took) < MAX_TIMED:
            self._took[self._first_step + self._steps + offset] = float(us)

    def add_load(self, counts: npt.ArrayLike, steps: int = 1, rows: npt.ArrayLike | None = None) -> None:
        """Add the logical load of `steps` steps, int [L, E]; `rows` [n, L, E]: the counts of the sampled ones
        among them (`sampled(steps)`), or None when the engine cannot tell its steps apart (the report then
        carries the totals only)."""
        c = np.asarray(counts)
        if c.shape != self._load.shape or steps < 1:
            raise BadInput(f"load shape {c.shape} over {steps} steps: expected {self._load.shape} over >= 1")
        n = len(self.sampled(steps))
        if rows is None:
            self._sampled = self._sampled and n == 0
        else:
            r = np.asarray(rows)
            if r.shape != (n, *self._load.shape):
                raise BadInput(f"sampled rows shape {r.shape}: expected {(n, *self._load.shape)} (the sampled "
                               f"steps among {steps} from step {self._first_step + self._steps})")
            self._rows.extend(r.astype(np.int64))
        self._load += c
        self._steps += steps
        self.stats.steps += steps

    def peer_unreachable(self, rank: int) -> None:
        """The engine could not reach `rank` (a collective or dispatch timeout, a dead link): the next report
        carries it, and the agent suspects that rank's node at once (Lifeguard's local evidence)."""
        if not 0 <= rank < self.topo.ranks or rank == self.rank:
            raise BadInput(f"unreachable rank {rank}: expected another rank in 0..{self.topo.ranks - 1}")
        self._unreachable.add(rank)

    def report_evidence(self, timeout: float = 2.0) -> bool:
        """Send the unreachable peers now, in a report of its own (no steps, no load), and wait up to `timeout`
        for the agent's ack when the link can (the engine is about to fail: this may be its last word).
        True if there was evidence to send."""
        if not self._unreachable:
            return False
        report = make_load_report(self.shim_id, self.rank, self._first_step, 0, self.version,
                                  np.zeros(self._load.shape, np.uint32), unreachable_ranks=self._unreachable,
                                  max_batch_tokens=self.max_batch_tokens)
        self._unreachable = set()
        try:
            self.link.report(report, timeout)
        except Exception as e:  # noqa: BLE001 - the agent may be gone too: the evidence is best effort
            log.warning("rank %d: could not report unreachable peers to the agent: %s", self.rank, e)
            return True
        self.stats.reports += 1
        return True

    def maybe_report(self) -> bool:
        """Once `report_every` steps of load are in, offer them to the link as one report (never blocks)."""
        if self._steps < self.report_every:
            return False
        return self._report()

    def flush(self) -> bool:
        """Offer the load added since the last report now, however few its steps (never blocks): before the
        engine's install empties its counters, so that those steps are reported under the version they ran
        on. False when no step is pending."""
        return self._steps > 0 and self._report()

    def _report(self) -> bool:
        counts = np.minimum(self._load, np.iinfo(np.uint32).max).astype(np.uint32)
        rows = None
        if self._sampled and self.sample_every > 0:
            rows = (np.minimum(np.stack(self._rows), np.iinfo(np.uint32).max).astype(np.uint32) if self._rows
                    else np.zeros((0, *counts.shape), np.uint32))
        first, end = self._first_step, self._first_step + self._steps
        times: list[float] | None = None
        strides: list[float] | None = None
        if rows is not None and len(rows):  # each sampled step: its own time and its stride's mean; all or none
            means = stride_means([self._took.get(s, 0.0) for s in range(first, end)], first, self.sample_every)
            if len(means) == len(rows) and all(x is not None for x in means):
                times = [self._took[s] for s in sample_steps(first, end - first, self.sample_every)]
                strides = [float(x or 0.0) for x in means]
        report = make_load_report(self.shim_id, self.rank, first, self._steps, self.version, counts,
                                  unreachable_ranks=self._unreachable, samples=rows, sample_every=self.sample_every,
                                  max_batch_tokens=self.max_batch_tokens, step_us=times, stride_us=strides)
        self._rows, self._sampled = [], True
        self._took = {s: t for s, t in self._took.items() if s >= end}
        self._unreachable = set()
        self.link.offer(report)
        self.stats.reports += 1
        self._first_step += self._steps
        self._steps = 0
        self._load[:] = 0
        return True
