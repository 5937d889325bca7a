"""`emoe bench`: the drift-injection benchmark, every policy side by side (see bench/run.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_POLICIES = "static,eplb,craft,craft-periodic,elastic,hindsight"

# DeepSeek's published serving shapes on the SGLang DeepSeek-V3 statistics in ../shared/traces (one workload,
# then another), and the ESFT task pair: `--case NAME` sets these flags, each still overridable
CASES: dict[str, dict[str, Any]] = {
    # decode: EP144 (18 nodes x 8 GPUs), 256 experts + 32 redundant = 2 slots a GPU, 128 tokens a GPU a step
    "deepseek-decode-ep144": {"trace": ["sglang:decode_in500out1500", "sglang:decode_in2000out100"],
                              "initial": "eplb:sglang:decode_in500out1500", "nodes": 18, "ranks_per_node": 8,
                              "slots_per_rank": 2, "batch": 144 * 128, "expert_groups": 1},
    # prefill: EP32 (4 nodes x 8 GPUs), 9 slots a GPU, 4096 prompt tokens a GPU a step. Global EPLB: on these
    # statistics DeepSeek's hierarchical policy (--expert-groups 8, its 8 expert groups packed 2 a node) boots
    # at 1.39 and even fitted in hindsight stays at 1.23, where global EPLB reaches 1.014 (bench, seed 0)
    "deepseek-prefill-ep32": {"trace": ["sglang:prefill_in512", "sglang:prefill_in4096"],
                              "initial": "eplb:sglang:prefill_in512", "nodes": 4, "ranks_per_node": 8,
                              "slots_per_rank": 9, "batch": 32 * 4096, "expert_groups": 1},
    # the public pair at 8 x 8, 5 slots a GPU, 2048 tokens a step (the project's earlier reference shape)
    "deepseek-decode-8x8": {"trace": ["sglang:decode_in500out1500", "sglang:decode_in2000out100"],
                            "initial": "eplb:sglang:decode_in500out1500", "nodes": 8, "ranks_per_node": 8,
                            "slots_per_rank": 5, "batch": 2048},
    "esft-intent-law": {"trace": ["esft:intent", "esft:law"], "initial": "eplb:esft:intent", "nodes": 2,
                        "ranks_per_node": 8, "slots_per_rank": 5, "batch": 2048},
}
# the flags a case may set, and their values without one
CASE_FALLBACK: dict[str, Any] = {"initial": "static", "nodes": 2, "ranks_per_node": 8, "slots_per_rank": 5,
                                 "batch": 2048, "expert_groups": None}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="replay traces through every policy; write results.json and plots")
    p.add_argument("--case", choices=sorted(CASES), default=None,
                   help="a named case: traces, initial placement and cluster shape together (deepseek-decode-ep144 "
                        "and deepseek-prefill-ep32 are DeepSeek's published serving shapes); other flags override")
    p.add_argument("--trace", action="append", default=[], metavar="SPEC",
                   help="a native .npz, or esft:intent / esft:law (pseudo-decode from ../shared/traces), or "
                        "olmoe:MODEL/DOMAIN or sglang:NAME|PATH (SGLang logical_count totals, e.g. "
                        "sglang:decode_in500out1500; sampled at --batch tokens x top-8 per step), or "
                        "zipf:EXPERTS/TOP_K/HOT/LAYERS/MIX_SEED (skewed shares built from a description, the hottest "
                        "expert taking HOT of a layer: bench.traces.zipf_totals); repeat to play them as "
                        "consecutive segments")
    p.add_argument("--initial", default=None, metavar="static|eplb:SPEC",
                   help="every policy's boot placement: static (expert e on slot e) or EPLB fitted on the totals "
                        "of trace SPEC (any --trace spec, sampled with seed+1: earlier traffic, as vLLM's first "
                        "rearrange or SGLang's --init-expert-location). Default static")
    p.add_argument("--synthetic", metavar="LxE", help="a synthetic skewed, drifting trace of L layers x E experts")
    p.add_argument("--segments", type=int, default=2, help="--synthetic: number of segments (default 2)")
    p.add_argument("--ramp-steps", type=int, default=0,
                   help="steps over which each new segment ramps in (a linear mix; default 0 = abrupt)")
    p.add_argument("--top-k", type=int, default=8, help="--synthetic: top-k (default 8)")
    p.add_argument("--batch", type=int, default=None, help="tokens per step for imported traces (default 2048)")
    p.add_argument("--cold-start", action="store_true",
                   help="build the trace's steps from a cold start instead of steady state: esft lanes all start "
                        "at token 0 (lockstep through the shared prompt template) instead of at staggered positions; "
                        "olmoe and sglang (counts only, no token order) batches fill and drain in waves "
                        "(bench.traces.burst_steps) instead of a constant batch. results.json's construction says "
                        "which"),
    p.add_argument("--segment-steps", type=int, default=2000, help="steps per segment (default 2000)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="GPUs (EP ranks) a node (default 8)")
    p.add_argument("--slots-per-rank", type=int, default=None, help="expert slots a GPU (default 5)")
    p.add_argument("--window", type=int, default=100, help="W steps per window of the metrics (recovery, regressions) and of the baselines' cadence (default 100); the elastic policy closes windows at the agents' decision.window (default 50; --elastic-param window=N)")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help=f"comma list (default {DEFAULT_POLICIES}); eplb:3000")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace and the step model (default 0)")
    p.add_argument("--expert-groups", type=int, default=None,
                   help="EPLB expert groups: 1 (default) is global EPLB, DeepSeek's choice for a decode pool with "
                        "large EP; G > 1 is hierarchical EPLB (groups packed onto nodes), its choice for prefill")
    p.add_argument("--craft-budget", type=float, default=1.0, help="CRAFT replica budget, fraction of free slots")
    p.add_argument("--commit-latency", type=int, default=3,
                   help="elastic: steps from a window's close to its commit reaching the engines' plugins (gossip, "
                        "the decision, one accept round trip; default 3); they then install at the step after their "
                        "next agreement (--agree-every)")
    p.add_argument("--agree-every", type=int, default=None,
                   help="elastic: the engine plugins' version agreement period in steps (EMOE_AGREE_EVERY; default "
                        "theirs, 32): a commit is served from the step after their next agreement")
    p.add_argument("--copy-share", type=float, default=0.5, help="elastic: link share taken by replica copies")
    p.add_argument("--elastic-param", action="append", default=[], metavar="K=V",
                   help="a DecisionParams field for the elastic policy, e.g. theta=1.1 (repeatable)")
    p.add_argument("--elastic-profile", type=Path, default=None, metavar="FILE",
                   help="a stability profile (emoe profile) as the elastic planner's prior (default: none)")
    p.add_argument("--kill-rank", action="append", default=[], metavar="R@STEP",
                   help="rank R dies at STEP (repeatable): recovery, delayed and dropped tokens per policy")
    p.add_argument("--detect-s", type=float, default=0.26,
                   help="time until a killed rank is known lost (default 0.26 s: its process died, its node's agent "
                        "saw its local link close, detect_p99_ms of python -m bench.rankexit; a whole node's death "
                        "is found by membership: 2.477 s, detect_p99_s of python -m bench.detect --nodes 64); "
                        "converted to steps with the step-time model")
    p.add_argument("--detect-steps", type=int, default=None, help="detection delay in steps (overrides --detect-s)")
    p.add_argument("--live", action="store_true",
                   help="run the elastic policy as real agent processes (one a node, loopback gRPC) fed by one engine "
                        "plugin core a rank replaying the trace (bench/live.py); same flags and results.json")
    p.add_argument("--live-step-ms", type=float, default=10.0,
                   help="--live: wall milliseconds a replayed step takes (default 10)")
    p.add_argument("--no-plots", action="store_true", help="write results.json only, no plots")
    p.add_argument("--no-progress", action="store_true", help="print no progress lines on stderr")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="directory for results.json and the plots")
    p.set_defaults(func=bench_main)


def _value(v: str) -> Any:
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def load_traces(args: argparse.Namespace) -> Any:
    """Build the bench trace from --trace specs or --synthetic; raises ValueError naming the bad spec."""
    from bench import traces
    from chaos.synthetic import synthetic_trace

    if args.synthetic:
        if args.trace:
            raise ValueError("--synthetic and --trace: give one or the other")
        try:
            L, E = (int(x) for x in args.synthetic.lower().split("x"))
        except ValueError:
            raise ValueError(f"--synthetic {args.synthetic!r}: expected LxE, e.g. 58x256") from None
        return synthetic_trace(L, E, args.segment_steps, args.segments, top_k=args.top_k, batch=args.batch,
                               ramp_steps=args.ramp_steps, seed=args.seed)
    if not args.trace:
        raise ValueError("no trace: give --trace (repeatable) or --synthetic LxE")
    parts = [trace_part(spec, args, args.seed) for spec in args.trace]
    shapes = {p.counts.shape[1:] for p in parts}
    if len(shapes) != 1:
        raise ValueError(f"--trace: segments disagree on [layers, experts]: {sorted(shapes)}")
    return traces.ramp(parts, args.segment_steps, args.ramp_steps)


def trace_part(spec: str, args: argparse.Namespace, seed: int) -> Any:
    """One --trace SPEC as a Trace of --segment-steps steps; raises ValueError naming a bad spec."""
    from bench import traces

    kind, _, rest = spec.partition(":")
    if kind == "esft" and rest:
        return traces.import_esft(rest, args.batch, args.segment_steps, seed, stagger=not args.cold_start)
    if kind == "olmoe" and "/" in rest:
        model, domain = rest.split("/", 1)
        return traces.import_olmoe(model, domain, args.batch, args.segment_steps, seed, burst=args.cold_start)
    if kind == "sglang" and rest:
        return traces.import_sglang_logical_count(traces.sglang_path(rest), 8, args.batch, args.segment_steps, seed,
                                                  burst=args.cold_start)
    if kind == "zipf" and rest:
        return traces.import_zipf(rest, args.batch, args.segment_steps, seed, burst=args.cold_start)
    if spec.endswith(".npz"):
        return traces.load_trace(spec)
    raise ValueError(f"--trace {spec!r}: expected a .npz path, esft:TASK, olmoe:MODEL/DOMAIN, sglang:NAME or "
                     "zipf:EXPERTS/TOP_K/HOT/LAYERS/MIX_SEED")


def construction(args: argparse.Namespace) -> dict[str, Any]:
    """How the trace's steps were built, as results.json records it: steady state or a cold start, and per kind
    of data the construction used (issue 49); raises ValueError for --cold-start on data it cannot apply to."""
    from bench.traces import burst_parameters

    cold = bool(args.cold_start)
    kinds = {spec.partition(":")[0] for spec in args.trace}
    out: dict[str, Any] = {"name": "cold-start" if cold else "steady", "seed": args.seed}
    if args.synthetic:
        if cold:
            raise ValueError("--cold-start with --synthetic: the synthetic trace has no cold-start construction")
        out["synthetic"] = "chaos.synthetic"
        return out
    if "esft" in kinds:
        out["per_token"] = ("lockstep lanes: every lane starts at token 0 (bench.traces.pseudo_decode stagger=False)"
                            if cold else "staggered lanes (bench.traces.pseudo_decode stagger=True)")
    if kinds & {"olmoe", "sglang", "zipf"}:
        out["counts_only"] = ({"construction": "burst waves (bench.traces.burst_steps)", **burst_parameters()}
                              if cold else {"construction": "constant batch (bench.traces.sample_steps)"})
    if cold and not kinds & {"esft", "olmoe", "sglang", "zipf"}:
        raise ValueError("--cold-start: no --trace it applies to (esft:, olmoe:, sglang:, zipf:); a .npz plays as "
                         "recorded")
    return out


def initial_totals(args: argparse.Namespace) -> Any:
    """None for --initial static, else the [L, E] totals EPLB is fitted on for --initial eplb:SPEC."""
    kind, _, spec = args.initial.partition(":")
    if args.initial == "static":
        return None
    if kind != "eplb" or not spec:
        raise ValueError(f"--initial {args.initial!r}: expected static or eplb:SPEC (SPEC: a --trace spec)")
    return trace_part(spec, args, args.seed + 1).counts.sum(axis=0, dtype="int64")


def apply_case(args: argparse.Namespace) -> None:
    """Fill the flags left unset from --case, then from CASE_FALLBACK."""
    case = CASES.get(args.case or "", {})
    if not args.trace and not args.synthetic and "trace" in case:
        args.trace = list(case["trace"])
    for name, fallback in CASE_FALLBACK.items():
        if getattr(args, name) is None:
            setattr(args, name, case.get(name, fallback))


def bench_main(args: argparse.Namespace) -> int:
    from agent.cli.profile import load_profile
    from bench.run import BenchConfig, run_bench
    from controlplane.errors import ControlPlaneError

    apply_case(args)
    for name in ("segment_steps", "nodes", "ranks_per_node", "slots_per_rank", "window", "commit_latency"):
        if getattr(args, name) < (0 if name == "commit_latency" else 1):
            print(f"emoe bench: --{name.replace('_', '-')} {getattr(args, name)}: expected >= 1", file=sys.stderr)
            return 2
    if not 0.0 < args.copy_share < 1.0 or not 0.0 <= args.craft_budget <= 1.0:
        print("emoe bench: --copy-share in (0, 1) and --craft-budget in [0, 1] expected", file=sys.stderr)
        return 2
    params = {}
    for kv in args.elastic_param:
        k, sep, v = kv.partition("=")
        if not sep:
            print(f"emoe bench: --elastic-param {kv!r}: expected K=V", file=sys.stderr)
            return 2
        params[k] = _value(v)
    try:
        built = construction(args)
        trace = load_traces(args)
        from bench.rankloss import parse_kills

        if args.detect_s < 0 or (args.detect_steps is not None and args.detect_steps < 0):
            raise ValueError("--detect-s and --detect-steps: expected >= 0")
        init = initial_totals(args)
        if init is not None and init.shape != trace.counts.shape[1:]:
            raise ValueError(f"--initial {args.initial!r}: its [layers, experts] {list(init.shape)} differ from the "
                             f"trace's {list(trace.counts.shape[1:])}")
        kills = parse_kills(args.kill_rank, args.nodes * args.ranks_per_node, trace.counts.shape[0])
        cfg = BenchConfig(args.nodes, args.ranks_per_node, args.slots_per_rank, args.window,
                          tuple(p for p in args.policies.split(",") if p), args.seed, args.expert_groups,
                          args.craft_budget, args.commit_latency, args.copy_share, params, tuple(kills),
                          args.detect_s, args.detect_steps, args.initial, init,
                          load_profile(args.elastic_profile) if args.elastic_profile else None,
                          live=args.live, live_step_s=args.live_step_ms / 1e3, agree_every=args.agree_every,
                          construction=built)
        if args.agree_every is not None and args.agree_every < 1:
            raise ValueError(f"--agree-every {args.agree_every}: expected >= 1")
        if args.live and not args.live_step_ms > 0:
            raise ValueError(f"--live-step-ms {args.live_step_ms}: expected > 0")
        from bench.policies import make_policy

        for spec in cfg.policies:
            make_policy(spec, cfg.window, 1, cfg.craft_budget, cfg.commit_latency)
    except (OSError, ValueError, KeyError, ControlPlaneError) as e:  # bad input (agent.cli.exits: 2)
        print(f"emoe bench: {e}", file=sys.stderr)
        return 2
    try:
        res = run_bench(trace, cfg, args.out, progress=not args.no_progress, plots=not args.no_plots)
    except (OSError, ValueError, KeyError, ControlPlaneError) as e:
        print(f"emoe bench: {e}", file=sys.stderr)
        return 1
    print(format_table(res))
    print(f"wrote {args.out / 'results.json'} ({res['wall_s']:.1f} s)")
    return 0


def format_table(res: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    head = ("| policy | mean imb | p50 ms | p99 ms | tokens/s (modelled) | recovery | GB moved | replica slots "
            "| stall ms | commits | regressions |\n|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [head]
    for name, r in res["policies"].items():
        if "unavailable" in r:
            rows.append(f"| {name} | unavailable: {r['unavailable']} ||||||||||")
            continue
        rows.append(f"| {name} | {r['mean_step_imbalance']:.4f} | {r['p50_step_ms']:.3f} | {r['p99_step_ms']:.3f} "
                    f"| {r.get('modelled_tokens_per_s', 0.0):,.0f} | {r['recovery_steps']} | {r['bytes_moved'] / 1e9:.2f} | {r['replica_slots']} "
                    f"| {r['stall_ms_total']:.1f} | {r['commits']} | {r['regressions']} |")
    if "rank_loss" in res:
        rows += ["", "| policy | rank loss: recovery | delayed tokens | dropped tokens | sent to dead rank | detect step "
                 "| repair step |", "|---|---|---|---|---|---|---|"]
        for name, r in res["policies"].items():
            if "rank_loss" in r:
                k = r["rank_loss"]
                rows.append(f"| {name} | {k['recovery_steps']} | {k['delayed_tokens']} | {k['dropped_tokens']} "
                            f"| {k['sent_to_dead_rank']} | {k['detect_step']} | {k['repair_step']} |")
    return "\n".join(rows)
