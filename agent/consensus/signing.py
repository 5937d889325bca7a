"""Signed votes, member claims and load windows: under mTLS a quorum certificate carries every signer's
signature, checked by every node, and a gossip member's address, ranks and incarnation, and each of its load
windows, are its own signed word. So does a certified control record (the pause switch): each voter it names
signed `control_digest(record)` when it accepted it, and its writer signs `writer_digest(record)`, its word that it
wrote the record for the admin it names (so that a voter finishing another writer's record can show the writer
wrote it, and every node can check who asked).

Without signatures a certificate is a list of voter names: one forged `Learn` (or a member's) could make an
arbitrary table the head everywhere. With them, each voter signs `accept_digest(version, ballot,
table_hash)` with its node key (the mTLS key pair of `emoe certs`, ECDSA P-256) when it accepts, and sends its
node certificate with the signature. A certificate is valid only if a quorum of the named voters each has a
signature that verifies under a certificate the cluster CA issued to that voter's name. Plaintext clusters
have no keys, so their certificates stay unsigned (and `emoe agent --check` refuses plaintext off loopback).

Promises are not signed, on purpose: a signature matters for what is relayed (a certificate travels from
node to node; a member claim is gossiped), and a promise never is. It is the reply to the proposer's own
call, on a channel whose server certificate must be issued to the acceptor called
(`ssl_target_name_override`), so nobody but that acceptor can answer for it, and a signature would let the
acceptor say nothing it cannot already say.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from elasticmoe.v1 import consensus_pb2 as pb

_DOMAIN = b"elasticmoe/v1 accept\x00"
_CLAIM_DOMAIN = b"elasticmoe/v1 member\x00"  # a member's signed word about itself (agent/gossip/membership.py)
_WINDOW_DOMAIN = b"elasticmoe/v1 window\x00"  # a node's own load window (agent/gossip/windowguard.py)
_CONTROL_DOMAIN = b"elasticmoe/v1 control\x00"  # a voter's accept of a control record (agent/consensus/control.py)
_WRITER_DOMAIN = b"elasticmoe/v1 control writer\x00"  # a control record's writer vouching for it


def accept_digest(version: int, ballot: tuple[int, str], table_hash: bytes) -> bytes:
    """The bytes a voter signs when it accepts `table_hash` for `version` at `ballot`."""
    return _DOMAIN + struct.pack("<QQ", version, ballot[0]) + ballot[1].encode() + b"\x00" + table_hash


def _fields(r: pb.ControlRecord) -> bytes:
    """Fields 1 to 5 of control record `r`, each string length-prefixed."""
    node, note = r.node_id.encode(), r.note.encode()
    return (struct.pack("<QBQ", r.seq, int(r.paused), r.at_ms) + struct.pack("<I", len(node)) + node
            + struct.pack("<I", len(note)) + note)


def control_digest(r: pb.ControlRecord) -> bytes:
    """The bytes a voter signs when it accepts control record `r`: fields 1 to 5, as every release signs them
    (so that the certificates of both releases of a rolling upgrade check on both). Not `admin` (6): a voter
    cannot know who asked the writer; the writer vouches for it (`writer_digest`)."""
    return _CONTROL_DOMAIN + _fields(r)


def writer_digest(r: pb.ControlRecord) -> bytes:
    """The bytes the writer of control record `r` signs, its word that it wrote `r` for `r.admin`: every field,
    `admin` included (another domain than a voter's accept, so that neither stands for the other)."""
    admin = r.admin.encode()
    return _WRITER_DOMAIN + _fields(r) + struct.pack("<I", len(admin)) + admin


class SignatureError(ValueError):
    """A signature or certificate that does not verify; the message says which and why."""


class VoteSigner:
    """This node's signing key and certificate, and the cluster CA that vouches for every voter's."""

    def __init__(self, node_id: str, key: ec.EllipticCurvePrivateKey, cert_der: bytes, ca: x509.Certificate) -> None:
        self.node_id = node_id
        self._key = key
        self.cert_der = cert_der
        self._ca = ca
        self._known: dict[bytes, tuple[str, ec.EllipticCurvePublicKey]] = {}  # sha256(DER) -> (CN, key)

    @classmethod
    def from_cert_dir(cls, cert_dir: str | Path, node_id: str) -> VoteSigner:
        from agent.security import cert_paths, identity_files

        ca_pem, cert_pem, key_pem = identity_files(cert_dir, node_id)
        key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise SignatureError(f"{cert_paths(cert_dir, node_id)[1]}: expected an EC private key (emoe certs makes "
                                 "P-256)")
        cert = x509.load_pem_x509_certificate(cert_pem)
        return cls(node_id, key, cert.public_bytes(serialization.Encoding.DER), x509.load_pem_x509_certificate(ca_pem))

    def sign(self, version: int, ballot: tuple[int, str], table_hash: bytes) -> bytes:
        return self._key.sign(accept_digest(version, ballot, table_hash), ec.ECDSA(hashes.SHA256()))

    def sign_claim(self, claim: bytes) -> bytes:
        """Sign this node's member claim (a serialized gossip MemberState about itself)."""
        return self._key.sign(_CLAIM_DOMAIN + claim, ec.ECDSA(hashes.SHA256()))

    def check_claim(self, member: str, claim: bytes, cert_der: bytes, signature: bytes) -> str:
        """Why `claim` is not `member`'s own signed word, or ""."""
        return self._check(member, cert_der, signature, _CLAIM_DOMAIN + claim, "claim signature")

    def sign_window(self, payload: bytes) -> bytes:
        """Sign this node's load window (`payload`: agent.gossip.windowguard.window_payload of it)."""
        return self._key.sign(_WINDOW_DOMAIN + payload, ec.ECDSA(hashes.SHA256()))

    def check_window(self, node: str, payload: bytes, cert_der: bytes, signature: bytes) -> str:
        """Why `payload` (agent.gossip.windowguard.window_payload of a window) is not `node`'s own signed word, or ""."""
        return self._check(node, cert_der, signature, _WINDOW_DOMAIN + payload, "window signature")

    def _check(self, name: str, cert_der: bytes, signature: bytes, signed: bytes, what: str) -> str:
        """Why `signature` over `signed` is not by `name` under a certificate the cluster CA issued it, or ""."""
        try:
            cn, pub = self._voter_key(cert_der)
        except SignatureError as e:
            return f"{name}: {e}"
        if cn != name:
            return f"{name}: signed with the certificate of {cn!r}"
        try:
            pub.verify(signature, signed, ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            return f"{name}: {what} does not verify"
        return ""

    def _voter_key(self, cert_der: bytes) -> tuple[str, ec.EllipticCurvePublicKey]:
        """(CN, public key) of a certificate the cluster CA issued; cached by its DER bytes."""
        h = hashlib.sha256(cert_der).digest()
        hit = self._known.get(h)
        if hit is not None:
            return hit
        try:
            cert = x509.load_der_x509_certificate(cert_der)
            ca_key = self._ca.public_key()
            if not isinstance(ca_key, ec.EllipticCurvePublicKey) or cert.signature_hash_algorithm is None:
                raise SignatureError("the cluster CA is not an EC key")
            ca_key.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm))
        except InvalidSignature:
            raise SignatureError("certificate not issued by the cluster CA") from None
        except ValueError as e:
            raise SignatureError(f"certificate unreadable: {e}") from None
        cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        pub = cert.public_key()
        if not cns or not isinstance(pub, ec.EllipticCurvePublicKey):
            raise SignatureError("certificate has no CN or no EC key")
        out = (str(cns[0].value), pub)
        if len(self._known) > 4096:  # bounded: a hostile peer cannot grow it without end
            self._known.clear()
        self._known[h] = out
        return out

    def sign_control(self, r: pb.ControlRecord) -> bytes:
        """Sign this voter's accept of control record `r`."""
        return self._key.sign(control_digest(r), ec.ECDSA(hashes.SHA256()))

    def sign_writer(self, r: pb.ControlRecord) -> pb.VoteSignature:
        """This node's word that it wrote control record `r` (for ControlAcceptRequest.writer)."""
        sig = self._key.sign(writer_digest(r), ec.ECDSA(hashes.SHA256()))
        return pb.VoteSignature(voter=self.node_id, certificate=self.cert_der, signature=sig)

    def check_writer(self, r: pb.ControlRecord, s: pb.VoteSignature) -> str:
        """Why `s` is not the signature of `r`'s writer (`r.node_id`) over `r` under a certificate the cluster CA
        issued it, or ""."""
        if s.voter != r.node_id:
            return f"writer.voter = {s.voter[:64]!r}: expected the record's node_id {r.node_id[:64]!r}"
        return self._check(r.node_id, s.certificate, s.signature, writer_digest(r), "writer signature")

    def check_control(self, c: pb.ControlCommit, must_sign: Callable[[str], bool]) -> str:
        """Why a voter that `c` names has no signature over its record that verifies, or "". A named voter
        without a signature passes only where `must_sign(voter)` is False (a voter last seen running a release
        before control signatures); a signature present must verify. (Which voters and how many is
        `control.check_commit`.)"""
        sigs = {s.voter: s for s in c.signatures}
        signed = control_digest(c.record)
        for voter in c.voters:
            s = sigs.get(voter)
            if s is None:
                if must_sign(voter):
                    return f"signatures: no signature of {voter}"
                continue
            why = self._check(voter, s.certificate, s.signature, signed, "control signature")
            if why:
                return f"signatures: {why}"
        return ""

    def check_vote(self, voter: str, version: int, ballot: tuple[int, str], table_hash: bytes, cert_der: bytes,
                   signature: bytes) -> str:
        """Why this vote's signature does not verify, or ""."""
        return self._check(voter, cert_der, signature, accept_digest(version, ballot, table_hash), "signature")

    def check_certificate(self, c: pb.Commit, voters: Iterable[str]) -> str:
        """Why `c`'s quorum certificate lacks verifiable signatures of the voters it names, or "". (Which voters
        and how many is `paxos.check_certificate`; this checks that each named voter really signed.)"""
        qc = c.qc
        ballot = (int(qc.ballot.round), qc.ballot.node_id)
        sigs = {s.voter: s for s in qc.signatures}
        vs = set(voters)
        for voter in qc.voters:
            s = sigs.get(voter)
            if s is None or voter not in vs:
                return f"qc.signatures: no signature of {voter}"
            why = self.check_vote(voter, int(qc.version), ballot, qc.table_hash, s.certificate, s.signature)
            if why:
                return f"qc.signatures: {why}"
        return ""
