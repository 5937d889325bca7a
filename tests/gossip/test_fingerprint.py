"""The cluster fingerprint (agent/fingerprint.py): carried in member states, learned with a member's newer
incarnation, refuted by its owner when a view of its previous process says another; the check abstains when a
quorum of the voters holds another fingerprint, or last held one (kept in the data_dir), and names the differing
fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.clock import FakeClock
from agent.fingerprint import FingerprintCheck, describe, differences, load_cluster
from agent.gossip.gossip_node import GossipNode
from agent.storage.datadir import DataDirError
from agent.transport.sim import SimNetwork
from chaos.gossipsim import profile_gossip
from elasticmoe.v1 import gossip_pb2 as pb

FP = pb.Fingerprint(nodes=3, ranks_per_node=2, slots_per_rank=4, layers=2, experts=8, top_k=2, genesis=b"g" * 8)
DRIFT = pb.Fingerprint(nodes=3, ranks_per_node=2, slots_per_rank=5, layers=2, experts=8, top_k=2, genesis=b"h" * 8)


def node(fp: pb.Fingerprint) -> GossipNode:
    net = SimNetwork(FakeClock(), 0)
    g = GossipNode("me", "me:1", [0], profile_gossip("lan"), net.clock("me"), net.transport("me"), {}, rng_seed=0,
                   shape=(2, 8), fingerprint=fp)
    g.start()
    return g


def state(n: str, inc: int, fp: pb.Fingerprint | None) -> pb.MemberState:
    st = pb.MemberState(node_id=n, incarnation=inc, status=pb.ALIVE, address=f"{n}:1")
    if fp is not None:
        st.fingerprint.CopyFrom(fp)
    return st


def test_a_member_state_carries_its_fingerprint_and_a_newer_incarnation_replaces_it() -> None:
    g = node(FP)
    assert g.membership.state_pb("me").fingerprint == FP
    g.membership.apply(state("x", 0, DRIFT), push_pull=True)
    g.membership.apply(state("y", 0, None), push_pull=True)  # a member too old to say: not judged
    assert g.fingerprints() == {"me": FP, "x": DRIFT}
    g.membership.apply(state("x", 1, FP))  # x restarted with the cluster's config
    assert g.fingerprints()["x"] == FP
    g.membership.apply(state("x", 2, None))  # x came back on a release that says none (a downgrade)
    assert "x" not in g.fingerprints() and not g.membership.state_pb("x").HasField("fingerprint")


def test_a_view_of_our_previous_process_with_another_fingerprint_is_refuted() -> None:
    g = node(FP)
    inc = g.membership.incarnation
    g.membership.apply(state("me", inc, DRIFT))  # what the others still hold of our previous process
    assert g.membership.incarnation == inc + 1 and g.membership.state_pb("me").fingerprint == FP
    g.membership.apply(state("me", g.membership.incarnation, FP))  # our own view: nothing to refute
    assert g.membership.incarnation == inc + 1


def test_the_check_abstains_only_against_a_quorum_and_names_the_fields() -> None:
    voters = ["a", "b", "c"]
    heard = {"a": DRIFT, "b": FP, "c": FP}
    drifted = FingerprintCheck("a", DRIFT, voters, lambda: heard)
    why = drifted.verdict()
    assert why.startswith("cluster fingerprint differs from the one 2 of 3 voters hold (b, c): slots_per_rank = 5 "
                          "here, 4 on b; genesis = 6868686868686868 here, 6767676767676767 on b"), why
    fine = FingerprintCheck("b", FP, voters, lambda: heard)
    assert fine.verdict() == "" and fine.mismatches() == [("a", differences(FP, DRIFT))]
    split = FingerprintCheck("a", DRIFT, voters, lambda: {"a": DRIFT, "b": FP})  # c unheard: no quorum
    assert split.verdict() == "" and [n for n, _ in split.mismatches()] == ["b"]


def test_the_check_is_sticky_to_the_fingerprint_a_quorum_last_held_and_keeps_it(tmp_path: Path) -> None:
    """a (drifted) abstains against b and c; with c unheard it goes on abstaining (one against one, but b's is the
    fingerprint a quorum last held), and so does a new check on the same file (a restart); it votes again once
    its config agrees, or once a quorum holds its fingerprint (a rolling change past its majority)."""
    voters, keep = ["a", "b", "c"], tmp_path / "FINGERPRINT"
    heard = {"a": DRIFT, "b": FP, "c": FP}
    drifted = FingerprintCheck("a", DRIFT, voters, lambda: heard, keep=keep)
    assert drifted.verdict().startswith("cluster fingerprint differs from the one 2 of 3 voters hold")
    assert load_cluster(keep) == FP
    del heard["c"]
    why = drifted.verdict()
    assert why.startswith("cluster fingerprint differs from the one a quorum of the 3 voters last held") \
        and "slots_per_rank = 5 here, 4 in the cluster" in why, why
    again = FingerprintCheck("a", DRIFT, voters, lambda: {"a": DRIFT}, keep=keep)  # restarted, alone
    assert again.verdict() == why
    assert FingerprintCheck("a", FP, voters, lambda: {"a": FP}, keep=keep).verdict() == ""  # its config agrees
    heard["c"] = DRIFT  # c restarted with a's config: a quorum holds it now
    assert drifted.verdict() == "" and load_cluster(keep) == DRIFT
    b = FingerprintCheck("b", FP, voters, lambda: heard, keep=tmp_path / "b")
    assert b.verdict().startswith("cluster fingerprint differs from the one 2 of 3 voters hold (a, c)")


def test_a_kept_fingerprint_that_does_not_parse_names_the_file(tmp_path: Path) -> None:
    keep = tmp_path / "FINGERPRINT"
    keep.write_text("nodes=3 top_k=two\n")
    with pytest.raises(DataDirError, match="FINGERPRINT: cannot read the cluster fingerprint"):
        FingerprintCheck("a", FP, ["a"], lambda: {}, keep=keep)
    keep.write_text(describe(FP) + "\n")
    assert FingerprintCheck("a", FP, ["a"], lambda: {}, keep=keep).cluster == FP
