"""The simulated chaos runner in CI: a short run with zero violations, scenario files, the schedule generator,
the planning turn, detection, disks and learners in a SimCluster. That every checker catches a planted
violation is tests/chaos/test_checkers.py."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest

from agent.consensus.paxos import round0_owner
from chaos import schedules, simdisks
from chaos.__main__ import main
from chaos.invariants import INVARIANTS, check_cluster
from chaos.simcluster import Shape, SimCluster
from chaos.simrun import run_schedule

logging.getLogger("agent").setLevel(logging.ERROR)


def test_short_sim_run_has_zero_violations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["run", "--runner", "sim", "--nodes", "8", "--schedules", "6", "--seed", "1", "--json",
               "--out", str(tmp_path)])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, out
    assert out["runner"] == "sim" and out["nodes"] == 8 and out["schedules"] == 6
    assert out["violations"] == dict.fromkeys(INVARIANTS, 0)
    assert out["commits"] > 6  # plans were proposed and committed under the faults
    assert 0.0 <= out["convergence_p99_s"] <= 20.0
    runs = sorted(tmp_path.glob("run-*.json"))
    assert len(runs) == 6 and (tmp_path / "summary.json").exists()
    r = json.loads(runs[0].read_text())
    assert r["done"][-1].startswith("t=") and r["tokens"]["served"] > 0


def test_a_default_run_commits_rollbacks_and_i6_holds(capsys: pytest.CaptureFixture[str]) -> None:
    """Generated schedules end with a load drift whose rebalance the load turns against as it commits
    (chaos/simload.py): the change realises worse than its parent and must be superseded in time (I6); the
    controller does it by a rollback. A controller that never rolls back commits none here."""
    rc = main(["run", "--runner", "sim", "--nodes", "3", "--schedules", "4", "--seed", "1", "--json", "--jobs", "1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["violations"]["I6"] == 0, out
    assert rc == 0 and out["violations"] == dict.fromkeys(INVARIANTS, 0), out
    assert out["rollbacks"] >= 1 and out["i6_judged"] >= 1, out
    assert out["shifts"] and out["faults"].get("shift", 0) == 8


@pytest.mark.parametrize("path", schedules.files(), ids=lambda p: p.stem)
def test_scenario_files(path: Path) -> None:
    lines = schedules.load(path)
    nodes = int(lines[0].split()[1])
    res = run_schedule(nodes, 7, lines, Shape(layers=4, experts=16, slots_per_rank=4))
    assert res.counts() == dict.fromkeys(INVARIANTS, 0), res.violations
    assert res.convergence_s, "the scenario never settled"


def test_generator_is_seeded() -> None:
    a = schedules.generate(random.Random(4), 8)
    assert a == schedules.generate(random.Random(4), 8)
    assert a[0] == "add-nodes 8" and a[-1] == "stabilize"
    with pytest.raises(schedules.ScheduleError, match="unknown command"):
        schedules.apply(SimCluster(2, Shape(2, 4, 1, 4), 0), "explode n00", random.Random(0))


def test_one_node_plans_each_window_and_the_turn_passes_on() -> None:
    """Fault-free: every node that holds the same view of a window (the same head, learned in the same window)
    names the same planner (one planner, not eight); the round-0 owner of the next version plans first, and the
    turn passes on every handover_windows windows without a commit. A node that learned the head one window
    later than the others counts the turn from there (paxos.planner_turn: views may differ a moment; two plan and
    consensus picks one): the only way two nodes of one head name different planners."""
    from agent.consensus.paxos import round0_owner
    from controlplane.controller import WindowClosed

    c = SimCluster(8, Shape(layers=4, experts=16, slots_per_rank=4), seed=3)
    # window -> node -> (planner it names, its head, the window it learned that head in)
    seen: dict[int, dict[str, tuple[str, int, int]]] = {}
    for n, stt in c.states.items():
        step = stt.pipeline.controller.step

        def rec(ev: object, n: str = n, step: object = step, stt: object = stt) -> object:
            if isinstance(ev, WindowClosed):
                seen.setdefault(ev.window_seq, {})[n] = (ev.planner or n, stt.head_version(),  # type: ignore[attr-defined]
                                                         stt.pipeline.head_seq)  # type: ignore[attr-defined]
            return step(ev)  # type: ignore[operator]

        stt.pipeline.controller.step = rec  # type: ignore[method-assign]
    c.run(20.0)
    assert len(c.history.commits) >= 1
    for k, v in seen.items():  # nodes on one head that name different planners learned it in different windows
        for head in {h for _, h, _ in v.values()}:
            views = {(p, s) for p, h, s in v.values() if h == head}
            assert len({p for p, _ in views}) <= len({s for _, s in views}), (k, v)
    full = {k: v for k, v in seen.items() if len(v) == 8 and len({(h, s) for _, h, s in v.values()}) == 1}
    assert len(full) >= 8
    turns: dict[int, list[str]] = {}
    for k in sorted(full):
        planners = {p for p, _, _ in full[k].values()}
        assert len(planners) == 1, (k, full[k])  # every node names the same planner
        head = next(iter(full[k].values()))[1]
        turns.setdefault(head, []).append(planners.pop())
    for head, ps in turns.items():
        assert ps[0] == round0_owner(head + 1, c.ids) or len(ps) > 2  # the owner first (unless mid-turn)
    assert any(len(set(ps)) > 1 for ps in turns.values())  # a turn without a commit passes on


def test_skew_joins_the_generated_faults_only_when_asked() -> None:
    plain = [schedules.generate(random.Random(s), 8, faults=6) for s in range(40)]
    skewed = [schedules.generate(random.Random(s), 8, faults=6, skew=True) for s in range(40)]
    assert not any(line.startswith("skew") for s in plain for line in s)
    lines = [line for s in skewed for line in s if line.startswith("skew")]
    assert lines and all(line.split()[1] == "random" and float(line.split()[2]) > 0 for line in lines)
    res = run_schedule(8, 11, next(s for s in skewed if any(x.startswith("skew") for x in s)),
                       Shape(layers=4, experts=16, slots_per_rank=4))
    assert res.counts() == dict.fromkeys(INVARIANTS, 0), res.violations
    assert any(" skew n" in d for d in res.done)


def test_detection_time_is_measured_from_the_crash_of_the_same_outage() -> None:
    """A node restarted before anyone declared it dead, then crashed for good: its detection time counts
    from the second crash (it counted from the first, and a 64-node run reported a p99 of 57 s)."""
    c = SimCluster(6, Shape(layers=2, experts=8, ranks_per_node=1, slots_per_rank=4), seed=11)
    c.run(2.0)
    c.crash("n02")
    c.run(0.05)
    c.restart("n02")  # back before its suspicion timed out
    c.run(6.0)
    assert c.history.detections == []
    t_crash = c.clock.now()
    c.crash("n02")
    c.run(6.0)
    [(node, t0, t)] = c.history.detections  # one outage declared, once however many nodes declare it
    assert (node, t0) == ("n02", t_crash) and 0 < t - t0 < 6.0


def test_a_wiped_data_dir_on_a_new_cluster_does_not_vote_again_on_what_it_accepted() -> None:
    """A new 3-node cluster (head = genesis v1). v2's round-0 owner sends its accept of X to itself and one
    voter only (the thrifty first wave), both accept, X is chosen; the owner persists its commit and dies
    before its Learn leaves; the voter that accepted X loses its whole data_dir (store and IDENTITY marker)
    right after its reply left, and restarts as if new. A forced proposal through the third voter, which
    heard of none of it, must be refused while the owner is down (the wiped voter, enrolled with the others,
    may not vote yet), and once the owner returns every node holds X at v2. Before the enrolment rule the
    wiped voter voted at once as a founder of a new cluster and the third voter's proposal chose a second
    table for v2 (I1)."""
    c = SimCluster(3, Shape(layers=4, experts=16, slots_per_rank=11), seed=0)
    rng = random.Random(0)
    owner = round0_owner(2, c.ids)
    first, third = sorted((n for n in c.ids if n != owner), key=lambda d: (c.ids.index(d) - 2) % 3)
    # 2 s: the first window's plan (2 replay rows) is refused as GAIN_NOT_SIGNIFICANT, the second one's commits
    for line in ("add-nodes 3", "crash voter after-commit", f"wipe-data-dir {first} after-accept", "tick 2s"):
        schedules.apply(c, line, rng)
    accepts = {e.node: e.digest for e in c.history.events if e.kind == "accept" and e.version == 2}
    assert set(accepts) == {owner, first} and len(set(accepts.values())) == 1  # X, chosen by the first wave
    x = accepts[owner]
    assert c.down == {owner} and c.history.wipes == [(first, c.history.wipes[0][1], 1)]  # wiped at genesis
    assert c.heads() == {first: 1, third: 1} and not c.states[first].consensus.had_store  # "new"
    ack = c.admin(lambda: c.states[third].manual.drain(c.ranks_of[owner][0]), tries=1)
    assert not ack.ok and "learner" in ack.reason, ack
    assert c.heads() == {first: 1, third: 1}  # nothing chosen without the owner
    schedules.apply(c, f"restart {owner}", rng)
    assert c.settle() is not None
    assert {n: c.states[n].consensus.committed(2).qc.table_hash for n in c.ids} == dict.fromkeys(c.ids, x)
    assert check_cluster(c).violations == dict.fromkeys(INVARIANTS, [])


def test_disk_schedules_wipe_a_data_dir_at_every_step_and_keep_the_lines_drawn_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--disks adds one `wipe-data-dir` a schedule, drawn apart: taking out the lines it inserted gives the
    schedule the seed gave before, and the seed's generator is left where it was; wipes strike on the new
    cluster and later, at once and armed for a promise, accept or commit, some with the next version's
    owner armed to die between its commit and its Learn."""
    def gen(s: int, disks: bool = True) -> tuple[list[str], float]:
        rng = random.Random(s)
        return schedules.generate(rng, 3, disks=disks), rng.random()

    wiped = [gen(s) for s in range(60)]
    assert wiped == [gen(s) for s in range(60)]  # seeded
    assert not any(x.startswith("wipe-data-dir") for s in range(60) for x in gen(s, False)[0])
    with monkeypatch.context() as m:
        m.setattr(schedules, "with_wipe", lambda lines, w: lines)
        before = [gen(s) for s in range(60)]
    for (lines, after), (plain, after0) in zip(wiped, before, strict=True):
        i = next(i for i, (a, b) in enumerate(zip(lines, plain, strict=False)) if a != b)
        k = len(lines) - len(plain)
        assert 1 <= k <= 3 and lines[:i] + lines[i + k:] == plain and after == after0
        assert sum(x.startswith("wipe-data-dir") for x in lines[i:i + k]) == 1
    kinds = {" ".join(x.split()[2:]) for ls, _ in wiped for x in ls if x.startswith("wipe-data-dir")}
    assert kinds == {"", "after-promise", "after-accept", "after-commit"}
    armed = [ls.index("crash voter after-commit") for ls, _ in wiped if "crash voter after-commit" in ls]
    assert 1 in armed and max(armed) > 2  # before the first commit, and later


def test_a_learner_leaves_the_planning_turn_until_it_votes_again() -> None:
    """A voter whose data_dir is wiped in a running cluster rejoins as a learner: its proposals are refused, so
    a turn it held passed only after handover_windows and a rollback due then came a turn late (3-node sim,
    seed 9051 schedule 1883: I6). Its windows say `learner`, so every node leaves it out of the turn while it
    learns, and takes it back once it votes again."""
    c = SimCluster(3, Shape(layers=4, experts=16, slots_per_rank=11), seed=3)
    c.run(4.0)
    assert c.settle() is not None
    for node in c.states.values():
        node.pipeline.paused = True  # no commit for a while: the learner stays one (it votes again past head + 1)
    wiped = sorted(c.ids)[1]
    simdisks.wipe_data_dir(c, wiped)
    # (node, window, the planner it sees for that window) while wiped learns: every window of one whole
    # rotation of the turn ahead (handover_windows x voters), so the wiped node's place in the turn comes up
    # whatever the head's version and the windows since it: only the exclusion keeps it out
    planners: list[tuple[str, int, str]] = []
    for _ in range(60):
        c.run(0.2)
        role = c.states[wiped].consensus.role
        for n in c.up():
            if n != wiped and role.startswith("learner") and wiped in c.states[n].gossip.learners():
                pipe = c.states[n].pipeline
                ahead = pipe.handover_windows * len(c.ids)
                assert ahead > 0, "handover_windows = 0: no turn to leave"
                for k in range(1, ahead + 1):
                    p = pipe.turn(pipe.window_seq + k)[0]
                    planners.append((n, pipe.window_seq + k, p or n))
    assert planners, "the learner's windows never said so"
    assert all(p != wiped for _, _, p in planners), [x for x in planners if x[2] == wiped][:5]
    assert {p for _, _, p in planners} == set(c.ids) - {wiped}  # the others take its turns meanwhile
    for node in c.states.values():
        node.pipeline.paused = False
    # commits past what the learner may have voted on (it may have promised the version after the head it was
    # wiped at, so two: v3 and v4; until 1b397b0 the second came from an automatic rebalance, which now verifies
    # a mix that moves window after window, as this sim's does, on its last two windows): it votes again ...
    rank, manual = c.ranks_of[sorted(c.ids)[2]][0], c.states[sorted(c.ids)[0]].manual
    for act in (manual.drain, manual.restore):  # a rank drained, then back in service
        ack = c.admin(lambda act=act: act(rank), tries=3)  # type: ignore[misc]
        assert ack.ok, ack
    c.run(6.0)
    assert c.states[wiped].consensus.role == "voter"
    assert all(wiped not in c.states[n].gossip.learners() for n in c.up())  # ... and plans again
    assert check_cluster(c).violations == dict.fromkeys(INVARIANTS, [])
