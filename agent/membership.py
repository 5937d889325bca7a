"""SWIM membership with Lifeguard, sans-IO: driven by a Clock and a Transport, randomness from a seeded rng.

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

from agent.broadcasts import RumourQueue
from agent.clock import Clock, Timer
from agent.config import GossipConfig
from agent.transport import Deferred, InvalidArgument, Transport
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
    __slots__ = ("node_id", "address", "status", "incarnation", "ranks", "since", "heard")

    def __init__(self, node_id: str, address: str, status: MemberStatus, incarnation: int,
                 ranks: tuple[int, ...], since: float) -> None:
        self.node_id, self.address, self.status, self.incarnation = node_id, address, status, incarnation
        self.ranks, self.since, self.heard = ranks, since, since

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
        if s.incarnation >= 2**63:  # unbeatable, and a refutation (incarnation + 1) would overflow uint64
            raise InvalidArgument(f"member state {s.node_id!r} with incarnation {s.incarnation}: expected < 2^63")
        if s.incarnation >= MAX_COUNTER:
            raise InvalidArgument(f"member state {s.node_id!r}: incarnation {s.incarnation} >= 2^63")


class Suspicion:
    """Lifeguard's suspicion timer: max at first, min after K independent confirmations (log in between)."""

    def __init__(self, clock: Clock, first: str, k: int, lo: float, hi: float, grace: float,
                 on_expire: Callable[[], None]) -> None:
        self.clock, self.k, self.lo, self.hi, self.grace = clock, k, lo, hi, grace
        self.start = clock.now()
        self.confirmers = {first}
        self.on_expire = on_expire
        self._graced = False
        self._timer: Timer | None = None
        self._arm()

    def timeout(self) -> float:
        n = len(self.confirmers) - 1
        if self.k < 1:
            return self.lo
        frac = math.log(n + 1) / math.log(self.k + 1)
        return max(self.lo, self.hi - frac * (self.hi - self.lo))

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        due = self.start + self.timeout()
        self._timer = self.clock.call_later(max(0.0, due - self.clock.now()), lambda: self._fire(due))

    def confirm(self, node: str) -> bool:
        """Count an independent suspicion; False if already counted or no more are needed."""
        if node in self.confirmers or len(self.confirmers) - 1 >= self.k:
            return False
        self.confirmers.add(node)
        self._arm()
        return True

    def _fire(self, due: float) -> None:
        self._timer = None
        late = self.clock.now() - due
        if late > self.grace and not self._graced:
            # We were not running when it fell due (paused, stalled loop): refutations may be waiting for
            # us; give them one grace period before accusing anyone.
            self._graced = True
            self._timer = self.clock.call_later(self.grace, lambda: self._fire(self.clock.now()))
            return
        self.on_expire()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _Probe:
    __slots__ = ("target", "seq", "deadline", "done", "indirect", "helpers", "nacks", "stalled", "timers")

    def __init__(self, target: str, seq: int, deadline: float) -> None:
        self.target, self.seq, self.deadline = target, seq, deadline
        self.done = self.indirect = self.stalled = False
        self.helpers = self.nacks = 0
        self.timers: list[Timer] = []


class Membership:
    def __init__(self, node_id: str, address: str, ranks: Iterable[int], cfg: GossipConfig, clock: Clock,
                 transport: Transport, rng: random.Random, rumours: RumourQueue, piggyback: Piggyback,
                 on_change: Callable[[Member], None]) -> None:
        self.node_id, self.cfg, self.clock, self.transport, self.rng = node_id, cfg, clock, transport, rng
        self.rumours, self.piggyback, self.on_change = rumours, piggyback, on_change
        self.me = _State(node_id, address, MemberStatus.ALIVE, 0, tuple(ranks), clock.now())
        self._m: dict[str, _State] = {node_id: self.me}
        self._hash = _hash(node_id, 0, MemberStatus.ALIVE)
        self._suspicions: dict[str, Suspicion] = {}
        self._order: list[str] = []
        self._idx = 0
        self._round = 0
        self._ring: list[tuple[int, str]] | None = None  # live members by hash, for _successor
        self._live: list[str] | None = None  # live members but us
        self._dead: list[str] | None = None
        self._my_ring_key = (_hash(node_id, 0, MemberStatus.ALIVE), node_id)
        self._probing: dict[str, _Probe] = {}
        self._seq = 0
        self.awareness = 0
        self._running = False
        self._timer: Timer | None = None
        self._reap_timers: dict[str, Timer] = {}

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
        return sorted(n for n, s in self._m.items() if s.status in LIVE)

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
        return pb.MemberState(node_id=s.node_id, address=s.address, incarnation=s.incarnation,
                              status=TO_PB[s.status], ranks=s.ranks, from_node=from_node or self.node_id)

    def full_state(self) -> list[pb.MemberState]:
        return [self.state_pb(n) for n in self._m]

    def scaled(self, seconds: float) -> float:
        """Lifeguard: our own timeouts grow with our local-health score."""
        return seconds * (self.awareness + 1)

    def _awareness(self, delta: int) -> None:
        self.awareness = min(max(0, self.awareness + delta), self.cfg.awareness_max_mult - 1)

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._running = True
        self._timer = self.clock.call_later(self.rng.random() * self.cfg.probe_interval_ms / 1e3, self._tick)
        self.rumours.put("m", self.node_id, self.state_pb(self.node_id))

    def stop(self) -> None:
        self._running = False
        for t in [self._timer, *self._reap_timers.values()]:
            if t is not None:
                t.cancel()
        for s in self._suspicions.values():
            s.cancel()
        for p in self._probing.values():
            for t in p.timers:
                t.cancel()
        self._suspicions.clear()
        self._probing.clear()
        self._reap_timers.clear()

    def leave(self) -> None:
        """Say we left (a rumour: LEFT wins over every state at our incarnation) and stop probing."""
        if self._timer is not None:
            self._timer.cancel()
        self._set(self.me, MemberStatus.LEFT, self.me.incarnation)

    # ---- probing ------------------------------------------------------------------------------
    def _tick(self) -> None:
        if not self._running or self.me.status == MemberStatus.LEFT:
            return
        self._timer = self.clock.call_later(self.scaled(self.cfg.probe_interval_ms / 1e3), self._tick)
        self._round += 1
        target = self._successor() if self._round % 2 == 0 else None
        target = target or self._next_target()
        if target is not None:
            self.probe(target)

    def _successor(self) -> str | None:
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
        return None if n == self.node_id or n in self._probing else n

    def _next_target(self) -> str | None:
        for _ in range(2):
            while self._idx < len(self._order):
                n = self._order[self._idx]
                self._idx += 1
                s = self._m.get(n)
                if s is not None and s.status in LIVE and n not in self._probing:
                    return n
            self._order = list(self.live_peers())
            self.rng.shuffle(self._order)
            self._idx = 0
        return None

    def heard(self, node_id: str) -> None:
        """Any message or reply from `node_id`: it was alive just now."""
        s = self._m.get(node_id)
        if s is not None:
            s.heard = self.clock.now()

    def report_failure(self, node_id: str) -> None:
        """A call to `node_id` failed: probe it now unless we heard from it within a probe timeout."""
        s = self._m.get(node_id)
        if (self._running and s is not None and s.status in LIVE and node_id not in self._probing
                and self.clock.now() - s.heard > self.cfg.probe_timeout_ms / 1e3):
            self.probe(node_id)

    def probe(self, target: str) -> None:
        if not self._running or target in self._probing or target == self.node_id:
            return
        self._seq += 1
        now = self.clock.now()
        rnd = self.scaled(self.cfg.probe_interval_ms / 1e3)
        p = _Probe(target, self._seq, now + rnd)
        self._probing[target] = p
        req = pb.ProbeRequest(from_node=self.node_id, seq=p.seq, target=target)
        self.piggyback.fill(req, target)
        # The direct probe's deadline is the probe timeout; then indirect probes until the round ends.
        timeout = self.scaled(self.cfg.probe_timeout_ms / 1e3)
        self.transport.call(target, "Gossip/Probe", req, timeout, lambda r: self._on_direct(p, r, now + timeout))
        p.timers.append(self.clock.call_later(rnd, lambda: self._verdict(p)))

    def _late(self, p: _Probe, due: float) -> None:
        if self.clock.now() - due > self.cfg.probe_timeout_ms / 1e3:
            p.stalled = True

    def _on_direct(self, p: _Probe, reply: pb.ProbeAck | None, due: float) -> None:
        if p.done:
            return
        if reply is None or not reply.ok:
            self._indirect(p, due if reply is None else None)
            return
        self.piggyback.absorb(p.target, reply.piggyback, reply.digests)
        self._acked(p)

    def _indirect(self, p: _Probe, due: float | None) -> None:
        if p.done or p.indirect:
            return
        if due is not None:
            self._late(p, due)
        p.indirect = True
        helpers = self._helpers(p.target)
        p.helpers = len(helpers)
        remaining = max(0.0, p.deadline - self.clock.now())
        if remaining <= 0:
            return
        addr = self._m[p.target].address if p.target in self._m else ""
        for h in helpers:
            req = pb.IndirectProbeRequest(from_node=self.node_id, seq=p.seq, target=p.target, target_address=addr,
                                          timeout_ms=max(1, int(remaining * 1e3)))
            self.piggyback.fill(req, h)
            self.transport.call(h, "Gossip/IndirectProbe", req, remaining, lambda r, h=h: self._on_indirect(p, h, r))

    def _helpers(self, target: str) -> list[str]:
        """Up to indirect_checks random alive members other than `target` (without copying the list)."""
        live, want, out = self.live_peers(), self.cfg.indirect_checks, []
        for _ in range(4 * want if len(live) > 4 * want else 0):
            n = live[self.rng.randrange(len(live))]
            if n != target and n not in out and self._m[n].status == MemberStatus.ALIVE:
                out.append(n)
                if len(out) == want:
                    return out
        cands = [n for n in live if n != target and self._m[n].status == MemberStatus.ALIVE]
        return self.rng.sample(cands, min(want, len(cands)))

    def _on_indirect(self, p: _Probe, helper: str, reply: pb.ProbeAck | None) -> None:
        if reply is None:
            return
        self.heard(helper)
        self.piggyback.absorb(helper, reply.piggyback, reply.digests)
        if p.done:
            return
        if reply.ok:
            self._acked(p)
        else:
            p.nacks += 1

    def _acked(self, p: _Probe) -> None:
        self._finish(p)
        self.heard(p.target)
        self._awareness(-1)

    def _finish(self, p: _Probe) -> None:
        p.done = True
        for t in p.timers:
            t.cancel()
        if self._probing.get(p.target) is p:
            del self._probing[p.target]

    def _verdict(self, p: _Probe) -> None:
        if p.done:
            return
        self._late(p, p.deadline)
        self._finish(p)
        if p.stalled or not self._running:
            self._awareness(1)  # we were not running on time: no verdict about anyone else
            return
        self._awareness(p.helpers - p.nacks if p.helpers else 1)
        s = self._m.get(p.target)
        if s is not None and s.status in LIVE:
            self.suspect(p.target, s.incarnation, self.node_id)

    # ---- serving ------------------------------------------------------------------------------
    def handle_probe(self, src: str, req: pb.ProbeRequest) -> pb.ProbeAck:
        if req.target and req.target != self.node_id:
            raise InvalidArgument(f"probe for {req.target!r} reached {self.node_id!r}")
        check_states(req.piggyback)
        self.piggyback.absorb(src, req.piggyback, req.digests)
        ack = pb.ProbeAck(from_node=self.node_id, seq=req.seq, ok=True)
        self.piggyback.fill(ack, src)
        return ack

    def handle_indirect(self, src: str, req: pb.IndirectProbeRequest) -> Deferred | pb.ProbeAck:
        if not req.target:
            raise InvalidArgument("indirect probe without a target")
        check_states(req.piggyback)
        self.piggyback.absorb(src, req.piggyback, [])
        if req.target == self.node_id:
            return pb.ProbeAck(from_node=self.node_id, seq=req.seq, ok=True)
        if req.target_address and req.target not in self._m:
            self.transport.add_peer(req.target, req.target_address)
        wait = 0.8 * (req.timeout_ms / 1e3 if req.timeout_ms else self.cfg.probe_timeout_ms / 1e3)
        d = Deferred()
        self._seq += 1
        probe = pb.ProbeRequest(from_node=self.node_id, seq=self._seq, target=req.target)
        self.piggyback.fill(probe, req.target)

        def done(r: pb.ProbeAck | None) -> None:
            ok = r is not None and r.ok
            if r is not None:
                self.heard(req.target)
                self.piggyback.absorb(req.target, r.piggyback, r.digests)
            ack = pb.ProbeAck(from_node=self.node_id, seq=req.seq, ok=ok)  # ok=False: Lifeguard's nack
            self.piggyback.fill(ack, src)
            d.reply(ack)

        self.transport.call(req.target, "Gossip/Probe", probe, wait, done)  # type: ignore[arg-type]
        return d

    # ---- state changes (SWIM rules) -----------------------------------------------------------
    def _set(self, s: _State, status: MemberStatus, incarnation: int, *, from_node: str = "",
             source: str | None = None) -> None:
        self._hash ^= _hash(s.node_id, s.incarnation, s.status) ^ _hash(s.node_id, incarnation, status)
        if status != s.status:
            self._dead = None
            if (status in LIVE) != (s.status in LIVE):
                self._ring = self._live = None
        s.status, s.incarnation, s.since = status, incarnation, self.clock.now()
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
            if (status != MemberStatus.ALIVE and inc >= self.me.incarnation) or inc > self.me.incarnation:
                self._refute(inc)
            return
        s = self._m.get(node)
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
            self._set(s, status, inc, from_node=st.from_node, source=source)

    def _learn_address(self, s: _State, st: pb.MemberState) -> None:
        if st.address and st.address != s.address:
            s.address = st.address
            self.transport.add_peer(s.node_id, st.address)
        s.ranks = tuple(st.ranks)

    def _add(self, st: pb.MemberState, status: MemberStatus, source: str | None, rumour: bool = True) -> None:
        s = _State(st.node_id, st.address, MemberStatus.ALIVE, st.incarnation, tuple(st.ranks), self.clock.now())
        self._m[st.node_id] = s
        self._ring = self._live = None
        self._hash ^= _hash(s.node_id, s.incarnation, s.status)
        if st.address:
            self.transport.add_peer(st.node_id, st.address)
        if self._order:  # memberlist: a new member joins the probe order at a random place
            self._order.insert(self.rng.randrange(self._idx, len(self._order) + 1), st.node_id)
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
            self.probe(node)  # an independent check of our own: confirms a real failure within a round

    def _expire(self, node: str, incarnation: int) -> None:
        s = self._m.get(node)
        self._suspicions.pop(node, None)
        if s is not None and s.status == MemberStatus.SUSPECT and s.incarnation == incarnation:
            self._set(s, MemberStatus.DEAD, incarnation)
