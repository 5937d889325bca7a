"""One node's agent process: composes transport, membership + load gossip, consensus, the decision core,
the shim link and the admin service on one grpc.aio server (plus a unix socket for the local shim)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from agent.admin import AdminService
from agent.config import AgentConfig
from agent.state import NodeState
from elasticmoe.v1 import admin_pb2, admin_pb2_grpc, consensus_pb2, gossip_pb2

log = logging.getLogger("emoe.agent")

SERVICE_NAMES = (
    admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
    gossip_pb2.DESCRIPTOR.services_by_name["Gossip"].full_name,
    consensus_pb2.DESCRIPTOR.services_by_name["Consensus"].full_name,
    health.SERVICE_NAME,
    reflection.SERVICE_NAME,
)


class AgentProcess:
    """The gRPC servers around a NodeState, with graceful shutdown."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.state = NodeState(cfg)
        self.server: grpc.aio.Server | None = None
        self.shim_server: grpc.aio.Server | None = None
        self.health_server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.port = 0

    async def start(self) -> None:
        server = grpc.aio.server(interceptors=self.state.interceptors(), options=[("grpc.max_receive_message_length", 64 << 20),
                                          ("grpc.max_send_message_length", 64 << 20)])
        admin_pb2_grpc.add_AdminServicer_to_server(AdminService(self.state), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(SERVICE_NAMES, server)
        self.state.attach(server)
        creds = self.state.server_credentials()
        if creds is None:
            self.port = server.add_insecure_port(self.cfg.listen)
        else:
            self.port = server.add_secure_port(self.cfg.listen, creds)
        if self.port == 0:
            raise OSError(f"cannot listen on {self.cfg.listen}")
        await server.start()
        self.server = server
        self.state.start()
        sock = self.cfg.shim_socket or str(Path(self.cfg.data_dir) / "shim.sock")
        self.shim_server = await self.state.serve_shim(sock)
        if self.cfg.tls.health_listen:
            from agent.security import serve_plaintext_health

            self.health_server, _ = await serve_plaintext_health(self.cfg.tls.health_listen, self.health)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("agent %s serving on %s (shim link %s)", self.cfg.node_id, self.cfg.listen, sock)

    async def _set_health(self, status: int) -> None:
        for name in ("", *SERVICE_NAMES):
            res = self.health.set(name, status)
            if asyncio.iscoroutine(res):
                await res

    async def stop(self, grace: float = 2.0) -> None:
        """SIGTERM path: stop serving new work, leave the cluster gracefully, then close."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.state.stop()
        await asyncio.sleep(0.1)  # let the leave broadcast go out
        await self.state.close()
        for srv in (self.shim_server, self.health_server, self.server):
            if srv is not None:
                await srv.stop(grace)


async def _main(cfg: AgentConfig) -> int:
    proc = AgentProcess(cfg)
    await proc.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("agent %s: draining and shutting down", cfg.node_id)
    await proc.stop()
    return 0


def run_forever(cfg: AgentConfig) -> int:
    logging.basicConfig(level=os.environ.get("EMOE_LOG", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop

        return uvloop.run(_main(cfg))
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(_main(cfg))
