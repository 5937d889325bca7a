"""Invariant checks and the engine client of the real-process chaos runner (chaos.procrunner).

Histories come from the agents' own store files (`data/consensus`, agent.storage.store framing; read-only, a torn
tail is ignored exactly as recovery ignores it) and from what each engine's shim was streamed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import grpc
import numpy as np

from agent.storage.store import parse
from agent.wire import plan_kind
from chaos.realised import realised_worse
from controlplane.table import RoutingTable
from controlplane.topology import Topology
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import admin_pb2_grpc
from elasticmoe.v1 import consensus_pb2 as cpb

INVARIANTS = ("I1", "I2", "I3", "I4", "I5", "I6", "I7")


def read_log(path: Path) -> list[cpb.Commit]:
    """The committed tables in a store file, in log order ([] if there is none yet)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return parse(data)[0].commits


def versions(commits: list[cpb.Commit]) -> dict[int, bytes]:
    """version -> table content hash."""
    return {c.table.version: bytes(c.table.content_hash) for c in commits}


async def agent_head(channel: grpc.aio.Channel, timeout: float = 1.0) -> int | None:
    """The agent's committed version (Admin Status), None if it does not answer in time."""
    try:
        r = await admin_pb2_grpc.AdminStub(channel).Status(apb.StatusRequest(), timeout=timeout)
    except (TimeoutError, grpc.aio.AioRpcError):
        return None
    return int(r.committed_version)


def _is_rebalance(plan: cpb.Plan) -> bool:
    """A plan the decision core chose on load (not a rollback, repair or operator's plan)."""
    return plan_kind(plan) == "rebalance"


class Checks:
    """Violations, each counted once by a key naming it (node, version, ...)."""

    def __init__(self, topo: Topology, voters: list[str], tau: float = 0.02) -> None:
        self.topo, self.voters, self.tau = topo, voters, tau
        self.found: dict[str, set[str]] = {k: set() for k in INVARIANTS}
        self.details: list[str] = []
        self.max_version = 1
        self._valid: dict[tuple[int, bytes], str] = {}  # (version, hash) -> "" or why invalid
        self.tables: dict[int, RoutingTable] = {}  # valid committed tables by version
        self.triggers: dict[int, tuple[str, float, bool]] = {}  # version -> (trigger, verified gain, rebalance?)
        self.kinds: dict[int, str] = {}  # version -> plan kind (rebalance, repair, rollback, restore, manual, ...)
        self.installed_at: dict[int, float] = {}  # version -> when an engine first installed it (monotonic)
        self.i6_judged = 0

    def note(self, inv: str, key: str, detail: str = "") -> None:
        if key not in self.found[inv]:
            self.found[inv].add(key)
            self.details.append(f"{inv}: {detail or key}")

    def violations(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.found.items()}

    def summary(self) -> str:
        return f"violations {self.violations()}"

    def table(self, commit: cpb.Commit) -> tuple[RoutingTable | None, str]:
        """Decode, certify (voters, quorum, hash) and validate; cached per (version, hash)."""
        from dataplane_shim.certify import table_from_commit

        key = (commit.table.version, bytes(commit.table.content_hash))
        try:
            t = table_from_commit(commit, self.topo, self.voters)
            t.validate()
        except Exception as e:  # Uncertified, InvalidTable: both are I3 violations
            self._valid[key] = str(e)
            return None, str(e)
        self._valid[key] = ""
        self.tables[t.version] = t
        return t, ""

    def logs(self, by_node: dict[str, list[cpb.Commit]]) -> None:
        """I1 across nodes, I2 per node, I3 per committed table."""
        chosen: dict[int, set[bytes]] = {}
        for node, commits in by_node.items():
            prev: int | None = None
            for c in commits:
                v, h = c.table.version, bytes(c.table.content_hash)
                chosen.setdefault(v, set()).add(h)
                self.max_version = max(self.max_version, v)
                if c.table.parent != v - 1 or (prev is not None and not (v > prev and c.table.parent == prev)):
                    self.note("I2", f"{node}:{v}", f"{node} log: v{v} (parent {c.table.parent}) after v{prev}")
                elif prev is None and c.table.parent != 1:
                    self.note("I2", f"{node}:{v}", f"{node} log starts at v{v} (parent {c.table.parent}), not after v1")
                prev = v
                if (v, h) not in self._valid:
                    self.table(c)
                if self._valid[(v, h)]:
                    self.note("I3", f"{v}:{h.hex()}", f"v{v}: {self._valid[(v, h)]}")
                trig, gain = c.plan.trigger, float(c.plan.verified_gain)
                self.triggers[v] = (trig, gain, _is_rebalance(c.plan))
                self.kinds[v] = plan_kind(c.plan)
                if _is_rebalance(c.plan) and gain < self.tau - 1e-12:
                    self.note("I6", f"gain:{v}", f"v{v} committed a rebalance with verified gain {gain:.4f} < tau "
                                                 f"{self.tau} ({trig!r})")
        for v, hs in chosen.items():
            if len(hs) > 1:
                self.note("I1", str(v), f"v{v}: {len(hs)} different tables committed")

    def realised(self, genesis: RoutingTable, windows: dict[int, np.ndarray], t0: float, span: float,
                 faulty: list[tuple[float, float]], n: int, grace: int, margin: float = 0.05,
                 now: float = float("inf")) -> None:
        """I6, realised effect: a committed rebalance whose step imbalance over the `n` windows from the first
        that starts after its first install (the load the engines reported, `windows[seq]` summed over engines;
        window seq starts at t0 + seq x span) is worse than its parent's by more than `margin` must be
        superseded (rolled back, or replaced by a later commit) within `n + grace` windows, unless over the last `n` windows before that deadline it is no
        longer worse by `margin` (the load moved). Judged only when no fault was active in that span (`faulty`
        intervals: cut off from a quorum, no rollback can commit) and once the deadline is past `now` (a
        rollback may still come). The rule of chaos.invariants.check_i6; these windows are on the engines'
        fixed clock, so the deadline is a time and cannot be swallowed by a burst of window closes."""
        tables = {genesis.version: genesis, **self.tables}
        for v in sorted(self.tables):
            rebalance = self.triggers.get(v, ("", 0.0, False))[2]
            t, parent = self.installed_at.get(v), tables.get(v - 1)
            if not rebalance or t is None or parent is None:
                continue
            first = int(np.ceil((t - t0) / span))  # the first window that starts after the install
            deadline = t0 + (first + n + grace) * span
            seqs = list(range(first, first + n))
            if (deadline > now or any(a < deadline and b > t for a, b in faulty)
                    or not all(k in windows for k in seqs)):
                continue
            self.i6_judged += 1
            late = [windows[k] for k in range(first + grace, first + grace + n) if k in windows]
            worse = realised_worse(tables[v], parent, [windows[k] for k in seqs], late, margin)
            # rolled back or replaced by a later commit (chaos.invariants.check_i6)
            if worse is not None and not any(w > v and at <= deadline for w, at in self.installed_at.items()):
                self.note("I6", f"realised:{v}", worse.message(v, n, grace))

    def restart(self, node: str, before: dict[int, bytes], acked: int | None, after: dict[int, bytes],
                acked_after: int | None) -> None:
        """I7: every commit on disk at the kill is there after the restart, and the head did not regress."""
        lost = sorted(v for v, h in before.items() if after.get(v) != h)
        if lost:
            self.note("I7", f"{node}:{lost[0]}", f"{node}: v{lost} lost across kill -9")
        if acked is not None and (acked_after is None or acked_after < acked):
            self.note("I7", f"{node}:head{acked}", f"{node}: acknowledged head v{acked}, after restart {acked_after}")

    def install(self, engine: str, commit: cpb.Commit, head: int) -> RoutingTable | None:
        """An engine's shim was streamed `commit` while running `head`: I2 (in order), I3 (certified, valid)."""
        t, why = self.table(commit)
        v = commit.table.version
        if t is None:
            self.note("I3", f"{engine}:{v}", f"{engine}: streamed v{v}: {why}")
            return None
        if not (v > head and t.parent == head):
            self.note("I2", f"{engine}:{v}", f"{engine}: streamed v{v} (parent {t.parent}) while at v{head}")
        self.installed_at.setdefault(v, time.monotonic())
        return t


class EngineClock(Protocol):
    """What the engine client needs of its runner (chaos.procrunner.ProcRunner): the engines' shared step clock,
    the load each window is given, and where the reported load is summed."""

    t0: float
    windows: dict[int, np.ndarray]
    reporters: dict[int, int]

    def counts(self, rng: np.random.Generator, steps: int) -> np.ndarray: ...


class Engine:
    """One node's engine: a shim client that reports skewed load each window and installs what it is
    streamed, re-connecting (bounded waits) when its agent is killed or paused."""

    def __init__(self, i: int, sock: str, topo: Topology, checks: Checks, runner: EngineClock,
                 step_s: float = 0.01, window: int = 10) -> None:
        self.i, self.sock, self.topo, self.checks, self.runner = i, sock, topo, checks, runner
        self.name = f"engine{i}"
        self.step_s, self.window = step_s, window
        self.backlog = 64
        self.head = 1
        self.installs = 0
        self.stop = False
        self.rng = np.random.default_rng(1000 + i)
        self.pending: list[cpb.Commit] = []  # streamed, not yet handed to the data plane's shims

    async def run(self) -> None:
        await asyncio.gather(self._watch(), self._report())

    async def _watch(self) -> None:
        from dataplane_shim.link import ShimLink

        while not self.stop:
            link = ShimLink(self.sock, shim_id=self.name)
            try:
                async for commit in link.watch_tables(self.head):
                    t = self.checks.install(self.name, commit, self.head)
                    if t is not None and t.version > self.head:
                        self.head = t.version
                        self.installs += 1
                        self.pending.append(commit)
            except grpc.aio.AioRpcError:
                pass
            finally:
                await link.close()
            await asyncio.sleep(0.2)  # the agent is down or restarting: try again

    async def _report(self) -> None:
        """A report per window of `window` steps; steps follow the runner's shared clock (EP engines step in
        lockstep, whatever their agent does), so every engine numbers a window alike. Like a real shim's
        client stream, reports queue while the agent does not take them (paused, restarting) and go out in
        order when it does (at most `backlog` kept)."""
        from dataplane_shim.link import ShimLink, make_load_report

        link = ShimLink(self.sock, shim_id=self.name)
        span = self.step_s * self.window
        done = int((time.monotonic() - self.runner.t0) / span)  # windows before this engine started: skipped
        pending: list[Any] = []
        try:
            while not self.stop:
                now_seq = int((time.monotonic() - self.runner.t0) / span)
                await asyncio.sleep(max(0.0, self.runner.t0 + (now_seq + 1) * span - time.monotonic()))
                now_seq += 1
                for seq in range(done, now_seq):
                    counts = self.runner.counts(self.rng, self.window)
                    total = self.runner.windows.setdefault(seq, np.zeros(counts.shape, np.uint64))
                    total += counts
                    self.runner.reporters[seq] = self.runner.reporters.get(seq, 0) + 1
                    pending.append(make_load_report(self.name, self.i, seq * self.window, self.window, self.head,
                                                    counts))
                done = now_seq
                del pending[:-self.backlog]
                try:
                    await asyncio.wait_for(link.report_load(list(pending)), 1.0)
                    pending.clear()
                except (TimeoutError, grpc.aio.AioRpcError):
                    await link.close()
                    link = ShimLink(self.sock, shim_id=self.name)
        finally:
            await link.close()


class DataPlane:
    """The engines' tokens, so that I4 is checked against real agents: each engine's ranks have a Shim
    (shared version counters, as the ranks of one EP group have) that installs what the engine's agent
    streamed it, a few slots at a time, with a mover writing the rank's real expert memory. Every step each
    rank sends its tokens to the other ranks' shims (chaos/tokens.py); a token accepted by a slot whose
    memory does not hold its expert is an I4 violation. The engines outlive their agents (kill -9 and
    SIGSTOP hit the agent process), so no rank dies here; the sim runner covers rank loss."""

    def __init__(self, engines: list[Engine], genesis: RoutingTable, step_s: float = 0.05,
                 tokens_per_step: int = 32, seed: int = 0) -> None:
        from chaos.tokens import Fabric, Retries, TokenStats, rank_shim
        from dataplane_shim.counters import DeviceCounters
        from dataplane_shim.shim import Shim

        topo = genesis.topology
        R, S = topo.ranks_per_node, topo.slots_per_rank
        self.engines, self.step_s, self.tokens = engines, step_s, tokens_per_step
        self.layers, self.experts = genesis.layers, genesis.experts
        self.rng = np.random.default_rng(seed)
        self.stats = TokenStats()
        self.steps = 0
        self.stop = False
        counters = DeviceCounters(topo.ranks)
        self.mem: dict[int, np.ndarray] = {}
        self.shims: dict[int, Shim] = {}
        self.ranks: dict[int, list[int]] = {e.i: list(range(e.i * R, (e.i + 1) * R)) for e in engines}
        for g in range(topo.ranks):
            self.shims[g], self.mem[g] = rank_shim(genesis, g, counters)
        self.retries = {g: Retries() for g in self.shims}
        self.fabric = Fabric(S, self.shims.get, self.mem.__getitem__, self.stats, time.monotonic)

    def step(self, hot: np.ndarray) -> None:
        from chaos.tokens import route_step

        p = np.ones(self.experts)
        p[hot] = 10.0
        p /= p.sum()
        for e in self.engines:
            commits, e.pending = e.pending, []
            for g in self.ranks[e.i]:
                shim = self.shims[g]
                shim.begin_step(commits, stage_limit=int(self.rng.choice((1, 2, 4, 64))))
                share = np.stack([self.rng.multinomial(self.tokens, p) for _ in range(self.layers)]).astype(np.int64)
                route_step(self.fabric, g, shim, share, self.retries[g], set())
                shim.end_step()
        self.steps += 1

    async def run(self, hot: Callable[[], np.ndarray]) -> None:
        while not self.stop:
            await asyncio.sleep(self.step_s)
            self.step(hot())

    def report(self, checks: Checks) -> dict[str, int]:
        st = self.stats
        if st.i4:
            checks.note("I4", "i4", f"{st.i4} tokens accepted by slots whose memory does not hold their expert "
                                    f"(e.g. {st.i4_examples[:2]})")
        if st.misrouted:
            checks.note("I4", "misrouted", f"{st.misrouted} tokens dispatched to ranks the sender had declared dead")
        return {"steps": self.steps, "sent": st.sent, "served": st.served, "nacked": st.nacked, "i4": st.i4,
                "dropped": st.dropped, "installed": min(s.version for s in self.shims.values())}
