"""8 GossipNodes on the real GrpcTransport in one process (loopback grpc.aio servers on port 0, uvloop,
lan profile): they join, converge to the same load view within 3 gossip intervals of a round of new
windows, see a graceful leave, and declare a stopped node dead."""

from __future__ import annotations

import asyncio
import json
import os

import grpc
import numpy as np
import uvloop

from agent.clock import RealClock
from agent.gossip.gossip_node import GossipNode
from agent.gossip.membership import MemberStatus
from agent.transport.grpc import GrpcTransport
from chaos.gossipsim import profile_gossip

N = 8
SHAPE = (58, 256)  # DeepSeek-V3


async def _until(pred: object, limit: float, step: float = 0.002) -> float:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not pred():  # type: ignore[operator]
        if loop.time() - t0 > limit:
            raise TimeoutError(f"not within {limit} s")
        await asyncio.sleep(step)
    return loop.time() - t0


async def _cluster_test() -> list[float]:
    cfg = profile_gossip("lan")
    servers = [grpc.aio.server() for _ in range(N)]
    ports = [s.add_insecure_port("127.0.0.1:0") for s in servers]
    ids = [f"g{i + 1}" for i in range(N)]
    addr = {n: f"127.0.0.1:{p}" for n, p in zip(ids, ports, strict=True)}
    seeds = {ids[0]: addr[ids[0]]}
    transports = [GrpcTransport(n, seeds) for n in ids]
    for t, s in zip(transports, servers, strict=True):
        t.attach(s)
        await s.start()
    clock = RealClock()
    nodes = [GossipNode(n, addr[n], [i], cfg, clock, t, seeds, rng_seed=i, shape=SHAPE)
             for i, (n, t) in enumerate(zip(ids, transports, strict=True))]
    for g in nodes:
        g.start()
    times: list[float] = []
    try:
        await _until(lambda: all(len(g.live_nodes()) == N for g in nodes), 10.0)
        await asyncio.sleep(2.0)  # every pair has probed and connected
        rng = np.random.default_rng(0)
        for rnd in range(1, 6):
            for g in nodes:
                g.publish_window(rnd, (rnd - 1) * 100, 100, rng.integers(0, 1 << 16, SHAPE, dtype=np.uint32))

            def same(rnd: int = rnd) -> bool:
                views = [g.load_view() for g in nodes]
                return all(len(v.windows) == N and {w.window_seq for w in v.windows.values()} == {rnd}
                           and np.array_equal(v.total, views[0].total) for v in views)

            times.append(await _until(same, 10.0, step=0.001))
            await asyncio.sleep(0.5)
        nodes[-1].leave()
        await _until(lambda: all(g.member(ids[-1]).status == MemberStatus.LEFT for g in nodes[:-1]), 5.0)
        nodes[-1].stop()
        nodes[-2].stop()  # a crash, as far as the others can tell: nothing answers any more
        await servers[-2].stop(None)
        await _until(lambda: all(g.member(ids[-2]).status == MemberStatus.DEAD for g in nodes[:-2]), 10.0, 0.01)
        assert all(g.member(n).status == MemberStatus.ALIVE for g in nodes[:-2] for n in ids[:-2])
    finally:
        for g in nodes:
            g.stop()
        for t in transports:
            await t.close()
        for s in servers:
            await s.stop(None)
    return times


def test_eight_nodes_converge_on_grpc_within_three_gossip_intervals() -> None:
    interval = profile_gossip("lan").interval_ms / 1e3
    times = uvloop.run(_cluster_test())
    out = os.environ.get("EMOE_GOSSIP_GRPC_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"nodes": N, "interval_s": interval, "converge_s": times}, f)
    # The figure is the median of five rounds: on a shared 2-core CI box a round can lose the CPU for a while
    # (all 8 nodes share one event loop here); any round must still converge well within push-pull repair.
    assert sorted(times)[len(times) // 2] <= 3 * interval, times
    assert max(times) <= 10 * interval, times
