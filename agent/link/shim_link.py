"""Agent side of the local link: the `elasticmoe.v1.DataplaneLink` servicer on a unix socket.

`WatchTables(from_version)` streams every certified commit newer than `from_version` from a
`TableSource`, then each new one as it commits, and tells `presence` (agent.link.ranklink) when a rank's stream
opens and when it ends (the rank's process left); `ReportLoad` hands each well-formed `LoadReport` to the
sink. A malformed report (shape, byte length, or one the sink refuses with ValueError) ends the stream
with INVALID_ARGUMENT and the reason; reports before it were delivered, the bad one changed nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc

from agent.link.ranklink import RankPresence
from dataplane_shim.link import check_load_report
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.v1 import dataplane_pb2 as dpb
from elasticmoe.v1 import dataplane_pb2_grpc as dgrpc

log = logging.getLogger(__name__)


class TableSource(Protocol):
    """Committed tables, in version order."""

    def head_version(self) -> int:
        """The committed head's version (the genesis table's, 1, has no commit record to send)."""
        ...

    def commits_since(self, version: int) -> list[cpb.Commit]:
        """Certified commits with table.version > version, ascending."""
        ...

    async def wait_for_newer(self, version: int) -> None:
        """Return once a version > `version` is committed."""
        ...


LoadSink = Callable[[dpb.LoadReport], int | None]  # -> the step the engine should continue at, when it is behind


class DataplaneLinkServicer(dgrpc.DataplaneLinkServicer):
    def __init__(self, source: TableSource, sink: LoadSink, *, layers: int | None = None,
                 experts: int | None = None, presence: RankPresence | None = None) -> None:
        self.source, self.sink, self.presence = source, sink, presence
        self.layers, self.experts = layers, experts
        self.accepted = 0
        self.rejected = 0

    async def WatchTables(  # noqa: N802 (gRPC method name)
        self, request: dpb.WatchTablesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[dpb.TableUpdate]:
        v = request.from_version
        ranks = list(request.ranks)
        if self.presence is not None:
            self.presence.attach(ranks)
        try:
            while True:
                for c in self.source.commits_since(v):
                    if c.table.version > v:
                        yield dpb.TableUpdate(commit=c)
                        v = c.table.version
                # versions up to the head without a commit record to send (the genesis table) are not waited for
                # (a stream from version 0 waited for "newer than 0" forever at once: a busy loop in the agent)
                await self.source.wait_for_newer(max(v, self.source.head_version()))
        finally:  # the client went away (its process exited, or it closed the stream), or this server stops
            if self.presence is not None:
                self.presence.detach(ranks)

    async def ReportLoad(  # noqa: N802
        self, request_iterator: AsyncIterator[dpb.LoadReport], context: grpc.aio.ServicerContext
    ) -> dpb.ReportLoadAck:
        accepted, next_step = 0, 0
        async for r in request_iterator:
            reason = check_load_report(r, self.layers, self.experts)
            if not reason:
                try:
                    next_step = max(next_step, self.sink(r) or 0)
                except ValueError as exc:
                    reason = str(exc)
            if reason:
                self.rejected += 1
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"load report {accepted} from {r.shim_id or r.rank}: {reason}")
            accepted += 1
            self.accepted += 1
        return dpb.ReportLoadAck(accepted=accepted, next_step=next_step)


# The socket's mode: the agent's user and group may connect (the engine runs as another user, in the agent's
# group: systemd's emoe group, the pods' shared gid), nobody else.
SOCKET_MODE = 0o660


async def serve_unix(path: str, source: TableSource, sink: LoadSink, *, layers: int | None = None,
                     experts: int | None = None, presence: RankPresence | None = None,
                     group: int | None = None) -> grpc.aio.Server:
    """Start a grpc.aio server for the link on `unix:{path}`, with mode SOCKET_MODE and group `group` (a gid;
    None: the group of the directory that holds it); the caller stops it."""
    from agent.decode_guard import DecodeGuardInterceptor
    from agent.wireversion import WireInterceptor

    server = grpc.aio.server(interceptors=[WireInterceptor(), DecodeGuardInterceptor()])
    dgrpc.add_DataplaneLinkServicer_to_server(  # type: ignore[no-untyped-call]
        DataplaneLinkServicer(source, sink, layers=layers, experts=experts, presence=presence), server)
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    share_socket(path, os.stat(os.path.dirname(os.path.abspath(path))).st_gid if group is None else group)
    return server


def share_socket(path: str, group: int) -> None:
    """Give the socket at `path` mode SOCKET_MODE and group `group`, so that an engine of that group may connect
    (a socket is created with the process's umask, typically srwxr-xr-x: nobody else could). A group this
    process may not give (not one of its groups, unless root) is logged and the socket keeps its own."""
    os.chmod(path, SOCKET_MODE)
    if os.stat(path).st_gid == group:
        return
    try:
        os.chown(path, -1, group)
    except PermissionError:
        log.warning("shim socket %s: cannot give it group %d (this agent is not in that group): engines must "
                    "run in group %d to connect", path, group, os.stat(path).st_gid)
