"""Signed member claims (mTLS): a member's address, ranks, incarnation and alive/left status are its own word,
signed with its node key and relayed unchanged (gossip MemberState.claim, claim_signature, claim_certificate).
A state that adds a member, or says it is alive or left, is accepted only with a claim that matches it and
verifies under a certificate the cluster CA issued to that member's name; suspicion and death of a member
already known need none (SWIM: anyone may suspect, the member refutes). agent/gossip/membership.py applies it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from typing import Protocol

from elasticmoe.v1 import gossip_pb2 as pb

log = logging.getLogger(__name__)

# A member's signed word about itself, as relayed: (claim, signature, certificate DER).
Proof = tuple[bytes, bytes, bytes]
MAX_CLAIM_BYTES, MAX_SIGNATURE_BYTES, MAX_CERT_BYTES = 1 << 12, 256, 1 << 13
_STATUS = {pb.ALIVE: "alive", pb.SUSPECT: "suspect", pb.DEAD: "dead", pb.LEFT: "left"}


class ClaimSigner(Protocol):
    """This node's key and the cluster CA (agent.consensus.signing.VoteSigner under mTLS)."""

    cert_der: bytes

    def sign_claim(self, claim: bytes) -> bytes: ...

    def check_claim(self, member: str, claim: bytes, cert_der: bytes, signature: bytes) -> str: ...


class Claims:
    """Signs this node's claims and checks others' (each distinct claim verified once; bounded cache)."""

    def __init__(self, signer: ClaimSigner) -> None:
        self.signer = signer
        self.refused = 0  # member states refused for a missing or wrong claim
        self.refused_why = ""
        self._verified: dict[bytes, None] = {}

    def sign(self, node_id: str, address: str, incarnation: int, status: pb.MemberStatus, ranks: Iterable[int],
             fingerprint: pb.Fingerprint | None = None) -> Proof:
        c = pb.MemberState(node_id=node_id, address=address, incarnation=incarnation, status=status, ranks=list(ranks))
        if fingerprint is not None:
            c.fingerprint.CopyFrom(fingerprint)
        claim = c.SerializeToString(deterministic=True)
        return claim, self.signer.sign_claim(claim), self.signer.cert_der

    def accept(self, st: pb.MemberState, known: bool) -> bool:
        """Whether `st` may be applied; a refusal is counted and logged (once per distinct reason)."""
        why = self.fault(st, known)
        if why:
            self.refused += 1
            if why != self.refused_why:  # a hostile peer cannot flood the log
                log.warning("refused a member state: %s", why)
            self.refused_why = why
        return not why

    def fault(self, st: pb.MemberState, known: bool) -> str:
        """Why `st` is not backed by its member's own signed claim, or "" (also "" for a suspicion of a member we
        know)."""
        status = _STATUS.get(st.status, "unknown")
        if known and st.status in (pb.SUSPECT, pb.DEAD):
            return ""
        if not st.claim:
            return f"member state {st.node_id!r} ({status}, incarnation {st.incarnation}) has no signed claim"
        c = pb.MemberState()
        try:
            c.ParseFromString(st.claim)
        except Exception:  # noqa: BLE001 - any undecodable claim is refused, not raised
            return f"member state {st.node_id!r}: claim does not decode"
        if c.node_id != st.node_id or c.address != st.address or list(c.ranks) != list(st.ranks):
            return (f"member state {st.node_id!r} at {st.address!r} ranks {list(st.ranks)}: its claim says "
                    f"{c.node_id!r} at {c.address!r} ranks {list(c.ranks)}")
        if st.HasField("fingerprint") and c.fingerprint != st.fingerprint:  # (a claim without one: unset, differs)
            return f"member state {st.node_id!r}: its fingerprint is not the one its claim says"
        if st.status in (pb.ALIVE, pb.LEFT):
            if c.status != st.status or c.incarnation != st.incarnation:
                return (f"member state {st.node_id!r} {status} at incarnation {st.incarnation}: its claim is "
                        f"{_STATUS.get(c.status, 'alive')} at {c.incarnation}")
        elif c.incarnation > st.incarnation:
            return f"member state {st.node_id!r} at incarnation {st.incarnation}: claim from {c.incarnation}"
        key = hashlib.blake2b(st.claim + b"\0" + st.claim_signature + st.claim_certificate, digest_size=16).digest()
        if key in self._verified:
            return ""
        why = self.signer.check_claim(st.node_id, st.claim, st.claim_certificate, st.claim_signature)
        if not why:
            if len(self._verified) > 4096:
                self._verified.clear()
            self._verified[key] = None
        return why
