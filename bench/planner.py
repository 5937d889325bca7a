"""Time one estimate+verify decision at DeepSeek-V3 shape on one core.

    python -m bench.planner --json

Shape: 58 MoE layers x 256 routed experts, 8 nodes x 8 ranks, 5 slots per rank (static EP head: 4 experts
and one spare slot per rank), replay buffer of one window of the agents' W (decision.window, 50) steps, seen as the agent's controller sees it: its sampled steps (every
`sample_every` = 10th: 5 rows), of synthetic skewed counts
(per layer a seeded Zipf(1.2) popularity over a random expert order, 2048 tokens x top-8 per step, multinomial
per step). Two cases: `incremental` (the head is EPLB fitted on the first segment of the public DeepSeek-V3
decode pair in ../shared/traces, the window taken from the second, both sampled per step at 2048 tokens x
top-8; `source` says so, or that it fell back to synthetic load where the traces are absent) and `large` (the
static head against the synthetic load: the re-pack planner of controlplane.retarget runs too). Each case also
times the project's EPLB baseline (controlplane.baselines.eplb, DeepSeek's eplb.py algorithm, vectorised)
re-planning the same window globally: `eplb_replan_median_ms`, and `ratio_to_eplb` = median_ms over it; and
DeepSeek's published eplb.py itself (bench.eplb_reference, torch on the CPU: the same algorithm, its Python
loops as published) on the same window: `eplb_reference_median_ms`, `ratio_to_eplb_reference` (null without
torch). One decision = plan on the buffer's block totals (blocks of `plan_block` = 20 steps) + apply + validate + replay verification of the
changed layers on every row + cost of the diff + gating (`controlplane.decision.rebalance`). The head's
per-step figures are the load monitor's, computed when the window closed (the trigger needs them), so they
are prepared outside the timed region. `cpu_median_ms` is the same in process CPU time (robust to other
load on the machine); `from_scratch_median_ms` times the same decision with them computed inside,
and `voter_verify_ms` a voter's independent `verify_decision` (full replay of the head + changed layers).
`loop_stall_ms` is the longest an asyncio event loop went without running (a 1 ms heartbeat) while the same
decision was computed on the loop (`on_loop`: what every agent did before its plans moved to a worker thread) and
through the agent's `agent.decision.offloop.OffLoopPlanner` (`off_loop`: what the agent does), with each one's wall time.
`stage_share`: each stage's share of one decision's time under cProfile (STAGES: greedy search, exchange search,
recount, re-pack, ...; "other" the rest), a guide to where a faster planner must start.
`repair`: the repair after losing one rank and after losing a whole node (8 ranks) on the incremental case's
head, and the fill of that node's ranks restored afterwards: wall times and the same loop stalls (the agent
computes repairs and fills off the loop too).
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # one core, before numpy loads
    os.environ[_v] = "1"

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from functools import partial  # noqa: E402

import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402

from controlplane.baselines.eplb import eplb_table  # noqa: E402
from controlplane.decision import rebalance  # noqa: E402
from controlplane.monitor import ReplayBuffer  # noqa: E402
from controlplane.ops import Restore, apply_ops  # noqa: E402
from controlplane.params import DecisionParams  # noqa: E402
from controlplane.requests import PlanRequest  # noqa: E402
from controlplane.table import RoutingTable, initial_table  # noqa: E402
from controlplane.topology import Topology  # noqa: E402
from controlplane.verify import verify_decision  # noqa: E402

LAYERS, EXPERTS, NODES, RANKS_PER_NODE, SLOTS = 58, 256, 8, 8, 5


def synthetic_counts(steps: int, layers: int, experts: int, tokens: int, seed: int) -> npt.NDArray[np.uint32]:
    """[steps, layers, experts] multinomial draws of `tokens` choices per layer per step from a skewed
    (Zipf 1.2 over a random order of experts) popularity per layer."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, experts + 1, dtype=np.float64)
    out = np.empty((steps, layers, experts), dtype=np.uint32)
    for layer in range(layers):
        p = ranks ** -1.2
        p = p[rng.permutation(experts)]
        out[:, layer, :] = rng.multinomial(tokens, p / p.sum(), size=steps)
    return out


DECODE_PAIR = ("decode_in500out1500", "decode_in2000out100")  # SGLang's DeepSeek-V3 statistics, ../shared/traces


def real_pair(window: int, seed: int) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint32]] | None:
    """The public DeepSeek-V3 decode pair, sampled per step (2048 tokens x top-8): the first segment's
    `window * 10` steps, and a window of the second; None when ../shared/traces is absent."""
    from bench.traces import import_sglang_logical_count, sglang_path

    paths = [sglang_path(n) for n in DECODE_PAIR]
    if not all(p.exists() for p in paths):
        return None
    first = import_sglang_logical_count(paths[0], 8, 2048, window * 10, seed).counts
    second = import_sglang_logical_count(paths[1], 8, 2048, window, seed + 1).counts
    return first, second


def setup(window: int, seed: int, case: str = "large") -> tuple[RoutingTable, npt.NDArray[np.uint32], DecisionParams]:
    """case "large": the static EP head against skewed synthetic load (a large gap: the re-pack planner runs);
    "incremental": the head is EPLB fitted on the first segment of the public DeepSeek-V3 decode pair and the
    window comes from the second (a real drift, small enough for the greedy planner; synthetic, EPLB fitted on
    an earlier window of the same mix, where ../shared/traces is absent: see `source`)."""
    topo = Topology(NODES, RANKS_PER_NODE, SLOTS)
    head = initial_table(topo, LAYERS, EXPERTS)
    if case == "incremental":
        pair = real_pair(window, seed)
        if pair is not None:
            first, second = pair
            return (eplb_table(head, first.sum(axis=0, dtype=np.int64)), second,
                    DecisionParams(window=window, replay_windows=1))
    counts = synthetic_counts(2 * window, LAYERS, EXPERTS, 2048 * 8, seed)
    if case == "incremental":
        head = eplb_table(head, counts[:window].sum(axis=0, dtype=np.int64))
    return head, counts[window:], DecisionParams(window=window, replay_windows=1)


def agent_rows(counts: npt.NDArray[np.uint32], params: DecisionParams) -> npt.NDArray[np.uint32]:
    """What the agent's controller sees of the window: its sampled steps (every sample_every-th, the load path's
    rows: agent.decision.pipeline.window_rows)."""
    return counts[::params.sample_every] if params.sample_every else counts.sum(axis=0, dtype=np.uint32)[None]


def _buffer(head: RoutingTable, counts: npt.NDArray[np.uint32], warm: bool, block: int = 20,
            span: int = 0) -> ReplayBuffer:
    buf = ReplayBuffer(head.layers, head.experts, 1, block)
    buf.push(0, 0, counts, span)
    if warm:
        buf.stats(head)  # what the monitor computed when the window closed
    return buf


def request(head: RoutingTable, counts: npt.NDArray[np.uint32], params: DecisionParams,
            lost: tuple[int, ...] = (), restored: tuple[int, ...] = ()) -> PlanRequest:
    """What the agent's controller hands its planner: a rebalance, (`lost`) the repair of those ranks, or
    (`restored`) the fill of those ranks restored in `head`."""
    cool = np.zeros((head.layers, head.experts), dtype=bool)
    buf = _buffer(head, counts, True, params.plan_block, params.window)
    if lost:
        return PlanRequest(0, head, buf, params, None, cool, "bench", False, 0.0, "repair", lost)
    if restored:
        return PlanRequest(0, head, buf, params, None, cool, "bench", False, 0.0, "fill", ranks=restored,
                           restore_version=head.version)
    return PlanRequest(0, head, buf, params, None, cool, "bench", False, 0.0)


def loop_stall(req: PlanRequest, off_loop: bool) -> tuple[float, float]:
    """(the longest gap of a 1 ms heartbeat on an event loop, the decision's wall time), both in ms, while one
    decision is computed on that loop or through the agent's OffLoopPlanner."""
    from agent.decision.offloop import OffLoopPlanner
    from controlplane.decision import Attempt

    async def run() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Attempt] = loop.create_future()
        gaps: list[float] = []

        async def beat() -> None:
            last = time.perf_counter()
            while not done.done():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        hb = asyncio.create_task(beat())
        await asyncio.sleep(0.02)
        gaps.clear()
        t0 = time.perf_counter()
        planner = OffLoopPlanner("bench")
        if off_loop:
            planner(req, done.set_result)
        else:
            done.set_result(req.run())
        await done
        wall = time.perf_counter() - t0
        await hb
        planner.close()
        return max(gaps) * 1e3, wall * 1e3

    return asyncio.run(run())


def loop_stalls(make: Callable[[], PlanRequest], repeats: int) -> dict[str, list[tuple[float, float]]]:
    """`loop_stall` of a fresh request from `make`, `repeats` times (at most 5) on the loop and off it."""
    return {mode: [loop_stall(make(), mode == "off_loop") for _ in range(max(1, min(repeats, 5)))]
            for mode in ("on_loop", "off_loop")}


def medians(stalls: dict[str, list[tuple[float, float]]], i: int) -> dict[str, float]:
    """Per mode, the median of each run's i-th figure (0: the loop stall, 1: the plan's wall time), in ms."""
    return {m: round(float(np.median([x[i] for x in v])), 1) for m, v in stalls.items()}


# where a decision's time goes: (stage, the module's file, its function); none of these calls another
STAGES = (("greedy search", "controlplane/greedy.py", "search"),
          ("exchange search", "controlplane/retarget.py", "exchange"),
          ("recount", "controlplane/retarget.py", "recount"),
          ("re-pack", "controlplane/retarget.py", "repack"),
          ("layer objectives", "controlplane/retarget.py", "layer_objective"),
          ("apply operations", "controlplane/ops.py", "apply_ops"),
          ("replay verification", "controlplane/monitor.py", "stats"),
          ("copy costs", "controlplane/cost.py", "layer_costs"),
          ("copy costs", "controlplane/cost.py", "change_cost"))


def stage_shares(decide: Callable[[], object]) -> dict[str, float]:
    """Each stage's share of one decision's time (STAGES; "other": the rest: sizing the plan, choosing layers,
    building operations), from one run of `decide` under cProfile: its overhead weighs Python-level calls more
    than numpy's, so the shares are a guide to where the time goes, not timings."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(decide)
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = max(sum(tt for _cc, _nc, tt, _ct, _callers in stats.values()), 1e-12)
    out: dict[str, float] = {}
    for (path, _line, func), (_cc, _nc, _tt, ct, _callers) in stats.items():
        for stage, file, name in STAGES:
            if func == name and path.endswith(file):
                out[stage] = out.get(stage, 0.0) + ct / total
    out["other"] = max(0.0, 1.0 - sum(out.values()))
    return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def reference_eplb_ms(head: RoutingTable, window_counts: npt.NDArray[np.uint32], repeats: int) -> float | None:
    """Median ms of DeepSeek's published `rebalance_experts` (global policy, as the project's baseline at one
    expert group) re-planning the window's totals; None without torch."""
    try:
        import torch

        from bench.eplb_reference import rebalance_experts
    except ImportError:
        return None
    torch.set_num_threads(1)
    w = torch.from_numpy(window_counts.sum(axis=0, dtype=np.int64))
    topo = head.topology
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        rebalance_experts(w, topo.slots, 1, topo.nodes, topo.ranks)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def measure(repeats: int, window: int, seed: int, case: str = "large") -> dict[str, object]:
    head, window_counts, params = setup(window, seed, case)
    counts = agent_rows(window_counts, params)
    source = ("DeepSeek-V3 decode pair (" + " -> ".join(DECODE_PAIR) + ")" if case == "incremental"
              and real_pair(1, seed) is not None else "synthetic Zipf(1.2)")
    cool = np.zeros((head.layers, head.experts), dtype=bool)
    trig = "bench"
    times, cpu, scratch, voter = [], [], [], []
    result = None
    for _ in range(repeats):
        buf = _buffer(head, counts, True, params.plan_block, window)
        t0, c0 = time.perf_counter(), time.process_time()
        result = rebalance(head, buf, params, None, cool, trig)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        buf = _buffer(head, counts, False, params.plan_block, window)
        t0 = time.perf_counter()
        rebalance(head, buf, params, None, cool, trig)
        scratch.append(time.perf_counter() - t0)
    assert result is not None
    d = result.decision
    if d is not None:
        for _ in range(repeats):
            t0 = time.perf_counter()
            verify_decision(head, d.table, counts, params.tau)
            voter.append(time.perf_counter() - t0)
    ms = np.array(times) * 1e3
    eplb = []  # the project's EPLB baseline (DeepSeek's eplb.py): a global re-plan of the same window
    for _ in range(max(1, min(repeats, 5))):
        t0 = time.perf_counter()
        eplb_table(head, window_counts.sum(axis=0, dtype=np.int64))
        eplb.append(time.perf_counter() - t0)
    eplb_ms = float(np.median(eplb) * 1e3)
    ref_ms = reference_eplb_ms(head, window_counts, max(1, min(repeats, 3)))
    stalls = loop_stalls(partial(request, head, counts, params), repeats)
    warm = _buffer(head, counts, True, params.plan_block, window)
    shares = stage_shares(lambda: rebalance(head, warm, params, None, cool, trig))
    return {
        "case": case,
        "source": source,
        "eplb_replan_median_ms": round(eplb_ms, 3),
        "ratio_to_eplb": round(float(np.median(ms)) / eplb_ms, 4),
        "eplb_reference_median_ms": None if ref_ms is None else round(ref_ms, 1),
        "ratio_to_eplb_reference": None if ref_ms is None else round(float(np.median(ms)) / ref_ms, 4),
        "shape": [LAYERS, EXPERTS],
        "ranks": NODES * RANKS_PER_NODE,
        "window": window,
        "rows": int(counts.shape[0]),  # the window's sampled steps the decision sees
        "median_ms": round(float(np.median(ms)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "cpu_median_ms": round(float(np.median(cpu) * 1e3), 3),
        "from_scratch_median_ms": round(float(np.median(scratch) * 1e3), 3),
        "voter_verify_median_ms": round(float(np.median(voter) * 1e3), 3) if voter else None,
        "stage_share": shares,
        "loop_stall_ms": medians(stalls, 0),
        "loop_plan_wall_ms": medians(stalls, 1),
        "outcome": result.outcome,
        "ops": len(d.ops) if d else 0,
        "refused": len(result.refused),
        "estimated_gain": round(result.estimated_gain, 5),
        "verified_gain": round(result.verified_gain, 5),
        "repeats": repeats,
    }


def measure_repair(repeats: int, window: int, seed: int) -> dict[str, object]:
    """The repair after losing one rank (rank 5) and after losing a whole node (ranks 8-15), on the incremental
    case's head and window, and the fill of that node's ranks restored after its repair: the wall time, and the
    loop stall each caused on the loop and off it (the agent computes both off the loop too)."""
    head, window_counts, params = setup(window, seed, "incremental")
    counts = agent_rows(window_counts, params)
    node = tuple(range(RANKS_PER_NODE, 2 * RANKS_PER_NODE))
    repaired = request(head, counts, params, node).run().decision
    assert repaired is not None
    back = apply_ops(repaired.table, [Restore(r) for r in node])
    out: dict[str, object] = {}
    for name, at, lost, restored in (("rank", head, (5,), ()), ("node", head, node, ()), ("fill", back, (), node)):
        times, result = [], None
        for _ in range(repeats):
            req = request(at, counts, params, lost, restored)
            t0 = time.perf_counter()
            result = req.run()
            times.append(time.perf_counter() - t0)
        assert result is not None
        stalls = loop_stalls(partial(request, at, counts, params, lost, restored), repeats)
        out[name] = {
            "lost": list(lost),
            "restored": list(restored),
            "outcome": result.outcome,
            "ops": len(result.decision.ops) if result.decision else 0,
            "median_ms": round(float(np.median(times) * 1e3), 3),
            "loop_stall_ms": medians(stalls, 0),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.planner", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--window", type=int, default=DecisionParams.window, help="the agents' window (default: theirs)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out: dict[str, dict[str, object]] = {case: measure(args.repeats, args.window, args.seed, case)
                                         for case in ("incremental", "large")}
    out["repair"] = measure_repair(args.repeats, args.window, args.seed)
    if args.json:
        print(json.dumps(out))
    else:
        for case, r in out.items():
            for k, v in r.items():
                print(f"{case + '.' + k:>36}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
