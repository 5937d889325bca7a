"""Transport: how protocol code talks to peers.

A request/reply message interface that maps onto unary gRPC calls (real) and onto a seeded simulated
network (in-memory). Protocol code is sans-IO: it registers a synchronous request handler and gets each
reply, or None for a timeout or failure, through a callback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from google.protobuf.message import Message

# (source node, method, request) -> reply, or None to send no reply (the caller times out).
RequestHandler = Callable[[str, str, Message], Message | None]
# reply, or None when the call failed or timed out
ReplyCallback = Callable[[Message | None], None]


class Transport(Protocol):
    def call(self, dst: str, method: str, request: Message, timeout: float, on_reply: ReplyCallback) -> None:
        """Send `request` to node `dst` for `method` (e.g. "Gossip/Probe"); `on_reply` runs exactly once."""
        ...

    def serve(self, handler: RequestHandler) -> None:
        """Install the handler for requests addressed to this node."""
        ...
