"""OffLoopPlanner: the agent computes its rebalances, repairs, rollbacks and fills on a worker thread, not on its
event loop.

A plan at DeepSeek-V3 size (58 layers x 256 experts, 64 ranks) takes about a third of a second of CPU
(`python -m bench.planner`). On the event loop that is a third of a second in which the node answers no probe
(gossip.probe_timeout_ms is 100 by default: its peers suspect it), no vote and no engine report. The
decision is a pure function of a snapshot (controlplane.decision.PlanRequest), so it runs on one worker
thread here and its Attempt comes back to the loop, where the controller takes it as PlanReady (or drops it as
STALE_PLAN when the head moved meanwhile). The interpreter lets the loop's thread in between (every 5 ms of
a plan's Python at most, sys.getswitchinterval), so the loop answers within milliseconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from agent.decision.pipeline import failed_plan
from controlplane.decision import Attempt
from controlplane.requests import PlanRequest

log = logging.getLogger(__name__)


class OffLoopPlanner:
    """A `DecisionPipeline.run_plan` for the agent: one plan at a time on a thread of its own (the controller
    asks for one at a time; a repair that supersedes a rebalance still computing waits behind it), its answer
    handed to `done` on the event loop that asked. Called with no event loop running (a test driving the
    pipeline by hand), it plans at once. A planner that raises is logged with its traceback and answered
    PLANNER_ERROR; after `close`, answers are dropped."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self.pending: Future[Attempt] | None = None  # the plan being computed, if any (tests wait on it)

    def __call__(self, request: PlanRequest, done: Callable[[Attempt], None]) -> None:
        if self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            done(request.run())
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"emoe-plan-{self._name}")
        fut = self._pool.submit(request.run)
        self.pending = fut

        def answer(f: Future[Attempt]) -> None:
            if self._closed or f.cancelled():
                return
            err = f.exception()
            if err is not None:
                log.error("%s: the planner raised on window %d", self._name, request.seq, exc_info=err)
                done(failed_plan(request, err))
            else:
                done(f.result())

        def back(f: Future[Attempt]) -> None:  # on the worker thread
            try:
                loop.call_soon_threadsafe(answer, f)
            except RuntimeError:  # the loop closed meanwhile: nobody is left to answer
                pass

        fut.add_done_callback(back)

    def close(self) -> None:
        """Drop answers from now on; a plan being computed finishes on its thread and is not waited for."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
