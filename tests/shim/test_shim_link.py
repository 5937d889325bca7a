"""Local link: the agent's DataplaneLink servicer and the shim's client over a real unix socket."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
import pytest_asyncio

from agent.link.shim_link import serve_unix
from controlplane.table import initial_table
from controlplane.topology import Topology
from dataplane_shim.certify import certified_commit, table_from_commit
from dataplane_shim.link import LinkThread, ShimLink, make_load_report
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.v1 import dataplane_pb2 as dpb

TOPO = Topology(1, 2, 3)


class Source:
    def __init__(self) -> None:
        self.commits: list[cpb.Commit] = []
        self.event = asyncio.Event()

    def commit(self, version: int) -> None:
        t = initial_table(TOPO, 2, 4).with_version(version, version - 1)
        self.commits.append(certified_commit(t, ["a", "b"], 2))
        self.event.set()

    def head(self) -> int:
        return self.commits[-1].table.version if self.commits else 0

    def head_version(self) -> int:
        return self.head()

    def commits_since(self, version: int) -> list[cpb.Commit]:
        return [c for c in self.commits if c.table.version > version]

    async def wait_for_newer(self, version: int) -> None:
        while self.head() <= version:
            self.event.clear()
            await self.event.wait()


@pytest_asyncio.fixture
async def served() -> AsyncIterator[tuple[str, Source, list[dpb.LoadReport]]]:
    d = tempfile.mkdtemp(prefix="emoe-")
    path = os.path.join(d, "shim.sock")
    src, got = Source(), []
    server = await serve_unix(path, src, got.append, layers=2, experts=4)
    yield path, src, got
    await server.stop(None)
    if os.path.exists(path):
        os.unlink(path)
    os.rmdir(d)


@pytest.mark.asyncio
async def test_watch_tables_catches_up_then_streams_new_commits(served: tuple[str, Source, list]) -> None:
    path, src, _ = served
    for v in (1, 2, 3):
        src.commit(v)
    async with ShimLink(path, shim_id="r0") as link:
        stream = link.watch_tables(1)
        seen = [(await anext(stream)).table.version for _ in range(2)]
        src.commit(4)
        seen.append((await asyncio.wait_for(anext(stream), 5)).table.version)
        await stream.aclose()
    assert seen == [2, 3, 4]
    assert table_from_commit(src.commits[-1], TOPO).version == 4  # what arrives is certified


@pytest.mark.asyncio
async def test_a_watch_from_before_genesis_waits_instead_of_spinning(tmp_path: object) -> None:
    """The genesis table (v1) has no commit record: a stream from version 0 must wait for v2, not ask again and
    again (it did: every wait for "newer than 0" returned at once, a busy loop in the agent)."""
    class Genesis(Source):
        calls = 0

        def head(self) -> int:  # the agent's head is genesis (v1) before any commit
            return max(1, super().head())

        def commits_since(self, version: int) -> list[cpb.Commit]:
            Genesis.calls += 1
            return super().commits_since(version)

    d = tempfile.mkdtemp(prefix="emoe-")
    path = os.path.join(d, "shim.sock")
    src = Genesis()
    server = await serve_unix(path, src, lambda r: None, layers=2, experts=4)
    try:
        async with ShimLink(path, shim_id="r0") as link:
            stream = link.watch_tables(0)
            first = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.5)
            assert Genesis.calls <= 2 and not first.done()
            src.commit(2)
            assert (await asyncio.wait_for(first, 5)).table.version == 2
            await stream.aclose()
    finally:
        await server.stop(None)


@pytest.mark.asyncio
async def test_report_load_delivers_good_reports_and_refuses_bad_ones(served: tuple[str, Source, list]) -> None:
    path, _, got = served
    counts = np.arange(8, dtype=np.uint32).reshape(2, 4)
    good = make_load_report("r0", 0, 0, 1, 1, counts)
    async with ShimLink(path) as link:
        ack = await link.report_load([good, good])
        assert ack.accepted == 2 and len(got) == 2
        assert np.frombuffer(got[0].counts, "<u4").reshape(2, 4).tolist() == counts.tolist()
        short = dpb.LoadReport(shim_id="r0", steps=1, layers=2, experts=4, counts=b"\0" * 31)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await link.report_load(short)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "31 bytes" in (err.value.details() or "")
        wrong = make_load_report("r0", 0, 0, 1, 1, np.zeros((3, 4), np.uint32))
        with pytest.raises(grpc.aio.AioRpcError, match=r"expected \[2, 4\]"):
            await link.report_load(wrong)
    assert len(got) == 2  # bad reports changed nothing


@pytest.mark.asyncio
async def test_link_thread_serves_a_synchronous_engine(served: tuple[str, Source, list]) -> None:
    path, src, got = served
    src.commit(1)
    lt = await asyncio.to_thread(LinkThread, path, 0, shim_id="r1")
    try:
        seen: list[int] = []
        for _ in range(200):  # bounded poll: the thread streams in the background
            seen += [c.table.version for c in lt.drain()]
            if seen:
                break
            await asyncio.sleep(0.01)
        assert seen == [1]
        ack = await asyncio.to_thread(lt.report, make_load_report("r1", 1, 0, 1, 1, np.ones((2, 4), np.uint32)))
        assert ack.accepted == 1 and got[-1].rank == 1
    finally:
        await asyncio.to_thread(lt.close)
    assert not lt.errors


@pytest.mark.asyncio
async def test_offer_never_blocks_and_counts_what_it_drops(served: tuple[str, Source, list]) -> None:
    """An absent agent: offers return at once and are counted as dropped; once the agent is there, the next
    report goes through carrying the count."""
    path, _, got = served
    d = tempfile.mkdtemp(prefix="emoe-")
    absent = await asyncio.to_thread(LinkThread, os.path.join(d, "nobody.sock"), 0, shim_id="r0")
    try:
        t0 = asyncio.get_running_loop().time()
        for step in range(5):
            absent.offer(make_load_report("r0", 0, step, 1, 1, np.ones((2, 4), np.uint32)))
        assert asyncio.get_running_loop().time() - t0 < 0.05  # the step did not wait
        for _ in range(500):
            if absent.dropped == 5:
                break
            await asyncio.sleep(0.01)
        assert absent.dropped == 5 and absent.sent == 0 and absent.errors
    finally:
        await asyncio.to_thread(absent.close)
        await asyncio.to_thread(absent.close)  # idempotent
        os.rmdir(d)
    lt = await asyncio.to_thread(LinkThread, path, 0, shim_id="r1", queue_size=2)
    try:
        lt._failed = 3  # as if three earlier sends had failed
        lt.offer(make_load_report("r1", 1, 0, 1, 1, np.ones((2, 4), np.uint32)))
        for _ in range(500):
            if got and lt.sent:  # the agent has it, and the sender saw its ack
                break
            await asyncio.sleep(0.01)
        assert got[-1].dropped_reports == 3 and lt.sent == 1
        # a full outbox drops at once instead of waiting: stop the sender, then offer more than it holds
        lt._loop.call_soon_threadsafe(lt._sender.cancel)
        for step in range(5):
            lt.offer(make_load_report("r1", 1, step, 1, 1, np.ones((2, 4), np.uint32)))
        for _ in range(500):
            if lt.dropped == 3 + 3:
                break
            await asyncio.sleep(0.01)
        assert lt.dropped == 6
    finally:
        await asyncio.to_thread(lt.close)


def test_what_the_agent_imports_needs_no_torch() -> None:
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch blocked for this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import agent.link.shim_link, dataplane_shim, dataplane_shim.link, dataplane_shim.certify\n"
        "import dataplane_shim.counters, dataplane_shim.adapters, dataplane_shim.errors\n"
        "print('ok')\n"
    )
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_the_shared_grpc_poller_noise_goes_to_debug_and_other_errors_to_the_default_handler(
        caplog: pytest.LogCaptureFixture) -> None:
    """grpc.aio's one poller wakes every loop of the process (grpc/grpc#25364): several links in one process
    (bench --live) get BlockingIOError / "Event loop is closed" from PollerCompletionQueue._handle_events. The
    links' handler logs those at DEBUG; anything else still reaches asyncio's default handler (ERROR)."""
    import logging

    from dataplane_shim.link import _quiet_shared_poller

    class Handle:
        def __repr__(self) -> str:
            return "<Handle PollerCompletionQueue._handle_events(<_UnixSelectorEventLoop running=True>)()>"

    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.DEBUG):
            for exc in (RuntimeError("Event loop is closed"), BlockingIOError(11, "Resource temporarily unavailable")):
                _quiet_shared_poller(loop, {"message": "Exception in callback", "exception": exc, "handle": Handle()})
            _quiet_shared_poller(loop, {"message": "Exception in callback", "exception": ValueError("mine"),
                                        "handle": "<Handle my_callback()>"})
    finally:
        loop.close()
    quiet = [r for r in caplog.records if r.name == "dataplane_shim.link"]
    assert [r.levelno for r in quiet] == [logging.DEBUG, logging.DEBUG], quiet
    loud = [r for r in caplog.records if r.name == "asyncio"]
    assert len(loud) == 1 and loud[0].levelno == logging.ERROR and "mine" in str(loud[0].exc_info[1])


@pytest.mark.asyncio
async def test_an_ack_of_a_report_numbered_before_a_renumbering_does_not_renumber_again() -> None:
    """A restarted engine's early reports (numbered from 0) are told to go on from 180; every rank renumbers to
    180. A report of the old count acked after that (sent late, or acked after the agent closed one more
    window) is told 200: that says nothing of the new count and must not renumber a second time. A report of
    the new count still can."""
    d = tempfile.mkdtemp(prefix="emoe-")
    path = os.path.join(d, "shim.sock")
    said = {0: 200, 180: 240}  # the agent's answer by the report's first step (0: before the renumbering)
    server = await serve_unix(path, Source(), lambda r: said[0 if r.first_step < 180 else 180], layers=2, experts=4)
    links: list[LinkThread] = []

    async def acked(lt: LinkThread, first: int) -> None:
        n = lt.sent
        lt.offer(make_load_report("r0", 0, first, 4, 1, np.ones((2, 4), np.uint32)))
        for _ in range(500):
            if lt.sent > n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"no ack for the report from step {first}: {lt.errors}")

    try:
        fresh = await asyncio.to_thread(LinkThread, path, 0, shim_id="r0")
        links.append(fresh)
        await acked(fresh, 21)  # no renumbering yet: the agent's answer stands
        assert fresh.next_step == 200
        lt = await asyncio.to_thread(LinkThread, path, 0, shim_id="r0")
        links.append(lt)
        lt.go_on_from(180)  # the ranks agreed on 180 (from another rank's ack)
        await acked(lt, 21)  # a report of the old count, acked late
        assert lt.next_step == 0
        await acked(lt, 180)  # the new count's own report is told where to go on
        assert lt.next_step == 240
    finally:
        for lt in links:
            await asyncio.to_thread(lt.close)
        await server.stop(None)
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(d)
