"""Run the bench's five acceptance cases and fourteen runs they are not tuned on, each in both constructions, then
judge them all in one table.

    python -m bench.heldout --out DIR [--jobs 2] [--only NAME ...] [--construction steady|cold-start|both]
                            [-- extra bench flags]

Each run is `python -m agent.cli bench ... --no-plots --no-progress --out DIR/CONSTRUCTION/NAME` (the in-process
bench, EPLB boot); the table at the end is `python -m bench.verdict` over all of them, one row per run and
construction. The cases are the bench's `--case`s; the held-out runs reverse or re-order their segments, add a
third segment, change the seed, the cluster or the slots, and bring models the cases do not have (OLMoE;
Mixtral, added after the defaults were last changed; two skewed families built from issue 49's description,
bench.traces.zipf_totals): data the decision's defaults were not chosen on.

Constructions (issue 49): every run is played in steady state (ESFT lanes at staggered positions, counts-only
data at a constant batch) and from a cold start (`emoe bench --cold-start`: ESFT lanes in lockstep from token
0; counts-only data, which has no token order, in bench.traces' burst waves, the batch filling and draining as
requests arrive and finish together). results.json's `construction` says which. A run takes 1 s to 2 min; all
thirty-eight took 8 minutes with --jobs 2 on 2 cores. Exit status: the verdict's (0 when every run passes).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench import verdict

CASES: dict[str, str] = {
    "esft-2x8": "--case esft-intent-law",
    "esft-4x8": "--case esft-intent-law --nodes 4",
    "decode-8x8": "--case deepseek-decode-8x8",
    "decode-ep144": "--case deepseek-decode-ep144",
    "prefill-ep32": "--case deepseek-prefill-ep32",
}
HELD_OUT: dict[str, str] = {
    "r1-law-intent": "--trace esft:law --trace esft:intent --initial eplb:esft:law",
    "r2-law-intent-4x8": "--trace esft:law --trace esft:intent --initial eplb:esft:law --nodes 4",
    "r3-intent-law-intent-4x8": "--trace esft:intent --trace esft:law --trace esft:intent --initial eplb:esft:intent "
                                "--nodes 4",
    "r4-esft-4x8-seed1": "--case esft-intent-law --nodes 4 --seed 1",
    "r5-olmoe-arxiv-github": "--trace olmoe:olmoe/arxiv --trace olmoe:olmoe/github --initial eplb:olmoe:olmoe/arxiv",
    "r6-olmoe-3seg-4x8-3slots": "--trace olmoe:olmoe/github --trace olmoe:olmoe/wikipedia --trace olmoe:olmoe/arxiv "
                                "--initial eplb:olmoe:olmoe/github --nodes 4 --slots-per-rank 3",
    "r7-prefill-reversed": "--case deepseek-prefill-ep32 --trace sglang:prefill_in4096 --trace sglang:prefill_in512 "
                           "--initial eplb:sglang:prefill_in4096",
    "r8-decode-reversed-seed2": "--case deepseek-decode-8x8 --trace sglang:decode_in2000out100 "
                                "--trace sglang:decode_in500out1500 --initial eplb:sglang:decode_in2000out100 --seed 2",
    # added in session 18, after the decision changes of that session: a model family the defaults never saw
    # (Mixtral: 8 experts, EP8 with one spare slot per expert) and another order of three OLMoE domains
    "r9-mixtral-arxiv-github-1x8": "--trace olmoe:mistral/arxiv --trace olmoe:mistral/github "
                                   "--initial eplb:olmoe:mistral/arxiv --nodes 1 --ranks-per-node 8 --slots-per-rank 2",
    "r10-olmoe-book-c4-github-4x8-3slots": "--trace olmoe:olmoe/book --trace olmoe:olmoe/c4 --trace olmoe:olmoe/github "
                                           "--initial eplb:olmoe:olmoe/book --nodes 4 --slots-per-rank 3",
    # added in session 26: the two model families issue 49 describes and the repository has no data of, built
    # from that description (bench.traces.zipf_totals; a second mix seed is the drift): a top-1-of-128 model
    # whose hottest expert takes a quarter of a layer at 2x8 ranks, 10 slots a rank; a top-4-of-32 model at 2x4.
    # Not quite held out: that session's last two decision changes were kept after runs of this construction
    # with other seeds and shapes (its closing note has them)
    "r11-top1of128-hot25-2x8-10slots": "--trace zipf:128/1/0.25/6/7 --trace zipf:128/1/0.25/6/107 "
                                       "--initial eplb:zipf:128/1/0.25/6/7 --slots-per-rank 10",
    "r12-top4of32-2x4": "--trace zipf:32/4/0.12/8/3 --trace zipf:32/4/0.12/8/103 --initial eplb:zipf:32/4/0.12/8/3 "
                        "--ranks-per-node 4 --slots-per-rank 5",
    # added in session 29, two of nine shapes a probe tried that the runs above do not have (its other seven
    # passed): a top-1-of-128 model whose hottest expert takes 40% of a layer, and Mixtral with three domains and
    # 3 slots a rank. Not quite held out: r13 in steady state changed the large-gap planner's copy charge (it
    # stayed at 1.29 for its second segment against hindsight's 1.13); r14 in steady state failed on its excess
    # over hindsight and is kept as found
    "r13-top1of128-hot40-2x8-10slots": "--trace zipf:128/1/0.40/6/9 --trace zipf:128/1/0.40/6/109 "
                                       "--initial eplb:zipf:128/1/0.40/6/9 --slots-per-rank 10",
    "r14-mixtral-3seg-1x8-3slots": "--trace olmoe:mistral/c4 --trace olmoe:mistral/book --trace olmoe:mistral/wikipedia "
                                   "--initial eplb:olmoe:mistral/c4 --nodes 1 --ranks-per-node 8 --slots-per-rank 3",
}


# the two ways each run's trace is built, and the bench flags that select them
CONSTRUCTIONS: dict[str, str] = {"steady": "", "cold-start": "--cold-start"}


@dataclass(frozen=True)
class Run:
    """One bench run: a case or held-out run in one construction, written to OUT/construction/name."""

    name: str
    construction: str
    flags: str

    @property
    def label(self) -> str:
        return f"{self.construction}/{self.name}"


def plan(names: list[str], constructions: list[str]) -> list[Run]:
    """Every named run in every construction, each run's constructions side by side."""
    runs = {**CASES, **HELD_OUT}
    return [Run(n, c, f"{runs[n]} {CONSTRUCTIONS[c]}".strip()) for n in names for c in constructions]


def run_one(run: Run, out: Path, extra: list[str]) -> tuple[Run, int, float]:
    t0 = time.monotonic()
    (out / run.construction).mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "agent.cli", "bench", *run.flags.split(), *extra, "--no-plots", "--no-progress",
           "--out", str(out / run.label)]
    with open(out / f"{run.label}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    return run, rc, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.heldout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, metavar="DIR")
    ap.add_argument("--jobs", type=int, default=2, help="bench runs side by side (default 2)")
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="run only these (repeatable)")
    ap.add_argument("--construction", choices=[*CONSTRUCTIONS, "both"], default="both",
                    help="steady state, a cold start, or both (default both: every run in each)")
    ap.add_argument("extra", nargs="*", help="flags passed to every bench run (after --)")
    args = ap.parse_args(argv)
    runs = {**CASES, **HELD_OUT}
    unknown = [n for n in args.only if n not in runs]
    if unknown:
        ap.error(f"--only {unknown}: expected names from {list(runs)}")
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: expected >= 1")
    names = [n for n in runs if not args.only or n in args.only]
    chosen = plan(names, list(CONSTRUCTIONS) if args.construction == "both" else [args.construction])
    args.out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        for run, rc, secs in pool.map(lambda r: run_one(r, args.out, args.extra), chosen):
            print(f"{run.label}: {'ok' if rc == 0 else f'exit {rc}, see ' + str(args.out / (run.label + '.log'))} "
                  f"({secs:.0f} s)", file=sys.stderr, flush=True)
    return verdict.main([str(args.out / r.label) for r in chosen])


if __name__ == "__main__":
    raise SystemExit(main())
