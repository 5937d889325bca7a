"""Failure detection: how long until every live member declares a crashed node dead, and false deaths.

Simulated (SimNetwork + FakeClock, lan profile). Each seeded trial brings `--nodes` GossipNodes up on a
quiet LAN, then turns on `--loss` message loss (each message, either direction) and, in turn:
- pauses one random node for `--pause-s` seconds (a stalled process: it neither receives nor runs timers);
- crashes `--crashes` random other nodes, `--gap-s` seconds apart, and measures for each the time from the
  crash until the last live member marks it DEAD.
`detect_p99_s` is the 99th percentile of those times over all trials; `false_deaths` counts every time any
member marked a node that had not crashed DEAD (the paused node, or any other).

`--engine-evidence-s T`: the engines report the crashed node's ranks unreachable T seconds after the crash
(a collective or dispatch timeout in every rank of the EP group), and every live agent suspects it at once
(`GossipNode.suspect_ranks`, Lifeguard's local evidence) instead of waiting for its own probes to fail.

    python -m bench.detect --nodes 64 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from agent.gossip.membership import MemberStatus
from agent.transport.sim import LinkSpec
from chaos.gossipsim import GossipSim, profile_gossip


def trial(nodes: int, seed: int, loss: float, pause_s: float, crashes: int, gap_s: float,
          profile: str, evidence_s: float | None = None) -> tuple[list[float], int, dict[str, float]]:
    sim = GossipSim(seed=seed, cfg=profile_gossip(profile), link=LinkSpec())
    sim.add_nodes(nodes)
    if sim.stabilize(limit=60.0) is None:
        raise RuntimeError(f"seed {seed}: {nodes} nodes did not converge within 60 s")
    sim.set_loss(loss)
    sim.run(2.0)
    t_start = sim.clock.now()
    sim.events.clear()
    victims = sim.rng.sample(sim.ids(), crashes + 1)
    paused, crashed = victims[0], victims[1:]
    sim.pause(paused, pause_s)
    sim.run(gap_s)
    times: list[float] = []
    crash_at: dict[str, float] = {}
    for c in crashed:
        crash_at[c] = sim.clock.now()
        sim.crash(c)
        if evidence_s is not None:
            sim.run(evidence_s)
            for n in sim.ids():
                if n != c and n not in crash_at:
                    sim.nodes[n].suspect_members([c])
            sim.run(gap_s - evidence_s)
        else:
            sim.run(gap_s)
    sim.run(gap_s)
    for c in crashed:
        t0 = crash_at[c]
        first: dict[str, float] = {}
        for e in sim.events:
            if e.member.node_id == c and e.member.status == MemberStatus.DEAD and e.t >= t0:
                first.setdefault(e.observer, e.t)
        # members that must declare it: everyone up (not crashed, or crashed later than c) at the end
        observers = [n for n in sim.ids() if n != c and (n not in crash_at or crash_at[n] > t0 + gap_s)]
        late = [first.get(o, float("inf")) - t0 for o in observers]
        times.append(max(late))
    false = 0
    for e in sim.events:
        if e.member.status == MemberStatus.DEAD and e.t >= t_start:
            victim = e.member.node_id
            if victim not in crash_at or e.t < crash_at[victim]:
                false += 1
    extra = {"paused_refuted": float(sim.nodes[paused].incarnation)}
    return times, false, extra


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--crashes", type=int, default=4, help="crashes per trial, measured one at a time")
    ap.add_argument("--gap-s", type=float, default=8.0, help="seconds between faults")
    ap.add_argument("--loss", type=float, default=0.05)
    ap.add_argument("--pause-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profile", default="lan", choices=["lan", "local", "test"])
    ap.add_argument("--engine-evidence-s", type=float, default=None, metavar="T",
                    help="the engines report a crashed node's ranks unreachable T s after the crash (default: never)")
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    args = ap.parse_args(argv)
    t0 = time.time()
    times: list[float] = []
    false = 0
    for i in range(args.trials):
        ts, f, _ = trial(args.nodes, args.seed + i, args.loss, args.pause_s, args.crashes, args.gap_s, args.profile,
                         args.engine_evidence_s)
        times += ts
        false += f
        if not args.json:
            print(f"trial {i}: detect {[round(t, 2) for t in ts]} s, false deaths {f}", file=sys.stderr)
    arr = np.array(times)
    out: dict[str, object] = {"nodes": args.nodes, "detect_p99_s": round(float(np.percentile(arr, 99)), 3),
                              "false_deaths": false}
    if args.engine_evidence_s is not None:
        out["engine_evidence_s"] = args.engine_evidence_s
    if not args.json:
        print(f"{len(times)} crashes: median {np.median(arr):.2f} s, max {arr.max():.2f} s; "
              f"{time.time() - t0:.1f} s wall", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
