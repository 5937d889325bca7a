"""The shim's client of its node agent's local link (gRPC over a unix socket): tables in, loads out.

`ShimLink` is the asyncio client; `LinkThread` runs one on a background thread for engines whose step
loop is synchronous: `drain()` returns the commits that arrived since the last call, `offer()` queues a
load report without ever blocking the step. No torch here: the agent imports `check_load_report`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterable, Sequence

import grpc
import numpy as np
import numpy.typing as npt

from dataplane_shim.errors import BadInput
from elasticmoe.loadcodec import RowsError, rows_bytes, sample_steps
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.v1 import dataplane_pb2 as dpb
from elasticmoe.v1 import dataplane_pb2_grpc as dgrpc
from elasticmoe.versions import WIRE_KEY, WIRE_VERSION

log = logging.getLogger(__name__)


def _quiet_shared_poller(loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
    """The links' loops' exception handler: grpc.aio shares one completion-queue poller among every event loop
    of a process (grpc/grpc#25364), so where several links run in one process (the bench's live mode, tests:
    an engine has one a rank process) a loop is woken for another loop's event, or for the loop of a link that
    has closed, and its callback raises BlockingIOError or "Event loop is closed" (seen at the bench's shutdown,
    its runs complete). This handler changes only where that traceback goes: DEBUG instead of the default
    handler's ERROR; any other exception still goes to the default handler."""
    exc, handle = context.get("exception"), repr(context.get("handle", ""))
    if "PollerCompletionQueue" in handle and isinstance(exc, (BlockingIOError, RuntimeError)):
        log.debug("grpc.aio shared poller: %r (grpc/grpc#25364)", exc)
        return
    loop.default_exception_handler(context)

_WIRE = ((WIRE_KEY, str(WIRE_VERSION)),)  # this release's wire version on every call (elasticmoe/versions.py)
MAX_UNREACHABLE = 4096  # peers one report may name: a bound on input, far above a decode pool's EP group
MAX_ERROR = 1024  # characters of a plugin's fatal error (LoadReport.error)


def check_load_report(r: dpb.LoadReport, layers: int | None = None, experts: int | None = None) -> str:
    """'' if `r` is well formed (and of shape [layers, experts] when given), else the reason."""
    if r.layers < 1 or r.experts < 1:
        return f"shape [{r.layers}, {r.experts}]: expected layers >= 1 and experts >= 1"
    if layers is not None and experts is not None and (r.layers, r.experts) != (layers, experts):
        return f"shape [{r.layers}, {r.experts}]: expected [{layers}, {experts}]"
    if len(r.counts) != r.layers * r.experts * 4:
        return (f"counts has {len(r.counts)} bytes: expected layers x experts x 4 = "
                f"{r.layers * r.experts * 4} (little-endian uint32)")
    if len(r.error) > MAX_ERROR:
        return f"error of {len(r.error)} characters: expected at most {MAX_ERROR}"
    if r.steps < 1 and not (r.steps == 0 and (r.unreachable_ranks or r.error) and not any(r.counts)):
        return (f"steps = {r.steps}: expected >= 1 (0 only in an evidence or error report: unreachable_ranks or "
                f"error set and every count zero)")
    if r.first_step + r.steps > 2**63:
        return f"first_step = {r.first_step} + steps = {r.steps}: expected <= 2^63 (a step counter overflow)"
    if len(r.unreachable_ranks) > MAX_UNREACHABLE:
        return f"unreachable_ranks has {len(r.unreachable_ranks)} entries: expected at most {MAX_UNREACHABLE}"
    bad = [g for g in r.unreachable_ranks if g < 0 or g == r.rank]
    if bad:
        return f"unreachable_ranks {bad[:4]}: expected other ranks' ids (>= 0, not this report's rank {r.rank})"
    n = len(sample_steps(r.first_step, r.steps, r.sample_every))
    if len(r.samples) != 4 * n * r.layers * r.experts:
        return (f"samples has {len(r.samples)} bytes: expected {n} sampled steps (sample_every = {r.sample_every} "
                f"over steps {r.first_step}..{r.first_step + r.steps - 1}) x {r.layers} x {r.experts} x 4")
    if r.step_us and len(r.step_us) != 4 * n * bool(r.samples):
        return (f"step_us has {len(r.step_us)} bytes: expected one little-endian uint32 per sampled step the report's "
                f"samples hold ({n if r.samples else 0} x 4)")
    if r.stride_us and len(r.stride_us) != len(r.step_us):
        return (f"stride_us has {len(r.stride_us)} bytes: expected one little-endian uint32 per sampled step its "
                f"step_us holds ({len(r.step_us) // 4} x 4)")
    return ""


def make_load_report(
    shim_id: str, rank: int, first_step: int, steps: int, version: int, counts: npt.ArrayLike,
    stale_dispatches: int = 0, dropped_tokens: int = 0, unreachable_ranks: Iterable[int] = (),
    samples: npt.ArrayLike | None = None, sample_every: int = 0, error: str = "", max_batch_tokens: int = 0,
    step_us: npt.ArrayLike | None = None, stride_us: npt.ArrayLike | None = None,
) -> dpb.LoadReport:
    """A LoadReport for uint32 counts [L, E] summed over `steps` steps starting at `first_step`;
    `unreachable_ranks`: peers this rank's collectives or dispatch could not reach since its last report;
    `samples` [n, L, E]: the counts of the sampled steps in the range (every `sample_every`-th global step,
    elasticmoe.loadcodec), or None (sample_every is then sent as 0); `max_batch_tokens`: the most tokens one
    step of the engine carries into the counts (0: not declared; the agent bounds the counts by it); `step_us` [n]:
    the engine's wall time of each sampled step in microseconds (with `samples` only; None: not measured);
    `stride_us` [n]: the mean wall time of the steps each stands for (elasticmoe.loadcodec.stride_means; with
    `step_us` only)."""
    c = np.asarray(counts)
    if c.ndim != 2 or c.dtype.kind not in "iu" or (c < 0).any() or (c > np.iinfo(np.uint32).max).any():
        raise BadInput(f"counts shape {c.shape} dtype {c.dtype}: expected uint32 [layers, experts]")
    r = dpb.LoadReport(
        shim_id=shim_id, rank=rank, first_step=first_step, steps=steps, version=version,
        layers=c.shape[0], experts=c.shape[1], counts=c.astype("<u4").tobytes(),
        stale_dispatches=stale_dispatches, dropped_tokens=dropped_tokens,
        unreachable_ranks=sorted(set(int(g) for g in unreachable_ranks)), error=error[:MAX_ERROR],
        max_batch_tokens=max_batch_tokens,
    )
    if samples is not None and sample_every > 0:
        try:
            r.samples, r.sample_every = rows_bytes(samples), sample_every
        except RowsError as e:
            raise BadInput(str(e)) from None
        if step_us is not None:
            t = np.rint(np.asarray(step_us, dtype=np.float64).reshape(-1))
            r.step_us = np.clip(t, 0, np.iinfo(np.uint32).max).astype("<u4").tobytes()
            if stride_us is not None:
                t = np.rint(np.asarray(stride_us, dtype=np.float64).reshape(-1))
                r.stride_us = np.clip(t, 0, np.iinfo(np.uint32).max).astype("<u4").tobytes()
    reason = check_load_report(r)
    if reason:
        raise BadInput(reason)
    return r


class ShimLink:
    """asyncio client of `elasticmoe.v1.DataplaneLink` at `unix:{socket_path}`."""

    def __init__(self, socket_path: str, *, shim_id: str = "", ranks: Sequence[int] = ()) -> None:
        self.shim_id, self.ranks = shim_id, list(ranks)
        self._channel = grpc.aio.insecure_channel(f"unix:{socket_path}")
        self._stub = dgrpc.DataplaneLinkStub(self._channel)  # type: ignore[no-untyped-call]

    async def watch_tables(self, from_version: int) -> AsyncIterator[cpb.Commit]:
        """Every certified commit with version > from_version, then each new one, in order."""
        call = self._stub.WatchTables(
            dpb.WatchTablesRequest(from_version=from_version, shim_id=self.shim_id, ranks=self.ranks), metadata=_WIRE)
        try:
            async for update in call:
                yield update.commit
        finally:
            call.cancel()

    async def report_load(self, reports: dpb.LoadReport | Iterable[dpb.LoadReport]) -> dpb.ReportLoadAck:
        """Send one or more reports on one client stream; raises grpc.aio.AioRpcError (INVALID_ARGUMENT)."""
        items = [reports] if isinstance(reports, dpb.LoadReport) else list(reports)
        ack: dpb.ReportLoadAck = await self._stub.ReportLoad(iter(items), metadata=_WIRE)
        return ack

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> ShimLink:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class LinkThread:
    """A ShimLink on its own thread and event loop, for a synchronous engine loop.

    `drain()` returns the certified commits that arrived since the last call; `offer(report)` hands a load
    report to the sender and returns at once: when `queue_size` reports already wait (a slow agent) or the
    send fails (an absent one) the report is dropped and counted in `dropped`, and the next report that
    goes through carries that count in `dropped_reports`. The watch reconnects with backoff and resumes
    after the last version it delivered. A step never waits on the agent, nor wakes the link's thread: `offer`
    appends to a deque that the sender polls every `poll_s` (a wake-up per report cost the engine's thread
    hundreds of microseconds of GIL hand-over on a busy host, more than the report itself)."""

    def __init__(self, socket_path: str, from_version: int, *, shim_id: str = "", ranks: Sequence[int] = (),
                 queue_size: int = 64, retry_s: tuple[float, float] = (0.05, 2.0), poll_s: float = 0.02) -> None:
        self._commits: queue.SimpleQueue[cpb.Commit] = queue.SimpleQueue()
        self._outbox: collections.deque[dpb.LoadReport] = collections.deque()  # appended by the engine's thread
        self._poll_s = poll_s
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.errors: list[BaseException] = []  # the last few link errors (bounded), for diagnostics
        self.sent = 0
        # the step the agent said this engine should go on from (its reports were for windows it had closed:
        # the engine restarted and counts from 0); 0: none. Written by the link's thread, read by the engine's
        self.next_step = 0
        # the step the engine last renumbered to (`go_on_from`): the acks of reports numbered before it are about
        # the old count and say nothing of the new one (a late one would renumber every rank a second time)
        self._renumbered_to = 0
        self._overflowed = 0  # reports refused by `offer` (the engine's thread)
        self._failed = 0      # reports whose send failed (the link's thread)
        self._queue_size, self._retry_s = queue_size, retry_s
        self._args = (socket_path, from_version, shim_id, list(ranks))
        self._thread = threading.Thread(target=self._run, name=f"shim-link-{shim_id}", daemon=True)
        self._thread.start()
        self._ready.wait(5.0)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.set_exception_handler(_quiet_shared_poller)
        path, v, shim_id, ranks = self._args
        self.link = ShimLink(path, shim_id=shim_id, ranks=ranks)
        self._watch = self._loop.create_task(self._pump(v))
        self._sender = self._loop.create_task(self._send())
        self._ready.set()
        self._loop.run_forever()

    def _error(self, exc: BaseException) -> None:
        self.errors = [*self.errors[-7:], exc]

    async def _pump(self, v: int) -> None:
        delay = self._retry_s[0]
        while True:
            try:
                async for c in self.link.watch_tables(v):
                    self._commits.put(c)
                    v = c.table.version
                    delay = self._retry_s[0]
            except grpc.aio.AioRpcError as exc:
                self._error(exc)
            await asyncio.sleep(delay)  # the stream ended (agent restarting): resume after v
            delay = min(self._retry_s[1], delay * 2)

    async def _send(self) -> None:
        while True:
            if not self._outbox:
                await asyncio.sleep(self._poll_s)
                continue
            r = self._outbox.popleft()
            r.dropped_reports = self.dropped
            try:
                ack = await self.link.report_load(r)
                self.sent += 1
                if r.first_step >= self._renumbered_to:
                    self.next_step = max(self.next_step, int(ack.next_step))
            except grpc.aio.AioRpcError as exc:
                self._failed += 1
                self._error(exc)

    def drain(self) -> list[cpb.Commit]:
        out: list[cpb.Commit] = []
        while True:
            try:
                out.append(self._commits.get_nowait())
            except queue.Empty:
                return out

    @property
    def dropped(self) -> int:
        """Reports dropped: refused while `queue_size` waited, or whose send failed (one counter per thread)."""
        return self._overflowed + self._failed

    def go_on_from(self, step: int) -> None:
        """The engine numbers its steps from `step` now: the acks of reports numbered before it are ignored
        (what a report of the old count is told to go on from is about windows the new count is already past)."""
        self._renumbered_to = max(self._renumbered_to, step)

    def offer(self, report: dpb.LoadReport) -> None:
        """Queue `report` for the agent without waiting (dropped and counted if the agent lags)."""
        if len(self._outbox) >= self._queue_size:
            self._overflowed += 1
        else:
            self._outbox.append(report)

    def report(self, report: dpb.LoadReport, timeout: float = 5.0) -> dpb.ReportLoadAck:
        """Send `report` and wait for the agent's ack (the engine's last word, tests and tools; an engine step
        uses `offer`)."""
        fut = asyncio.run_coroutine_threadsafe(self.link.report_load(report), self._loop)
        return fut.result(timeout)

    def close(self) -> None:
        """Stop the watch and the sender and the loop's thread; idempotent."""
        if self._loop.is_closed():
            return

        async def stop() -> None:
            for task in (self._watch, self._sender):
                task.cancel()
            await asyncio.gather(self._watch, self._sender, return_exceptions=True)
            await self.link.close()
            # gRPC's own tasks of the calls just ended (their status handling): finished here, not destroyed
            # pending when the loop closes ("Task was destroyed but it is pending!" at exit)
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        self._loop.close()
