"""Control records, sans-IO: the cluster's pause switch, committed by a quorum of the voters apart from the
routing tables (no version, no parent, no install: the table chain and the engines never see one).

A record is a value named by its key `(seq, node_id)`; keys order all records. Only `node_id` writes records
under its name, and it never reuses a key: it accepts its own record durably before it sends it, and picks
its next seq above every key it knows. An operator's record also names the admin who asked (`admin`); its
`node_id` is the agent that admitted that admin's call and vouches for it: under mTLS the writer signs the whole
record, admin included, and a certified record that names an admin carries that signature (`ControlCommit.writer`).

- Writer: a voter takes a record only from its writer (`node_id == src`: under mTLS `src` is the peer's
  certificate CN, in plaintext only the name the peer claims), or from another voter finishing it (below)
  with the writer's signature over it (`ControlAcceptRequest.writer`, mTLS; plaintext has no keys, so there
  a voter's word that it is finishing is all there is). The writer must be a voter or a member of the cluster.
  So under mTLS a member can write records under its own name only: never an admin's, never another node's.

- Accept: a voter takes a record iff its key is above every key it accepted or saw certified, or it is a
  record it already holds (a retry, or a record being finished); it makes that durable before it acks.
- Certified: a record acked by a quorum of the configured voters. Its `ControlCommit` names the ackers; every
  node adopts the certified record with the highest key it hears of (a learn, a catch-up reply, an ack), and
  that record says whether automatic rebalancing is paused.
- Order: once a record R is certified, a quorum holds a key >= key(R), so a record certified by a write that
  started after it has a higher key (two quorums meet), and every node's state moves along one order.
  Concurrent writes are ordered by key: the highest certified wins everywhere. A writer whose seq is stale
  is refused by a voter that holds a higher key, which says which; the writer tries again above it.
- Failed writes: a writer that cannot reach a quorum in time gives its record up and never sends it again.
  If no other voter accepted it (the writer was cut off), it can never be certified. If some did, they finish
  it: a voter holding another writer's record that it has not seen certified re-sends that same record, with
  the writer's signature it kept, to the voters and certifies it on a quorum of acks. So a record certified just before a partition, whose learn
  did not get out, still reaches every voter on the majority side (the ones that accepted it tell the rest).

The driver is agent/consensus/controlnode.py; the etcd backend's counterpart is agent/etcd/etcd_pause.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from agent.consensus.paxos import quorum_size
from agent.consensus.refusal import control_refusal
from elasticmoe.v1 import consensus_pb2 as pb

Key = tuple[int, str]
NO_KEY: Key = (0, "")
MAX_NOTE = 256        # characters of an operator's note
MAX_NODE_ID = 253     # as agent.config.NODE_ID_RE
MAX_ADMIN = 253       # characters of an admin's name (a certificate CN, or what the CLI said)
# why a record or a commit was refused (consensus.proto ControlRefusal), beside the words of `reason`
Refusal = pb.ControlRefusal
# (mTLS) why a writer's signature over a record does not verify, or "" (agent.consensus.signing.check_writer)
WriterCheck = Callable[[pb.ControlRecord, pb.VoteSignature], str]
# a record's seq may lead the highest this voter knows by at most this much: a forged seq near 2^64 would
# leave the switch unwritable for good (the next seq would overflow), as MAX_ROUND_STEP guards ballots
MAX_SEQ_STEP = 2**16


def key(r: pb.ControlRecord | None) -> Key:
    return NO_KEY if r is None else (int(r.seq), r.node_id)


def check_record(r: pb.ControlRecord) -> str:
    """Why `r` is not a well-formed record, or ""."""
    if r.seq < 1:
        return f"record.seq = {r.seq}: expected >= 1"
    if not r.node_id or len(r.node_id) > MAX_NODE_ID:
        return f"record.node_id of {len(r.node_id)} characters: expected 1..{MAX_NODE_ID}"
    if len(r.note) > MAX_NOTE:
        return f"record.note of {len(r.note)} characters: expected at most {MAX_NOTE}"
    if len(r.admin) > MAX_ADMIN:
        return f"record.admin of {len(r.admin)} characters: expected at most {MAX_ADMIN}"
    return ""


def check_commit(c: pb.ControlCommit, voters: Iterable[str]) -> str:
    """Why `c` is not a certified record for the configured `voters` (a quorum of them, each named once), or ""."""
    if not c.HasField("record"):
        return "control commit has no record"
    why = check_record(c.record)
    if why:
        return why
    vs = set(voters)
    need = quorum_size(len(vs))
    signers = list(c.voters)
    if c.quorum != need:
        return f"quorum = {c.quorum}: expected a majority of {len(vs)} voters = {need}"
    if len(set(signers)) != len(signers) or not set(signers) <= vs:
        return f"voters {signers[:8]}: expected distinct configured voters"
    if len(signers) < need:
        return f"voters has {len(signers)} voters: expected at least {need}"
    return ""


def describe(c: pb.ControlCommit | None) -> str:
    """The switch in words: 'paused by node1 for admin alice (record 3)' (node1 admitted alice's call and
    vouches for it); 'never paused' without a record."""
    if c is None:
        return "never paused"
    r = c.record
    asked = f" for admin {r.admin}" if r.admin else ""
    return f"{'paused' if r.paused else 'resumed'} by {r.node_id}{asked} (record {r.seq})"


class ControlAcceptor:
    """One node's control-record state: the record it accepted with the highest key (with its writer's signature,
    under mTLS), the newest certified record it knows, and the highest key it heard of anywhere (in memory: only
    for picking its next seq). `is_member(node)`: whether a writer that is not a voter is a member of the
    cluster; `check_writer` (mTLS): why a writer's signature does not verify (None: plaintext, no keys)."""

    def __init__(self, node_id: str, voters: Iterable[str], state: pb.ControlState | None = None, *,
                 is_member: Callable[[str], bool] = lambda _: False, check_writer: WriterCheck | None = None) -> None:
        self.node_id, self.voters = node_id, sorted(set(voters))
        self.is_member, self.check_writer = is_member, check_writer
        self.accepted: pb.ControlRecord | None = None
        self.writer: pb.VoteSignature | None = None  # the writer's signature over `accepted` (mTLS)
        self.certified: pb.ControlCommit | None = None
        self.heard: Key = NO_KEY
        if state is not None:
            self.apply(state)

    def apply(self, st: pb.ControlState) -> None:
        """Adopt a state once it is durable."""
        self.accepted = st.accepted if st.HasField("accepted") else None
        self.writer = st.writer if st.HasField("writer") else None
        self.certified = st.certified if st.HasField("certified") else None
        self.heard = max(self.heard, key(self.accepted), key(self.certified.record if self.certified else None))

    def state(self, accepted: pb.ControlRecord | None = None, certified: pb.ControlCommit | None = None,
              writer: pb.VoteSignature | None = None) -> pb.ControlState:
        """This state with `accepted` (and its `writer` signature) or `certified` replaced (what to persist before
        adopting it)."""
        st = pb.ControlState()
        acc = accepted if accepted is not None else self.accepted
        sig = writer if accepted is not None else self.writer
        cert = certified if certified is not None else self.certified
        if acc is not None:
            st.accepted.CopyFrom(acc)
        if sig is not None and sig.signature:
            st.writer.CopyFrom(sig)
        if cert is not None:
            st.certified.CopyFrom(cert)
        return st

    def admits(self, r: pb.ControlRecord, src: str, writer: pb.VoteSignature | None) -> tuple[Refusal, str]:
        """Whether `src` may hand this voter record `r` (module docstring, Writer): (CONTROL_REFUSAL_UNSPECIFIED,
        "") when it may, else the code and why. `writer`: the writer's signature that came with it, if any."""
        w = r.node_id
        if w != self.node_id and w not in self.voters and not self.is_member(w):
            return pb.CONTROL_UNKNOWN_WRITER, (f"record.node_id = {w[:64]!r}: its writer is neither a voter nor a "
                                               f"member of the cluster")
        if src == w:
            return pb.CONTROL_REFUSAL_UNSPECIFIED, ""
        if src not in self.voters:
            return pb.CONTROL_NOT_WRITER, (f"record.node_id = {w[:64]!r}: sent by {src[:64]!r}, which is neither "
                                           f"its writer nor a voter finishing it")
        if self.check_writer is None:  # plaintext: no keys, a voter's word that it finishes is all there is
            return pb.CONTROL_REFUSAL_UNSPECIFIED, ""
        if writer is None or not writer.signature:
            return pb.CONTROL_WRITER_UNSIGNED, (f"record.node_id = {w[:64]!r}: sent by {src[:64]!r}, not its "
                                                f"writer, without the writer's signature over it")
        why = self.check_writer(r, writer)
        if why:
            return pb.CONTROL_WRITER_BAD_SIGNATURE, (f"record.node_id = {w[:64]!r}: sent by {src[:64]!r} with a "
                                                     f"writer signature that does not check: {why}")
        return pb.CONTROL_REFUSAL_UNSPECIFIED, ""

    @property
    def high(self) -> Key:
        """The highest key accepted or certified here: a record at or below it is refused (unless held here)."""
        return max(key(self.accepted), key(self.certified.record if self.certified else None))

    def holds(self, r: pb.ControlRecord) -> bool:
        return r == self.accepted or (self.certified is not None and r == self.certified.record)

    def on_accept(self, r: pb.ControlRecord, src: str,
                  writer: pb.VoteSignature | None = None) -> tuple[pb.ControlAck, pb.ControlState | None]:
        """The reply to `src`'s accept of `r` (`writer`: the writer's signature that came with it) and the state to
        make durable before it leaves (None: nothing to write). A refusal changes nothing but `heard`."""
        no = pb.ControlAck(ok=False, from_node=self.node_id)
        if self.accepted is not None:
            no.accepted.CopyFrom(self.accepted)
        if self.certified is not None:
            no.certified.CopyFrom(self.certified)
        why = check_record(r)
        if not why and r.seq > self.high[0] + MAX_SEQ_STEP:
            why = f"record.seq = {r.seq}: expected <= {self.high[0] + MAX_SEQ_STEP} (the highest seq here + {MAX_SEQ_STEP})"
        if why:
            no.reason, no.code = f"INVALID_ARGUMENT: {why}", pb.CONTROL_MALFORMED
            return no, None
        code, why = self.admits(r, src, writer)
        if why:
            no.reason, no.code = f"PERMISSION_DENIED: {why}", code
            return no, None
        self.heard = max(self.heard, key(r))
        yes = pb.ControlAck(ok=True, from_node=self.node_id)
        if self.holds(r):
            return yes, None
        if key(r) <= self.high:
            no.reason = f"superseded: record {key(r)} is not above {self.high}, the highest held here"
            no.code = pb.CONTROL_SUPERSEDED
            return no, None
        return yes, self.state(accepted=r, writer=writer)

    def learn(self, c: pb.ControlCommit) -> pb.ControlState | None:
        """The state to make durable to adopt certified `c` (checked by the caller), or None: not newer here."""
        self.heard = max(self.heard, key(c.record))
        if self.certified is not None and key(c.record) <= key(self.certified.record):
            return None
        return self.state(certified=c)

    def next_record(self, paused: bool, at_ms: int, note: str, admin: str = "") -> pb.ControlRecord:
        """This node's next record (for `admin`, when an operator asked): its seq above every key it knows of, so
        that it is never refused as stale by a voter this node has heard from, and never reuses one of its own
        keys."""
        return pb.ControlRecord(seq=max(self.high, self.heard)[0] + 1, node_id=self.node_id, paused=paused,
                                at_ms=at_ms, note=note[:MAX_NOTE], admin=admin[:MAX_ADMIN])


@dataclass
class ControlWrite:
    """One record on its way to a quorum: feed it acks with `on_ack`, which returns "certified" (a quorum acked:
    build `commit()`), "refused" (a quorum can no longer ack it) or ""."""

    record: pb.ControlRecord
    voters: list[str]
    acks: set[str] = field(default_factory=set)
    refusals: dict[str, str] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)  # may not vote yet (a learner): asked again
    done: bool = False
    superseded: bool = False  # a voter refused it holding a key at or above its own: a retry must go higher
    signatures: dict[str, pb.VoteSignature] = field(default_factory=dict)  # (mTLS) the signed acks, by voter
    writer: pb.VoteSignature | None = None  # (mTLS) the writer's signature over the record, sent with it

    def __post_init__(self) -> None:
        self.voters = sorted(set(self.voters))
        self.quorum = quorum_size(len(self.voters))

    def on_ack(self, src: str, a: pb.ControlAck) -> str:
        if self.done or src not in self.voters or src in self.acks or src in self.refusals:
            return ""
        if not a.ok:
            unavailable = control_refusal(a) == pb.CONTROL_UNAVAILABLE
            transient = unavailable and not a.HasField("accepted") and not a.HasField("certified")
            if transient:  # a voter enrolling or catching up: asked again next round (unless a retry goes higher)
                self.unavailable[src] = a.reason
            else:
                self.refusals[src] = a.reason
            held = max(key(a.accepted if a.HasField("accepted") else None),
                       key(a.certified.record if a.HasField("certified") else None))
            self.superseded = self.superseded or held >= key(self.record)
            out = len(self.refusals) + (len(self.unavailable) if self.superseded else 0)
            if out > len(self.voters) - self.quorum:
                self.done = True
                return "refused"
            return ""
        self.acks.add(src)
        if a.signature:
            self.signatures[src] = pb.VoteSignature(voter=src, certificate=a.certificate, signature=a.signature)
        self.unavailable.pop(src, None)
        if len(self.acks) >= self.quorum:
            self.done = True
            return "certified"
        return ""

    def waiting(self) -> list[str]:
        """The voters that have not answered yet."""
        return [v for v in self.voters if v not in self.acks and v not in self.refusals]

    def commit(self) -> pb.ControlCommit:
        c = pb.ControlCommit(record=self.record, voters=sorted(self.acks), quorum=self.quorum,
                             signatures=[self.signatures[v] for v in sorted(self.acks) if v in self.signatures])
        if self.writer is not None and self.writer.signature:
            c.writer.CopyFrom(self.writer)
        return c

    def tally(self) -> str:
        """Who accepted, who refused (with why) and who did not answer, in words."""
        parts = [f"accepted by {', '.join(sorted(self.acks)) or 'nobody'} of {len(self.voters)} voters "
                 f"(quorum {self.quorum})"]
        parts += [f"{k}: {v[:200]}" for k, v in sorted({**self.unavailable, **self.refusals}.items())]
        silent = [v for v in self.waiting() if v not in self.unavailable]
        if silent:
            parts.append(f"no reply from {', '.join(silent)}")
        return "; ".join(parts)
