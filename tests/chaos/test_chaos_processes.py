"""The real-process chaos runner: a CI-sized run (4 agent processes x 2 schedules), and its checkers and
schedule generator on hand-made inputs (each check shown to fire)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from chaos.episodes import Episode
from chaos.proccheck import Checks
from chaos.procrunner import _drop_map, make_schedule
from controlplane.topology import Topology
from elasticmoe.v1 import consensus_pb2 as cpb


def _commit(version: int, parent: int, tag: int) -> cpb.Commit:
    """An uncertified commit whose table hash is `tag` (enough for I1, I2 and I7; I3 refuses it)."""
    return cpb.Commit(table=cpb.RoutingTable(version=version, parent=parent, content_hash=bytes([tag]) * 32))


def test_schedules_are_seeded_bounded_and_use_distinct_nodes() -> None:
    ra, rb = random.Random(7), random.Random(7)
    a = [make_schedule(ra, 8) for _ in range(30)]
    b = [make_schedule(rb, 8) for _ in range(30)]
    assert [[e.describe([str(i) for i in range(8)]) for e in s] for s in a] == \
           [[e.describe([str(i) for i in range(8)]) for e in s] for s in b]
    kinds = set()
    for eps in a:
        assert 1 <= len(eps) <= 3
        for ep in eps:
            assert 0.8 <= ep.hold_s <= 2.5
            touched = ep.kill + ep.pause
            assert len(set(touched)) == len(touched)
            if ep.groups:
                assert sorted(ep.groups[0] + ep.groups[1]) == list(range(8)) and all(ep.groups)
            kinds |= {k for k, on in (("kill", ep.kill), ("pause", ep.pause), ("partition", ep.groups)) if on}
    assert kinds == {"kill", "pause", "partition"}
    drop = _drop_map(["a", "b", "c"], [[0], [1, 2]])
    assert drop == {"a": ["b", "c"], "b": ["a"], "c": ["a"]}


def test_disk_schedules_wipe_one_data_dir_and_keep_the_episodes_drawn_before(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """With disks, one episode of each schedule also wipes a node's whole data_dir (a node no other fault of
    that episode touches), drawn apart: the episodes are otherwise the ones the seed gave before, and the
    runner's generator is left where it was. The wipe takes the IDENTITY marker with the log."""
    import chaos.episodes
    from agent.storage.datadir import mark_owner, owner
    from chaos.procfaults import wipe_data_dir

    def draw(seed: int) -> tuple[list[dict[str, object]], float]:
        rng = random.Random(seed)
        return [vars(e) for e in make_schedule(rng, 5, net=True, disks=True)], rng.random()

    ids = [str(i) for i in range(5)]
    drawn = [draw(seed) for seed in range(40)]
    with monkeypatch.context() as m:
        m.setattr(chaos.episodes, "with_wipe", lambda eps, n, w: eps)
        before = [draw(seed) for seed in range(40)]
    assert sum(bool(e["wipe_data_dir"]) for eps, _ in drawn for e in eps) >= 30
    for (eps, after), (plain, after0) in zip(drawn, before, strict=True):
        assert sum(len(e["wipe_data_dir"]) for e in eps) <= 1 and after == after0  # type: ignore[arg-type]
        assert [{**e, "wipe_data_dir": []} for e in eps] == plain
        for e in eps:
            ep = Episode(**e)  # type: ignore[arg-type]
            for k in ep.wipe_data_dir:
                assert k not in ep.kill + ep.pause + ep.deaf + ep.lose_store + ep.corrupt + ep.cut_log + ep.disk_full
                assert f"wipe the data_dir of {k}" in ep.describe(ids)
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    (d / "store.log").write_bytes(b"x")
    mark_owner(d, "n1")
    entries = len(list(d.iterdir()))  # sub, store.log and the marker's files (IDENTITY, FORMAT)
    assert entries >= 3 and owner(d, "n1")
    assert wipe_data_dir(d) == entries and d.is_dir() and not any(d.iterdir()) and not owner(d, "n1")


def test_checks_fire_on_conflicting_reordered_uncertified_and_lost_commits() -> None:
    ch = Checks(Topology(2, 1, 4), ["n1", "n2"])
    ch.logs({"n1": [_commit(2, 1, 1), _commit(3, 2, 1)], "n2": [_commit(2, 1, 1), _commit(3, 2, 2)]})
    v = ch.violations()
    assert v["I1"] == 1 and v["I2"] == 0 and v["I3"] == 3  # v3 twice chosen; none certified
    ch.logs({"n1": [_commit(2, 1, 1), _commit(4, 3, 1)]})  # v3 missing: v4's parent is not the previous entry
    assert ch.violations()["I2"] == 1
    ch.logs({"n2": [_commit(2, 1, 1), _commit(3, 1, 2)]})  # a table whose parent is not its version - 1
    assert ch.violations()["I2"] == 2
    ch.restart("n1", {2: b"\x01" * 32, 3: b"\x01" * 32}, 3, {2: b"\x01" * 32}, 3)
    assert ch.violations()["I7"] == 1
    ch.restart("n2", {2: b"\x01" * 32}, 5, {2: b"\x01" * 32}, 4)  # the acknowledged head regressed
    assert ch.violations()["I7"] == 2
    ok = Checks(Topology(2, 1, 4), ["n1", "n2"])
    ok.restart("n1", {2: b"\x01" * 32}, 2, {2: b"\x01" * 32, 3: b"\x02" * 32}, 3)
    assert ok.violations() == {"I1": 0, "I2": 0, "I3": 0, "I4": 0, "I5": 0, "I6": 0, "I7": 0}


@pytest.mark.slow
def test_four_agent_processes_two_schedules_no_violations() -> None:
    from chaos.procmain import run_processes
    from chaos.procrunner import MECHANISM

    res = run_processes(4, 2, seed=9, netns=False)  # seed 9: three episodes with kill -9, SIGSTOP and partitions
    assert res["runner"] == "processes" and res["nodes"] == 4 and res["schedules"] == 2
    assert res["violations"] == {"I1": 0, "I2": 0, "I3": 0, "I4": 0, "I5": 0, "I6": 0, "I7": 0}, res["details"]
    assert res["partition_mechanism"] == MECHANISM.format(why="not asked for")
    assert res["convergence_p99_s"] is not None and res["convergence_p99_s"] >= 0
    assert all(res["faults"][k] >= 1 for k in ("kill", "pause", "partition")), res["faults"]
    assert res["commits"] >= 1 and res["installs_checked"] >= 4  # real plans committed and streamed
    tk = res["tokens"]  # tokens routed between the engines' shims on the streamed tables (I4 checked)
    assert tk["served"] > 1000 and tk["i4"] == 0 and tk["installed"] >= 2, tk
    # I6 is in the violations above; how many rebalances it can judge here depends on timing (fault-free
    # spans on a loaded machine), so the count is not asserted: tests above show both I6 checks fire


def test_sigterm_cancels_the_run_so_that_its_cleanup_runs() -> None:
    """A SIGTERM to the runner cancels the run like Ctrl-C: its `finally` (agents, namespaces, mounts) runs;
    before, the default action killed the process and left namespaces and tmpfs mounts behind."""
    import asyncio
    import os
    import signal

    from chaos.procmain import _until_terminated

    cleaned: list[str] = []

    async def run() -> dict[str, str]:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(10)
            return {}
        finally:
            cleaned.append("cleanup")

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(_until_terminated(run()))
    assert cleaned == ["cleanup"]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler goes with the run


def test_stable_ports_lie_below_the_ephemeral_range_and_are_free() -> None:
    import socket

    from chaos.localcluster import stable_ports

    ports = stable_ports(4)
    assert len(set(ports)) == 4 and all(20000 <= p < 32000 for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free: binding does not raise


def test_i6_realised_check_fires_on_a_regression_left_in_place_only() -> None:
    import numpy as np

    from controlplane.table import initial_table

    topo = Topology(2, 1, 4)  # genesis: experts 0, 1 on rank 0; 2, 3 on rank 1; two spare slots each
    gen = initial_table(topo, 1, 4)
    t2 = gen.successor(np.array([[0, 1, 2, 3, 0, 1, -1, -1]]))  # rank 0 takes 2 and 3 too; 0 and 1 on both
    trig = {2: ("step imbalance 1.82 > theta 1.10 for 1 windows", 0.3, True)}  # (trigger, gain, rebalance?)
    helps = {k: np.array([[100, 100, 10, 10]], np.uint64) for k in range(20)}   # 1.82 -> 1.09
    hurts = {k: np.array([[100, 10, 100, 10]], np.uint64) for k in range(20)}   # 1.00 -> 1.50

    def judge(windows: dict[int, np.ndarray], installed: dict[int, float],
              faulty: list[tuple[float, float]] = ()) -> Checks:  # type: ignore[assignment]
        ch = Checks(topo, ["n1", "n2"], tau=0.02)
        ch.tables, ch.triggers, ch.installed_at = {2: t2}, dict(trig), installed
        ch.realised(gen, windows, 0.0, 0.1, list(faulty), n=3, grace=3)
        return ch

    ch = judge(hurts, {2: 0.25})
    assert ch.i6_judged == 1 and ch.violations()["I6"] == 1 and "1.500 vs 1.000" in ch.details[0]
    assert judge(hurts, {2: 0.25, 3: 0.85}).violations()["I6"] == 0  # superseded within 3 + 3 windows
    assert judge(hurts, {2: 0.25, 3: 1.05}).violations()["I6"] == 1  # ... but not later
    early = Checks(topo, ["n1", "n2"], tau=0.02)  # judged before its deadline: a rollback may still come
    early.tables, early.triggers, early.installed_at = {2: t2}, dict(trig), {2: 0.25}
    early.realised(gen, hurts, 0.0, 0.1, [], n=3, grace=3, now=0.8)
    assert early.i6_judged == 0 and early.violations()["I6"] == 0
    faulted = judge(hurts, {2: 0.25}, [(0.5, 0.6)])  # a fault in the span: not judged
    assert faulted.i6_judged == 0 and faulted.violations()["I6"] == 0
    good = judge(helps, {2: 0.25})
    assert good.i6_judged == 1 and good.violations()["I6"] == 0
    moved = judge({k: hurts[k] if k < 6 else helps[k] for k in range(20)}, {2: 0.25})  # worse in windows 3-5,
    assert moved.i6_judged == 1 and moved.violations()["I6"] == 0  # better in 6-8: no rollback is owed
    rolled = dict(trig)
    rolled[2] = ("rollback: v1 realised better", 0.0, False)  # rollbacks are not judged as rebalances
    ch = Checks(topo, ["n1", "n2"], tau=0.02)
    ch.tables, ch.triggers, ch.installed_at = {2: t2}, rolled, {2: 0.25}
    ch.realised(gen, hurts, 0.0, 0.1, [], n=3, grace=3)
    assert ch.i6_judged == 0


def test_i6_gain_below_tau_is_read_from_the_commit_log() -> None:
    ch = Checks(Topology(2, 1, 4), ["n1", "n2"], tau=0.02)
    low = _commit(2, 1, 1)
    low.plan.trigger, low.plan.verified_gain = "step imbalance 1.80 > theta 1.10 for 1 windows", 0.005
    roll = _commit(3, 2, 1)
    roll.plan.trigger, roll.plan.verified_gain = "rollback: v2 realised worse", 0.0  # rollbacks carry no gain
    ch.logs({"n1": [low, roll]})
    assert ch.violations()["I6"] == 1 and any("0.0050 < tau" in d for d in ch.details)


def test_real_network_and_disk_faults_no_violations() -> None:
    """Each agent in its own network namespace (partitions, one-way links and loss by nftables, delay with
    reordering and duplication by the switch between them), data_dirs on tmpfs: a whole-cluster kill -9, a lost log, a log
    cut at a record boundary (noticed, rebuilt), a corrupt log (refused, repaired), a full disk, with 0
    violations."""
    from chaos.netns import unavailable
    from chaos.procmain import run_processes
    from chaos.procrunner import NETNS_MECHANISM

    why = unavailable()
    if why:
        pytest.skip(f"network namespaces unavailable here: {why}")
    res = run_processes(4, 4, seed=1227, disks=True)  # seed 1227: every fault kind within 4 schedules
    assert res["partition_mechanism"] == NETNS_MECHANISM and res["disk_faults"] == "on"
    assert res["violations"] == {"I1": 0, "I2": 0, "I3": 0, "I4": 0, "I5": 0, "I6": 0, "I7": 0}, res["details"]
    for kind in ("partition", "one_way", "loss", "delay", "duplicate", "restart_all", "lose_store", "corrupt",
                 "disk_full", "cut_log", "wipe_data_dir"):
        assert res["faults"][kind] >= 1, res["faults"]
    assert res["switch_frames"]["delayed"] > 0 and res["switch_frames"]["duplicated"] > 0, res["switch_frames"]
    assert res["restart_failures"] == [] and res["commits"] >= 1
    assert res["head_again_s"]["max"] is not None  # a killed agent's head was read again after its restart (I7)


def test_the_process_runners_data_plane_catches_a_token_on_memory_that_lacks_its_expert() -> None:
    """I4 in the process runner: tokens go between the engines' shims on the tables the agents streamed; a
    rank whose real memory silently lost an expert is caught the first time a token lands there."""
    from types import SimpleNamespace

    from chaos.proccheck import DataPlane
    from controlplane.table import initial_table

    topo = Topology(3, 1, 6)
    engines = [SimpleNamespace(i=i, pending=[]) for i in range(3)]
    dp = DataPlane(engines, initial_table(topo, 2, 12), tokens_per_step=64, seed=1)  # type: ignore[arg-type]
    hot = np.array([0, 1])
    for _ in range(5):
        dp.step(hot)
    assert dp.stats.served > 0 and dp.stats.i4 == 0
    dp.mem[1][:, :] = -7  # rank 1's weights are gone, and nothing told its shim
    dp.step(hot)
    ch = Checks(topo, ["n1", "n2", "n3"])
    rep = dp.report(ch)
    assert rep["i4"] > 0 and ch.violations()["I4"] == 1
