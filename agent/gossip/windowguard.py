"""Load windows bound to their node and to the present; agent/gossip/loadgossip.py stores a window only if this allows.

- Signed (mTLS): a window is its node's own word. The origin signs it once (LoadWindow.signature over
  `window_payload`, with its DER certificate in LoadWindow.certificate) and every relay passes it on unchanged
  through pushes, pulls and push-pull, so each hop checks the signature itself: the certificate of the
  connection it came on names only the last relay. A window without a signature, or whose signature does not
  verify under a certificate the cluster CA issued to the window's node, is refused. Plaintext clusters carry
  no signatures and check none.
- Not from the future (plaintext too): newest (incarnation, window_seq) wins, so one window far ahead would
  hide every genuine window of its node for as long as it leads; a window may lead only within the bounds
  below (`ahead`).
- Not from the past (plaintext too): a window below its member's incarnation is an earlier life's (`stale`). A
  node's windows are stamped with its incarnation and re-stamped when it refutes, so once this node holds the
  member at incarnation i, no genuine window of it is at less than i. Without this floor a window captured
  before its node was reaped, replayed after the node came back (at a higher incarnation, with no window yet
  held of it), was newer than anything held and became the node's newest everywhere.

A refusal is counted by reason (`refused`), logged once per reason and node, and changes no state. Each
distinct window is checked once (a bounded cache of verdicts); the node's certificate once (VoteSigner).
"""

from __future__ import annotations

import hashlib
import logging
import struct
from enum import StrEnum
from typing import Protocol

from google.protobuf.unknown_fields import UnknownFieldSet

from elasticmoe.v1 import gossip_pb2 as pb

log = logging.getLogger(__name__)

# A window's incarnation may not exceed the incarnation this node holds for the window's member (lead 0).
# A node stamps its windows with its own incarnation, which it raises only to refute (by one, announced at
# once to every live member; a restarted node too: it refutes the incarnation its peers hold for it) and then
# re-stamps its window under it: so the member record moves first, and a window ahead of it was forged, or
# overtook the refutation's announcement. The latter is refused now and arrives again with the next digest or
# push-pull, which applies member states before windows. Under mTLS the member record is the member's own
# signed claim (agent/gossip/claims.py), so this binds the window's incarnation to the member's word; in plaintext
# the membership layer takes incarnations as heard (below MAX_COUNTER, no step limit), and so does this.
INCARNATION_LEAD = 0
# A window's window_seq may lead the newest window_seq this node holds (of that node, of this node, of any
# live member) by at most this many windows. window_seq is first_step // W of the engine's step counter, and
# the EP ranks of all nodes step together (one collective per step), so genuine windows of all nodes carry
# about the same seq at the same time and lead the newest one held by a window or two of publication skew. A
# node back from a partition or a restart comes back at the cluster's seq, which this node holds from the
# others (or, when it holds nothing, takes as heard: there is no clock to compare with). The margin covers a
# reference that is itself stale: a small cluster that was partitioned for less than failure detection +
# dead_reclaim_ms (~40 s, after which a member's windows are dropped) at windows as short as 0.1 s is 400
# windows behind. A window forged 1024 ahead (plaintext) hides its node's windows for 1024 windows, not
# forever; under mTLS only the node itself can sign one.
WINDOW_SEQ_LEAD = 1024
# verdicts kept (each ~100 bytes): far more than the windows of a 1024-node cluster in flight at once
_CACHE = 4096


class Refusal(StrEnum):
    UNSIGNED = "unsigned"                      # mTLS: no signature or no certificate
    BAD_SIGNATURE = "bad_signature"            # does not verify under a CA-issued certificate of its node
    FUTURE_INCARNATION = "future_incarnation"  # past the member's incarnation (INCARNATION_LEAD)
    FUTURE_WINDOW_SEQ = "future_window_seq"    # past the newest window_seq held + WINDOW_SEQ_LEAD
    STALE_INCARNATION = "stale_incarnation"    # below the member's incarnation: an earlier life's window


# Fields 1 to 13 are signed one by one below; any later field (elasticmoe/versions.py) is signed as the bytes of
# its encoding, whether this release knows it or not.
_FIELDS_BY_NAME = 13


def later_fields(w: pb.LoadWindow) -> bytes:
    """The encoding of `w`'s fields numbered above 13, known to this release or not ("" when none is set): a
    newer release's fields reach an older one as unknown fields, kept as received and encoded after the known
    ones, which is where (and how) the newer release, in field-number order, encodes them."""
    if not len(UnknownFieldSet(w)) and not any(f.number > _FIELDS_BY_NAME for f, _ in w.ListFields()):
        return b""
    rest = type(w)()  # (the class of `w`: a test's newer release's LoadWindow too)
    rest.ParseFromString(w.SerializeToString())
    for f in rest.DESCRIPTOR.fields:
        if f.number <= _FIELDS_BY_NAME:
            rest.ClearField(f.name)
    return bytes(rest.SerializeToString())


def window_payload(w: pb.LoadWindow) -> bytes:
    """What a node signs of its window: every field but signature and certificate, the counts by their SHA-256,
    fields added after sample_every by the SHA-256 of their encoding (the signing domain is added by the
    signer)."""
    head = struct.pack("<QQQIII?", w.incarnation, w.window_seq, w.first_step, w.steps, w.layers, w.experts,
                       w.learner)
    out = head + hashlib.sha256(w.counts).digest() + w.node_id.encode()
    if w.samples or w.sample_every:  # (a window without samples signs as before this field was added)
        out += b"\x00samples" + struct.pack("<I", w.sample_every) + hashlib.sha256(w.samples).digest()
    if later := later_fields(w):  # (and one without later fields as before they could be added)
        out += b"\x00later" + hashlib.sha256(later).digest()
    return out


def ahead(incarnation: int, window_seq: int, member_incarnation: int, newest_seq: int | None) -> Refusal | None:
    """Whether a window (or a digest) at (incarnation, window_seq) is from the future, given the incarnation
    this node holds for its member and the newest window_seq it holds (None: none to compare with)."""
    if incarnation > member_incarnation + INCARNATION_LEAD:
        return Refusal.FUTURE_INCARNATION
    if newest_seq is not None and window_seq > newest_seq + WINDOW_SEQ_LEAD:
        return Refusal.FUTURE_WINDOW_SEQ
    return None


def stale(incarnation: int, member_incarnation: int) -> bool:
    """Whether a window (or a digest) at `incarnation` is from an earlier life of its member, which this node
    holds at `member_incarnation` (the floor: a node re-stamps its window when it refutes, so all its genuine
    windows are at its member's incarnation)."""
    return incarnation < member_incarnation


class WindowSigner(Protocol):
    """This node's key and the cluster CA (agent.consensus.signing.VoteSigner under mTLS)."""

    cert_der: bytes

    def sign_window(self, payload: bytes) -> bytes: ...

    def check_window(self, node: str, payload: bytes, cert_der: bytes, signature: bytes) -> str: ...


class WindowGuard:
    """Signs this node's windows and judges others' (signature, then bounds); counts what it refuses."""

    def __init__(self, signer: WindowSigner | None) -> None:
        self.signer = signer
        self.refused: dict[Refusal, int] = dict.fromkeys(Refusal, 0)
        self.refused_why = ""
        self._logged: set[tuple[Refusal, str]] = set()  # (reason, node): a hostile peer cannot flood the log
        self._verdicts: dict[bytes, str] = {}  # window + signature + certificate -> why refused, or ""

    @property
    def refused_total(self) -> int:
        return sum(self.refused.values())

    def sign(self, w: pb.LoadWindow) -> None:
        """Sign `w`, this node's window, in place (plaintext: leave it unsigned)."""
        if self.signer is not None:
            w.signature = self.signer.sign_window(window_payload(w))
            w.certificate = self.signer.cert_der

    def accept(self, w: pb.LoadWindow, member_incarnation: int, newest_seq: int | None) -> bool:
        """Whether `w` (newer than what we hold of its node, of a known member) may be stored; a refusal is
        counted and logged (once per reason and node)."""
        reason, why = self._signature(w)
        if reason is None and stale(w.incarnation, member_incarnation):
            reason = Refusal.STALE_INCARNATION
            why = (f"window of {w.node_id!r} at incarnation {w.incarnation} (window_seq {w.window_seq}): its member "
                   f"is at {member_incarnation}, and a node's windows are at its member's incarnation: an earlier "
                   f"life's window, or a replay")
        if reason is None:
            reason = ahead(w.incarnation, w.window_seq, member_incarnation, newest_seq)
            if reason is Refusal.FUTURE_INCARNATION:
                why = (f"window of {w.node_id!r} at incarnation {w.incarnation}: its member is at "
                       f"{member_incarnation}")
            elif reason is Refusal.FUTURE_WINDOW_SEQ:
                why = (f"window of {w.node_id!r} at window_seq {w.window_seq}: more than {WINDOW_SEQ_LEAD} past "
                       f"the newest held, {newest_seq}")
        if reason is None:
            return True
        self.refused[reason] += 1
        self.refused_why = why
        if (reason, w.node_id) not in self._logged:
            if len(self._logged) > _CACHE:
                self._logged.clear()
            self._logged.add((reason, w.node_id))
            log.warning("refused a load window (%s): %s", reason.value, why)
        return False

    def _signature(self, w: pb.LoadWindow) -> tuple[Refusal | None, str]:
        if self.signer is None:
            return None, ""
        if not w.signature or not w.certificate:
            return Refusal.UNSIGNED, f"window of {w.node_id!r} (incarnation {w.incarnation}, window_seq " \
                                     f"{w.window_seq}) is not signed"
        payload = window_payload(w)
        key = hashlib.blake2b(payload + w.signature + w.certificate, digest_size=16).digest()
        why = self._verdicts.get(key)
        if why is None:
            why = self.signer.check_window(w.node_id, payload, w.certificate, w.signature)
            if len(self._verdicts) >= _CACHE:
                self._verdicts.clear()
            self._verdicts[key] = why
        if why:
            return Refusal.BAD_SIGNATURE, f"window of {w.node_id!r} (window_seq {w.window_seq}): {why}"
        return None, ""
