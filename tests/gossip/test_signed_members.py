"""Gossip member claims under mTLS: a member's address, ranks and incarnation are accepted only as the member's
own signed word (relayed unchanged by anyone), or as SWIM suspicion of a member already known. In plaintext
nothing can be checked, so a forged member is taken as heard (test_restart shows it still drains nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.consensus.signing import VoteSigner
from agent.gossip.membership import MemberStatus
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


def _moved(real: gpb.MemberState) -> gpb.MemberState:
    """n1's state at the next incarnation with another address, with a claim that matches it exactly (so
    that only the signature can tell it from n1's own word); the signature and certificate are left to set."""
    st = gpb.MemberState()
    st.CopyFrom(real)
    st.address, st.incarnation = "10.9.9.9:7400", real.incarnation + 1
    st.claim = gpb.MemberState(node_id="n1", address=st.address, incarnation=st.incarnation, status=st.status,
                               ranks=list(st.ranks)).SerializeToString(deterministic=True)
    return st


def _flipped(sig: bytes, at: int) -> bytes:
    b = bytearray(sig)
    b[at] ^= 0x01
    return bytes(b)


def test_a_claim_whose_signature_bytes_do_not_verify_is_refused(cert_dir: Path) -> None:
    """The issuer and the name are right (n1's own certificate) and the claim matches the state: only the
    signature bytes are wrong (flipped, truncated, another claim's, empty), and each is refused and counted."""
    sim = _sim(cert_dir)
    m3 = sim.nodes["n3"].membership
    real = m3.state_pb("n1")
    n1 = VoteSigner.from_cert_dir(cert_dir, "n1")
    st = _moved(real)
    genuine = n1.sign_claim(st.claim)
    sigs = [_flipped(genuine, len(genuine) - 1), _flipped(genuine, len(genuine) // 2), genuine[:-1],
            real.claim_signature, b""]
    for sig in sigs:
        before = m3.refused
        bad = gpb.MemberState()
        bad.CopyFrom(st)
        bad.claim_signature, bad.claim_certificate = sig, n1.cert_der
        m3.absorb([bad], "n2")
        assert m3.refused == before + 1
        assert "n1: claim signature does not verify" in m3.refused_why
        got = m3.get("n1")
        assert got is not None and got.address == real.address and got.incarnation == real.incarnation
    ok = gpb.MemberState()  # the same state with n1's real signature is taken: the refusals were the bytes
    ok.CopyFrom(st)
    ok.claim_signature, ok.claim_certificate = genuine, n1.cert_der
    before = m3.refused
    m3.absorb([ok], "n2")
    assert m3.refused == before and m3.get("n1").address == "10.9.9.9:7400"  # type: ignore[union-attr]


def test_a_signature_over_another_claim_is_refused(cert_dir: Path) -> None:
    """n1 really signed a claim, but not this one: its signature over another claim (another address) does
    not make this state n1's word, for a known member (an address change) or a new one (mallory's key)."""
    sim = _sim(cert_dir)
    m3 = sim.nodes["n3"].membership
    real = m3.state_pb("n1")
    n1 = VoteSigner.from_cert_dir(cert_dir, "n1")
    st = _moved(real)
    other = gpb.MemberState(node_id="n1", address="10.8.8.8:7400", incarnation=st.incarnation, status=st.status,
                            ranks=list(st.ranks)).SerializeToString(deterministic=True)
    st.claim_signature, st.claim_certificate = n1.sign_claim(other), n1.cert_der
    before = m3.refused
    m3.absorb([st], "n2")
    assert m3.refused == before + 1 and "n1: claim signature does not verify" in m3.refused_why
    got = m3.get("n1")
    assert got is not None and got.address == real.address and got.incarnation == real.incarnation
    mallory = VoteSigner.from_cert_dir(cert_dir, "mallory")
    new = _forged_alive("mallory", [5])
    new.claim = gpb.MemberState(node_id="mallory", address=new.address, incarnation=1, status=gpb.ALIVE,
                                ranks=[5]).SerializeToString(deterministic=True)
    elsewhere = gpb.MemberState(node_id="mallory", address="10.7.7.7:7400", incarnation=1, status=gpb.ALIVE,
                                ranks=[5]).SerializeToString(deterministic=True)
    new.claim_signature, new.claim_certificate = mallory.sign_claim(elsewhere), mallory.cert_der
    m3.absorb([new], "n2")
    assert m3.refused == before + 2 and "mallory: claim signature does not verify" in m3.refused_why
    assert not m3.is_known("mallory")


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
    from agent.gossip.membership import check_states
    from agent.transport import InvalidArgument

    with pytest.raises(InvalidArgument, match="certificate of 9000"):
        check_states([gpb.MemberState(node_id="x", status=gpb.ALIVE, claim_certificate=b"\0" * 9000)])
