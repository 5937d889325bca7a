"""One node's agent process: composes transport, membership + load gossip, consensus, the decision core,
the shim link and the admin service on one grpc.aio server (plus a unix socket for the local shim)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from agent.admin.admin import AdminService, local_callers_only
from agent.admin.metrics import MetricsServer
from agent.config import AgentConfig
from agent.credentials import channel_credentials, interceptors, server_credentials
from agent.state import NodeState
from agent.storage.datadir import DataDirError, DataDirLock
from agent.storage.store import StoreCorrupt, StoreNewer
from agent.transport.grpc import GrpcTransport
from elasticmoe.v1 import admin_pb2, admin_pb2_grpc, consensus_pb2, gossip_pb2

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
    gossip_pb2.DESCRIPTOR.services_by_name["Gossip"].full_name,
    consensus_pb2.DESCRIPTOR.services_by_name["Consensus"].full_name,
    health.SERVICE_NAME,
    reflection.SERVICE_NAME,
)


# The health service name for liveness (Kubernetes livenessProbe `grpc.service`): SERVING from the moment the
# server answers until the process exits, whatever the node's readiness (the "" service and every service
# above: NOT_SERVING while the store has failed or etcd is unreachable, which a restart does not cure).
LIVENESS = "liveness"


# No SO_REUSEPORT: with it, a second agent on the same port starts without error and the kernel splits
# connections between the two (two clusters merged into one). Without it, the second bind fails.
SERVER_OPTIONS = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 64 << 20),
                  ("grpc.max_send_message_length", 64 << 20)]


class StartupError(RuntimeError):
    """The agent cannot start: a message for the operator (no traceback), naming what to fix."""


class AgentProcess:
    """The gRPC servers around a NodeState, with graceful shutdown."""

    def __init__(self, cfg: AgentConfig, drops: Callable[[str], bool] | None = None) -> None:
        """`drops`: the gRPC transport's fault hook (None in production; the chaos harness's chaos.agentproc)."""
        self.cfg = cfg
        self._drops = drops
        self._state: NodeState | None = None  # built once the server is bound (start)
        self.server: grpc.aio.Server | None = None
        self.shim_server: grpc.aio.Server | None = None
        self.health_server: grpc.aio.Server | None = None
        self.metrics: MetricsServer | None = None
        self.health = health.aio.HealthServicer()
        self.port = 0
        self.lock = DataDirLock(cfg.data_dir)
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Lock the data_dir, bind, recover the store, then serve. Raises StartupError with the reason."""
        try:
            self.lock.acquire()
        except DataDirError as e:
            raise StartupError(str(e)) from None
        try:
            await self._start()
        except BaseException:
            await self._abort()
            raise

    @property
    def state(self) -> NodeState:
        """The node, once start() built it."""
        if self._state is None:
            raise RuntimeError(f"agent {self.cfg.node_id} has not started")
        return self._state

    async def _abort(self) -> None:
        """Undo a failed start: stop what started, and let go of the data_dir (its LOCK file goes too, whatever
        else fails here)."""
        try:
            if self._state is not None:  # started, then a later step failed: stop voting first
                self._state.stop(graceful=False)
                await self._state.close()
            for srv in (self.shim_server, self.health_server, self.server):
                if srv is not None:
                    await srv.stop(0)
            if self.metrics is not None:
                await asyncio.to_thread(self.metrics.close)
        finally:
            self.lock.release()

    async def _start(self) -> None:
        # readiness is NOT_SERVING until the node is built and says it serves (the servicer starts SERVING)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await _maybe_await(self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING))
        sock = self.cfg.shim_socket_path
        if _socket_answers(sock):  # binding would silently take the socket from the agent behind it
            raise StartupError(f"shim_socket = {sock!r} is in use by another process: give each agent its own")
        server = grpc.aio.server(interceptors=interceptors(self.cfg), options=SERVER_OPTIONS)
        # without TLS no caller has a verified identity: mutating admin calls only from this host
        authorize = None if self.cfg.tls.cert_dir else local_callers_only
        service = AdminService(self.cfg.node_id, authorize=authorize)  # bound to the node's parts once it started
        admin_pb2_grpc.add_AdminServicer_to_server(service, server)  # type: ignore[no-untyped-call]
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(SERVICE_NAMES, server)
        addresses = {n: a for n, a in self.cfg.seed_map.items() if n != self.cfg.node_id}
        transport = GrpcTransport(self.cfg.node_id, addresses, credentials=channel_credentials(self.cfg),
                                  drops=self._drops)
        transport.attach(server)
        creds = server_credentials(self.cfg)
        try:
            if creds is None:
                self.port = server.add_insecure_port(self.cfg.listen)
            else:
                self.port = server.add_secure_port(self.cfg.listen, creds)
        except RuntimeError:  # grpc raises when the address cannot be bound
            self.port = 0
        if self.port == 0:
            raise StartupError(f"listen = {self.cfg.listen!r}: cannot bind (in use by another process, or not an "
                               f"address of this host)")
        await server.start()
        self.server = server
        try:
            self._state = NodeState(self.cfg, transport)
        except (StoreCorrupt, StoreNewer, DataDirError) as e:
            await transport.close()
            raise StartupError(str(e)) from None
        service.bind(self.state.view, self.state.manual)
        self.shim_server = await self.state.serve_shim(sock)
        if self.cfg.tls.health_listen:
            from agent.security import serve_plaintext_health

            try:
                self.health_server, _ = await serve_plaintext_health(self.cfg.tls.health_listen, self.health)
            except OSError as e:
                raise StartupError(str(e)) from None
        if self.cfg.metrics.listen:
            try:
                self.metrics = MetricsServer(self.cfg.metrics.listen, self.state.view, asyncio.get_running_loop(),
                                             self.cfg.metrics.per_expert)
            except OSError as e:
                raise StartupError(f"metrics.listen = {self.cfg.metrics.listen!r}: cannot bind ({e})") from None
        health = self.state.view.health()
        serving = health == "SERVING"
        if serving:
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._watch = asyncio.get_running_loop().create_task(self._watch_health(serving))
        log.info("agent %s %s on %s (shim link %s)", self.cfg.node_id,
                 "serving" if serving else f"started, {health},", self.cfg.listen, sock)

    async def _set_health(self, status: int) -> None:
        """Readiness: the overall ("") status and every service's; LIVENESS is apart."""
        for name in ("", *SERVICE_NAMES):
            await _maybe_await(self.health.set(name, status))

    async def _watch_health(self, serving: bool, every: float = 0.25) -> None:
        """Follow the node's health: NOT_SERVING while its store has failed or its etcd is unreachable."""
        while True:
            await asyncio.sleep(every)
            now = self.state.view.health() == "SERVING"
            if now != serving:
                serving = now
                await self._set_health(health_pb2.HealthCheckResponse.SERVING if now
                                       else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float = 2.0) -> None:
        """SIGTERM path: stop serving new work, leave the cluster gracefully, then close."""
        if self._watch is not None:
            self._watch.cancel()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.state.stop()
        await asyncio.sleep(0.1)  # let the leave broadcast go out
        await self.state.close()
        try:
            for srv in (self.shim_server, self.health_server, self.server):
                if srv is not None:
                    await srv.stop(grace)
            if self.metrics is not None:
                await asyncio.to_thread(self.metrics.close)
        finally:
            self.lock.release()


async def _maybe_await(res: object) -> None:
    """grpc's HealthServicer.set is a coroutine in grpc.aio and a plain call in the sync servicer."""
    if asyncio.iscoroutine(res):
        await res


def _socket_answers(path: str) -> bool:
    """Whether a process accepts connections on the unix socket at `path`."""
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False  # a stale socket file left by a crash
    return True


async def _main(cfg: AgentConfig, drops: Callable[[str], bool] | None) -> int:
    proc = AgentProcess(cfg, drops)
    try:
        await proc.start()
    except StartupError as e:
        log.error("agent %s cannot start: %s", cfg.node_id, e)
        print(f"emoe agent: error: {e}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("agent %s: draining and shutting down", cfg.node_id)
    await proc.stop()
    return 0


def run_forever(cfg: AgentConfig, drops: Callable[[str], bool] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("EMOE_LOG", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop

        return uvloop.run(_main(cfg, drops))
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(_main(cfg, drops))
