"""Transport: how protocol code talks to peers.

A request/reply message interface that maps onto unary gRPC calls (real, `agent.transport.grpc`) and onto
a seeded simulated network (in-memory, `agent.transport.sim`). Protocol code is sans-IO: it registers a
synchronous request handler and gets each reply, or None for a timeout or failure, through a callback.

Three small additions keep that shape while letting several protocols share one transport:
- `serve(handler, service="Gossip")` installs a handler for one service's methods only; `serve(handler)`
  installs the handler for every other method. Membership and consensus each serve their own service.
- A handler that can only answer later (an indirect probe waits for the target) returns a `Deferred` and
  calls `Deferred.reply(message)` (or `reply(None)`: no reply) when it can.
- A handler that rejects its input raises `InvalidArgument(reason)`: gRPC answers INVALID_ARGUMENT with the
  reason, the simulated network answers with a failure; either way the caller's `on_reply` gets None.

May import: agent.clock, agent.security, agent.wireversion; nothing of the subsystems that stand on it
(tests/project/test_layering.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from google.protobuf.message import Message


class InvalidArgument(Exception):
    """Raised by a request handler for bad input from the network; the handler must have changed no state."""


class Deferred:
    """A reply that a handler gives later: return it from the handler, then call `reply` exactly once."""

    __slots__ = ("_done", "_value", "_sink")

    def __init__(self) -> None:
        self._done = False
        self._value: Message | None = None
        self._sink: Callable[[Message | None], None] | None = None

    @property
    def done(self) -> bool:
        return self._done

    def reply(self, message: Message | None) -> None:
        """Send `message` as the reply (None: send none, the caller fails). Later calls are ignored."""
        if self._done:
            return
        self._done = True
        self._value = message
        sink, self._sink = self._sink, None
        if sink is not None:
            sink(message)

    def bind(self, sink: Callable[[Message | None], None]) -> None:
        """For transports: deliver the reply to `sink` (at once if it was already given)."""
        if self._done:
            sink(self._value)
        else:
            self._sink = sink


# (source node, method, request) -> reply, a Deferred reply, or None to send no reply (the caller fails).
RequestHandler = Callable[[str, str, Message], "Message | Deferred | None"]
# reply, or None when the call failed or timed out
ReplyCallback = Callable[[Message | None], None]


def service_of(method: str) -> str:
    """"Gossip/Probe" -> "Gossip"."""
    return method.partition("/")[0]


class Transport(Protocol):
    def call(self, dst: str, method: str, request: Message, timeout: float, on_reply: ReplyCallback) -> None:
        """Send `request` to node `dst` for `method` (e.g. "Gossip/Probe"); `on_reply` runs exactly once
        (with the reply, or None on failure or after `timeout` seconds), never before `call` returns."""
        ...

    def serve(self, handler: RequestHandler, service: str | None = None) -> None:
        """Install the handler for requests addressed to this node: for one service's methods, or (None)
        for every method that no service-specific handler takes."""
        ...

    def add_peer(self, node_id: str, address: str) -> None:
        """Learn (or update) where a node listens; the simulated network needs no addresses."""
        ...

    async def close(self) -> None:
        """Release what the transport holds (channels, sockets); the simulated network holds none."""
        ...


class HandlerTable:
    """Service-specific handlers and a fallback, shared by the transports' dispatch."""

    __slots__ = ("by_service", "fallback")

    def __init__(self) -> None:
        self.by_service: dict[str, RequestHandler] = {}
        self.fallback: RequestHandler | None = None

    def set(self, handler: RequestHandler | None, service: str | None) -> None:
        if service is None:
            self.fallback = handler
        elif handler is None:
            self.by_service.pop(service, None)
        else:
            self.by_service[service] = handler

    def get(self, method: str) -> RequestHandler | None:
        return self.by_service.get(service_of(method), self.fallback)
