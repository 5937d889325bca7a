"""SWIM's failure detector, sans-IO: probe, indirect probe, and the verdict that makes a member suspect.

Each probe interval this node probes one member: every other round its successor on a ring ordered by
hash of node id (so every member is probed at least every two rounds: the wait for a crash's first probe
is bounded), otherwise the next member of a randomised round-robin (SWIM). A direct probe waits the probe
timeout; then `indirect_checks` alive members probe the target for us until the round ends, each
answering ok or, Lifeguard's nack, "no answer from it either". No ack by the end of the round: suspect.

Lifeguard's local health: missing nacks (our own messages are not getting through) and rounds that ended
while we were stalled raise the awareness score that scales our timeouts; acks lower it. A verdict formed
while this node was not running on time (its timers fired late: a paused process, a blocked loop)
accuses nobody. A failed call of any other kind (rumours, pulls, push-pull) triggers a probe at once.
"""

from __future__ import annotations

import random
from functools import partial

from agent.clock import Clock, Timer
from agent.config import GossipConfig
from agent.gossip.membership import LIVE, Membership, MemberStatus, Piggyback, check_states
from agent.transport import Deferred, InvalidArgument, Transport
from elasticmoe.v1 import gossip_pb2 as pb


class _Probe:
    __slots__ = ("target", "seq", "start", "deadline", "incarnation", "done", "indirect", "helpers", "nacks",
                 "stalled", "timers")

    def __init__(self, target: str, seq: int, start: float, deadline: float, incarnation: int) -> None:
        self.target, self.seq, self.start, self.deadline = target, seq, start, deadline
        self.incarnation = incarnation  # what we suspect if it fails: a refutation since outbids it
        self.done = self.indirect = self.stalled = False
        self.helpers = self.nacks = 0
        self.timers: list[Timer] = []


class Prober:
    def __init__(self, membership: Membership, cfg: GossipConfig, clock: Clock, transport: Transport,
                 rng: random.Random, piggyback: Piggyback) -> None:
        self.m, self.cfg, self.clock, self.transport, self.rng = membership, cfg, clock, transport, rng
        self.piggyback = piggyback
        self.node_id = membership.node_id
        self._order: list[str] = []
        self._idx = 0
        self._round = 0
        self._probing: dict[str, _Probe] = {}
        self._seq = 0
        self._running = False
        self._timer: Timer | None = None
        membership.probe_now = self.probe
        membership.report_failure = self.report_failure
        membership.on_new_member = self._new_member

    def start(self) -> None:
        self._running = True
        self._timer = self.clock.call_later(self.rng.random() * self.cfg.probe_interval_ms / 1e3, self._tick)

    def stop(self) -> None:
        """Stop probing (on leave or stop); keep answering probes until the owner stops serving."""
        self._running = False
        if self._timer is not None:
            self._timer.cancel()
        for p in self._probing.values():
            p.done = True
            for t in p.timers:
                t.cancel()
        self._probing.clear()

    def _new_member(self, node_id: str) -> None:
        if self._order:  # memberlist: a new member joins the probe order at a random place
            self._order.insert(self.rng.randrange(self._idx, len(self._order) + 1), node_id)

    def _successor(self) -> str | None:
        n = self.m.successor()
        return None if n is None or n in self._probing else n

    def _tick(self) -> None:
        if not self._running or self.m.me.status == MemberStatus.LEFT:
            return
        self._timer = self.clock.call_later(self.m.scaled(self.cfg.probe_interval_ms / 1e3), self._tick)
        self._round += 1
        target = self._successor() if self._round % 2 == 0 else None
        target = target or self._next_target()
        if target is not None:
            self.probe(target)

    def _next_target(self) -> str | None:
        for _ in range(2):
            while self._idx < len(self._order):
                n = self._order[self._idx]
                self._idx += 1
                s = self.m._m.get(n)
                if s is not None and s.status in LIVE and n not in self._probing:
                    return n
            self._order = list(self.m.live_peers())
            self.rng.shuffle(self._order)
            self._idx = 0
        return None

    def report_failure(self, node_id: str) -> None:
        """A call to `node_id` failed: probe it now unless we heard from it within a probe timeout."""
        s = self.m._m.get(node_id)
        if (self._running and s is not None and s.status in LIVE and node_id not in self._probing
                and self.clock.now() - s.heard > self.cfg.probe_timeout_ms / 1e3):
            self.probe(node_id)

    def probe(self, target: str) -> None:
        if not self._running or target in self._probing or target == self.node_id:
            return
        self._seq += 1
        now = self.clock.now()
        rnd = self.m.scaled(self.cfg.probe_interval_ms / 1e3)
        st = self.m._m.get(target)
        p = _Probe(target, self._seq, now, now + rnd, st.incarnation if st is not None else 0)
        self._probing[target] = p
        req = pb.ProbeRequest(from_node=self.node_id, seq=p.seq, target=target)
        self.piggyback.fill(req, target)
        # The direct probe's deadline is the probe timeout; then indirect probes until the round ends.
        timeout = self.m.scaled(self.cfg.probe_timeout_ms / 1e3)
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
        addr = self.m._m[p.target].address if self.m.is_known(p.target) else ""
        for h in helpers:
            req = pb.IndirectProbeRequest(from_node=self.node_id, seq=p.seq, target=p.target, target_address=addr,
                                          timeout_ms=max(1, int(remaining * 1e3)))
            self.piggyback.fill(req, h)
            self.transport.call(h, "Gossip/IndirectProbe", req, remaining, partial(self._on_indirect, p, h))

    def _helpers(self, target: str) -> list[str]:
        """Up to indirect_checks random alive members other than `target` (without copying the list)."""
        live, want, out = self.m.live_peers(), self.cfg.indirect_checks, []
        for _ in range(4 * want if len(live) > 4 * want else 0):
            n = live[self.rng.randrange(len(live))]
            if n != target and n not in out and self.m._m[n].status == MemberStatus.ALIVE:
                out.append(n)
                if len(out) == want:
                    return out
        cands = [n for n in live if n != target and self.m._m[n].status == MemberStatus.ALIVE]
        return self.rng.sample(cands, min(want, len(cands)))

    def _on_indirect(self, p: _Probe, helper: str, reply: pb.ProbeAck | None) -> None:
        if reply is None:
            return
        self.m.heard(helper)
        self.piggyback.absorb(helper, reply.piggyback, reply.digests)
        if p.done:
            return
        if reply.ok:
            self._acked(p)
        else:
            p.nacks += 1

    def _acked(self, p: _Probe) -> None:
        self._finish(p)
        self.m.heard(p.target)
        self.m._awareness(-1)

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
            self.m._awareness(1)  # we were not running on time: no verdict about anyone else
            return
        self.m._awareness(p.helpers - p.nacks if p.helpers else 1)
        s = self.m._m.get(p.target)
        if s is not None and s.status in LIVE and s.heard <= p.start:  # it spoke to us since: no verdict
            self.m.suspect(p.target, p.incarnation, self.node_id)

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
        if req.target_address and not self.m.is_known(req.target):
            self.transport.add_peer(req.target, req.target_address)
        wait = 0.8 * (req.timeout_ms / 1e3 if req.timeout_ms else self.cfg.probe_timeout_ms / 1e3)
        d = Deferred()
        self._seq += 1
        probe = pb.ProbeRequest(from_node=self.node_id, seq=self._seq, target=req.target)
        self.piggyback.fill(probe, req.target)

        def done(r: pb.ProbeAck | None) -> None:
            ok = r is not None and r.ok
            if r is not None:
                self.m.heard(req.target)
                self.piggyback.absorb(req.target, r.piggyback, r.digests)
            ack = pb.ProbeAck(from_node=self.node_id, seq=req.seq, ok=ok)  # ok=False: Lifeguard's nack
            self.piggyback.fill(ack, src)
            d.reply(ack)

        self.transport.call(req.target, "Gossip/Probe", probe, wait, done)
        return d

