"""A seeded simulated network on a FakeClock: the in-memory Transport.

Per-link latency with jitter, loss, duplication and reordering; partitions; crashed and paused nodes. Every
random choice comes from one `random.Random(seed)` drawn in event order, and events run in (time, insertion)
order, so a run is a pure function of the seed and the schedule of faults.

Each request and reply crosses the network as bytes (serialised with the method table's classes), so no
node ever shares a message object with another, handlers see exactly what gRPC would deliver, and
`stats` counts the bytes each node sends. Semantics follow unary gRPC with a deadline:
- `on_reply` runs exactly once: with the reply, or with None when the call timed out or was rejected
  (InvalidArgument, no handler for the method); a handler that returns None sends no reply (timeout).
- A paused node neither receives (requests and replies addressed to it are dropped) nor runs timers; its
  overdue timers, call timeouts included, run when it resumes. A crashed node does nothing ever again;
  `restart` gives its id a fresh clock and transport (a new process).
- A partition drops every message between nodes of different groups, including those already in flight.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from google.protobuf.message import Message

from agent.clock import FakeClock, NodeClock, Timer
from agent.transport import Deferred, HandlerTable, InvalidArgument, ReplyCallback, RequestHandler
from agent.transport.methods import lookup


@dataclass(frozen=True)
class LinkSpec:
    """How one direction of a link behaves. Defaults: a quiet datacenter LAN."""

    latency: float = 0.0005       # one-way seconds: a LAN hop plus a gRPC stack
    jitter: float = 0.0005        # plus uniform [0, jitter) seconds; reorders close messages now and then
    loss: float = 0.0             # probability a message is dropped
    duplicate: float = 0.0        # probability a message is delivered twice (independent delays)
    reorder: float = 0.0          # probability a message is held back by up to reorder_delay extra
    reorder_delay: float = 0.01

    def validate(self) -> None:
        for f in ("latency", "jitter", "reorder_delay"):
            if getattr(self, f) < 0:
                raise ValueError(f"LinkSpec.{f} = {getattr(self, f)!r}: expected >= 0")
        for f in ("loss", "duplicate", "reorder"):
            if not 0.0 <= getattr(self, f) <= 1.0:
                raise ValueError(f"LinkSpec.{f} = {getattr(self, f)!r}: expected a probability in [0, 1]")


@dataclass
class SimStats:
    """What crossed the network: per sending node and per method, request and reply bytes alike."""

    bytes_by_node: Counter[str]
    msgs_by_node: Counter[str]
    bytes_by_method: Counter[str]
    msgs_by_method: Counter[str]
    dropped: int = 0

    @classmethod
    def empty(cls) -> SimStats:
        return cls(Counter(), Counter(), Counter(), Counter())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_node.values())


class _Node:
    __slots__ = ("node_id", "clock", "handlers", "crashed", "addresses")

    def __init__(self, node_id: str, clock: NodeClock) -> None:
        self.node_id = node_id
        self.clock = clock
        self.handlers = HandlerTable()
        self.crashed = False
        self.addresses: dict[str, str] = {}

    @property
    def running(self) -> bool:
        return not self.crashed and self.clock.running


class PendingCall:
    """A call awaiting its reply: finished once, by the reply or by its deadline (chaos/mcworld.py uses it too)."""

    __slots__ = ("on_reply", "timer", "done")

    def __init__(self, on_reply: ReplyCallback) -> None:
        self.on_reply = on_reply
        self.timer: Timer | None = None
        self.done = False

    def finish(self, reply: Message | None) -> None:
        if self.done:
            return
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
        self.on_reply(reply)


class SimNetwork:
    """`transport(node_id)` and `clock(node_id)` for each simulated node, plus the fault controls."""

    def __init__(self, clock: FakeClock, seed: int, link: LinkSpec | None = None, *, header_bytes: int = 0) -> None:
        self.base = clock
        self.rng = random.Random(seed)
        self.default = link or LinkSpec()
        self.default.validate()
        self.header_bytes = header_bytes  # added to each message's size in stats (framing, headers)
        self._links: dict[tuple[str, str], LinkSpec] = {}
        self._nodes: dict[str, _Node] = {}
        self._group: dict[str, int] = {}
        self.stats = SimStats.empty()

    # ---- nodes --------------------------------------------------------------------------------
    def _node(self, node_id: str) -> _Node:
        n = self._nodes.get(node_id)
        if n is None:
            n = self._nodes[node_id] = _Node(node_id, NodeClock(self.base))
        return n

    def transport(self, node_id: str) -> SimTransport:
        return SimTransport(self, self._node(node_id))

    def clock(self, node_id: str) -> NodeClock:
        return self._node(node_id).clock

    def nodes(self) -> list[str]:
        return list(self._nodes)

    def is_running(self, node_id: str) -> bool:
        n = self._nodes.get(node_id)
        return n is not None and n.running

    def is_crashed(self, node_id: str) -> bool:
        n = self._nodes.get(node_id)
        return n is not None and n.crashed

    # ---- faults -------------------------------------------------------------------------------
    def set_default(self, **changes: float) -> None:
        """Change the default link, e.g. `set_default(loss=0.05)`."""
        spec = replace(self.default, **changes)
        spec.validate()
        self.default = spec

    def set_link(self, a: str, b: str, spec: LinkSpec | None, *, both: bool = True) -> None:
        """Override the link a->b (and b->a); None restores the default."""
        if spec is not None:
            spec.validate()
        for k in ((a, b), (b, a)) if both else ((a, b),):
            if spec is None:
                self._links.pop(k, None)
            else:
                self._links[k] = spec

    def partition(self, groups: Iterable[Iterable[str]]) -> None:
        """Nodes in different groups cannot talk; a node named in no group talks to everyone."""
        self._group = {n: i for i, g in enumerate(groups) for n in g}

    def heal(self) -> None:
        self._group = {}

    def pause(self, node_id: str) -> None:
        self._node(node_id).clock.pause()

    def resume(self, node_id: str) -> None:
        self._node(node_id).clock.resume()

    def pause_for(self, node_id: str, seconds: float) -> None:
        self.pause(node_id)
        self.base.call_later(seconds, lambda: self.resume(node_id))

    def crash(self, node_id: str) -> None:
        n = self._node(node_id)
        n.crashed = True
        n.clock.stop()

    def restart(self, node_id: str) -> None:
        """Forget a crashed node's process: the next `transport`/`clock` for the id start fresh."""
        old = self._nodes.pop(node_id, None)
        if old is not None:
            old.crashed = True
            old.clock.stop()

    def reachable(self, a: str, b: str) -> bool:
        ga, gb = self._group.get(a), self._group.get(b)
        return ga is None or gb is None or ga == gb

    # ---- the wire -----------------------------------------------------------------------------
    def _account(self, src: str, method: str, size: int) -> None:
        size += self.header_bytes
        s = self.stats
        s.bytes_by_node[src] += size
        s.msgs_by_node[src] += 1
        s.bytes_by_method[method] += size
        s.msgs_by_method[method] += 1

    def _send(self, src: str, dst: str, deliver: Callable[[], None]) -> None:
        spec = self._links.get((src, dst), self.default)
        rng = self.rng
        copies = 2 if spec.duplicate and rng.random() < spec.duplicate else 1
        for _ in range(copies):
            if spec.loss and rng.random() < spec.loss:
                self.stats.dropped += 1
                continue
            delay = spec.latency + (rng.random() * spec.jitter if spec.jitter else 0.0)
            if spec.reorder and rng.random() < spec.reorder:
                delay += rng.random() * spec.reorder_delay
            self.base.call_later(delay, deliver)

    def _call(self, src: _Node, dst: str, method: str, request: Message, timeout: float,
              on_reply: ReplyCallback) -> None:
        if not src.running:
            return  # a crashed node's code does not run; a paused one's cannot call
        req_cls, rep_cls = lookup(method)
        if not isinstance(request, req_cls):
            raise TypeError(f"{method}: request is a {type(request).__name__}, expected {req_cls.__name__}")
        data = request.SerializeToString()
        self._account(src.node_id, method, len(data))
        call = PendingCall(on_reply)
        call.timer = src.clock.call_later(timeout, lambda: call.finish(None))
        s = src.node_id

        def deliver() -> None:
            self._deliver_request(src, dst, method, data, call)

        if self.reachable(s, dst):
            self._send(s, dst, deliver)
        else:
            self.stats.dropped += 1

    def _deliver_request(self, src: _Node, dst_id: str, method: str, data: bytes, call: PendingCall) -> None:
        dst = self._nodes.get(dst_id)
        if dst is None or not dst.running or not self.reachable(src.node_id, dst_id):
            self.stats.dropped += 1
            return
        handler = dst.handlers.get(method)
        if handler is None:  # UNIMPLEMENTED: the caller learns at once
            self._send_back(dst, src, method, None, call, error=True)
            return
        req_cls, _ = lookup(method)
        try:
            reply = handler(src.node_id, method, req_cls.FromString(data))
        except InvalidArgument:
            self._send_back(dst, src, method, None, call, error=True)
            return
        if reply is None:
            return
        if isinstance(reply, Deferred):
            reply.bind(lambda m: self._send_back(dst, src, method, m, call))
        else:
            self._send_back(dst, src, method, reply, call)

    def _send_back(self, dst: _Node, src: _Node, method: str, reply: Message | None, call: PendingCall,
                   error: bool = False) -> None:
        if dst.crashed or (reply is None and not error):
            return
        payload: bytes | None = None
        if reply is not None:
            _, rep_cls = lookup(method)
            if not isinstance(reply, rep_cls):
                raise TypeError(f"{method}: reply is a {type(reply).__name__}, expected {rep_cls.__name__}")
            payload = reply.SerializeToString()
            self._account(dst.node_id, method, len(payload))
        else:
            self._account(dst.node_id, method, 0)

        def deliver() -> None:
            if not src.running or not self.reachable(src.node_id, dst.node_id):
                self.stats.dropped += 1
                return
            if payload is None:
                call.finish(None)
            else:
                call.finish(lookup(method)[1].FromString(payload))

        if self.reachable(dst.node_id, src.node_id):
            self._send(dst.node_id, src.node_id, deliver)
        else:
            self.stats.dropped += 1


class SimTransport:
    """One node's endpoint on a SimNetwork (see the module docstring for the semantics)."""

    def __init__(self, net: SimNetwork, node: _Node) -> None:
        self._net = net
        self._node = node

    @property
    def node_id(self) -> str:
        return self._node.node_id

    @property
    def clock(self) -> NodeClock:
        return self._node.clock

    def call(self, dst: str, method: str, request: Message, timeout: float, on_reply: ReplyCallback) -> None:
        self._net._call(self._node, dst, method, request, timeout, on_reply)

    def serve(self, handler: RequestHandler, service: str | None = None) -> None:
        self._node.handlers.set(handler, service)

    def add_peer(self, node_id: str, address: str) -> None:
        self._node.addresses[node_id] = address

    async def close(self) -> None:
        """Nothing to release: no sockets."""
