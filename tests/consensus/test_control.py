"""Control records (agent/consensus/control.py, controlnode.py): the pause switch committed by a quorum of the
voters apart from the tables. The acceptor's rules sans-IO, then ConsensusNodes on the simulated network:
learned everywhere, durable across restarts, totally ordered under concurrent writes, never taking effect from
a writer cut off from the quorum, and reaching the majority side when certified just before a partition."""

from __future__ import annotations

from agent.config import ConsensusConfig
from agent.consensus.control import MAX_SEQ_STEP, ControlAcceptor, ControlWrite, check_commit, key
from agent.consensus.controlnode import ControlOutcome
from agent.storage.store import MemoryDisk, Store
from chaos.quorumsim import QuorumSim
from elasticmoe.v1 import consensus_pb2 as pb


def rec(seq: int, node: str, paused: bool = True) -> pb.ControlRecord:
    return pb.ControlRecord(seq=seq, node_id=node, paused=paused, at_ms=1, note="test")


def test_an_acceptor_takes_only_keys_above_what_it_holds() -> None:
    a = ControlAcceptor("b", ["a", "b", "c"], is_member=lambda n: True)
    ok, st = a.on_accept(rec(1, "a"), "a")
    assert ok.ok and st is not None
    a.apply(st)
    again, st2 = a.on_accept(rec(1, "a"), "a")  # the same record again (a retry, or a finish): yes, nothing to write
    assert again.ok and st2 is None
    for stale in (rec(1, "a", paused=False), rec(0, "z"), rec(1, "0")):  # same key other value; below (1, "a")
        no, st3 = a.on_accept(stale, stale.node_id)
        assert not no.ok and st3 is None and key(no.accepted) == (1, "a"), no.reason
        assert no.code in (pb.CONTROL_SUPERSEDED, pb.CONTROL_MALFORMED), no
    higher, st4 = a.on_accept(rec(1, "c", paused=False), "c")  # (1, "c") > (1, "a"): concurrent writers by key
    assert higher.ok and st4 is not None
    far, _ = a.on_accept(rec(2 + MAX_SEQ_STEP, "c"), "c")
    assert not far.ok and "INVALID_ARGUMENT" in far.reason and far.code == pb.CONTROL_MALFORMED
    assert a.next_record(True, 5, "x").seq == 2  # above every key heard of


def test_a_certificate_names_a_quorum_of_distinct_configured_voters() -> None:
    vs = ["a", "b", "c"]
    good = pb.ControlCommit(record=rec(1, "a"), voters=["a", "b"], quorum=2)
    assert check_commit(good, vs) == ""
    for bad in (pb.ControlCommit(record=rec(1, "a"), voters=["a"], quorum=2),
                pb.ControlCommit(record=rec(1, "a"), voters=["a", "a"], quorum=2),
                pb.ControlCommit(record=rec(1, "a"), voters=["a", "x"], quorum=2),
                pb.ControlCommit(record=rec(1, "a"), voters=["a", "b"], quorum=1),
                pb.ControlCommit(record=rec(0, "a"), voters=["a", "b"], quorum=2),
                pb.ControlCommit(voters=["a", "b"], quorum=2)):
        assert check_commit(bad, vs), bad


def test_a_write_refused_by_a_higher_key_is_superseded() -> None:
    w = ControlWrite(rec(1, "a"), ["a", "b", "c"])
    assert w.on_ack("b", pb.ControlAck(ok=False, reason="superseded", accepted=rec(3, "c"))) == ""
    assert w.superseded
    assert w.on_ack("c", pb.ControlAck(ok=False, reason="UNAVAILABLE: learner")) == "refused"


def test_a_voter_that_may_not_vote_yet_is_asked_again() -> None:
    """A learner's refusal (a new cluster's voters enrolling) is not final: the write keeps asking it until its
    deadline, and a later ack from it counts."""
    w = ControlWrite(rec(1, "a"), ["a", "b", "c"])
    assert w.on_ack("a", pb.ControlAck(ok=True)) == ""
    assert w.on_ack("b", pb.ControlAck(ok=False, reason="UNAVAILABLE: b is a learner (empty store)")) == ""
    assert w.on_ack("c", pb.ControlAck(ok=False, reason="UNAVAILABLE: c is a learner (empty store)")) == ""
    assert not w.done and w.waiting() == ["b", "c"] and "b: UNAVAILABLE: b is a learner" in w.tally()
    assert "no reply" not in w.tally()
    assert w.on_ack("b", pb.ControlAck(ok=True)) == "certified" and w.commit().voters == ["a", "b"]


def cluster(seed: int = 3, n: int = 5) -> QuorumSim:
    c = QuorumSim(n, n, seed, ConsensusConfig(accept_timeout_ms=50, sync_interval_ms=200))
    c.run(0.2)
    return c


def write(c: QuorumSim, n: str, paused: bool, run_s: float = 1.0) -> list[ControlOutcome]:
    out: list[ControlOutcome] = []
    c.nodes[n].control.write(paused, "emoe pause" if paused else "emoe resume", out.append)
    c.run(run_s)
    return out


def switch(c: QuorumSim) -> dict[str, tuple[int, str, bool] | None]:
    out: dict[str, tuple[int, str, bool] | None] = {}
    for n in c.up():
        r = c.nodes[n].control.record
        out[n] = None if r is None else (int(r.record.seq), r.record.node_id, r.record.paused)
    return out


def test_a_pause_is_learned_everywhere_and_kept_across_restarts() -> None:
    c = cluster()
    w = c.voters[1]
    (o,) = write(c, w, True)
    assert o.committed and o.commit is not None and len(o.commit.voters) >= 3, o.reason
    assert set(switch(c).values()) == {(1, w, True)}
    heads = c.heads()
    for n in list(c.ids):  # every node, kill -9, then all back
        c.crash(n)
    for n in list(c.ids):
        c.restart(n)
    c.run(0.5)
    assert set(switch(c).values()) == {(1, w, True)} and c.heads() == heads
    (o2,) = write(c, c.voters[3], False)  # after the restart the next record goes above the recovered one
    assert o2.committed, o2.reason
    assert set(switch(c).values()) == {(2, c.voters[3], False)}


def test_concurrent_writes_end_in_one_order_everywhere() -> None:
    for seed in range(4):
        c = cluster(seed)
        outs: list[ControlOutcome] = []
        a, b = c.voters[0], c.voters[4]
        c.nodes[a].control.write(True, "pause", outs.append)
        c.nodes[b].control.write(False, "resume", outs.append)
        c.run(2.0)
        assert len(outs) == 2 and all(o.committed for o in outs), [o.reason for o in outs]
        finals = set(switch(c).values())
        assert len(finals) == 1, finals  # every node holds the same record ...
        (final,) = finals
        assert final is not None
        top = max((int(o.commit.record.seq), o.commit.record.node_id) for o in outs if o.commit is not None)
        assert final[:2] == top  # ... the certified one with the highest key


def test_a_writer_cut_off_from_the_quorum_fails_and_its_record_never_takes_effect() -> None:
    c = cluster()
    w = c.voters[2]
    c.net.partition([[w], [n for n in c.ids if n != w]])
    (o,) = write(c, w, True, run_s=3.0)
    assert not o.committed and "not committed" in o.reason and "did not change" in o.reason, o.reason
    c.net.heal()
    c.run(5.0)  # many sync rounds and finish deadlines: nobody else holds it, so nobody completes it
    assert set(switch(c).values()) == {None}
    (o2,) = write(c, c.voters[0], False)  # the abandoned record refuses nothing but keys at or below its own
    assert o2.committed, o2.reason
    assert {switch(c)[n] for n in c.ids} == {(int(o2.commit.record.seq), c.voters[0], False)} if o2.commit else False


def test_a_record_certified_just_before_a_partition_reaches_the_majority_side() -> None:
    c = cluster()
    w = c.voters[0]
    rest = [n for n in c.ids if n != w]
    node = c.nodes[w].control
    # the writer is cut off the moment it knows its record certified: its learns are lost on the wire
    node.on_change(lambda cm: c.net.partition([[w], rest]))
    (o,) = write(c, w, True, run_s=0.1)  # (a finish starts only `deadline` = 0.4 s after an accept)
    assert o.committed, o.reason
    certified_by = set(o.commit.voters) if o.commit else set()
    assert all(c.nodes[n].control.record is None for n in rest)  # nobody learned it from the writer ...
    assert any(c.nodes[n].control.acceptor.accepted is not None for n in rest if n in certified_by)
    c.run(3.0)  # ... the voters that accepted it complete it on their side
    assert {switch(c)[n] for n in rest} == {(1, w, True)}


def test_a_stale_writer_goes_above_what_it_missed() -> None:
    c = cluster()
    late = c.voters[4]
    c.crash(late)
    assert write(c, c.voters[0], True)[0].committed
    assert write(c, c.voters[1], False)[0].committed
    assert write(c, c.voters[2], True)[0].committed
    c.restart(late)  # and writes at once, before any sync: it knows no record
    assert c.nodes[late].control.record is None
    (o,) = write(c, late, False, run_s=2.0)
    assert o.committed and o.commit is not None and o.commit.record.seq == 4, o.reason
    assert set(switch(c).values()) == {(4, late, False)}


def test_a_voter_that_abstains_refuses_control_records() -> None:
    c = cluster()
    for n in c.voters[1:]:
        c.nodes[n].gate = lambda: "cluster fingerprint differs"
    (o,) = write(c, c.voters[0], True)
    assert not o.committed and "fingerprint" in o.reason, o.reason


def test_the_control_state_is_kept_by_compaction() -> None:
    disk = MemoryDisk()
    s = Store(disk=disk)
    s.open()
    st = pb.ControlState(accepted=rec(4, "b"), certified=pb.ControlCommit(record=rec(3, "a"), voters=["a", "b"],
                                                                           quorum=2))
    s.save_control(st)
    assert s.compact([], [])
    s.close()
    again = Store(disk=disk)
    assert again.open().control == st and again.control == st


def test_a_voter_that_abstains_still_refuses_a_forged_record_as_forged() -> None:
    """A learner (or a failed disk) answers a record from its writer "try again" (UNAVAILABLE), but a record sent
    under another's name is refused as PERMISSION_DENIED whatever the receiver's state: the sender learns nothing
    from the timing of the receiver's recovery, and the refusal is counted as one."""
    c = cluster()
    a, b, other = c.voters[0], c.voters[1], c.voters[2]
    c.nodes[b].gate = lambda: "node is a learner (empty store)"
    node = c.nodes[b].control
    honest = node.handle(a, pb.ControlAcceptRequest(record=rec(1, a)))
    assert isinstance(honest, pb.ControlAck) and not honest.ok and honest.code == pb.CONTROL_UNAVAILABLE, honest
    for src, forged, code in (("outsider", rec(1, other), pb.CONTROL_NOT_WRITER),
                              (a, rec(1, "admin"), pb.CONTROL_UNKNOWN_WRITER)):
        no = node.handle(src, pb.ControlAcceptRequest(record=forged))
        assert isinstance(no, pb.ControlAck) and not no.ok and no.code == code, no
        assert no.reason.startswith("PERMISSION_DENIED") and f"record.node_id = {forged.node_id!r}" in no.reason
    assert node.acceptor.accepted is None and node.refused["CONTROL_UNKNOWN_WRITER"] == 1
