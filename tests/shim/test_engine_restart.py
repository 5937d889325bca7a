"""An engine that restarts counts its steps from 0 again, while the agents' windows (numbered by engine steps)
are far past that: its reports would be dropped as late until its count caught up, for as long as it had run.
The agent answers such a report with the step to go on from (ReportLoadAck.next_step); the ranks agree on the
largest they were told in their version agreement and all renumber at the same step (PluginCore.go_on_from)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from agent.loadpath import LocalWindows
from controlplane.table import initial_table
from controlplane.topology import Topology
from dataplane_shim.genesis import genesis_table
from dataplane_shim.install import Installer
from dataplane_shim.plugin import PluginCore
from tests.shim.test_shim_plugin import FakeLink

L, E, W = 2, 8, 10


def test_local_windows_name_where_a_restarted_engine_goes_on() -> None:
    lw = LocalWindows(L, E, W)
    for s in range(0, 50, 5):
        lw.add("a", s, 5, np.ones((L, E), np.uint32))
    assert lw.next_open_step(50, 5) == 0  # the open window
    assert lw.next_open_step(40, 5) == 0  # a window late: only dropped, as before
    assert lw.next_open_step(0, 5) == 50 and lw.next_open_step(30, 5) == 50  # far behind: go on at 50


def test_a_restarted_engine_goes_on_past_the_window_its_first_run_left_open() -> None:
    """The engine stopped 5 steps into window 5 (steps 50-54 reported, the window open). Its restart goes on at
    60, not 50: window 5 keeps only what the first run reported, instead of adding the new count's steps 50-59
    to it (15 steps of load in a 10-step window), and closes once the new count is a window past it."""
    lw = LocalWindows(L, E, W)
    step = np.ones((L, E), np.uint32)  # one token of each expert a step
    for s in range(0, 55, 5):
        lw.add("a", s, 5, 5 * step)
    assert lw.next_open_step(0, 5) == 60
    closed = lw.add("a", 60, 10, 10 * step)  # window 6, all of it: window 5 still open
    assert closed == []
    closed = lw.add("a", 70, 5, 5 * step)  # the new count a window past window 5
    assert [w.seq for w in closed] == [5, 6]
    assert int(closed[0].counts[0, 0]) == 5 and int(closed[1].counts[0, 0]) == 10  # window 5: the first run's 5


def test_the_ranks_renumber_together_from_the_largest_step_an_agent_asked_for() -> None:
    topo = Topology(1, 2, 8)
    boot = genesis_table("static", topo, L, E).phy2log
    links = [FakeLink(), FakeLink()]
    cores = [PluginCore(link, topo, L, E, g, boot, genesis="static", report_every=5, shim_id=f"rank{g}")
             for g, link in enumerate(links)]
    insts = [Installer(c, agree_every=4, stall_steps=1 << 30, rank=c.rank) for c in cores]
    load = np.ones((L, E), np.int64)
    links[1].next_step = 700  # rank 1's agent has closed windows up to step 700; rank 0's said nothing
    for step in range(12):
        for i in insts:
            i.step = step
        if insts[0].agreement_due():
            red = np.min([i.agreement_vector() for i in insts], axis=0)
            for i in insts:
                i.agreed(red)
        for c in cores:
            c.add_load(load)
            c.maybe_report()
    # renumbered at the agreement of step 0, both: steps 0.. are 700.. on both ranks, reports aligned
    assert [[int(r.first_step) for r in link.sent] for link in links] == [[700, 705], [700, 705]]
    assert [c.next_step_number for c in cores] == [712, 712]
    assert not cores[0].go_on_from(700)  # behind the count: nothing to do


@pytest.mark.slow
def test_an_engine_restarted_under_running_agents_reports_into_their_windows_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Real agents; an engine (one plugin core per rank) runs 200 steps, then a new one starts from step 0
    (a restart): within one agreement its load closes the agents' windows again."""
    from bench.live import ReplayEngine, genesis_spec
    from chaos.localcluster import LocalCluster
    from tests.adminclient import status

    topo = Topology(2, 2, 6)
    base = initial_table(topo, L, E)
    rng = np.random.default_rng(0)
    counts = rng.multinomial(256, np.full(E, 1 / E), size=(200, L)).astype(np.uint32)
    shape = {"nodes": 2, "ranks_per_node": 2, "slots_per_rank": 6, "layers": L, "experts": E, "top_k": 2,
             "genesis": genesis_spec(base, tmp_path)}
    cluster = LocalCluster(2, tmp_path, shape, profile="local", sections={"decision": {"window": 20}})

    def newest_window() -> int:
        return max(int(status(cluster.addresses[k]).window_seq) for k in range(2))

    def run(engine: ReplayEngine) -> None:
        try:
            engine.run(0.005, progress=False)  # 5 ms a step, then every rank's rest of the load
        finally:
            engine.close()

    with cluster.running(timeout=60):
        sockets = {g: cluster.shim_socket(g // 2) for g in range(4)}
        run(ReplayEngine(sockets, topo, counts, base, "static", 10, 4, 20))
        deadline = time.monotonic() + 10
        while newest_window() < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        before = newest_window()
        assert before >= 8, before
        with caplog.at_level(logging.WARNING, logger="elasticmoe.plugin"):
            run(ReplayEngine(sockets, topo, counts, base, "static", 10, 4, 20))  # restarted: from step 0
        deadline = time.monotonic() + 10
        while newest_window() < before + 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert newest_window() >= before + 5, (before, newest_window())
    said = [r.getMessage() for r in caplog.records if "renumbered" in r.getMessage()]
    to = Counter(int(m.split(" to ")[1].split()[0]) for m in said)
    # every rank renumbers once, at one agreement, to one step past the agents' windows. (A report of the old
    # count acked after that is told a later step: that ack is ignored, `LinkThread.go_on_from`; before it was,
    # one run under the whole suite's load renumbered every rank a second time, 21 -> 180 -> 200)
    assert len(to) == 1 and all(n == 4 for n in to.values()) and min(to) >= before * 20, said
    logs = [cluster.log(k).read_text() for k in range(2)]
    assert all("its engine is told to go on from step" in t for t in logs), logs[0][-2000:]
