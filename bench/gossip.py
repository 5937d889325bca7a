"""Load gossip: how fast a new window vector reaches the cluster, and at what cost in bytes.

Simulated (SimNetwork + FakeClock), lan profile (200 ms gossip interval), DeepSeek-V3 shape windows
(58 layers x 256 experts, uint32: 59,392 bytes of counts; 59,412 bytes as a LoadWindow, 60,000 signed
with `--signed`). After the cluster converges, every node publishes a
new window every `--window-period-s` seconds (random phase per node) for `--duration-s` seconds, then the
network drains for 2 s.
- t999_s: for each published window, the time until 99.9% of all nodes hold it (at 128 nodes: all of
  them); the figure is the worst window of the run (`--detail` also prints the median and p99).
- bytes_per_node_per_s: everything every node sent (probes, rumours, pulls, pushes, push-pulls, both
  requests and replies), plus `--header-bytes` per message for gRPC framing and HTTP/2 headers.
- overhead_ratio: those bytes / the bytes minimally needed, windows published x (nodes - 1) x 59,392.
- window_bytes (`--detail`): one window as gossip carries it (the LoadWindow message: counts, header fields,
  and with `--signed` its node's signature and certificate, as under mTLS: windows then are signed by the
  origin and verified at every hop, with keys and certificates from a development CA).

- window_bytes_ep144: a node's window as the agents' load path builds it (bench.agentfeed: totals plus every
  10th step's counts, zlib) on the public DeepSeek-V3 decode statistics in ../shared/traces at DeepSeek's decode
  shape, EP144 (18 nodes x 8 GPUs, 2 slots a GPU, EPLB placement, 128 tokens a GPU a step): median and max over
  the nodes and windows, unsigned and with mTLS's ~600 bytes, against the budget of 4 x 59,392 bytes (the
  counts alone, as windows were before they carried sampled steps). Skipped, with the reason, without the traces.

    python -m bench.gossip --nodes 128 --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

from agent.gossip.gossip_node import GossipSigner
from agent.transport.sim import LinkSpec
from chaos.gossipsim import GossipSim, profile_gossip


def run(nodes: int, seed: int, layers: int, experts: int, period: float, duration: float, loss: float,
        header_bytes: int, profile: str, interval_ms: int, signed: bool = False) -> dict[str, float]:
    cfg = profile_gossip(profile, interval_ms=interval_ms)
    sim = GossipSim(seed=seed, cfg=cfg, link=LinkSpec(), shape=(layers, experts), header_bytes=header_bytes)
    if signed:
        sim.signers = _signers([f"n{i + 1}" for i in range(nodes)])  # GossipSim names its nodes n1, n2, ...
    sim.add_nodes(nodes)
    if sim.stabilize(limit=60.0) is None:
        raise RuntimeError(f"{nodes} nodes did not converge within 60 s")
    sim.set_loss(loss)
    rng = np.random.default_rng(seed)
    # one fixed window per node: the bytes, not the values, are what this measures
    arrays = {n: rng.integers(0, 1 << 16, size=(layers, experts), dtype=np.uint32) for n in sim.ids()}
    need = math.ceil(0.999 * nodes) - 1  # other nodes that must hold a window (its origin holds it already)
    published: dict[tuple[str, int], float] = {}
    reached: dict[tuple[str, int], int] = {}
    t999: list[float] = []

    def arrived(observer: str, origin: str, seq: int) -> None:
        key = (origin, seq)
        if key not in published:
            return
        reached[key] = reached.get(key, 0) + 1
        if reached[key] == need:
            t999.append(sim.clock.now() - published[key])

    sim.window_listeners.append(arrived)
    seqs = dict.fromkeys(sim.ids(), 0)

    def publish(n: str) -> None:
        if sim.clock.now() - t0 >= duration:
            return
        seqs[n] += 1
        published[(n, seqs[n])] = sim.clock.now()
        sim.publish_array(n, seqs[n], arrays[n])
        sim.clock.call_later(period, lambda: publish(n))

    sim.net.stats.bytes_by_node.clear()
    base = sim.net.stats.total_bytes
    stats_before = dict(sim.net.stats.bytes_by_method)
    t0 = sim.clock.now()
    for n in sim.ids():
        sim.clock.call_later(float(rng.uniform(0, period)), lambda n=n: publish(n))
    sim.run(duration + 2.0)
    elapsed = sim.clock.now() - t0
    first = sim.ids()[0]
    own = [w for w in sim.nodes[first].load.newer_than([], 1 << 30) if w.node_id == first]
    sent = sim.net.stats.total_bytes - base
    needed = len(published) * (nodes - 1) * layers * experts * 4
    arr = np.array(t999) if t999 else np.array([float("inf")])
    incomplete = len(published) - len(t999)
    by_method = {m: b - stats_before.get(m, 0) for m, b in sim.net.stats.bytes_by_method.items()}
    return {"t999_s": float(arr.max()) if not incomplete else float("inf"), "t999_median_s": float(np.median(arr)),
            "t999_p99_s": float(np.percentile(arr, 99)), "windows": len(published), "incomplete": incomplete,
            "bytes_per_node_per_s": sent / nodes / elapsed, "overhead_ratio": sent / needed,
            "window_bytes": own[0].ByteSize() if own else 0,
            **{f"bytes_{m.split('/')[1]}": v / nodes / elapsed for m, v in sorted(by_method.items())}}


BUDGET_BYTES = 4 * 58 * 256 * 4  # 4 x a DeepSeek-V3 window of counts alone (59,392 bytes)


def ep144_window_bytes(windows: int = 4, seed: int = 0) -> dict[str, object]:
    """A node's window with its sampled steps at EP144 on the DeepSeek-V3 decode statistics (see the module
    docstring); {"skipped": why} without ../shared/traces."""
    from bench.agentfeed import LoadFeed
    from bench.traces import import_sglang_logical_count, sglang_path
    from controlplane.baselines.eplb import eplb_table
    from controlplane.params import DecisionParams
    from controlplane.table import initial_table
    from controlplane.topology import Topology

    path = sglang_path("decode_in500out1500")
    if not path.exists():
        return {"skipped": f"{path} is absent"}
    W, every = DecisionParams.window, DecisionParams.sample_every
    topo = Topology(18, 8, 2)
    tr = import_sglang_logical_count(path, 8, 144 * 128, W * windows, seed)
    head = eplb_table(initial_table(topo, *tr.counts.shape[1:]), tr.counts.sum(axis=0, dtype=np.int64))
    feed = LoadFeed(topo, *tr.counts.shape[1:], W, every, lambda *a: None)
    for k in range(windows):
        feed.feed(k * W, tr.counts[k * W:(k + 1) * W], head)
    b = feed.bytes_per_window()
    return {"shape": "58x256, 18 nodes x 8 GPUs x 2 slots", "sample_every": every, "windows": len(feed.window_bytes),
            "median": int(b["median"]), "max": int(b["max"]), "signed_max": int(b["signed_max"]),
            "budget": BUDGET_BYTES, "within_budget": b["signed_max"] <= BUDGET_BYTES}


def _signers(ids: list[str]) -> dict[str, GossipSigner]:
    """Each node's key and certificate from a fresh development CA (what `emoe certs` makes)."""
    import tempfile

    from agent.consensus.signing import VoteSigner
    from agent.security import write_dev_certs

    with tempfile.TemporaryDirectory() as d:
        write_dev_certs(d, ids)
        return {n: VoteSigner.from_cert_dir(d, n) for n in ids}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--interval-ms", type=int, default=200, help="gossip interval")
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--window-period-s", type=float, default=5.0,
                    help="seconds between a node's windows (100 decode steps of ~50 ms)")
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--header-bytes", type=int, default=48,
                    help="per-message gRPC framing and HPACK-compressed HTTP/2 headers (estimate)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profile", default="lan", choices=["lan", "local", "test"])
    ap.add_argument("--signed", action="store_true",
                    help="sign every window and verify it at every hop, as under mTLS")
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    ap.add_argument("--detail", action="store_true", help="also print per-method bytes and T999 percentiles")
    args = ap.parse_args(argv)
    t0 = time.time()
    r = run(args.nodes, args.seed, args.layers, args.experts, args.window_period_s, args.duration_s, args.loss,
            args.header_bytes, args.profile, args.interval_ms, args.signed)
    out = {"nodes": args.nodes, "interval_ms": args.interval_ms, "t999_s": round(r["t999_s"], 3),
           "bytes_per_node_per_s": round(r["bytes_per_node_per_s"]), "overhead_ratio": round(r["overhead_ratio"], 3)}
    if args.detail:
        out.update({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k not in out})
    out["window_bytes_ep144"] = ep144_window_bytes()
    if not args.json:
        print(f"{r['windows']} windows, {time.time() - t0:.1f} s wall", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
