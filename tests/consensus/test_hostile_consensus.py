"""Hostile input to the Consensus handlers (Prepare, Accept, Learn, CatchUp) of ConsensusNode.

Each case: the reply says ok=False with a reason, and nothing changed: head, committed log, buffered
commits, acceptor state, store bytes, recorded conflicts (ConsensusTarget.snapshot)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from agent.consensus.paxos import round0_owner
from chaos.fuzz_targets import VOTERS, ConsensusTarget, certify
from controlplane.table import RoutingTable
from elasticmoe.codec import table_to_pb
from elasticmoe.v1 import consensus_pb2 as pb

T = ConsensusTarget.TABLES  # versions 1..5; the node has 1..3 committed


def refused(method: str, req: pb.Message, expect: str, *, prime: list[pb.Message] = ()) -> ConsensusTarget:
    t = ConsensusTarget(method)
    for m in prime:
        assert not t.call(m).rejected, f"priming request refused: {m}"
    before = t.snapshot()
    v = t.call(req)
    assert v.rejected, f"{method} accepted hostile input: {req}"
    assert expect.lower() in v.reason.lower(), v.reason
    assert t.snapshot() == before, f"{method} refused ({v.reason}) but changed state"
    return t


def prepare(version: int = 4, rnd: int = 1, node: str = "b") -> pb.PrepareRequest:
    return pb.PrepareRequest(version=version, ballot=pb.Ballot(round=rnd, node_id=node), from_node=node)


def accept(table: pb.RoutingTable | None = None, rnd: int = 1, node: str = "b", version: int = 4,
           plan: pb.Plan | None = None) -> pb.AcceptRequest:
    p = pb.Proposal(version=version, ballot=pb.Ballot(round=rnd, node_id=node),
                    table=table if table is not None else table_to_pb(T[3]),
                    plan=plan if plan is not None else pb.Plan(trigger="t"), proposer=node)
    return pb.AcceptRequest(proposal=p, from_node=node)


def test_fixture_accepts_the_valid_requests() -> None:
    t = ConsensusTarget("Accept")
    assert t.node.head.version == 3
    assert not t.call(accept()).rejected
    t = ConsensusTarget("Learn")
    assert not t.call(certify(T[3])).rejected and t.node.head.version == 4


# ---- Prepare -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", [0, 1, 3])
def test_prepare_version_regression(version: int) -> None:
    refused("Prepare", prepare(version), "already committed")


def test_prepare_round_zero_and_lower_ballot() -> None:
    refused("Prepare", prepare(rnd=0), "round 0")
    refused("Prepare", prepare(rnd=4, node="b"), "promised", prime=[prepare(rnd=5, node="b")])


@pytest.mark.parametrize("node", ["a", "c", "mallory", ""])
def test_ballot_of_someone_else(node: str) -> None:
    """A sender may only use its own ballots: else a member could spend the round-0 owner's ballot."""
    refused("Prepare", prepare(rnd=3, node=node), "expected the sender")
    refused("Accept", accept(rnd=0, node=node), "expected the sender")
    refused("Accept", accept(rnd=2, node=node), "expected the sender")


@pytest.mark.parametrize("rnd", [2**63, 2**64 - 1])
def test_prepare_overflowing_round(rnd: int) -> None:
    """A round no proposer could ever beat (or whose successor overflows uint64) is refused."""
    refused("Prepare", prepare(rnd=rnd), "ballot.round")


# ---- Accept --------------------------------------------------------------------------------------------
def _tbl(**kw: object) -> pb.RoutingTable:
    m = table_to_pb(T[3])
    for k, v in kw.items():
        if k == "active_ranks":
            del m.active_ranks[:]
            m.active_ranks.extend(v)  # type: ignore[arg-type]
        else:
            setattr(m, k, v)
    return m


def _with_phy(phy: np.ndarray, experts: int = 8) -> pb.RoutingTable:
    t = RoutingTable(T[3].topology, experts, phy, version=4, parent=3, parent_hash=T[2].digest)
    return table_to_pb(t)


def test_accept_version_regression_and_wrong_parent() -> None:
    old = table_to_pb(T[2])
    refused("Accept", accept(old, version=3), "already committed")
    refused("Accept", accept(_tbl(parent=2)), "parent")
    refused("Accept", accept(version=7, table=_tbl(version=7)), "parent")


def test_accept_built_on_another_table_for_the_parent_version() -> None:
    """Version 4 whose parent is a version 3 other than the one this node committed: refused by hash."""
    other3 = T[2].with_version(3, 2, parent_hash=b"\x07" * 32)
    t4 = RoutingTable(T[3].topology, T[3].experts, T[3].phy2log, version=4, parent=3, parent_hash=other3.digest)
    refused("Accept", accept(table_to_pb(t4)), "parent hash")
    refused("Accept", accept(table_to_pb(T[3].with_version(4, 3))), "parent hash")  # no parent hash at all


def test_accept_round0_not_owned() -> None:
    t = ConsensusTarget("Accept")
    t.src = "c"  # c sends with its own ballot, but round 0 of version 4 belongs to b
    before = t.snapshot()
    v = t.call(accept(rnd=0, node="c"))
    assert v.rejected and "belongs to b" in v.reason and t.snapshot() == before
    assert round0_owner(4, VOTERS) == "b"


@pytest.mark.parametrize("delta", [-8, -1, 1, 8])
def test_accept_phy2log_byte_length(delta: int) -> None:
    raw = table_to_pb(T[3]).phy2log
    bad = raw[:delta] if delta < 0 else raw + b"\x00" * delta
    refused("Accept", accept(_tbl(phy2log=bad, content_hash=b"")), "phy2log")


def test_accept_wrong_hash_shape_and_unknown_ids() -> None:
    refused("Accept", accept(_tbl(content_hash=b"\x01" * 32)), "content_hash")
    refused("Accept", accept(_tbl(slots_per_rank=2, content_hash=b"")), "slots")
    refused("Accept", accept(_tbl(slots=16, slots_per_rank=8, content_hash=b"")), "slots")
    refused("Accept", accept(_tbl(active_ranks=[0, 1, 2, 99], content_hash=b"")), "active_ranks")
    phy = T[3].phy2log.copy()
    phy[0, 0] = 99  # an expert that does not exist
    refused("Accept", accept(_with_phy(phy)), "expert")
    refused("Accept", accept(_with_phy(T[3].phy2log, experts=9)), "experts")
    refused("Accept", accept(_with_phy(T[3].phy2log, experts=2**31)), "experts")  # must not allocate [L, 2^31]


def test_accept_table_version_differs_from_proposal() -> None:
    refused("Accept", accept(table_to_pb(T[3].with_version(5, 3))), "version")


@pytest.mark.parametrize("field", ["verified_gain", "estimated_gain", "cost"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_accept_non_finite_plan_numbers(field: str, value: float) -> None:
    plan = pb.Plan(trigger="t")
    setattr(plan, field, value)
    refused("Accept", accept(plan=plan), field)


def test_accept_empty_request() -> None:
    refused("Accept", pb.AcceptRequest(), "expected the sender")  # an empty ballot names nobody


# ---- Learn ---------------------------------------------------------------------------------------------
def _forged(**qc: object) -> pb.Commit:
    c = certify(T[3])
    for k, v in qc.items():
        if k == "voters":
            del c.qc.voters[:]
            c.qc.voters.extend(v)  # type: ignore[arg-type]
        else:
            setattr(c.qc, k, v)
    return c


@pytest.mark.parametrize("qc, why", [
    (dict(voters=["a"]), "voters"),                       # partial: 1 of the 2 needed
    (dict(voters=["a"], quorum=1), "quorum"),             # quorum lied about
    (dict(voters=["a", "mallory"]), "non-voters"),        # a stranger signs
    (dict(voters=["a", "a"]), "duplicates"),              # one voter counted twice
    (dict(table_hash=b"\x02" * 32), "table_hash"),        # certifies another table
    (dict(table_hash=b""), "table_hash"),
    (dict(version=5), "qc.version"),
])
def test_learn_forged_or_partial_certificate(qc: dict[str, object], why: str) -> None:
    refused("Learn", _forged(**qc), why)


def test_learn_without_certificate() -> None:
    c = certify(T[3])
    c.ClearField("qc")
    refused("Learn", c, "certificate")


def test_learn_tampered_table_under_a_good_certificate() -> None:
    c = certify(T[3])
    phy = bytearray(c.table.phy2log)
    phy[0] ^= 1
    c.table.phy2log = bytes(phy)  # qc and content_hash still name the original
    refused("Learn", c, "content_hash")


def test_learn_wrong_shape_table() -> None:
    """A table of another shape, consistently hashed and 'certified': refused before it becomes the head."""
    other = RoutingTable(T[3].topology, 8, np.vstack([T[3].phy2log, T[3].phy2log[:1]]), version=4, parent=3)
    refused("Learn", certify(other), "layers")


def test_learn_forged_old_version_is_not_a_conflict() -> None:
    """A commit for an installed version that differs from ours but carries no valid certificate is
    refused as invalid; it must not be recorded as an I1 conflict."""
    c = certify(T[2].successor(T[2].phy2log).with_version(2, 1), voters=["mallory", "eve"])
    refused("Learn", c, "non-voters")


def test_learn_forged_future_version_is_not_buffered() -> None:
    """A future commit whose table cannot even be decoded is refused, not kept for later."""
    c = certify(T[4])
    c.table.phy2log = c.table.phy2log[:-8]
    refused("Learn", c, "phy2log")


# ---- CatchUp -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("from_version, limit", [(2**64 - 1, 2**32 - 1), (0, 2**32 - 1), (3, 0), (1, 1)])
def test_catchup_hostile_bounds_change_nothing(from_version: int, limit: int) -> None:
    t = ConsensusTarget("CatchUp")
    before = t.snapshot()
    r = t.node._handle("mallory", "Consensus/CatchUp",
                       pb.CatchUpRequest(from_version=from_version, from_node="mallory", limit=limit))
    assert isinstance(r, pb.CatchUpReply) and r.committed_head == 3
    versions = [c.table.version for c in r.commits]
    assert versions == list(range(from_version + 1, from_version + 1 + len(versions)))
    assert len(versions) <= max(1, min(limit or 10**9, t.node.cfg.catchup_batch))
    assert t.snapshot() == before


def test_a_certified_table_built_on_another_history_is_a_loud_conflict() -> None:
    """A quorum certificate for version 4 whose parent is another version 3 than ours: two tables were chosen
    for version 3 somewhere (I1). The node says so (conflicts, failure -> NOT_SERVING), does not install it,
    and stops voting rather than building on either history."""
    t = ConsensusTarget("Learn")
    other3 = T[2].with_version(3, 2, parent_hash=b"\x07" * 32)
    t4 = RoutingTable(T[3].topology, T[3].experts, T[3].phy2log, version=4, parent=3, parent_hash=other3.digest)
    v = t.call(certify(t4))
    assert v.rejected and "does not build on ours" in v.reason, v.reason
    node = t.node
    assert node.head.version == 3 and len(node.conflicts) == 1
    assert node.failure.startswith("conflicting history: certified version 4 does not build on ours")
    reply = node._handle("b", "Consensus/Accept", accept())
    assert isinstance(reply, pb.Accepted) and not reply.ok and "conflicting history" in reply.reason
