"""A rank's engine process leaving is known first-hand by its own agent: the local link closes (agent.link.ranklink);
a host stopped past its suspicion (agent and engine), whose ranks the others repaired on their engines' word,
restores its ranks itself when it runs again (agent.decision.rejoin).

Unit: RankPresence on a fake clock. End to end: 3 agent processes; a real shim process for rank 1 (node 0)
holds its link open, is killed with SIGKILL, and the cluster commits a repair that drains rank 1, well before
membership could have said anything (node 0's agent is alive); a new shim process for rank 1 attaches and
the rank is restored."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import numpy as np
import pytest

from agent.clock import FakeClock
from agent.link.ranklink import RankPresence
from chaos.localcluster import ROOT, LocalCluster


def _presence(ranks: tuple[int, ...] = (0, 1)) -> tuple[FakeClock, RankPresence, list[tuple[str, tuple[int, ...]]]]:
    clock = FakeClock()
    seen: list[tuple[str, tuple[int, ...]]] = []
    p = RankPresence(clock, ranks, lambda r: seen.append(("lost", r)), lambda r: seen.append(("back", r)), 0.25)
    return clock, p, seen


def test_a_rank_whose_link_stays_closed_is_lost_once_and_back_when_it_attaches() -> None:
    clock, p, seen = _presence()
    p.attach([1])
    p.detach([1])
    clock.advance(0.2)
    assert seen == []  # within the grace: a reconnect is not a loss
    clock.advance(0.1)
    assert seen == [("lost", (1,))]
    clock.advance(5.0)
    assert seen == [("lost", (1,))]  # once
    p.attach([1])
    assert seen == [("lost", (1,)), ("back", (1,))]


def test_a_quick_reconnect_two_streams_others_ranks_and_shutdown_are_no_loss() -> None:
    clock, p, seen = _presence()
    p.attach([0])
    p.detach([0])
    clock.advance(0.1)
    p.attach([0])  # the shim reconnected within the grace
    clock.advance(1.0)
    p.attach([0])
    p.detach([0])  # one of two streams of rank 0 ended: the other is still open
    clock.advance(1.0)
    p.attach([7])
    p.detach([7])  # not this node's rank
    clock.advance(1.0)
    p.detach([0])
    p.close()  # the agent stops: its server ends the streams
    clock.advance(1.0)
    assert seen == []


def test_a_rank_that_never_attached_is_not_lost() -> None:
    clock, p, seen = _presence()
    clock.advance(10.0)
    assert seen == []


SHIM = textwrap.dedent("""
    import asyncio, sys
    from dataplane_shim.link import ShimLink

    async def main():
        ranks = [int(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "1").split(",")]
        link = ShimLink(sys.argv[1], shim_id="engine-ranks-" + "-".join(map(str, ranks)), ranks=ranks)

        async def watch():  # holds the link open for as long as the process lives
            async for _ in link.watch_tables(0):
                pass

        async def load():  # uniform load, one report per rank per step (windows close on it)
            from dataplane_shim.link import make_load_report
            import numpy as np

            step = 0
            while True:
                for r in ranks:
                    await link.report_load(make_load_report(f"rank{r}", r, step, 1, 0, np.full((4, 16), 8)))
                step += 1
                await asyncio.sleep(0.02)

        task = asyncio.ensure_future(watch())
        if len(sys.argv) > 3:
            asyncio.ensure_future(load())
        await asyncio.sleep(1.0)  # the stream is open on the agent's side by now
        print("attached", flush=True)
        await task

    asyncio.run(main())
""")

pytestmark = pytest.mark.slow
SHAPE = {"nodes": 3, "ranks_per_node": 2, "slots_per_rank": 4, "layers": 4, "experts": 16, "top_k": 2}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(3, tmp_path_factory.mktemp("ranklink"), SHAPE, profile="test")
    with c.running(timeout=60):
        yield c


def _shim(cluster: LocalCluster, ranks: str = "1", load: bool = False) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", SHIM, cluster.shim_socket(0), ranks, *(["load"] if load else [])],
                         cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout is not None and p.stdout.readline().startswith("attached"), "the shim did not attach"
    return p


def _kill(p: subprocess.Popen[str]) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    if p.stdout is not None:
        p.stdout.close()


def _active(cluster: LocalCluster, i: int) -> list[int]:
    r = subprocess.run([sys.executable, "-m", "agent.cli", "placement", "--agent", cluster.addresses[i], "--json",
                        "--layer", "-1"], capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout)["active_ranks"])


def _wait(cluster: LocalCluster, i: int, pred: object, limit_s: float = 20.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if pred(_active(cluster, i)):  # type: ignore[operator]
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"agent {i}: active ranks {_active(cluster, i)} after {limit_s} s")


def test_a_killed_rank_process_is_repaired_and_restored_when_it_returns(cluster: LocalCluster) -> None:
    assert 1 in _active(cluster, 2)
    shim = _shim(cluster)
    time.sleep(0.5)
    _kill(shim)
    took = _wait(cluster, 2, lambda act: 1 not in act)  # another node learned the repair
    print(f"\nrank 1's process killed: drained on node 2 after {took:.2f} s (polled)")
    assert 0 in _active(cluster, 2)  # node 0's other rank, and node 0 itself, stay
    back = _shim(cluster)
    try:
        _wait(cluster, 2, lambda act: 1 in act)
    finally:
        _kill(back)


def _unreachable(cluster: LocalCluster, node: int, rank: int, gone: list[int]) -> None:
    """The engine's word: rank `rank` of node `node` reports `gone` unreachable (its EP collective failed), in an
    evidence report of its own over its node's shim socket, as PluginCore.report_evidence sends it (a report
    stream only: no table stream, so no presence of `rank` starts or ends here)."""
    from dataplane_shim.link import ShimLink, make_load_report

    async def send() -> None:
        async with ShimLink(cluster.shim_socket(node), shim_id=f"rank{rank}", ranks=[rank]) as link:
            await link.report_load(make_load_report(f"rank{rank}", rank, 0, 0, 0, np.zeros((4, 16), np.uint32),
                                                    unreachable_ranks=gone))

    asyncio.run(send())


def test_a_node_stopped_past_its_suspicion_restores_its_ranks_itself_when_it_runs_again(cluster: LocalCluster) -> None:
    """SIGSTOP of node 0's host (its agent and its engine ranks, as a paused VM; the engine's link stays open):
    the others declare node 0 dead and, once their engines say its ranks are unreachable (the EP collective
    failed), repair them; after SIGCONT node 0 restores them itself (agent/decision/rejoin.py; checked as load windows
    close, so an idle cluster restores when load resumes). Before, they stayed drained until an operator ran
    `emoe restore`. (Its agent alone stopped, with its engine serving, repairs nothing:
    tests/agent/test_absent_agent.py.)"""
    shim = _shim(cluster, "0,1", load=True)  # rank 1 back if the test before left it drained; windows close
    _wait(cluster, 2, lambda act: {0, 1} <= set(act))
    try:
        cluster.signal(0, signal.SIGSTOP)
        shim.send_signal(signal.SIGSTOP)
        try:
            _unreachable(cluster, 1, 2, [0, 1])
            took = _wait(cluster, 2, lambda act: not {0, 1} & set(act))
            print(f"\nnode 0 stopped: its ranks drained on node 2 after {took:.2f} s (polled)")
        finally:
            shim.send_signal(signal.SIGCONT)
            cluster.signal(0, signal.SIGCONT)
        # rank 1 flapped in the test before (killed, restored, killed): its wait has doubled, to 12 s at most here
        took = _wait(cluster, 2, lambda act: {0, 1} <= set(act), limit_s=45.0)
        print(f"node 0 running again: its ranks restored on node 2 after {took:.2f} s (polled)")
        r = subprocess.run([sys.executable, "-m", "agent.cli", "history", "--agent", cluster.addresses[2], "--json",
                            "--limit", "10"], capture_output=True, text=True, cwd=ROOT, timeout=30)
        assert r.returncode == 0, r.stderr
        assert "is back after its repair (rejoin)" in r.stdout, r.stdout
    finally:
        _kill(shim)
