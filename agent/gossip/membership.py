"""SWIM membership with Lifeguard, sans-IO: the member table, its merge rules, suspicion and refutation.
Probing (the failure detector) is agent/gossip/probe.py; both are driven by a Clock and a Transport, randomness
from a seeded rng.

- Probe: each probe interval, the next member of a randomised round-robin gets a direct probe; without an
  ack within the probe timeout, `indirect_checks` members probe it for us until the round ends.
- Suspect: a member not acked within its round becomes suspect. Its suspicion timeout starts at
  suspicion_max_mult x min and shrinks (log) to the minimum as independent confirmations arrive; at zero
  the member is declared dead. Members that hear a suspicion probe the suspect themselves with probability
  (K + 1) / N, so a real failure gathers its K confirmations within about one round.
- Refute: a member that hears itself suspected or declared dead raises its incarnation and says it is
  alive; incarnations order all states about a member, and at equal incarnation the worse status wins.
- Lifeguard: nacks from indirect helpers and refutations feed a local-health score (awareness) that
  scales our own probe timeouts; messages to a suspect carry its suspicion (buddy system), so it refutes
  at once. Extensions: a failed call of any kind triggers an early probe of its destination, and a verdict
  or suspicion timeout reached while this node itself was stalled (timers ran late) accuses nobody.

State changes become rumours in the shared RumourQueue; `Piggyback` (the owning GossipNode) attaches
rumours to outgoing probes and absorbs those on incoming messages.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from agent.clock import Clock, Timer
from agent.config import GossipConfig
from agent.gossip.broadcasts import RumourQueue
from agent.gossip.claims import (
    MAX_CERT_BYTES,
    MAX_CLAIM_BYTES,
    MAX_SIGNATURE_BYTES,
    Claims,
    ClaimSigner,
    Proof,
)
from agent.gossip.suspicion import Suspicion
from agent.transport import InvalidArgument, Transport
from elasticmoe.v1 import gossip_pb2 as pb


class MemberStatus(StrEnum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


TO_PB = {MemberStatus.ALIVE: pb.ALIVE, MemberStatus.SUSPECT: pb.SUSPECT, MemberStatus.DEAD: pb.DEAD,
         MemberStatus.LEFT: pb.LEFT}
FROM_PB = {v: k for k, v in TO_PB.items()}
_RANK = {MemberStatus.ALIVE: 0, MemberStatus.SUSPECT: 1, MemberStatus.DEAD: 2, MemberStatus.LEFT: 3}
LIVE = (MemberStatus.ALIVE, MemberStatus.SUSPECT)


@dataclass(frozen=True)
class Member:
    node_id: str
    address: str
    status: MemberStatus
    incarnation: int
    ranks: tuple[int, ...]


class Piggyback(Protocol):
    def fill(self, msg: pb.ProbeRequest | pb.ProbeAck | pb.IndirectProbeRequest, dst: str) -> None: ...

    def absorb(self, src: str, members: Iterable[pb.MemberState], digests: Iterable[pb.Digest]) -> None: ...

    def announce(self) -> None: ...


class _State:
    __slots__ = ("node_id", "address", "status", "incarnation", "ranks", "since", "heard", "proof", "fp")

    def __init__(self, node_id: str, address: str, status: MemberStatus, incarnation: int,
                 ranks: tuple[int, ...], since: float, proof: Proof | None = None) -> None:
        self.node_id, self.address, self.status, self.incarnation = node_id, address, status, incarnation
        self.ranks, self.since, self.heard, self.proof = ranks, since, since, proof
        self.fp: pb.Fingerprint | None = None  # the member's cluster fingerprint, as it says (agent.fingerprint)

    def public(self) -> Member:
        return Member(self.node_id, self.address, self.status, self.incarnation, self.ranks)


def _hash(node_id: str, incarnation: int, status: MemberStatus) -> int:
    h = hashlib.blake2b(f"{node_id}\0{incarnation}\0{status.value}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


# Incarnations and window sequence numbers from the network must stay below this: a state at 2^64 - 1
# could never be outbid (a refutation needs incarnation + 1), so one hostile message would pin it forever.
MAX_COUNTER = 1 << 63


def check_states(states: Iterable[pb.MemberState]) -> None:
    """Reject malformed member states before any is applied (bad input changes no state)."""
    for s in states:
        if not s.node_id or s.status not in FROM_PB:
            raise InvalidArgument(f"member state {s.node_id!r} with status {s.status}: expected a node id "
                                  f"and a status in ALIVE..LEFT")
        if s.incarnation >= MAX_COUNTER:  # unbeatable, and a refutation (incarnation + 1) would overflow uint64
            raise InvalidArgument(f"member state {s.node_id!r} with incarnation {s.incarnation}: expected < 2^63")
        if (len(s.claim) > MAX_CLAIM_BYTES or len(s.claim_signature) > MAX_SIGNATURE_BYTES
                or len(s.claim_certificate) > MAX_CERT_BYTES):
            raise InvalidArgument(f"member state {s.node_id!r}: claim of {len(s.claim)} bytes, signature of "
                                  f"{len(s.claim_signature)}, certificate of {len(s.claim_certificate)}: expected at "
                                  f"most {MAX_CLAIM_BYTES}, {MAX_SIGNATURE_BYTES} and {MAX_CERT_BYTES}")


class Membership:
    def __init__(self, node_id: str, address: str, ranks: Iterable[int], cfg: GossipConfig, clock: Clock,
                 transport: Transport, rng: random.Random, rumours: RumourQueue, piggyback: Piggyback,
                 on_change: Callable[[Member], None], signer: ClaimSigner | None = None,
                 fingerprint: pb.Fingerprint | None = None) -> None:
        """`signer` (mTLS): this node signs its own state, and a state that adds a member or says it is alive or
        left is accepted only with that member's signed claim; without one (plaintext) states are taken as
        heard. `fingerprint`: this node's cluster fingerprint, carried in its own state like its ranks."""
        self.node_id, self.cfg, self.clock, self.transport, self.rng = node_id, cfg, clock, transport, rng
        self.claims = Claims(signer) if signer is not None else None
        self.rumours, self.piggyback, self.on_change = rumours, piggyback, on_change
        self.me = _State(node_id, address, MemberStatus.ALIVE, 0, tuple(ranks), clock.now())
        self.me.fp = fingerprint
        self._m: dict[str, _State] = {node_id: self.me}
        self._hash = _hash(node_id, 0, MemberStatus.ALIVE)
        self._suspicions: dict[str, Suspicion] = {}
        self._ring: list[tuple[int, str]] | None = None  # live members by hash, for _successor
        self._live: list[str] | None = None  # live members but us
        self._live_sorted: tuple[list[str], list[str]] | None = None  # (the _live it was built from, sorted)
        self._dead: list[str] | None = None
        self._my_ring_key = (_hash(node_id, 0, MemberStatus.ALIVE), node_id)
        self.awareness = 0
        self._running = False
        self._reap_timers: dict[str, Timer] = {}
        # set by the Prober: probe a member now (on hearing it suspected), a call to it failed, a new member
        self.probe_now: Callable[[str], None] = lambda node: None
        self.report_failure: Callable[[str], None] = lambda node: None
        self.on_new_member: Callable[[str], None] = lambda node: None
        self._sign_me()

    # ---- views --------------------------------------------------------------------------------
    def members(self) -> list[Member]:
        return [s.public() for s in sorted(self._m.values(), key=lambda s: s.node_id)]

    def get(self, node_id: str) -> Member | None:
        s = self._m.get(node_id)
        return None if s is None else s.public()

    def status(self, node_id: str) -> MemberStatus | None:
        s = self._m.get(node_id)
        return None if s is None else s.status

    def is_known(self, node_id: str) -> bool:
        return node_id in self._m

    def is_live(self, node_id: str) -> bool:
        s = self._m.get(node_id)
        return s is not None and s.status in LIVE

    def live_nodes(self) -> list[str]:
        """Alive and suspect members, us included while we are live, sorted (a cached list: do not modify)."""
        peers = self.live_peers()
        c = self._live_sorted
        if c is None or c[0] is not peers:
            c = self._live_sorted = (peers, sorted(peers + [self.node_id] if self.me.status in LIVE else peers))
        return c[1]

    def live_peers(self) -> list[str]:
        """Live members other than us (a cached list: do not modify)."""
        if self._live is None:
            self._live = [n for n, s in self._m.items() if s.status in LIVE and n != self.node_id]
        return self._live

    def dead_peers(self) -> list[str]:
        """Members declared dead, not left (a cached list: do not modify)."""
        if self._dead is None:
            self._dead = [n for n, s in self._m.items() if s.status == MemberStatus.DEAD]
        return self._dead

    def num_live(self) -> int:
        return len(self.live_peers()) + (self.me.status in LIVE)

    @property
    def incarnation(self) -> int:
        return self.me.incarnation

    @property
    def members_hash(self) -> int:
        return self._hash

    def state_pb(self, node_id: str, from_node: str = "") -> pb.MemberState:
        s = self._m[node_id]
        st = pb.MemberState(node_id=s.node_id, address=s.address, incarnation=s.incarnation,
                            status=TO_PB[s.status], ranks=s.ranks, from_node=from_node or self.node_id)
        if s.proof is not None:
            st.claim, st.claim_signature, st.claim_certificate = s.proof
        if s.fp is not None:
            st.fingerprint.CopyFrom(s.fp)
        return st

    def fingerprints(self) -> dict[str, pb.Fingerprint]:
        """The cluster fingerprint of each live member that said one, this node's included."""
        return {n: s.fp for n, s in self._m.items() if s.fp is not None and s.status in LIVE}

    # ---- signed claims (mTLS: agent/gossip/claims.py) -------------------------------------------------
    def _sign_me(self) -> None:
        if self.claims is not None:
            me = self.me
            me.proof = self.claims.sign(me.node_id, me.address, me.incarnation, TO_PB[me.status], me.ranks, me.fp)

    @property
    def refused(self) -> int:
        """Member states refused for a missing or wrong claim (mTLS)."""
        return self.claims.refused if self.claims is not None else 0

    @property
    def refused_why(self) -> str:
        return self.claims.refused_why if self.claims is not None else ""

    def full_state(self) -> list[pb.MemberState]:
        return [self.state_pb(n) for n in self._m]

    def scaled(self, seconds: float) -> float:
        """Lifeguard: our own timeouts grow with our local-health score."""
        return seconds * (self.awareness + 1)

    def _awareness(self, delta: int) -> None:
        self.awareness = min(max(0, self.awareness + delta), self.cfg.awareness_max_mult - 1)

    def heard(self, node_id: str) -> None:
        """Any message or reply from `node_id`: it was alive just now."""
        s = self._m.get(node_id)
        if s is not None:
            s.heard = self.clock.now()

    def successor(self) -> str | None:
        """The next live member after us on a ring ordered by hash of node id. Probing it every other
        round means every member is probed at least every two rounds by its predecessor, so the wait for
        a crash's first probe is bounded (round-robin alone leaves it exponential: a long tail)."""
        if self._ring is None:
            self._ring = sorted((_hash(n, 0, MemberStatus.ALIVE), n) for n, s in self._m.items() if s.status in LIVE)
        ring = self._ring
        if len(ring) < 2:
            return None
        i = bisect.bisect_right(ring, self._my_ring_key)
        n = ring[i % len(ring)][1]
        return None if n == self.node_id else n

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._running = True
        self.rumours.put("m", self.node_id, self.state_pb(self.node_id))

    def stop(self) -> None:
        self._running = False
        for t in self._reap_timers.values():
            t.cancel()
        for s in self._suspicions.values():
            s.cancel()
        self._suspicions.clear()
        self._reap_timers.clear()

    def leave(self) -> None:
        """Say we left (a rumour: LEFT wins over every state at our incarnation)."""
        self._set(self.me, MemberStatus.LEFT, self.me.incarnation)

    # ---- state changes (SWIM rules) -----------------------------------------------------------
    def _set(self, s: _State, status: MemberStatus, incarnation: int, *, from_node: str = "",
             source: str | None = None) -> None:
        self._hash ^= _hash(s.node_id, s.incarnation, s.status) ^ _hash(s.node_id, incarnation, status)
        if status != s.status:
            self._dead = None
            if (status in LIVE) != (s.status in LIVE):
                self._ring = self._live = None
        s.status, s.incarnation, s.since = status, incarnation, self.clock.now()
        if s is self.me:
            self._sign_me()
        if status not in (MemberStatus.SUSPECT,):
            sus = self._suspicions.pop(s.node_id, None)
            if sus is not None:
                sus.cancel()
        rt = self._reap_timers.pop(s.node_id, None)
        if rt is not None:
            rt.cancel()
        if status in (MemberStatus.DEAD, MemberStatus.LEFT) and s is not self.me and self._running:
            since = s.since
            self._reap_timers[s.node_id] = self.clock.call_later(self.cfg.dead_reclaim_ms / 1e3,
                                                                 lambda: self._reap(s.node_id, since))
        self.rumours.put("m", s.node_id, self.state_pb(s.node_id, from_node), source)
        self.on_change(s.public())

    def _reap(self, node_id: str, since: float) -> None:
        s = self._m.get(node_id)
        if s is not None and s.since == since and s.status in (MemberStatus.DEAD, MemberStatus.LEFT):
            self._hash ^= _hash(s.node_id, s.incarnation, s.status)
            del self._m[node_id]
            self._ring = self._live = self._dead = None
            self._reap_timers.pop(node_id, None)
            self.rumours.drop("m", node_id)

    def _refute(self, incarnation: int) -> None:
        """Someone says we are suspect, dead or alive at a newer incarnation: outbid it."""
        if self.me.status == MemberStatus.LEFT:
            self.rumours.put("m", self.node_id, self.state_pb(self.node_id))
            return
        self._awareness(1)
        self._set(self.me, MemberStatus.ALIVE, max(self.me.incarnation, incarnation) + 1)
        self.piggyback.announce()

    def absorb(self, states: Iterable[pb.MemberState], source: str) -> None:
        """Merge rumours from `source`; the common case, a state we hold already, takes a fast path."""
        m, seen, me = self._m, self.rumours.seen_by, self.me
        for st in states:
            s = m.get(st.node_id)
            if (s is None or s is me or st.incarnation != s.incarnation or st.status == pb.SUSPECT
                    or FROM_PB[st.status] != s.status):
                self.apply(st, source=source)
            seen("m", st.node_id, source, st)

    def apply(self, st: pb.MemberState, *, push_pull: bool = False, source: str | None = None,
              rumour_new: bool = True) -> None:
        """Merge one member state heard from the network (a rumour, or a push-pull's full state).
        `rumour_new=False`: a member new to us is not news to others (the member table a seed gave us
        when we joined): learn it without queueing a rumour."""
        status = FROM_PB[st.status]
        node, inc = st.node_id, st.incarnation
        if node == self.node_id:
            stale = st.HasField("fingerprint") and st.fingerprint != self.me.fp  # a view of our previous process
            if (status != MemberStatus.ALIVE or stale) and inc >= self.me.incarnation or inc > self.me.incarnation:
                self._refute(inc)
            return
        s = self._m.get(node)
        if self.claims is not None and not self.claims.accept(st, known=s is not None):
            return
        if status == MemberStatus.DEAD and push_pull:
            status = MemberStatus.SUSPECT  # memberlist: a peer's "dead" in a full sync is only a suspicion
        if s is None:
            if status in LIVE:
                self._add(st, status, source, rumour_new)
            return
        if inc < s.incarnation:
            return
        if status == MemberStatus.ALIVE:
            if inc > s.incarnation:
                self._learn_address(s, st)
                self._set(s, MemberStatus.ALIVE, inc, source=source)
        elif status == MemberStatus.SUSPECT:
            self.suspect(node, inc, st.from_node or node, source)
        elif _RANK[status] > _RANK[s.status] or inc > s.incarnation:
            if status == MemberStatus.LEFT and st.claim:
                s.proof = (st.claim, st.claim_signature, st.claim_certificate)
            self._set(s, status, inc, from_node=st.from_node, source=source)

    def _learn_address(self, s: _State, st: pb.MemberState) -> None:
        if st.address and st.address != s.address:
            s.address = st.address
            self.transport.add_peer(s.node_id, st.address)
        s.ranks = tuple(st.ranks)
        # a newer incarnation's word replaces the old one's, a fingerprint included: a member that came back on a
        # release that says none (a downgrade) says none, and relaying the old one beside its new claim would
        # have every mTLS peer refuse the state (the claim no longer says that fingerprint)
        s.fp = st.fingerprint if st.HasField("fingerprint") else None
        if st.claim:
            s.proof = (st.claim, st.claim_signature, st.claim_certificate)

    def _add(self, st: pb.MemberState, status: MemberStatus, source: str | None, rumour: bool = True) -> None:
        s = _State(st.node_id, st.address, MemberStatus.ALIVE, st.incarnation, tuple(st.ranks), self.clock.now(),
                   (st.claim, st.claim_signature, st.claim_certificate) if st.claim else None)
        s.fp = st.fingerprint if st.HasField("fingerprint") else None
        self._m[st.node_id] = s
        self._ring = self._live = None
        self._hash ^= _hash(s.node_id, s.incarnation, s.status)
        if st.address:
            self.transport.add_peer(st.node_id, st.address)
        self.on_new_member(st.node_id)
        if status == MemberStatus.ALIVE:
            if rumour:
                self.rumours.put("m", s.node_id, self.state_pb(s.node_id), source)
            self.on_change(s.public())
        else:
            self.suspect(st.node_id, st.incarnation, st.from_node or st.node_id, source)

    def suspect(self, node: str, incarnation: int, accuser: str, source: str | None = None) -> None:
        s = self._m.get(node)
        if s is None or incarnation < s.incarnation or s is self.me:
            return
        sus = self._suspicions.get(node)
        if s.status == MemberStatus.SUSPECT and sus is not None and incarnation == s.incarnation:
            if sus.confirm(accuser):
                self.rumours.put("m", node, self.state_pb(node, accuser), source)  # let others count it too
            return
        if s.status not in LIVE and incarnation == s.incarnation:
            return
        n = max(1, self.num_live())
        k = self.cfg.suspicion_confirmations if n - 2 >= self.cfg.suspicion_confirmations else 0
        lo = max(self.cfg.suspicion_min_ms / 1e3,
                 self.cfg.suspicion_mult * max(1.0, math.log10(n)) * self.cfg.probe_interval_ms / 1e3)
        hi = self.cfg.suspicion_max_mult * lo
        if sus is not None:
            sus.cancel()
        self._set(s, MemberStatus.SUSPECT, incarnation, from_node=accuser, source=source)
        self._suspicions[node] = Suspicion(self.clock, accuser, k, lo, hi, self.cfg.probe_interval_ms / 1e3,
                                           lambda: self._expire(node, incarnation))
        if accuser != self.node_id and self.rng.random() < (k + 1) / max(1, n - 2):
            self.probe_now(node)  # an independent check of our own: confirms a real failure within a round

    def _expire(self, node: str, incarnation: int) -> None:
        s = self._m.get(node)
        self._suspicions.pop(node, None)
        if s is not None and s.status == MemberStatus.SUSPECT and s.incarnation == incarnation:
            self._set(s, MemberStatus.DEAD, incarnation)
