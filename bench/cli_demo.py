"""`emoe demo`: what `make demo` runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from agent.cli.argtypes import float_in, int_in


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="run a local cluster on the bundled real trace and report")
    p.add_argument("--agents", type=int_in(3, 64), default=3,
                   help="agent processes (nodes), 3..64 (a quorum needs 3), default 3")
    p.add_argument("--ranks-per-node", type=int_in(1, 64), default=4, help="engine ranks per agent (default 4)")
    p.add_argument("--slots-per-rank", type=int_in(1, 64), default=6, help="expert slots per rank (default 6)")
    p.add_argument("--window", type=int_in(1, 100_000), default=50, help="steps per load window")
    p.add_argument("--segment-steps", type=int_in(1, 1_000_000), default=600,
                   help="steps per trace segment (two segments)")
    p.add_argument("--step-ms", type=float_in(0.0, 60_000.0), default=10.0, help="pace of the replay per step")
    p.add_argument("--out", type=Path, default=Path("out/demo"), help="where the report and plot go")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bench.demo import DemoSpec, run_demo

    spec = DemoSpec(agents=args.agents, ranks_per_node=args.ranks_per_node, slots_per_rank=args.slots_per_rank,
                    window=args.window, segment_steps=args.segment_steps, step_ms=args.step_ms, out=args.out)
    result = run_demo(spec, as_json=args.json)
    return 0 if result["versions_committed"] >= 1 and result["agreement"] else 1
