"""ConsensusNode behaviours on the simulated network: round-0 ownership across a crash, verification
rejections and their reasons, certificate checks on Learn, catch-up, stale proposals."""

from __future__ import annotations

import pytest

from agent.config import ConsensusConfig
from agent.consensus.node import ConsensusNode, Outcome
from agent.consensus.paxos import round0_owner
from agent.storage.store import MemoryDisk, Store, parse
from chaos.checkers import check
from chaos.quorumsim import QuorumSim, successor_table
from controlplane.table import RoutingTable
from elasticmoe.v1 import consensus_pb2 as pb


def cluster(seed: int = 5, voters: int = 5, nodes: int = 5, **cfg: int) -> QuorumSim:
    """A new cluster whose founding members have heard from each other (agent/consensus/rebuild.py)."""
    c = QuorumSim(nodes, voters, seed, ConsensusConfig(**{"accept_timeout_ms": 50, "sync_interval_ms": 0, **cfg}))
    c.run(0.1)
    return c


def commit_next(c: QuorumSim) -> None:
    v = c.nodes[c.up()[0]].head.version + 1
    owner = round0_owner(v, c.voters)
    c.propose(owner)
    c.run(0.2)


def test_round0_is_never_reused_after_a_crash() -> None:
    c = cluster()
    commit_next(c)  # the owner of version 3 reserved round 0 of 3 on disk, with the commit of 2
    v = 3
    owner = round0_owner(v, c.voters)
    c.propose(owner)  # round 0 accepts leave ...
    c.crash(owner)  # ... and the owner dies before its own accept is on disk
    c.restart(owner)
    assert c.nodes[owner].acceptor.state(v).proposer_round >= 1, "the round-0 reservation was lost"
    c.propose(owner)  # a different table for the same version: must go through a prepare now
    c.run(1.0)
    assert check(c.history) == []
    heads = {c.nodes[n].head.version for n in c.up()}
    assert heads == {3}
    # without the reservation the restarted owner would reuse round 0 for another table, and two tables
    # would each gather a quorum at ballot (0, owner): an I1 violation the checker above reports
    assert {e.ballot for e in c.history if e.kind == "accept" and e.version == v and e.ballot[0] == 0} <= {(0, owner)}


def test_a_round0_owner_that_promised_a_higher_ballot_prepares_at_once() -> None:
    """The owner of round 0 of v promised another proposer's prepare (that proposer then died, as a wiped
    planner does): round 0 is no longer its to use, and it must prepare above that ballot at once, not wait out
    a takeover for itself (5-node sim, seed 9051 schedule 269: every planner waited `accept_timeout` and a due
    rollback came after its deadline, I6)."""
    c = cluster(accept_timeout_ms=2000)
    commit_next(c)
    v = c.nodes[c.up()[0]].head.version + 1
    owner = round0_owner(v, c.voters)
    other = next(n for n in c.voters if n != owner)
    node = c.nodes[owner]
    promise, st = node.acceptor.on_prepare(pb.PrepareRequest(version=v, ballot=pb.Ballot(round=1, node_id=other),
                                                             from_node=other), node.head.version)
    assert promise.ok and st is not None
    node.acceptor.apply(st)
    c.propose(owner)
    c.run(0.2)  # a tenth of accept_timeout: a prepare and an accept round trip, no takeover wait
    assert [o.committed for n, o in c.outcomes if n == owner and o.version == v] == [True]
    assert set(c.heads().values()) == {v}
    assert check(c.history) == []


def test_verifier_rejections_reach_the_outcome() -> None:
    c = cluster()
    owner = round0_owner(2, c.voters)
    for n in c.ids:
        if n != owner:  # every other voter's own replay disagrees with the proposer's
            c.nodes[n].verifier = lambda head, t, plan: (False, 0.0, "replay: imbalance 1.31 -> 1.35 is worse")
    commit_next(c)
    (who, out), = c.outcomes
    assert who == owner and not out.committed
    assert {v.voter for v in out.votes if v.accept} == {owner}
    assert {v.reason for v in out.votes if not v.accept} == {"replay: imbalance 1.31 -> 1.35 is worse"}
    assert "worse" in out.reason
    assert all(c.nodes[n].head.version == 1 for n in c.ids)
    assert any("worse" in r for _, _, r in c.nodes[who].rejections)


def test_own_check_failure_sends_nothing() -> None:
    c = cluster()
    owner = round0_owner(2, c.voters)
    c.nodes[owner].verifier = lambda head, t, plan: (False, 0.0, "own replay worse")
    commit_next(c)
    (_, out), = c.outcomes
    assert not out.committed and "own check: own replay worse" in out.reason
    assert [(v.voter, v.accept) for v in out.votes] == [(owner, False)]
    assert c.net.stats.msgs_by_method["Consensus/Accept"] == 0


def test_a_verifiers_refusal_reaches_the_outcome_with_its_reason() -> None:
    """What a plan must show on a voter's own replay is the verifier's to say (agent.decision.voter.Voter: a rebalance's
    gain within verify_tolerance of the proposer's, a rollback's not held to it); the acceptor passes its
    verdict and reason on, for any plan."""
    c = cluster(seed=6)
    for n in c.ids:
        c.nodes[n].verifier = lambda head, t, plan: (False, 0.01, "replay gain 0.0100 is below the proposer's")
    node = c.nodes[round0_owner(2, c.voters)]
    outs: list[Outcome] = []
    node.propose(successor_table(node.head, c.rng), pb.Plan(verified_gain=0.2), outs.append)
    c.run(1.0)
    assert len(outs) == 1 and not outs[0].committed and "below the proposer's" in outs[0].reason


def test_learn_with_a_bad_certificate_changes_nothing() -> None:
    c = cluster()
    commit_next(c)
    good = c.nodes[c.voters[0]].committed(2)
    assert good is not None
    n = c.nodes[c.voters[1]]
    bad = pb.Commit()
    bad.CopyFrom(good)
    bad.table.version = 3
    bad.table.parent = 2
    bad.qc.version = 3
    ack = n._handle("x", "Consensus/Learn", bad)
    assert isinstance(ack, pb.CommitAck) and not ack.ok and "INVALID_ARGUMENT" in ack.reason
    forged = pb.Commit()
    forged.CopyFrom(good)
    del forged.qc.voters[1:]
    fresh = cluster(seed=5)
    ack = fresh.nodes[fresh.voters[0]]._handle("x", "Consensus/Learn", forged)
    assert isinstance(ack, pb.CommitAck) and not ack.ok and "qc.voters" in ack.reason
    assert fresh.nodes[fresh.voters[0]].head.version == 1


def test_a_node_with_a_lost_disk_catches_up_and_verifies() -> None:
    c = cluster(seed=7, sync_interval_ms=100)
    for _ in range(4):
        commit_next(c)
    victim = c.voters[2]
    c.crash(victim)
    c.disks[victim] = MemoryDisk()  # a replaced machine: nothing on disk
    c.restart(victim)
    assert c.nodes[victim].head.version == 1
    c.run(1.0)
    assert c.nodes[victim].head.version == 5
    assert [x.table.version for x in c.nodes[victim].commits_since(1)] == [2, 3, 4, 5]
    assert c.nodes[victim].peer_heads()[victim] == 5


def test_stale_and_duplicate_proposals_are_refused_at_once() -> None:
    c = cluster()
    commit_next(c)
    node = c.nodes[c.voters[0]]
    outs: list[Outcome] = []
    stale = successor_table(c.genesis, c.rng)
    node.propose(stale, pb.Plan(), outs.append)
    assert len(outs) == 1 and not outs[0].committed and "expected version 3 parent 2" in outs[0].reason
    t = successor_table(node.head, c.rng)
    node.propose(t, pb.Plan(), outs.append)
    node.propose(t, pb.Plan(), outs.append)
    assert "already in flight" in outs[-1].reason


def test_restart_resumes_at_the_last_committed_version() -> None:
    disk = MemoryDisk()
    c = cluster(seed=8)
    for _ in range(3):
        commit_next(c)
    n = c.voters[0]
    disk.data = bytearray(c.disks[n].data)
    g: RoutingTable = c.genesis
    fresh = ConsensusNode(n, c.voters, Store(disk=disk), c.net.clock("other"), c.net.transport("other"),
                          c.cfg, g)
    fresh.start()
    assert fresh.head.version == 4 and fresh.head.digest == c.nodes[n].head.digest
    fresh.stop()


def test_compaction_keeps_the_newest_commits_across_restarts() -> None:
    c = cluster(seed=9, sync_interval_ms=100, log_compact_bytes=6000, log_retain=4)
    for _ in range(25):
        commit_next(c)
    n = c.voters[1]
    assert c.nodes[n].head.version == 26
    assert len(c.disks[n].data) < 6000 + 4000  # compacted, not 25 commits long
    assert [x.table.version for x in c.nodes[n].commits_since(0)][-4:] == [23, 24, 25, 26]
    c.crash(n)
    commit_next(c)
    c.restart(n)
    assert c.nodes[n].head.version == 26  # recovered from the compacted log, then catches up
    c.run(1.0)
    assert c.nodes[n].head.version == 27
    assert check(c.history) == []


def test_a_full_disk_stops_the_votes_and_the_node_catches_up_when_it_recovers() -> None:
    c = cluster(voters=3, nodes=3, sync_interval_ms=200, disk_retry_ms=100)
    commit_next(c)
    full = c.ids[2]
    disk = c.disks[full]
    disk.capacity = len(disk.data)  # nothing more fits
    for _ in range(4):  # the other two keep committing without it
        commit_next(c)
        c.run(0.3)
    node = c.nodes[full]
    assert node.failure.startswith("store failed") and "No space left" in node.failure
    assert node.head.version < c.nodes[c.ids[0]].head.version
    reply = node._handle(c.ids[0], "Consensus/Prepare", pb.PrepareRequest(
        version=node.head.version + 1, ballot=pb.Ballot(round=9, node_id=c.ids[0]), from_node=c.ids[0]))
    assert isinstance(reply, pb.Promise) and not reply.ok and "UNAVAILABLE" in reply.reason
    outcomes: list[Outcome] = []
    node.propose(successor_table(node.head, c.rng), pb.Plan(), outcomes.append)
    assert outcomes and not outcomes[0].committed and "store failed" in outcomes[0].reason
    assert len(disk.data) == node.store.size  # no partial record left behind
    disk.capacity = None  # space returns: the node resumes and catches up
    c.run(2.0)
    assert node.failure == "" and node.head.version == c.nodes[c.ids[0]].head.version
    assert check(c.history) == []
    c.crash(full)
    c.restart(full)  # and every record it wrote is there after a restart
    assert c.nodes[full].head.version == c.nodes[c.ids[0]].head.version


def test_no_quorum_names_each_voter_that_refused_or_did_not_answer() -> None:
    """Of three voters, one has a full disk (it refuses, saying why) and one is down (no reply): the proposer's
    outcome says who refused and why, and who did not answer, not just "no quorum (1/2)"."""
    c = cluster(voters=3, nodes=3)
    owner = round0_owner(2, c.voters)
    full, down = (n for n in c.voters if n != owner)
    c.disks[full].capacity = len(c.disks[full].data)  # nothing more fits: its accept cannot be made durable
    c.crash(down)
    commit_next(c)
    c.run(1.0)  # a busy voter (UNAVAILABLE) is asked again with the next ballots, up to max_attempts
    (who, out), = c.outcomes
    assert who == owner and not out.committed
    assert "no quorum" in out.reason and "(1/2)" in out.reason, out.reason
    assert f"{full}: UNAVAILABLE: " in out.reason and "store failed" in out.reason, out.reason
    assert "No space left" in out.reason and f"no reply from {down}" in out.reason, out.reason
    assert {v.voter for v in out.votes if not v.accept} == {full}  # the fields are as before


def test_a_voters_reason_in_the_outcome_is_bounded() -> None:
    c = cluster(voters=3, nodes=3)
    owner = round0_owner(2, c.voters)
    loud, down = (n for n in c.voters if n != owner)
    c.nodes[loud].verifier = lambda head, t, plan: (False, 0.0, "worse " + "x" * 5000)
    c.crash(down)
    commit_next(c)
    (_, out), = c.outcomes
    assert not out.committed and f"{loud}: worse xxx" in out.reason and f"no reply from {down}" in out.reason
    assert len(out.reason) < 600, len(out.reason)


def _amnesia(c: QuorumSim, cut: bool = False) -> tuple[str, str, str]:
    """The next version (v) chosen by {owner, b} alone; then b loses its store (`cut`: only the records it
    wrote for v, its log cut at a record boundary) while the owner is down, and the third voter, which never
    heard of v, proposes another table for it through b."""
    v = c.nodes[c.voters[0]].head.version + 1
    owner = round0_owner(v, c.voters)
    b, third = [x for x in c.voters if x != owner]
    c.net.partition([[owner, b], [third]])
    before = parse(bytes(c.disks[b].data))[0].records
    c.propose(owner)
    c.run(0.3)
    assert c.nodes[owner].head.version == v and c.nodes[b].head.version == v
    c.crash(owner)
    if cut:
        c.crash(b, cut_records=parse(bytes(c.disks[b].data))[0].records - before)
    else:
        c.crash(b, lose_store=True)
    c.restart(b)
    c.net.heal()
    c.propose(third)
    c.run(2.0)
    return owner, b, third


def test_store_loss_cannot_choose_two_tables_for_one_version() -> None:
    c = cluster(voters=3, nodes=3, sync_interval_ms=200)
    owner, b, third = _amnesia(c)
    assert check(c.history) == []
    assert "learner" in c.nodes[b].role and c.nodes[third].head.version == 1  # no quorum without the owner
    c.restart(owner)
    c.run(2.0)
    assert check(c.history) == [] and set(c.heads().values()) == {2}
    assert "votes again once it holds version 3" in c.nodes[b].role
    c.propose(third)  # the owner and the third commit version 3 without b; b learns it and votes again
    c.run(1.0)
    assert set(c.heads().values()) == {3} and c.nodes[b].role == "voter"
    c.crash(owner)  # now b's vote is needed, and given
    c.propose(b)
    c.run(1.0)
    assert set(c.heads().values()) == {4} and check(c.history) == []
    assert all(c.nodes[n].rebuild is None for n in c.up())


def test_without_the_rebuild_the_same_loss_chooses_two_tables(monkeypatch: object) -> None:
    """The schedule above is a real hazard: a node that votes again at once makes the checker report I1."""
    import agent.consensus.recovery as recovery_mod

    class Amnesiac:  # decides at once, as the old code did
        def __init__(self, *a: object) -> None:
            self.decided, self.strict, self.abstain_through = True, False, 0

        def may_vote(self, head: int) -> bool:
            return True

        def report(self, *a: object) -> None: ...

        def describe(self, head: int) -> str:
            return "voter"

    monkeypatch.setattr(recovery_mod, "Rebuild", Amnesiac)  # type: ignore[attr-defined]
    c = cluster(voters=3, nodes=3, sync_interval_ms=200)
    _amnesia(c)
    assert any(v.startswith("I1") for v in check(c.history))


def test_a_log_cut_at_a_record_boundary_rebuilds_as_a_learner() -> None:
    """The log parses cleanly without the records of version 3; its high-water mark says they were there, so
    b rebuilds as after a lost store, and no second table is chosen for version 3."""
    c = cluster(voters=3, nodes=3, sync_interval_ms=200)
    commit_next(c)  # version 2 by all: b's log keeps it
    owner, b, third = _amnesia(c, cut=True)
    node = c.nodes[b]
    assert node.store.lost > 0 and "learner" in node.role and node.head.version == 2
    assert check(c.history) == [] and c.nodes[third].head.version == 2
    c.restart(owner)
    c.run(2.0)
    c.propose(third)
    c.run(1.0)
    assert check(c.history) == [] and set(c.heads().values()) == {4} and c.nodes[b].role == "voter"
    assert node.store.lost == 0  # settled: a later restart trusts the log again
    c.crash(b)
    c.restart(b)
    assert c.nodes[b].rebuild is None and c.nodes[b].store.lost == 0


def test_without_the_mark_a_cut_log_chooses_two_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cut above is a real hazard: without the high-water mark the node votes again at once, and the
    checker reports I1."""
    from agent.storage.store import Store

    monkeypatch.setattr(Store, "_read_high", lambda self: None)
    c = cluster(voters=3, nodes=3, sync_interval_ms=200)
    commit_next(c)
    _amnesia(c, cut=True)
    assert any(v.startswith("I1") for v in check(c.history))


def test_a_new_cluster_votes_once_its_founders_heard_from_each_other() -> None:
    c = QuorumSim(3, 3, 5, ConsensusConfig(accept_timeout_ms=50, sync_interval_ms=0))
    assert all(c.nodes[n].rebuild is not None for n in c.ids)  # new stores: each asks first
    c.run(0.01)  # one round trip
    assert all(c.nodes[n].rebuild is None for n in c.ids) and all(c.nodes[n].role == "voter" for n in c.ids)
    commit_next(c)
    assert set(c.heads().values()) == {2} and all(c.nodes[n].role == "voter" for n in c.ids)


def test_a_node_5000_commits_behind_the_compaction_horizon_catches_up_by_snapshot() -> None:
    c = cluster(voters=3, nodes=3, sync_interval_ms=200, log_compact_bytes=16384, log_retain=8)
    commit_next(c)
    late = c.voters[2]
    c.crash(late)
    owner = c.voters[0]
    for _ in range(5000):  # the other two commit on; their logs compact to the newest 8
        v = c.nodes[owner].head.version + 1
        c.propose(owner)
        for _ in range(50):
            c.run(0.01)
            if c.nodes[owner].head.version == v:
                break
        assert c.nodes[owner].head.version == v
    head = c.nodes[owner].head.version
    assert min(c.nodes[owner].log.commits) > 3  # version 3 is gone: CatchUp alone could never reach the head
    c.restart(late)
    c.run(2.0)
    node = c.nodes[late]
    assert node.head.version == head and node.log.snapshots == 1 and node.log.base >= head - 8
    assert check(c.history) == []
    c.crash(late)  # the snapshot is its durable base now
    c.restart(late)
    assert c.nodes[late].head.version == head
    c.propose(late)
    c.run(1.0)
    assert set(c.heads().values()) == {head + 1} and check(c.history) == []


def test_a_lost_store_rebuilds_from_a_snapshot() -> None:
    c = cluster(voters=3, nodes=3, sync_interval_ms=200, log_compact_bytes=4096, log_retain=4)
    for _ in range(40):
        commit_next(c)
    head = c.nodes[c.voters[0]].head.version
    c.crash(c.voters[1], lose_store=True)
    c.restart(c.voters[1])
    c.run(2.0)
    node = c.nodes[c.voters[1]]
    assert node.head.version == head and node.log.snapshots == 1 and check(c.history) == []


def test_founders_restarted_before_the_cluster_could_found_still_found() -> None:
    """Two of three voters of a new cluster start and cannot found (each needs both others); both restart, and
    then the third comes up: all three found (a restart resumes the founding rebuild under its enrolment id,
    rather than passing for a wiped voter and waiting for reports that never come)."""
    c = QuorumSim(3, 3, 5, ConsensusConfig(accept_timeout_ms=50, sync_interval_ms=0))
    late = c.voters[2]
    c.crash(late)
    c.run(0.5)
    early = [n for n in c.voters if n != late]
    assert all(c.nodes[n].rebuild is not None and not c.nodes[n].rebuild.decided for n in early)
    for n in early:
        c.crash(n)
        c.restart(n)
    c.run(0.2)
    c.restart(late)
    c.run(0.5)
    assert all(c.nodes[n].role == "voter" for n in c.voters), [c.nodes[n].role for n in c.voters]
    commit_next(c)
    assert set(c.heads().values()) == {2}


def test_a_wiped_voter_stays_known_across_a_restart_of_its_rebuild() -> None:
    """A voter wiped after the cluster founded is told it was known; if it restarts during that rebuild (same
    enrolment id), its peers still say so (the record is sticky) and it stays strict."""
    c = cluster(voters=3, nodes=3)
    commit_next(c)
    wiped, up = c.voters[0], c.voters[1:]
    c.crash(up[1])
    c.crash(wiped, lose_store=True)
    c.incarnation[wiped] = -1  # its whole data_dir: no marker says it ran before (restart counts it up to 0)
    c.restart(wiped)
    c.run(0.3)
    rb = c.nodes[wiped].rebuild
    assert rb is not None and rb.strict and not rb.decided, c.nodes[wiped].role
    c.crash(wiped)
    c.restart(wiped)
    c.run(0.3)
    rb = c.nodes[wiped].rebuild
    assert rb is not None and rb.strict and not rb.decided, c.nodes[wiped].role
    c.restart(up[1])
    c.run(1.0)
    assert c.nodes[wiped].rebuild is None or c.nodes[wiped].rebuild.strict
    assert check(c.history) == []
