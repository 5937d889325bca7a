"""A small seeded in-memory network for consensus tests and chaos schedules (FakeClock time).

Latency, loss, duplication, reordering (random latency), partitions and crashed nodes. Each request and
reply is copied through its serialized form, so no node ever shares a message object with another.
`on_reply` runs exactly once per call: with the reply, or with None at the timeout.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from google.protobuf.message import Message

from agent.clock import FakeClock
from agent.transport import ReplyCallback, RequestHandler


def _copy(m: Message) -> Message:
    return type(m).FromString(m.SerializeToString())


class LocalNetwork:
    def __init__(self, clock: FakeClock, seed: int = 0, latency: tuple[float, float] = (0.0005, 0.002)) -> None:
        self.clock = clock
        self.rng = random.Random(seed)
        self.latency = latency
        self.loss = 0.0
        self.dup = 0.0
        self.handlers: dict[str, RequestHandler] = {}
        self.down: set[str] = set()
        self.group: dict[str, int] = {}  # partition id per node; nodes in different groups cannot talk
        self.sent = 0

    def transport(self, node_id: str) -> _LocalTransport:
        return _LocalTransport(self, node_id)

    # ---- faults ---------------------------------------------------------------------------------
    def partition(self, *groups: Iterable[str]) -> None:
        self.group = {n: i for i, g in enumerate(groups) for n in g}

    def heal(self) -> None:
        self.group = {}

    def crash(self, node: str) -> None:
        self.down.add(node)
        self.handlers.pop(node, None)

    def restart(self, node: str) -> None:
        self.down.discard(node)

    def connected(self, a: str, b: str) -> bool:
        if a in self.down or b in self.down:
            return False
        return self.group.get(a, -1) == self.group.get(b, -1)

    def _delay(self) -> float:
        return self.rng.uniform(*self.latency)

    def call(self, src: str, dst: str, method: str, req: Message, timeout: float, on_reply: ReplyCallback) -> None:
        self.sent += 1
        state = {"done": False}

        def finish(reply: Message | None) -> None:
            if not state["done"]:
                state["done"] = True
                on_reply(reply)

        self.clock.call_later(timeout, lambda: finish(None))
        copies = 2 if self.rng.random() < self.dup else 1
        for _ in range(copies):
            if self.rng.random() < self.loss:
                continue
            data = _copy(req)
            self.clock.call_later(self._delay(), lambda data=data: self._deliver(src, dst, method, data, finish))

    def _deliver(self, src: str, dst: str, method: str, req: Message, finish: ReplyCallback) -> None:
        h = self.handlers.get(dst)
        if h is None or not self.connected(src, dst):
            return
        reply = h(src, method, req)
        if reply is None or self.rng.random() < self.loss:
            return
        data = _copy(reply)

        def back() -> None:
            if src not in self.down and self.connected(src, dst):
                finish(data)

        self.clock.call_later(self._delay(), back)


class _LocalTransport:
    def __init__(self, net: LocalNetwork, node_id: str) -> None:
        self.net = net
        self.node_id = node_id

    def call(self, dst: str, method: str, request: Message, timeout: float, on_reply: ReplyCallback) -> None:
        self.net.call(self.node_id, dst, method, request, timeout, on_reply)

    def serve(self, handler: RequestHandler) -> None:
        self.net.handlers[self.node_id] = handler
        self.net.down.discard(self.node_id)
