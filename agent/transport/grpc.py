"""The real Transport: unary grpc.aio calls between agents (works on uvloop).

- `attach(server)` registers generic handlers for every method of the method table (Gossip and Consensus)
  on the agent's one grpc.aio server, which also hosts Admin, health and reflection.
- One channel per peer, reused by every call and replaced only when the peer's address changes; short
  reconnect backoff so that a restarted peer is reachable again within a second.
- Every call has a deadline (`timeout`); any failure (unreachable, deadline, status error, unknown peer,
  transport closed) becomes `on_reply(None)`. Callbacks run on the event loop, never inside `call`.
- The caller names itself in the `x-emoe-from` metadata; under mutual TLS the certificate's CN is the
  caller instead, and a channel checks the server certificate against the peer's node id.
- Every call carries this release's wire version (`emoe-wire`, elasticmoe/versions.py; the server's
  agent.wireversion refuses a caller too far apart), and a reply from a server more than one version apart
  is dropped (logged once per peer and version), as the server would drop the call the other way.
- Handlers raising `InvalidArgument` answer INVALID_ARGUMENT with the reason; a handler returning None
  answers UNAVAILABLE; a `Deferred` reply is awaited until the caller's deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import Message

from agent.transport import Deferred, HandlerTable, InvalidArgument, ReplyCallback, RequestHandler
from agent.transport.methods import METHODS, SERVICE_FULL_NAMES, grpc_path, lookup
from agent.wireversion import metadata_value
from elasticmoe.versions import CONTROL_SIGNED_KEY, WIRE_KEY, WIRE_VERSION, wire_of, wire_refusal

log = logging.getLogger(__name__)

FROM_KEY = "x-emoe-from"


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # a peer that restarts is reachable again within ~1 s (gRPC's default backoff grows to 120 s)
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        # protocols retry on their own terms (a lost probe is information, not an error to hide)
        ("grpc.enable_retries", 0),
    ]


class _Peer:
    __slots__ = ("address", "channel", "calls")

    def __init__(self, address: str, channel: grpc.aio.Channel) -> None:
        self.address = address
        self.channel = channel
        self.calls: dict[str, Any] = {}

    def callable(self, method: str) -> Any:
        mc = self.calls.get(method)
        if mc is None:
            req_cls, rep_cls = lookup(method)
            mc = self.calls[method] = self.channel.unary_unary(
                grpc_path(method), request_serializer=req_cls.SerializeToString,
                response_deserializer=rep_cls.FromString)
        return mc


def _identity(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's verified certificate CN, or None on plaintext."""
    try:
        if not context.peer_identities():
            return None
        cns = context.auth_context().get("x509_common_name") or []
    except Exception:  # pragma: no cover - depends on the credentials in use
        return None
    if len(cns) != 1:
        return None
    cn = cns[0]
    return cn.decode("utf-8", "replace") if isinstance(cn, bytes) else str(cn)


class GrpcTransport:
    def __init__(self, node_id: str, addresses: dict[str, str], *,
                 credentials: grpc.ChannelCredentials | None = None,
                 max_message_bytes: int = 64 << 20, drops: Callable[[str], bool] | None = None) -> None:
        """`drops(peer)`: a fault hook, whether traffic with `peer` is to be dropped now (a partition that the
        chaos harness injects, chaos.faults; None in production)."""
        self.node_id = node_id
        self._credentials = credentials
        self._max = max_message_bytes
        self._addresses = {n: a for n, a in addresses.items() if n != node_id}
        self._peers: dict[str, _Peer] = {}
        self._handlers = HandlerTable()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing: list[grpc.aio.Channel] = []
        self._closed = False
        self._metadata = ((FROM_KEY, node_id), (WIRE_KEY, str(WIRE_VERSION)))
        self._drops = drops
        self._wire_logged: set[tuple[str, int]] = set()  # (peer, its wire version) refused and logged
        self._signs_control: dict[str, bool] = {}  # whether each peer's last answer said it signs control records

    # ---- peers --------------------------------------------------------------------------------
    def add_peer(self, node_id: str, address: str) -> None:
        if node_id == self.node_id or not address:
            return
        if self._addresses.get(node_id) != address:
            self._addresses[node_id] = address
            old = self._peers.pop(node_id, None)
            if old is not None:
                self._closing.append(old.channel)

    def address(self, node_id: str) -> str | None:
        return self._addresses.get(node_id)

    def _peer(self, node_id: str) -> _Peer | None:
        p = self._peers.get(node_id)
        if p is None:
            addr = self._addresses.get(node_id)
            if addr is None:
                return None
            opts = channel_options(self._max)
            if self._credentials is not None:
                opts.append(("grpc.ssl_target_name_override", node_id))
                ch = grpc.aio.secure_channel(addr, self._credentials, options=opts)
            else:
                ch = grpc.aio.insecure_channel(addr, options=opts)
            p = self._peers[node_id] = _Peer(addr, ch)
        return p

    def signs_control(self, dst: str) -> bool:
        """Whether `dst` signs the control records it accepts, as its last answer said (`CONTROL_SIGNED_KEY`)
        over a channel only it can answer; True before it has answered (agent.consensus.controlnode uses it)."""
        return self._signs_control.get(dst, True)

    # ---- client side --------------------------------------------------------------------------
    def call(self, dst: str, method: str, request: Message, timeout: float, on_reply: ReplyCallback) -> None:
        loop = asyncio.get_running_loop()
        lookup(method)  # unknown methods are a programming error: raise here, in the caller
        peer = None if self._closed else self._peer(dst)
        if peer is None or timeout <= 0:
            loop.call_soon(self._deliver, on_reply, None)
            return
        if self._drops is not None and self._drops(dst):  # injected partition: lost at the deadline
            loop.call_later(timeout, self._deliver, on_reply, None)
            return
        task = loop.create_task(self._invoke(dst, peer.callable(method), request, timeout, on_reply))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _invoke(self, dst: str, mc: Any, request: Message, timeout: float, on_reply: ReplyCallback) -> None:
        try:
            call = mc(request, timeout=timeout, metadata=self._metadata)
            reply = await call
            md = await call.initial_metadata()
            peer = wire_of(metadata_value(md, WIRE_KEY))
            self._signs_control[dst] = metadata_value(md, CONTROL_SIGNED_KEY) is not None
            if why := wire_refusal(peer, f"peer {dst}"):
                if (dst, peer) not in self._wire_logged:
                    self._wire_logged.add((dst, peer))
                    log.error("%s: dropped a reply: %s", self.node_id, why)
                reply = None
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                log.debug("%s: call failed: %s %s", self.node_id, e.code().name, e.details())
            reply = None
        except Exception:  # channel closed under us and the like: a failed call
            log.debug("%s: call failed", self.node_id, exc_info=True)
            reply = None
        self._deliver(on_reply, reply)

    def _deliver(self, on_reply: ReplyCallback, reply: Message | None) -> None:
        if self._closed:
            return
        try:
            on_reply(reply)
        except Exception:
            log.exception("%s: reply callback failed", self.node_id)

    # ---- server side --------------------------------------------------------------------------
    def serve(self, handler: RequestHandler | None, service: str | None = None) -> None:
        self._handlers.set(handler, service)

    def attach(self, server: grpc.aio.Server) -> None:
        """Register every method of the method table on `server` (before it starts)."""
        by_service: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
        for method, (req_cls, rep_cls) in METHODS.items():
            service, _, name = method.partition("/")
            by_service.setdefault(service, {})[name] = grpc.unary_unary_rpc_method_handler(
                self._server_handler(method), request_deserializer=req_cls.FromString,
                response_serializer=rep_cls.SerializeToString)
        server.add_generic_rpc_handlers(tuple(
            grpc.method_handlers_generic_handler(SERVICE_FULL_NAMES[s], hs) for s, hs in by_service.items()))

    def _server_handler(self, method: str) -> Callable[[Message, grpc.aio.ServicerContext], Any]:
        async def handle(request: Message, context: grpc.aio.ServicerContext) -> Message:
            src = _identity(context)
            if src is None:
                src = next((v for k, v in context.invocation_metadata() or () if k == FROM_KEY), "")
            if not src:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no {FROM_KEY} metadata")
            if self._drops is not None and self._drops(str(src)):
                await context.abort(grpc.StatusCode.UNAVAILABLE, "injected partition (drop hook)")
            handler = None if self._closed else self._handlers.get(method)
            if handler is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.node_id} does not serve {method} now")
            try:
                reply = handler(str(src), method, request)  # type: ignore[misc]
            except InvalidArgument as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if isinstance(reply, Deferred):
                fut: asyncio.Future[Message | None] = asyncio.get_running_loop().create_future()
                reply.bind(lambda m: None if fut.done() else fut.set_result(m))
                try:
                    reply = await asyncio.wait_for(fut, context.time_remaining())
                except TimeoutError:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no reply before the deadline")
            if reply is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no reply")
            return reply

        return handle

    # ---- shutdown -----------------------------------------------------------------------------
    async def close(self) -> None:
        """Cancel calls in flight (their callbacks do not run) and close every channel."""
        self._closed = True
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        channels = [p.channel for p in self._peers.values()] + self._closing
        self._peers.clear()
        self._closing.clear()
        await asyncio.gather(*(ch.close() for ch in channels), return_exceptions=True)
