"""GossipNode: one node's membership (SWIM + Lifeguard) and load gossip over one Transport and Clock.

It owns what the two share: the rumour queue, the piggybacking of rumours on every message, the gossip
tick that retransmits rumours (and the immediate send when a new one is queued), and push-pull
anti-entropy (member tables when their hashes differ, then window digests, then only the missing windows).
It serves the "Gossip" service of the transport; other services (consensus) keep their own handlers.

In the agent process: `GossipNode(..., clock=RealClock(), transport=GrpcTransport(...))`; in tests and
benchmarks: a FakeClock and a SimNetwork (see chaos/gossipsim.py).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from functools import partial
from typing import Protocol

import numpy as np
import numpy.typing as npt
from google.protobuf.message import Message

from agent.clock import Clock, Timer
from agent.config import GossipConfig
from agent.gossip.broadcasts import Kind, RumourQueue
from agent.gossip.claims import ClaimSigner
from agent.gossip.loadgossip import LoadGossip, LoadView, WindowCallback, check_digests
from agent.gossip.membership import LIVE, Member, Membership, MemberStatus, check_states
from agent.gossip.probe import Prober
from agent.gossip.windowform import check_windows
from agent.gossip.windowguard import WindowSigner
from agent.transport import Deferred, InvalidArgument, Transport
from elasticmoe.v1 import gossip_pb2 as pb

MemberCallback = Callable[[Member], None]


class GossipSigner(ClaimSigner, WindowSigner, Protocol):
    """This node's key under mTLS: it signs member claims and load windows (agent.consensus.signing.VoteSigner)."""


def pushpull_scale(interval: float, n: int) -> float:
    """memberlist's pushPullScale: x (ceil(log2(n) - log2(32)) + 1) above 32 nodes."""
    return interval if n <= 32 else interval * (math.ceil(math.log2(n) - 5) + 1)


class GossipNode:
    def __init__(self, node_id: str, address: str, ranks: Iterable[int], cfg: GossipConfig, clock: Clock,
                 transport: Transport, seeds: dict[str, str], rng_seed: int,
                 *, shape: tuple[int, int] | None = None, signer: GossipSigner | None = None,
                 fingerprint: pb.Fingerprint | None = None) -> None:
        """`seeds`: node_id -> host:port of members to join through (this node's own id is ignored);
        `shape`: the [layers, experts] of load windows (None: taken from the first window seen);
        `signer` (mTLS): member claims and load windows are signed and checked (agent.gossip.membership.Membership,
        agent.gossip.windowguard); `fingerprint`: this node's cluster fingerprint, in its member state (agent.fingerprint)."""
        self.node_id, self.cfg, self.clock, self.transport = node_id, cfg, clock, transport
        self.rng = random.Random(rng_seed)
        self.seeds = {n: a for n, a in seeds.items() if n != node_id}
        self.rumours = RumourQueue(cfg.retransmit_mult, self._size, on_put=self._kick)
        self.membership = Membership(node_id, address, ranks, cfg, clock, transport, random.Random(self.rng.random()),
                                     self.rumours, self, self._member_changed, signer=signer,
                                     fingerprint=fingerprint)
        self.prober = Prober(self.membership, cfg, clock, transport, random.Random(self.rng.random()), self)
        self.load = LoadGossip(node_id, cfg, clock, transport, random.Random(self.rng.random()), self.rumours,
                               self.membership, self._window_arrived, shape=shape, signer=signer)
        self.timeout = 2 * cfg.probe_timeout_ms / 1e3
        self._member_cbs: list[MemberCallback] = []
        self._window_cbs: list[WindowCallback] = []
        self._timers: dict[str, Timer] = {}
        self._flush_due = False
        self._running = False
        self._joined = not self.seeds
        self._inc = 0

    # ---- the API ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._running:
            return
        self._running = True
        self.transport.serve(self._handle, service="Gossip")
        for n, a in self.seeds.items():
            self.transport.add_peer(n, a)
        self.membership.start()
        self.prober.start()
        r = self.rng.random
        self._every("gossip", self.cfg.interval_ms / 1e3, self._gossip_tick, r())
        self._every("pushpull", self.cfg.pushpull_interval_ms / 1e3, self._pushpull_tick, r())
        self._every("reconnect", self.cfg.reconnect_interval_ms / 1e3, self._reconnect_tick, r())
        self._join()

    def leave(self, on_done: Callable[[], None] | None = None) -> None:
        """Announce that this node leaves (members mark it LEFT) and stop probing. Keep serving until
        `stop()` so that the news spreads; `on_done` runs once a member acknowledged it or timed out."""
        if not self._running:
            if on_done is not None:
                on_done()
            return
        self.prober.stop()
        self.membership.leave()
        peers = self.membership.live_peers()
        targets = self.rng.sample(peers, min(self.cfg.fanout, len(peers)))
        pending = [0, 0]  # replies outstanding, done

        def acked(peer: str, reply: Message | None) -> None:
            self._on_broadcast_reply(peer, reply)
            pending[0] -= 1
            if on_done is not None and not pending[1] and (reply is not None or pending[0] == 0):
                pending[1] = 1
                on_done()

        pending[0] = sum(self._broadcast_to(p, partial(acked, p)) for p in targets)
        if not pending[0] and on_done is not None:
            on_done()

    def stop(self) -> None:
        """Stop timers and stop answering (peers' calls fail from now on)."""
        if not self._running:
            return
        self._running = False
        for t in self._timers.values():
            t.cancel()
        self._timers.clear()
        self.prober.stop()
        self.membership.stop()
        self.load.stopped = True
        # answer nothing (as a stopped process would); other services keep their handlers
        self.transport.serve(lambda src, method, req: None, service="Gossip")

    def publish_window(self, window_seq: int, first_step: int, steps: int, counts: npt.NDArray[np.integer],
                       learner: bool = False, samples: npt.NDArray[np.uint32] | None = None,
                       sample_every: int = 0, step_us: npt.NDArray[np.uint32] | None = None,
                       step_version: npt.NDArray[np.uint32] | None = None,
                       stride_us: npt.NDArray[np.uint32] | None = None) -> None:
        """This node's newest load window, uint32 [L, E]; window_seq must increase (`learner`: this node abstains
        from consensus now, LoadWindow.learner; `samples` [S, L, E]: its sampled steps' counts, every
        `sample_every`-th step; `step_us`, `step_version`, `stride_us` [S]: their wall times, the versions they ran
        on and their strides' mean times).
        Ignored once stopped."""
        if not self.load.stopped:
            self.load.publish(window_seq, first_step, steps, counts, learner, samples, sample_every, step_us,
                              step_version, stride_us)

    def fingerprints(self) -> dict[str, pb.Fingerprint]:
        """The cluster fingerprint of each live member that said one, this node's included."""
        return self.membership.fingerprints()

    def learners(self) -> set[str]:
        """The nodes whose newest window says they abstain from consensus (LoadWindow.learner)."""
        return self.load.learners()

    def members(self) -> list[Member]:
        return self.membership.members()

    def member(self, node_id: str) -> Member | None:
        return self.membership.get(node_id)

    def suspect_ranks(self, ranks: Iterable[int]) -> list[str]:
        """Local evidence from the engine (Lifeguard): the live members holding any of `ranks` become suspect
        now, accused by this node, as if our own probe of them had failed; the suspicion spreads and times out
        as usual (each other node's own evidence confirms it and shortens the timeout), and a member that is
        alive refutes it. Returns the members suspected (this node is never one)."""
        wanted = set(ranks)
        return self.suspect_members([m.node_id for m in self.membership.members() if wanted & set(m.ranks)])

    def suspect_members(self, nodes: Iterable[str]) -> list[str]:
        """`suspect_ranks` by node id: the live ones among `nodes` (this node aside) become suspect now."""
        out = []
        for n in nodes:
            m = self.membership.get(n)
            if m is not None and n != self.node_id and m.status in LIVE:
                self.membership.suspect(n, m.incarnation, self.node_id)
                out.append(n)
        return out

    def live_nodes(self) -> list[str]:
        """Alive and suspect members, this node included (sorted)."""
        return self.membership.live_nodes()

    def load_view(self) -> LoadView:
        return self.load.view()

    @property
    def incarnation(self) -> int:
        return self.membership.incarnation

    @property
    def awareness(self) -> int:
        return self.membership.awareness

    def on_member_change(self, cb: MemberCallback) -> None:
        """cb(member) after each change of a member's status or incarnation (joins included)."""
        self._member_cbs.append(cb)

    def on_window(self, cb: WindowCallback) -> None:
        """cb(node_id, window_seq, counts uint32 [L, E], first_step, steps, samples uint32 [S, L, E] or None, step_us [S]
        or None, step_version [S] or None, stride_us [S] or None)
        when a newer window of another node arrives (not for this node's own `publish_window`)."""
        self._window_cbs.append(cb)

    # ---- glue ---------------------------------------------------------------------------------
    def _size(self) -> int:
        return self.membership.num_live()

    def _member_changed(self, m: Member) -> None:
        if m.node_id == self.node_id and m.incarnation != self._inc:
            self._inc = m.incarnation
            self.load.restamp()
        for cb in self._member_cbs:
            cb(m)

    def _window_arrived(self, node: str, seq: int, counts: npt.NDArray[np.uint32], first: int, steps: int,
                        samples: npt.NDArray[np.uint32] | None, step_us: npt.NDArray[np.uint32] | None,
                        step_version: npt.NDArray[np.uint32] | None = None,
                        stride_us: npt.NDArray[np.uint32] | None = None) -> None:
        for cb in self._window_cbs:
            cb(node, seq, counts, first, steps, samples, step_us, step_version, stride_us)

    def _every(self, name: str, period: float, fn: Callable[[], None], phase: float) -> None:
        def tick() -> None:
            if not self._running:
                return
            nxt = period
            if name == "pushpull":
                nxt = pushpull_scale(period, self._size())
            self._timers[name] = self.clock.call_later(nxt, tick)
            fn()

        self._timers[name] = self.clock.call_later(phase * period, tick)

    # ---- piggybacking (membership calls these too) ---------------------------------------------
    def fill(self, msg: pb.ProbeRequest | pb.ProbeAck | pb.IndirectProbeRequest, dst: str) -> None:
        members: list[pb.MemberState] = []
        digests: list[pb.Digest] | None = [] if hasattr(msg, "digests") else None
        self._take(dst, self.cfg.piggyback_bytes, members, digests)
        msg.piggyback.extend(members)
        if digests:
            msg.digests.extend(digests)

    def _take(self, dst: str, budget: int, members: list[pb.MemberState], digests: list[pb.Digest] | None) -> None:
        skip: set[tuple[Kind, str]] = set()
        st = self.membership.status(dst)
        if st is not None and st not in (MemberStatus.ALIVE, MemberStatus.LEFT):
            # Lifeguard's buddy system (extended to the dead): tell a member what we think of it, so that
            # it refutes at once if it is alive.
            members.append(self.membership.state_pb(dst))
            skip.add(("m", dst))
            budget -= members[-1].ByteSize()
        self.rumours.take(budget, members, digests, dst, skip)

    def absorb(self, src: str, members: Iterable[pb.MemberState], digests: Iterable[pb.Digest]) -> None:
        self.membership.absorb(members, src)
        seen = self.rumours.seen_by
        for d in digests:
            seen("w", d.node_id, src, d)
        self.load.on_digests(src, digests)

    def announce(self) -> None:
        """Send our own state to every live member now (a refutation: it must beat their suspicion timers,
        so it does not wait for the infection to reach the last few)."""
        me = self.membership.state_pb(self.node_id)
        for p in self.membership.live_peers():
            req = pb.BroadcastRequest(from_node=self.node_id, members=[me])
            self.transport.call(p, "Gossip/Broadcast", req, self.timeout, partial(self._on_broadcast_reply, p))

    # ---- serving ------------------------------------------------------------------------------
    def _handle(self, src: str, method: str, req: Message) -> Message | Deferred | None:
        if not self._running:
            return None
        self.membership.heard(src)
        name = method.partition("/")[2]
        if name == "Probe":
            return self.prober.handle_probe(src, req)
        if name == "IndirectProbe":
            return self.prober.handle_indirect(src, req)
        if name == "Broadcast":
            return self._handle_broadcast(src, req)
        if name == "Pull":
            return self.load.handle_pull(src, req)
        if name == "Push":
            return self._handle_push(src, req)
        if name == "PushPull":
            return self._handle_pushpull(src, req)
        raise InvalidArgument(f"unknown method {method!r}")

    def _handle_broadcast(self, src: str, req: pb.BroadcastRequest) -> pb.BroadcastReply:
        check_states(req.members)
        check_digests(req.digests)
        self.absorb(src, req.members, req.digests)
        rep = pb.BroadcastReply(from_node=self.node_id)
        self._fill_broadcast(rep, src)
        return rep

    def _handle_push(self, src: str, req: pb.PushRequest) -> pb.PushAck:
        check_states(req.members)
        check_windows(req.windows, self.load.shape)
        for st in req.members:
            self.membership.apply(st, push_pull=True, source=src)
        for w in req.windows:
            self.load.store(w, src)
        return pb.PushAck(from_node=self.node_id)

    def _handle_pushpull(self, src: str, req: pb.PushPullRequest) -> pb.PushPullReply:
        check_states(req.members)
        check_digests(req.digests)
        check_windows(req.windows, self.load.shape)
        for st in req.members:
            self.membership.apply(st, push_pull=True, source=src)
        for w in req.windows:
            self.load.store(w, src)
        m = self.membership
        rep = pb.PushPullReply(from_node=self.node_id, members_hash=m.members_hash)
        if req.join or req.members_hash != m.members_hash:
            rep.members.extend(m.full_state())
        rep.digests.extend(self.load.digests())
        budget = self.cfg.max_message_bytes - rep.ByteSize()
        rep.windows.extend(self.load.newer_than(req.digests, budget))
        return rep

    # ---- rumours: at once when new (after coalesce_ms), then every gossip interval --------------
    def _kick(self) -> None:
        if self._running and not self._flush_due:
            self._flush_due = True
            self.clock.call_later(self.cfg.coalesce_ms / 1e3, self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        if not self._running or not len(self.rumours):
            return
        peers = self.membership.live_peers()
        for p in self.rng.sample(peers, min(self.cfg.fanout, len(peers))):
            self._broadcast_to(p, partial(self._on_broadcast_reply, p))

    def _gossip_tick(self) -> None:
        self._flush()

    def _fill_broadcast(self, msg: pb.BroadcastRequest | pb.BroadcastReply, dst: str) -> None:
        members: list[pb.MemberState] = []
        digests: list[pb.Digest] = []
        self._take(dst, self.cfg.max_message_bytes // 4, members, digests)
        msg.members.extend(members)
        msg.digests.extend(digests)

    def _broadcast_to(self, peer: str, on_reply: Callable[[Message | None], None]) -> bool:
        req = pb.BroadcastRequest(from_node=self.node_id)
        self._fill_broadcast(req, peer)
        if not req.members and not req.digests:
            return False
        self.transport.call(peer, "Gossip/Broadcast", req, self.timeout, on_reply)
        return True

    def _on_broadcast_reply(self, peer: str, reply: Message | None) -> None:
        if reply is None:
            self.membership.report_failure(peer)
            return
        assert isinstance(reply, pb.BroadcastReply)
        try:
            check_states(reply.members)
            check_digests(reply.digests)
        except InvalidArgument:
            return
        self.membership.heard(peer)
        self.absorb(peer, reply.members, reply.digests)

    # ---- push-pull anti-entropy ---------------------------------------------------------------
    def _join(self) -> None:
        for n in self.seeds:
            self._pushpull(n, join=True)

    def _pushpull_tick(self) -> None:
        peers = self.membership.live_peers()
        if peers:
            self._pushpull(self.rng.choice(peers), join=False)

    def _reconnect_tick(self) -> None:
        if not self.membership.live_peers():
            self._joined = not self.seeds
            self._join()
        dead = self.membership.dead_peers()
        if dead:  # a dead member that answers learns it was declared dead (full state) and refutes
            self._pushpull(self.rng.choice(dead), join=False, full=True)

    def _pushpull(self, peer: str, join: bool, full: bool = False) -> None:
        m = self.membership
        req = pb.PushPullRequest(from_node=self.node_id, join=join, members_hash=m.members_hash)
        if join or full:
            req.members.extend(m.full_state())
        req.digests.extend(self.load.digests())
        self.transport.call(peer, "Gossip/PushPull", req, self.timeout, lambda r: self._on_pushpull(peer, r, join))

    def _on_pushpull(self, peer: str, reply: Message | None, join: bool) -> None:
        if not self._running:
            return
        if reply is None:
            self.membership.report_failure(peer)
            return
        assert isinstance(reply, pb.PushPullReply)
        try:
            check_states(reply.members)
            check_digests(reply.digests)
            check_windows(reply.windows, self.load.shape)
        except InvalidArgument:
            return
        self._joined = True
        m = self.membership
        m.heard(peer)
        for st in reply.members:
            m.apply(st, push_pull=True, source=peer, rumour_new=not join)
        for w in reply.windows:
            self.load.store(w, peer)
        push = pb.PushRequest(from_node=self.node_id)
        if reply.members_hash != m.members_hash and m.status(peer) in LIVE:
            push.members.extend(m.full_state())
        push.windows.extend(self.load.newer_than(reply.digests, self.cfg.max_message_bytes - push.ByteSize()))
        if push.members or push.windows:
            self.transport.call(peer, "Gossip/Push", push, self.timeout, lambda r: self._pushed(peer, r))

    def _pushed(self, peer: str, reply: Message | None) -> None:
        if reply is None:
            self.membership.report_failure(peer)
        else:
            self.membership.heard(peer)
