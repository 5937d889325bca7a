"""Load windows bound to their node (mTLS: each window carries its node's signature, checked at every hop) and
to the present (plaintext too: a window far ahead in incarnation or window_seq is refused). A refusal is counted
by reason and changes nothing: the node's genuine windows keep winning."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent.consensus.signing import VoteSigner
from agent.gossip.gossip_node import GossipNode
from agent.gossip.windowguard import WINDOW_SEQ_LEAD, Refusal
from chaos.gossipsim import GossipSim
from elasticmoe.v1 import gossip_pb2 as gpb

IDS = ["n1", "n2", "n3", "n4"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from agent.security import write_dev_certs

    d = tmp_path_factory.mktemp("tls")
    write_dev_certs(d, IDS)
    other = tmp_path_factory.mktemp("other-ca")  # a CA the cluster does not trust, issuing "n1" too
    write_dev_certs(other, ["n1"])
    return d, other


def _sim(cert_dir: Path | None) -> GossipSim:
    sim = GossipSim(seed=5)
    if cert_dir is not None:
        sim.signers = {n: VoteSigner.from_cert_dir(cert_dir, n) for n in IDS}
    sim.add_nodes(len(IDS))
    sim.run(5.0)
    assert sim.converged()
    for n in IDS:
        sim.publish(n)
    sim.run(2.0)
    assert all(sim.nodes[o].load.has(n, 0, 1) for o in IDS for n in IDS)
    return sim


def _held(node: GossipNode, of: str) -> tuple[int, int]:
    w = node.load._w[of]
    return (w.incarnation, w.window_seq)


def _window(of: str, inc: int, seq: int, value: int = 7, shape: tuple[int, int] = (2, 4)) -> gpb.LoadWindow:
    counts = np.full(shape, value, dtype="<u4").tobytes()
    return gpb.LoadWindow(node_id=of, incarnation=inc, window_seq=seq, layers=shape[0], experts=shape[1],
                          counts=counts, steps=100, first_step=(seq - 1) * 100)


def _push(sim: GossipSim, src: str, dst: str, w: gpb.LoadWindow) -> None:
    """`src` pushes `w` to `dst` over its own connection (whose certificate is src's)."""
    sim.nodes[dst]._handle_push(src, gpb.PushRequest(from_node=src, windows=[w]))


def _sign_as(signer: VoteSigner, w: gpb.LoadWindow) -> gpb.LoadWindow:
    from agent.gossip.windowguard import window_payload

    w.signature = signer.sign_window(window_payload(w))
    w.certificate = signer.cert_der
    return w


def _refused(sim: GossipSim, n: str) -> dict[Refusal, int]:
    return {r: c for r, c in sim.nodes[n].load.refused.items() if c}


def test_a_signed_cluster_carries_signed_windows_and_refuses_none(certs: tuple[Path, Path]) -> None:
    sim = _sim(certs[0])
    for _ in range(3):
        for n in IDS:
            sim.publish(n)
        sim.run(1.0)
    for o in IDS:
        assert _refused(sim, o) == {}, sim.nodes[o].load.refused_why
        for n in IDS:
            w = sim.nodes[o].load._w[n]
            assert w.window_seq == 4 and w.signature and w.certificate == sim.signers[n].cert_der


def test_a_relayed_genuine_window_is_accepted_at_a_third_node(certs: tuple[Path, Path]) -> None:
    sim = _sim(certs[0])
    sim.publish("n1")  # n1's window 2, not yet delivered to anyone
    w = gpb.LoadWindow()
    w.CopyFrom(sim.nodes["n1"].load._w["n1"])
    _push(sim, "n1", "n2", w)  # n2 has it from its origin ...
    relayed = sim.nodes["n2"].load.newer_than([], 1 << 20)
    relayed_w = next(x for x in relayed if x.node_id == "n1")
    _push(sim, "n2", "n3", relayed_w)  # ... and n3 from n2, whose certificate is not n1's
    assert _held(sim.nodes["n3"], "n1") == (0, 2)
    assert _refused(sim, "n3") == {}


@pytest.mark.parametrize("how", ["signed_by_n2", "unsigned", "tampered", "tampered_learner", "tampered_samples",
                                 "foreign_ca"])
def test_a_window_for_another_node_is_refused_and_counted(certs: tuple[Path, Path], how: str) -> None:
    """n2 (a legitimate node) pushes a window "for n1" to n3 and n4: signed with its own key, unsigned, n1's
    genuine signature over other counts, with `learner` set (which would take n1 out of the planning turn) or
    with other sampled steps, or signed by an "n1" of another CA. Refused and counted; n1's view unchanged, and n1's next genuine window
    accepted."""
    good, other = certs
    sim = _sim(good)
    if how == "signed_by_n2":
        forged = _sign_as(sim.signers["n2"], _window("n1", 0, 2, value=99))
        reason = Refusal.BAD_SIGNATURE
    elif how == "unsigned":
        forged = _window("n1", 0, 2, value=99)
        reason = Refusal.UNSIGNED
    elif how == "tampered":
        forged = _sign_as(sim.signers["n1"], _window("n1", 0, 2, value=1))
        forged.counts = np.full((2, 4), 99, dtype="<u4").tobytes()
        reason = Refusal.BAD_SIGNATURE
    elif how == "tampered_samples":
        from elasticmoe.loadcodec import pack_rows

        w = _window("n1", 0, 2, value=1)  # steps 100..199 sampled every 50: steps 100 and 150
        w.samples, w.sample_every = pack_rows(np.zeros((2, 2, 4), np.uint32)), 50
        forged = _sign_as(sim.signers["n1"], w)
        forged.samples = pack_rows(np.full((2, 2, 4), 99, np.uint32))
        reason = Refusal.BAD_SIGNATURE
    elif how == "tampered_learner":
        forged = _sign_as(sim.signers["n1"], _window("n1", 0, 2, value=1))
        forged.learner = True
        reason = Refusal.BAD_SIGNATURE
    else:
        forged = _sign_as(VoteSigner.from_cert_dir(other, "n1"), _window("n1", 0, 2, value=99))
        reason = Refusal.BAD_SIGNATURE
    for dst in ("n3", "n4"):
        signer, checks = sim.signers[dst], []
        signer.check_window = (  # type: ignore[method-assign]
            lambda *a, checks=checks, check=signer.check_window: checks.append(1) or check(*a))
        _push(sim, "n2", dst, forged)
        _push(sim, "n2", dst, forged)  # twice: counted twice, verified once
        assert len(checks) == (0 if reason is Refusal.UNSIGNED else 1)
        assert _refused(sim, dst) == {reason: 2}
        assert _held(sim.nodes[dst], "n1") == (0, 1)
        assert int(sim.nodes[dst].load.view().windows["n1"].counts[0, 0]) != 99
        assert "n1" not in sim.nodes[dst].learners()
    sim.publish("n1")
    sim.run(2.0)
    assert all(_held(sim.nodes[o], "n1") == (0, 2) for o in ("n2", "n3", "n4"))


def test_the_forgery_of_the_issue_is_refused_under_mtls(certs: tuple[Path, Path]) -> None:
    """A Push signed by n2's connection carrying a window for n1 at incarnation 10^9, window_seq 10^12."""
    sim = _sim(certs[0])
    forged = _sign_as(sim.signers["n2"], _window("n1", 10**9, 10**12))
    for dst in ("n3", "n4"):
        _push(sim, "n2", dst, forged)
        assert _refused(sim, dst) == {Refusal.BAD_SIGNATURE: 1}
    for _ in range(3):
        sim.publish("n1")
        sim.run(1.0)
    assert all(_held(sim.nodes[o], "n1") == (0, 4) for o in ("n2", "n3", "n4"))


@pytest.mark.parametrize("signed", [False, True])
def test_windows_from_the_future_are_refused(certs: tuple[Path, Path], signed: bool) -> None:
    """In plaintext any node can say anything about n1, but not from the future: an incarnation past n1's
    member record, or a window_seq more than WINDOW_SEQ_LEAD past the newest held. Under mTLS the bound holds
    for n1's own signature too."""
    sim = _sim(certs[0] if signed else None)
    n3 = sim.nodes["n3"]

    def make(inc: int, seq: int) -> gpb.LoadWindow:
        w = _window("n1", inc, seq)
        return _sign_as(sim.signers["n1"], w) if signed else w

    _push(sim, "n2", "n3", make(10**9, 10**12))  # the issue's window
    _push(sim, "n2", "n3", make(1, 2))  # n1's member record is at incarnation 0
    _push(sim, "n2", "n3", make(0, 1 + WINDOW_SEQ_LEAD + 1))
    assert _refused(sim, "n3") == {Refusal.FUTURE_INCARNATION: 2, Refusal.FUTURE_WINDOW_SEQ: 1}
    assert _held(n3, "n1") == (0, 1)
    _push(sim, "n2", "n3", make(0, 1 + WINDOW_SEQ_LEAD))  # at the bound: accepted (a gap, not the future)
    assert _held(n3, "n1") == (0, 1 + WINDOW_SEQ_LEAD)
    assert sum(_refused(sim, "n3").values()) == 3
    # (in plaintext such a window, forged, hides n1's genuine ones for at most WINDOW_SEQ_LEAD windows; under
    # mTLS only n1 can sign it)


def test_digests_from_the_future_pull_nothing() -> None:
    sim = _sim(None)
    n3 = sim.nodes["n3"]
    before = sim.net.stats.bytes_by_method.get("Gossip/Pull", 0)
    n3.load.on_digests("n2", [gpb.Digest(node_id="n1", incarnation=10**9, window_seq=10**12)])
    assert "n1" not in n3.load._pending
    assert sim.net.stats.bytes_by_method.get("Gossip/Pull", 0) == before


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("engine", ["continues", "restarts"])
def test_a_restarted_node_is_accepted(certs: tuple[Path, Path], signed: bool, engine: str) -> None:
    """n1's agent restarts (a new process at incarnation 0, refuting up to a new incarnation); its engine
    either kept stepping (window_seq continues, past a gap) or restarted too (window_seq from 1 again)."""
    sim = _sim(certs[0] if signed else None)
    for _ in range(4):
        sim.publish("n1")
        sim.run(0.5)
    sim.crash("n1")
    sim.run(0.5)  # down for less than failure detection: its peers still hold it alive
    sim.net.restart("n1")
    sim.crashed.discard("n1")
    node = GossipNode("n1", "n1:7400", [0], sim.cfg, sim.net.clock("n1"), sim.net.transport("n1"),
                      {"n2": "n2:7400"}, rng_seed=99, shape=sim.shape, signer=sim.signers.get("n1"))
    sim.nodes["n1"] = node
    node.start()
    sim.run(3.0)
    assert node.incarnation >= 1  # it refuted the incarnation its peers held
    seq = 5 + 40 if engine == "continues" else 1
    sim.publish("n1", seq)
    sim.run(3.0)
    for o in ("n2", "n3", "n4"):
        assert _held(sim.nodes[o], "n1") == (node.incarnation, seq)
        assert _refused(sim, o) == {}, sim.nodes[o].load.refused_why


@pytest.mark.parametrize("signed", [False, True])
def test_a_window_below_its_members_incarnation_is_refused(certs: tuple[Path, Path], signed: bool) -> None:
    """n1 refutes a suspicion (incarnation 1) and re-stamps its window; its incarnation-0 windows are an earlier
    life's from then on: one pushed to n3 (n1's genuine signature under mTLS) is refused and counted, a digest of
    one pulls nothing."""
    sim = _sim(certs[0] if signed else None)
    old = gpb.LoadWindow()
    old.CopyFrom(sim.nodes["n1"].load._w["n1"])
    old.window_seq = 2  # newer than n1's window held everywhere, as a window captured later would be
    if signed:
        _sign_as(sim.signers["n1"], old)
    sim.nodes["n1"].membership.apply(gpb.MemberState(node_id="n1", incarnation=0, status=gpb.SUSPECT,
                                                     from_node="n2"))
    sim.run(2.0)
    assert all(_held(sim.nodes[o], "n1") == (1, 1) for o in ("n2", "n3", "n4"))
    sim.nodes["n3"].load._w.pop("n1")  # (as after a reap: nothing of n1 held, so the old window would be newest)
    _push(sim, "n2", "n3", old)
    assert _refused(sim, "n3") == {Refusal.STALE_INCARNATION: 1}
    assert "n1" not in sim.nodes["n3"].load._w
    sim.nodes["n3"].load.on_digests("n2", [gpb.Digest(node_id="n1", incarnation=0, window_seq=2)])
    assert "n1" not in sim.nodes["n3"].load._pending
