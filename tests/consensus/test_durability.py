"""Acceptors persist promise and accept before they reply: a voter that votes, is killed right after its reply
has left, and restarts from its store still holds that vote, so a competing proposer cannot get a second table
chosen for the same version. Each schedule is forced step by step (held messages, a crash right after a
given reply), and chaos/checkers.py judges the history; without the write (an acceptor that replies from
memory) each one chooses two tables for one version, an I1 violation the checker reports."""

from __future__ import annotations

from collections.abc import Callable

from google.protobuf.message import Message

from agent.config import ConsensusConfig
from agent.consensus.paxos import round0_owner
from agent.transport import ReplyCallback, Transport
from chaos.checkers import check
from chaos.quorumsim import QuorumSim, successor_table
from controlplane.table import RoutingTable


class Held:
    """A node's transport that holds the calls `hold(dst, method)` selects until `release()`."""

    def __init__(self, inner: Transport, hold: Callable[[str, str], bool]) -> None:
        self.inner, self.hold = inner, hold
        self.held: list[tuple[str, str, Message, float, ReplyCallback]] = []

    def call(self, dst: str, method: str, request: Message, timeout: float, on_reply: ReplyCallback) -> None:
        if self.hold(dst, method):
            self.held.append((dst, method, request, timeout, on_reply))
        else:
            self.inner.call(dst, method, request, timeout, on_reply)

    def release(self) -> int:
        held, self.held = self.held, []
        for dst, method, request, timeout, on_reply in held:
            self.inner.call(dst, method, request, timeout, on_reply)
        return len(held)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def three_voters() -> tuple[QuorumSim, int, str, str, str]:
    """Three voters with version 2 committed by all (every store holds records: a restart is a plain restart,
    not a rebuild); returns the cluster, the next version v, its round-0 owner and the other two voters.
    The timeouts are long and anti-entropy is off, so that only the steps below move anything."""
    c = QuorumSim(3, 3, 11, ConsensusConfig(accept_timeout_ms=2000, sync_interval_ms=0, thrifty_ms=0))
    c.propose(round0_owner(2, c.voters))
    c.run(0.2)
    assert set(c.heads().values()) == {2}
    v = 3
    owner = round0_owner(v, c.voters)
    b, third = [x for x in c.voters if x != owner]
    return c, v, owner, b, third


def installed(c: QuorumSim, v: int) -> set[bytes]:
    return {e.digest for e in c.history if e.kind == "install" and e.version == v}


def committed(c: QuorumSim, n: str, t: RoutingTable) -> bool:
    return any(who == n and o.committed and o.version == t.version for who, o in c.outcomes) and \
        any(e.kind == "respond" and e.node == n and e.digest == t.digest and e.result == "ok" for e in c.history)


def test_an_accept_survives_a_crash_right_after_the_reply() -> None:
    """b accepts the owner's table X and is killed as its reply leaves: the owner commits X with b's vote,
    and nobody else hears of it (the third voter is cut off, b is down when the commit goes out). The owner
    dies; b restarts; the third voter proposes Y for the same version with b. b's stored accept makes the
    third voter's prepare adopt X: one table is chosen. An acceptor that forgot X lets Y be chosen too."""
    c, v, owner, b, third = three_voters()
    c.net.partition([[owner, b], [third]])
    c.crash_after_vote(b, ("Consensus/Accept",))
    x = successor_table(c.nodes[owner].head, c.rng)
    c.propose(owner, x)
    c.run(0.1)
    assert committed(c, owner, x) and b in c.down  # chosen by {owner, b}; b crashed before hearing so
    c.crash(owner)
    c.restart(b)
    c.net.heal()
    st = c.nodes[b].acceptor.state(v)
    y = successor_table(c.nodes[third].head, c.rng)
    assert y.digest != x.digest
    c.propose(third, y)
    c.run(3.0)
    assert check(c.history) == [], f"b restarted with acceptor state {st}"
    assert installed(c, v) == {x.digest} and c.nodes[third].head.digest == x.digest
    assert not committed(c, third, y)


def test_a_promise_survives_a_crash_right_after_the_reply() -> None:
    """b promises the third voter's ballot (1, third) and is killed as its reply leaves; the third voter
    accepts its table Y and its accept to b is held back. b restarts; the owner, cut off from the third voter,
    sends its round-0 accept of X to b: b's stored promise refuses the lower ballot. Then the third voter's
    accept of Y reaches b and Y is chosen, the only table chosen. An acceptor that forgot its promise accepts
    X at round 0 (X is chosen by {owner, b}) and then Y at round 1 (Y is chosen by {third, b}): two tables."""
    c, v, owner, b, third = three_voters()
    c.net.partition([[b, third], [owner]])
    gate = Held(c.nodes[third].transport, lambda dst, method: dst == b and method == "Consensus/Accept")
    c.nodes[third].proposer.transport = gate  # (the proposer sends the accepts)
    c.crash_after_vote(b, ("Consensus/Prepare",))
    y = successor_table(c.nodes[third].head, c.rng)
    c.propose(third, y)
    c.run(2.1)  # the owner's turn passes (one timeout); the third voter prepares, b promises
    assert b in c.down and len(gate.held) == 1  # b promised, then crashed; the accept of Y waits
    c.restart(b)
    c.net.partition([[owner, b], [third]])
    c.crash_after_vote(b, ("Consensus/Accept",))  # should b accept X, it hears nothing after
    x = successor_table(c.nodes[owner].head, c.rng)
    assert x.digest != y.digest
    c.propose(owner, x)  # round 0, reserved with the commit of version 2: straight to the accepts
    c.run(0.1)
    c.crash(owner)
    c.restart(b)  # (a no-op when b refused X and is still up)
    c.net.heal()
    assert gate.release() == 1
    c.run(0.1)
    assert check(c.history) == []
    assert installed(c, v) == {y.digest} and committed(c, third, y) and not committed(c, owner, x)


def test_a_wiped_data_dir_on_a_new_cluster_cannot_vote_again_on_its_accept() -> None:
    """A new cluster: v2's round-0 owner sends its accept of X to itself and one voter (the thrifty first wave),
    commits X, and is cut off as its Learn leaves, then dies; the voter that accepted X was killed as its reply
    left and comes back with its whole data_dir gone (store and IDENTITY marker: it looks new). The third
    voter, which never heard of X, proposes Y: it must not be chosen while the owner is down (the wiped
    voter enrols with both others before it votes), and once the owner is back X is v2 everywhere."""
    c = QuorumSim(3, 3, 11, ConsensusConfig(accept_timeout_ms=500, sync_interval_ms=500))
    owner = round0_owner(2, c.voters)
    first, third = sorted((n for n in c.voters if n != owner), key=lambda d: (c.voters.index(d) - 2) % 3)
    c.crash_after_vote(first, ("Consensus/Accept",))
    c.isolate_after_commit(owner)
    x = successor_table(c.nodes[owner].head, c.rng)
    c.propose(owner, x)
    c.run(0.1)
    assert committed(c, owner, x) and first in c.down
    assert {e.node for e in c.history if e.kind == "accept"} == {owner, first}  # the third heard nothing
    c.crash(owner)
    c.net.heal()
    c.restart(first)
    c.crash(first, wipe_data_dir=True)
    c.restart(first)
    assert not c.nodes[first].had_store and c.nodes[first].head.version == 1
    c.run(1.0)  # it has heard from the third voter by now
    y = successor_table(c.nodes[third].head, c.rng)
    c.propose(third, y)
    c.run(3.0)
    assert not committed(c, third, y) and installed(c, 2) == {x.digest}
    c.restart(owner)
    c.run(3.0)
    assert check(c.history) == []
    assert all(c.nodes[n].log.commits[2].qc.table_hash == x.digest for n in c.ids)
