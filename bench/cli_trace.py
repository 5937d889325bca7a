"""`emoe trace import`: routing data (ESFT, OLMoE, SGLang dumps) into the native .npz trace format."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    t = sub.add_parser("trace", help="trace tools")
    tsub = t.add_subparsers(dest="trace_command", metavar="SUBCOMMAND")
    imp = tsub.add_parser("import", help="convert routing data into the native .npz trace format")
    imp.add_argument("format", choices=["esft", "olmoe", "sglang"],
                     help="the source: esft (per-token routing, --task), olmoe (--model, --domain), sglang (--path)")
    imp.add_argument("--task", help="esft: intent or law")
    imp.add_argument("--model", default="olmoe", help="olmoe: olmoe, olmoe-sft, olmoe-dpo or mistral")
    imp.add_argument("--domain", help="olmoe: arxiv, book, c4, github, wikipedia or tulu")
    imp.add_argument("--path", type=Path, help="sglang: a logical_count dump (.json or .npz)")
    imp.add_argument("--top-k", type=int, default=8, help="sglang: the model's top-k")
    imp.add_argument("--batch", type=int, default=2048, help="tokens per step (default 2048)")
    imp.add_argument("--steps", type=int, default=2000, help="steps to generate (default 2000)")
    imp.add_argument("--seed", type=int, default=0, help="seed of the step model's draws (default 0)")
    imp.add_argument("--stagger", action="store_true",
                     help="esft: lanes start at seeded positions of their first sample (steady state)")
    imp.add_argument("--burst", action="store_true",
                     help="olmoe, sglang: a cold start, the batch filling and draining in waves of requests that "
                          "arrive and finish together (bench.traces.burst_steps), instead of a constant batch")
    imp.add_argument("--out", type=Path, required=True, help="the native .npz trace to write")
    imp.set_defaults(func=trace_import)


def trace_import(args: argparse.Namespace) -> int:
    from bench import traces

    if args.batch < 1 or args.steps < 1:
        print(f"emoe trace import: --batch {args.batch} / --steps {args.steps}: expected >= 1", file=sys.stderr)
        return 2
    try:
        if args.format == "esft":
            if args.task not in ("intent", "law"):
                print(f"emoe trace import: --task {args.task!r}: expected intent or law", file=sys.stderr)
                return 2
            tr = traces.import_esft(args.task, args.batch, args.steps, args.seed, stagger=args.stagger)
        elif args.format == "olmoe":
            tr = traces.import_olmoe(args.model, args.domain, args.batch, args.steps, args.seed, burst=args.burst)
        else:
            tr = traces.import_sglang_logical_count(args.path, args.top_k, args.batch, args.steps, args.seed,
                                                    burst=args.burst)
    except (OSError, ValueError, KeyError) as e:  # unreadable or malformed input (agent.cli.exits: 2)
        print(f"emoe trace import: {e}", file=sys.stderr)
        return 2
    try:
        tr.save(args.out)
    except OSError as e:
        print(f"emoe trace import: {args.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    T, L, E = tr.shape
    print(f"wrote {args.out}: {T} steps x {L} layers x {E} experts, step model '{tr.step_model}'")
    return 0
