"""The agent's plans run on a worker thread: its event loop keeps running meanwhile, and each answer comes
back on the loop (agent.decision.offloop.OffLoopPlanner)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest

from agent.decision.offloop import OffLoopPlanner
from controlplane.decision import Attempt


class _Request:
    """A PlanRequest's two members the runner uses: `seq` and `run`."""

    def __init__(self, run: Callable[[], Attempt], seq: int = 7) -> None:
        self.seq, self.run = seq, run


def _plan(p: OffLoopPlanner, req: _Request, done: Callable[[Attempt], None]) -> None:
    p(req, done)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_the_loop_runs_while_a_plan_is_computed_and_the_answer_comes_back_on_it() -> None:
    started, release = threading.Event(), threading.Event()

    def run() -> Attempt:
        started.set()
        released = release.wait(10)  # only the event loop sets it: a plan run on the loop would wait 10 s
        return Attempt(None, "NO_PLAN", f"released={released}")

    loop = asyncio.get_running_loop()
    answered: asyncio.Future[tuple[Attempt, threading.Thread]] = loop.create_future()
    p = OffLoopPlanner("n1")
    _plan(p, _Request(run), lambda a: answered.set_result((a, threading.current_thread())))
    assert await asyncio.to_thread(started.wait, 10)
    assert not answered.done()
    release.set()  # the loop runs while the plan waits
    a, thread = await asyncio.wait_for(answered, 10)
    assert a.detail == "released=True" and thread is threading.main_thread()
    p.close()


@pytest.mark.asyncio
async def test_a_planner_that_raises_is_answered_planner_error_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    def run() -> Attempt:
        raise ValueError("bad shape")

    answered: asyncio.Future[Attempt] = asyncio.get_running_loop().create_future()
    p = OffLoopPlanner("n1")
    with caplog.at_level(logging.ERROR, logger="agent"):
        _plan(p, _Request(run), answered.set_result)
        a = await asyncio.wait_for(answered, 10)
    assert a.decision is None and a.outcome == "PLANNER_ERROR" and "ValueError: bad shape" in a.detail
    assert "the planner raised on window 7" in caplog.text and "bad shape" in caplog.text
    p.close()


@pytest.mark.asyncio
async def test_after_close_an_answer_is_dropped() -> None:
    release = threading.Event()
    got: list[Any] = []
    p = OffLoopPlanner("n1")
    _plan(p, _Request(lambda: (release.wait(10), Attempt(None, "NO_PLAN"))[1]), got.append)
    pending = p.pending
    assert pending is not None
    p.close()
    release.set()
    await asyncio.wait_for(asyncio.wrap_future(pending), 10)  # the plan finished on its thread ...
    for _ in range(5):
        await asyncio.sleep(0.01)
    assert got == []  # ... and nobody was answered
    _plan(p, _Request(lambda: Attempt(None, "NO_PLAN")), got.append)  # nor asked, once closed
    await asyncio.sleep(0.05)
    assert got == []


def test_without_a_running_loop_it_plans_at_once() -> None:
    got: list[tuple[Attempt, threading.Thread]] = []
    p = OffLoopPlanner("n1")
    _plan(p, _Request(lambda: Attempt(None, "NO_PLAN")), lambda a: got.append((a, threading.current_thread())))
    assert len(got) == 1 and got[0][0].outcome == "NO_PLAN" and got[0][1] is threading.main_thread()
    assert p.pending is None
