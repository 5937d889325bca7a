"""The wire version on every gRPC call an agent serves (elasticmoe/versions.py says the rule).

`WireInterceptor` reads the caller's `emoe-wire` metadata and answers a caller more than one version away
with FAILED_PRECONDITION naming both versions (logged once per caller and version), before any handler runs;
every other call gets this agent's version in its initial metadata, so that a caller can judge the server
too (agent.transport.grpc does, for every peer call). A caller that sends no version is a release before
versions (version 1) on the services only agents and engine plugins call (Gossip, Consensus, the shim link);
on the others (Admin, health, reflection: any gRPC client may call them) it is served as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc
import grpc.aio

from agent.security import _guarded
from elasticmoe.versions import CONTROL_SIGNED_KEY, WIRE_KEY, WIRE_VERSION, wire_of, wire_refusal

log = logging.getLogger(__name__)

# services whose callers are agents or engine plugins: a call without a version comes from a release before
# versions
VERSIONED = ("/elasticmoe.v1.Gossip/", "/elasticmoe.v1.Consensus/", "/elasticmoe.v1.DataplaneLink/")
_ANSWER = ((WIRE_KEY, str(WIRE_VERSION)), (CONTROL_SIGNED_KEY, "1"))
_LOGGED_MAX = 1024


def metadata_value(metadata: object, key: str) -> str | bytes | None:
    """The value of `key` in gRPC metadata (a sequence of (key, value) pairs, or None)."""
    for k, v in metadata or ():  # type: ignore[attr-defined]
        if k == key:
            return v  # type: ignore[no-any-return]
    return None


class WireInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self) -> None:
        self.refused = 0
        self._logged: set[tuple[str, int]] = set()  # (caller, version): a peer cannot flood the log

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        md = details.invocation_metadata
        raw = metadata_value(md, WIRE_KEY)
        why = ""
        if raw is not None or details.method.startswith(VERSIONED):
            caller = metadata_value(md, "x-emoe-from") or "a client"
            caller = caller.decode(errors="replace") if isinstance(caller, bytes) else caller
            peer = wire_of(raw)
            why = wire_refusal(peer, f"{caller} (calling {details.method})")
            if why:
                self.refused += 1
                if (caller, peer) not in self._logged and len(self._logged) < _LOGGED_MAX:
                    self._logged.add((caller, peer))
                    log.error("refused a call: %s", why)

        async def check(ctx: grpc.aio.ServicerContext) -> str:
            if why:
                await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
            await ctx.send_initial_metadata(_ANSWER)
            return ""

        return _guarded(handler, check)
