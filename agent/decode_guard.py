"""Malformed protobufs get INVALID_ARGUMENT, not UNKNOWN.

grpc.aio answers a request its deserializer cannot parse with UNKNOWN ("Unexpected DecodeError"), and a
client cannot tell that from a server bug. `DecodeGuardInterceptor` swaps each handler's deserializer for
one that returns a `Malformed` marker instead of raising, and aborts such a call with INVALID_ARGUMENT and
the parser's reason before the servicer runs (for a client stream: when the bad message is reached, after
the good ones before it). Nothing else about the handler changes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from agent.security import _aiter, _maybe_await


class Malformed:
    """Stands for a request message that did not parse."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _lenient(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError, or whatever a generated parser raises on bad bytes
            return Malformed(f"{type(e).__name__}: {e}")

    return parse


async def _check(req: Any, ctx: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(req, Malformed):
        await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request to {method}: {req.reason}")


async def _checked(reqs: AsyncIterator[Any], ctx: grpc.aio.ServicerContext, method: str) -> AsyncIterator[Any]:
    async for r in _aiter(reqs):
        await _check(r, ctx, method)
        yield r


def guarded(h: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    ser = {"request_deserializer": _lenient(h.request_deserializer), "response_serializer": h.response_serializer}
    if h.unary_unary:
        fn_uu = h.unary_unary

        async def uu(req: Any, ctx: grpc.aio.ServicerContext) -> Any:
            await _check(req, ctx, method)
            return await _maybe_await(fn_uu(req, ctx))

        return grpc.unary_unary_rpc_method_handler(uu, **ser)
    if h.unary_stream:
        fn_us = h.unary_stream

        async def us(req: Any, ctx: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await _check(req, ctx, method)
            async for item in _aiter(fn_us(req, ctx)):
                yield item

        return grpc.unary_stream_rpc_method_handler(us, **ser)
    if h.stream_unary:
        fn_su = h.stream_unary

        async def su(reqs: Any, ctx: grpc.aio.ServicerContext) -> Any:
            return await _maybe_await(fn_su(_checked(reqs, ctx, method), ctx))

        return grpc.stream_unary_rpc_method_handler(su, **ser)
    fn_ss = h.stream_stream

    async def ss(reqs: Any, ctx: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for item in _aiter(fn_ss(_checked(reqs, ctx, method), ctx)):
            yield item

    return grpc.stream_stream_rpc_method_handler(ss, **ser)


class DecodeGuardInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return guarded(handler, handler_call_details.method)
