"""Gossip member claims under mTLS: a member's address, ranks and incarnation are accepted only as the member's
own signed word (relayed unchanged by anyone), or as SWIM suspicion of a member already known. In plaintext
nothing can be checked, so a forged member is taken as heard (test_restart shows it still drains nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.consensus.signing import VoteSigner
from agent.membership import MemberStatus
from agent.security import write_dev_certs
from chaos.gossipsim import GossipSim
from elasticmoe.v1 import gossip_pb2 as gpb

IDS = ["n1", "n2", "n3", "n4"]


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    write_dev_certs(d, [*IDS, "mallory"])
    return d


def _sim(cert_dir: Path | None) -> GossipSim:
    sim = GossipSim(seed=3)
    if cert_dir is not None:
        sim.signers = {n: VoteSigner.from_cert_dir(cert_dir, n) for n in IDS}
    sim.add_nodes(len(IDS))
    sim.run(5.0)
    assert sim.converged()
    return sim


def _forged_alive(node: str, ranks: list[int], inc: int = 1, address: str = "10.9.9.9:7400") -> gpb.MemberState:
    return gpb.MemberState(node_id=node, address=address, status=gpb.ALIVE, incarnation=inc, ranks=ranks,
                           from_node="n2")


def test_a_signed_cluster_converges_through_relayed_claims(cert_dir: Path) -> None:
    sim = _sim(cert_dir)  # n3 and n4 joined through n1: every other member reached them as a relayed claim
    for n in IDS:
        m = sim.nodes[n].membership
        assert sorted(x.node_id for x in m.members()) == IDS
        assert m.refused == 0, m.refused_why
        assert all(m.state_pb(x).claim for x in IDS)


@pytest.mark.parametrize("signed", [False, True])
def test_a_forged_member_is_refused_under_mtls(cert_dir: Path, signed: bool) -> None:
    """n2 (a legitimate node) relays a member 'mallory' that claims n1's rank. Under mTLS it needs mallory's
    signed claim, which n2 cannot make; in plaintext it is taken as heard (the failure this fixes)."""
    sim = _sim(cert_dir if signed else None)
    victim_rank = list(sim.nodes["n1"].membership.me.ranks)
    for n in ("n1", "n3", "n4"):
        sim.nodes[n].membership.absorb([_forged_alive("mallory", victim_rank)], "n2")
    sim.run(2.0)
    known = [n for n in ("n1", "n3", "n4") if sim.nodes[n].membership.is_known("mallory")]
    if signed:
        assert known == []
        assert "has no signed claim" in sim.nodes["n3"].membership.refused_why
    else:
        assert known == ["n1", "n3", "n4"]


def test_a_claim_signed_with_another_members_key_is_refused(cert_dir: Path) -> None:
    sim = _sim(cert_dir)
    n2 = VoteSigner.from_cert_dir(cert_dir, "n2")
    st = _forged_alive("mallory", [0])
    st.claim = gpb.MemberState(node_id="mallory", address=st.address, incarnation=1, status=gpb.ALIVE,
                               ranks=[0]).SerializeToString()
    st.claim_signature, st.claim_certificate = n2.sign_claim(st.claim), n2.cert_der
    sim.nodes["n3"].membership.absorb([st], "n2")
    assert not sim.nodes["n3"].membership.is_known("mallory")
    assert "signed with the certificate of 'n2'" in sim.nodes["n3"].membership.refused_why


def test_a_relayed_claim_cannot_be_rewritten(cert_dir: Path) -> None:
    """n1's own signed claim, with the address or ranks changed on the way, or replayed at a higher
    incarnation (a forged address change), is refused; n1 keeps its address."""
    sim = _sim(cert_dir)
    m3 = sim.nodes["n3"].membership
    real = m3.state_pb("n1")
    moved = gpb.MemberState()
    moved.CopyFrom(real)
    moved.address, moved.incarnation = "10.9.9.9:7400", real.incarnation + 1
    more_ranks = gpb.MemberState()
    more_ranks.CopyFrom(real)
    more_ranks.incarnation = real.incarnation + 1
    more_ranks.ranks.append(7)
    replay = gpb.MemberState()
    replay.CopyFrom(real)
    replay.incarnation = real.incarnation + 5
    for st, why in ((moved, "its claim says"), (more_ranks, "its claim says"), (replay, "its claim is alive at")):
        m3.absorb([st], "n2")
        assert why in m3.refused_why
        got = m3.get("n1")
        assert got is not None and got.address == real.address and got.incarnation == real.incarnation
        assert list(got.ranks) == list(real.ranks)


def test_suspicion_needs_no_claim_and_the_member_refutes(cert_dir: Path) -> None:
    """Anyone may suspect or declare a known member dead (SWIM); the member outbids it with a new signed
    claim, which every node accepts."""
    sim = _sim(cert_dir)
    inc = sim.nodes["n1"].membership.incarnation
    dead = gpb.MemberState(node_id="n1", address="n1:7400", status=gpb.DEAD, incarnation=inc + 3, ranks=[0],
                           from_node="n2")
    sim.nodes["n3"].membership.absorb([dead], "n2")
    assert sim.nodes["n3"].membership.status("n1") == MemberStatus.DEAD
    sim.nodes["n1"].membership.absorb([dead], "n2")  # n1 hears it too, and refutes
    sim.run(5.0)
    for n in IDS:
        m = sim.nodes[n].membership
        assert m.status("n1") == MemberStatus.ALIVE, n
        assert m.get("n1").incarnation == inc + 4  # type: ignore[union-attr]
        assert m.refused == 0, m.refused_why


def test_a_signed_leave_spreads(cert_dir: Path) -> None:
    sim = _sim(cert_dir)
    sim.leave("n4")
    sim.run(3.0)
    for n in ("n1", "n2", "n3"):
        assert sim.nodes[n].membership.status("n4") == MemberStatus.LEFT, n
        assert sim.nodes[n].membership.refused == 0


def test_oversized_claims_are_invalid_input() -> None:
    from agent.membership import check_states
    from agent.transport import InvalidArgument

    with pytest.raises(InvalidArgument, match="certificate of 9000"):
        check_states([gpb.MemberState(node_id="x", status=gpb.ALIVE, claim_certificate=b"\0" * 9000)])
