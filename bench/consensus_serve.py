"""A consensus-only process: one ConsensusNode (or EtcdBackend) on a grpc.aio server, on uvloop.

    python -m bench.consensus_serve --node-id a0 --listen 127.0.0.1:7501 \
        --peers a0@127.0.0.1:7501,a1@127.0.0.1:7502,a2@127.0.0.1:7503 --data-dir /tmp/a0

Runs until SIGTERM/SIGINT. With `--bench-versions N` it is the commit benchmark's worker (bench/commit.py):
it prints `ready`, waits for a line `go` on stdin, then proposes every version whose round-0 owner it is
(for etcd: the same rotation over the nodes) until the head has advanced N versions, and prints one JSON
line with the latencies, in ms, from its proposals to their commits being known here.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import random
import signal
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import grpc

from agent.clock import RealClock
from agent.config import ClusterConfig, ConsensusConfig
from agent.consensus.node import ConsensusNode, Outcome
from agent.consensus.paxos import round0_owner
from agent.storage.store import Store
from chaos.quorumsim import successor_table
from controlplane.table import RoutingTable, initial_table
from controlplane.topology import Topology
from elasticmoe.v1 import consensus_pb2 as pb


def parse_peers(s: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, s.split(",")):
        node, sep, addr = item.partition("@")
        if not sep or not node or ":" not in addr:
            raise SystemExit(f"--peers item {item!r}: expected node_id@host:port")
        out[node] = addr
    return out


def genesis(c: ClusterConfig) -> RoutingTable:
    return initial_table(Topology(c.nodes, c.ranks_per_node, c.slots_per_rank), c.layers, c.experts)


class BenchDriver:
    """Proposes each version whose owner this node is, as soon as its parent is installed."""

    def __init__(self, node_id: str, nodes: list[str], backend: Any, target: int, seed: int,
                 interval: float = 0.0) -> None:
        self.node_id, self.nodes, self.backend = node_id, sorted(nodes), backend
        self.target = target
        self.interval = interval  # idle time between a commit and the next proposal
        self.rng = random.Random(seed)
        self.lat_ms: list[float] = []
        self.failures: list[str] = []
        self.done = asyncio.Event()
        self.inflight = 0
        self.t0 = 0.0
        self.progress = time.monotonic()  # the last commit or outcome: a stall is reported (`watchdog`)
        self.reported = -1  # the head version a stall was last reported at

    def maybe_propose(self) -> None:
        head = self.backend.head
        if head.version >= self.target:
            self.done.set()
            return
        if self.inflight == head.version + 1 or round0_owner(head.version + 1, self.nodes) != self.node_id:
            return
        self.inflight = head.version + 1
        table = successor_table(head, self.rng)
        self.t0 = time.perf_counter()  # uvloop's loop.time() ticks in whole ms: too coarse for this
        self.backend.propose(table, pb.Plan(trigger="bench"), self._done)

    def _done(self, o: Outcome) -> None:
        self.progress = time.monotonic()
        if o.committed:
            self.lat_ms.append((time.perf_counter() - self.t0) * 1000.0)
        else:
            self.failures.append(o.reason[:200])
            if len(self.failures) <= 5 or len(self.failures) % 100 == 0:  # the first few, then every 100th
                print(f"{self.node_id}: proposal of v{o.version} failed ({len(self.failures)}): {o.reason[:200]}",
                      file=sys.stderr, flush=True)
        self.inflight = 0
        asyncio.get_running_loop().call_later(self.interval, self.maybe_propose)

    def on_commit(self, c: pb.Commit, t: RoutingTable) -> None:
        self.progress = time.monotonic()
        asyncio.get_running_loop().call_later(self.interval, self.maybe_propose)

    async def watchdog(self, stall_s: float = 5.0) -> None:
        while not self.done.is_set():  # re-kick after a lost proposal: the loop must not stall
            await asyncio.sleep(0.5)
            self.maybe_propose()
            head = self.backend.head.version
            idle = time.monotonic() - self.progress
            if idle > stall_s and self.reported != head:  # once per head: what the harness's tail shows
                self.reported = head
                owner = round0_owner(head + 1, self.nodes)
                print(f"{self.node_id}: no commit or outcome for {idle:.1f} s at head v{head} (target "
                      f"v{self.target}); v{head + 1} is {owner}'s to propose; in flight here: "
                      f"{f'v{self.inflight}' if self.inflight else 'none'}; failures so far: {self.failures[-3:]}",
                      file=sys.stderr, flush=True)


async def run(a: argparse.Namespace) -> int:
    peers = parse_peers(a.peers)
    peers.setdefault(a.node_id, a.listen)
    g = genesis(ClusterConfig())
    cfg = ConsensusConfig(accept_timeout_ms=a.accept_timeout_ms, sync_interval_ms=1000)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    transport: Any = None
    if a.backend == "quorum":
        from agent.transport.grpc import GrpcTransport

        transport = GrpcTransport(a.node_id, peers)
        transport.attach(server)
    server.add_insecure_port(a.listen)
    await server.start()
    data = Path(a.data_dir)
    data.mkdir(parents=True, exist_ok=True)
    backend: Any
    if a.backend == "etcd":
        from agent.etcd.etcd_backend import EtcdBackend

        backend = EtcdBackend(a.etcd.split(","), a.node_id, g, cluster=a.cluster, store=Store(data / "consensus.log"))
        backend.start()
        await backend.ready()
    else:
        backend = ConsensusNode(a.node_id, sorted(peers), Store(data / "consensus.log"), RealClock(), transport, cfg, g)
        backend.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if a.bench_versions:
            drv = BenchDriver(a.node_id, sorted(peers), backend, g.version + a.bench_versions,
                              zlib.crc32(a.node_id.encode()), a.interval_ms / 1000.0)
            backend.on_commit(drv.on_commit)
            print("ready", flush=True)
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if line.strip() != "go":
                return 2
            drv.maybe_propose()
            dog = asyncio.ensure_future(drv.watchdog())
            waiter = asyncio.ensure_future(stop.wait())
            await asyncio.wait([asyncio.ensure_future(drv.done.wait()), waiter], return_when=asyncio.FIRST_COMPLETED)
            dog.cancel()
            print(json.dumps({"node": a.node_id, "backend": a.backend, "head": backend.head.version,
                              "latencies_ms": drv.lat_ms, "failures": drv.failures[:5]}), flush=True)
            await asyncio.sleep(a.linger)  # let the last Learns and replies reach the slower peers
        else:
            await stop.wait()
    finally:
        if a.backend == "etcd":
            await backend.close()
        else:
            backend.stop()
        close = getattr(transport, "close", None)
        if close is not None:
            await close()
        await server.stop(0.2)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.consensus_serve", description=__doc__.split("\n")[0])
    ap.add_argument("--node-id", required=True)
    ap.add_argument("--listen", required=True, help="host:port for this node's gRPC server")
    ap.add_argument("--peers", default="", help="node_id@host:port,... (the voters; this node may be listed)")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--backend", choices=("quorum", "etcd"), default="quorum")
    ap.add_argument("--etcd", default="", help="etcd endpoints host:port,... (backend etcd)")
    ap.add_argument("--cluster", default="bench", help="etcd key prefix /emoe/<cluster>/")
    ap.add_argument("--accept-timeout-ms", type=int, default=150)
    ap.add_argument("--bench-versions", type=int, default=0)
    ap.add_argument("--interval-ms", type=float, default=0.0, help="bench: idle time before each proposal")
    ap.add_argument("--linger", type=float, default=1.0)
    a = ap.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a harness asks where a stalled node is
    if a.backend == "etcd" and not a.etcd:
        ap.error("--backend etcd needs --etcd host:port")
    try:
        import uvloop

        return uvloop.run(run(a))
    except ImportError:
        return asyncio.run(run(a))


if __name__ == "__main__":
    sys.exit(main())
