"""Control records, sans-IO: the cluster's pause switch, committed by a quorum of the voters apart from the
routing tables (no version, no parent, no install: the table chain and the engines never see one).

A record is a value named by its key `(seq, node_id)`; keys order all records. Only `node_id` writes records
under its name, and it never reuses a key: it accepts its own record durably before it sends it, and picks
its next seq above every key it knows.

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
  it: a voter holding another writer's record that it has not seen certified re-sends that same record to the
  voters and certifies it on a quorum of acks. So a record certified just before a partition, whose learn
  did not get out, still reaches every voter on the majority side (the ones that accepted it tell the rest).

The driver is agent/consensus/controlnode.py; the etcd backend's counterpart is agent/etcd_pause.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from agent.consensus.paxos import quorum_size
from elasticmoe.v1 import consensus_pb2 as pb

Key = tuple[int, str]
NO_KEY: Key = (0, "")
MAX_NOTE = 256        # characters of an operator's note
MAX_NODE_ID = 253     # as agent.config.NODE_ID_RE
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
    """The switch in words: 'paused by node1 (record 3)'; 'never paused' without a record."""
    if c is None:
        return "never paused"
    r = c.record
    return f"{'paused' if r.paused else 'resumed'} by {r.node_id} (record {r.seq})"


class ControlAcceptor:
    """One node's control-record state: the record it accepted with the highest key, the newest certified record
    it knows, and the highest key it heard of anywhere (in memory: only for picking its next seq)."""

    def __init__(self, node_id: str, voters: Iterable[str], state: pb.ControlState | None = None) -> None:
        self.node_id, self.voters = node_id, sorted(set(voters))
        self.accepted: pb.ControlRecord | None = None
        self.certified: pb.ControlCommit | None = None
        self.heard: Key = NO_KEY
        if state is not None:
            self.apply(state)

    def apply(self, st: pb.ControlState) -> None:
        """Adopt a state once it is durable."""
        self.accepted = st.accepted if st.HasField("accepted") else None
        self.certified = st.certified if st.HasField("certified") else None
        self.heard = max(self.heard, key(self.accepted), key(self.certified.record if self.certified else None))

    def state(self, accepted: pb.ControlRecord | None = None, certified: pb.ControlCommit | None = None) -> pb.ControlState:
        """This state with `accepted` or `certified` replaced (what to persist before adopting it)."""
        st = pb.ControlState()
        acc = accepted if accepted is not None else self.accepted
        cert = certified if certified is not None else self.certified
        if acc is not None:
            st.accepted.CopyFrom(acc)
        if cert is not None:
            st.certified.CopyFrom(cert)
        return st

    @property
    def high(self) -> Key:
        """The highest key accepted or certified here: a record at or below it is refused (unless held here)."""
        return max(key(self.accepted), key(self.certified.record if self.certified else None))

    def holds(self, r: pb.ControlRecord) -> bool:
        return r == self.accepted or (self.certified is not None and r == self.certified.record)

    def on_accept(self, r: pb.ControlRecord) -> tuple[pb.ControlAck, pb.ControlState | None]:
        """The reply to an accept and the state to make durable before it leaves (None: nothing to write)."""
        no = pb.ControlAck(ok=False, from_node=self.node_id)
        if self.accepted is not None:
            no.accepted.CopyFrom(self.accepted)
        if self.certified is not None:
            no.certified.CopyFrom(self.certified)
        why = check_record(r)
        if not why and r.seq > self.high[0] + MAX_SEQ_STEP:
            why = f"record.seq = {r.seq}: expected <= {self.high[0] + MAX_SEQ_STEP} (the highest seq here + {MAX_SEQ_STEP})"
        if why:
            no.reason = f"INVALID_ARGUMENT: {why}"
            return no, None
        self.heard = max(self.heard, key(r))
        yes = pb.ControlAck(ok=True, from_node=self.node_id)
        if self.holds(r):
            return yes, None
        if key(r) <= self.high:
            no.reason = f"superseded: record {key(r)} is not above {self.high}, the highest held here"
            return no, None
        return yes, self.state(accepted=r)

    def learn(self, c: pb.ControlCommit) -> pb.ControlState | None:
        """The state to make durable to adopt certified `c` (checked by the caller), or None: not newer here."""
        self.heard = max(self.heard, key(c.record))
        if self.certified is not None and key(c.record) <= key(self.certified.record):
            return None
        return self.state(certified=c)

    def next_record(self, paused: bool, at_ms: int, note: str) -> pb.ControlRecord:
        """This node's next record: its seq above every key it knows of, so that it is never refused as stale by a
        voter this node has heard from, and never reuses one of its own keys."""
        return pb.ControlRecord(seq=max(self.high, self.heard)[0] + 1, node_id=self.node_id, paused=paused,
                                at_ms=at_ms, note=note[:MAX_NOTE])


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

    def __post_init__(self) -> None:
        self.voters = sorted(set(self.voters))
        self.quorum = quorum_size(len(self.voters))

    def on_ack(self, src: str, a: pb.ControlAck) -> str:
        if self.done or src not in self.voters or src in self.acks or src in self.refusals:
            return ""
        if not a.ok:
            transient = (a.reason.startswith("UNAVAILABLE") and not a.HasField("accepted")
                         and not a.HasField("certified"))
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
        return pb.ControlCommit(record=self.record, voters=sorted(self.acks), quorum=self.quorum,
                                signatures=[self.signatures[v] for v in sorted(self.acks) if v in self.signatures])

    def tally(self) -> str:
        """Who accepted, who refused (with why) and who did not answer, in words."""
        parts = [f"accepted by {', '.join(sorted(self.acks)) or 'nobody'} of {len(self.voters)} voters "
                 f"(quorum {self.quorum})"]
        parts += [f"{k}: {v[:200]}" for k, v in sorted({**self.unavailable, **self.refusals}.items())]
        silent = [v for v in self.waiting() if v not in self.unavailable]
        if silent:
            parts.append(f"no reply from {', '.join(silent)}")
        return "; ".join(parts)
