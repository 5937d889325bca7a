"""python -m chaos run --runner sim --nodes 64 --schedules 1000 --seed 1 --json [--out DIR] [--jobs N]

Runs seeded fault schedules (chaos/schedules.py) against the in-process simulated cluster
(chaos/simcluster.py: full agents, shims and reference engines on a simulated network) and checks
invariants I1-I7 (chaos/invariants.py). `--schedule FILE` plays scenario files instead of generated ones.
`--runner processes` (real agent processes on loopback) is provided by chaos/procmain.py when present.
Prints one JSON object with --json; exit status 1 if any invariant was violated or any schedule raised (its
traceback is printed and kept in its report; the other schedules run on). `--out DIR` keeps one report per
schedule; `--resume` re-runs only those missing, and `--resume --tally` runs nothing and sums what DIR holds
(the figures so far of a long run, still going or cut off); `--resume --recheck K` first re-runs K kept
schedules and refuses to resume if this tree does not reproduce their reports.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from chaos.invariants import INVARIANTS
from chaos.simrun import run_job


def p99(xs: list[float]) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]


def _tally(collected: Any, a: argparse.Namespace, out: Path | None, t0: float) -> Any:
    """Write each report as it arrives (so that --resume loses at most the schedules in flight), say
    which schedules violated what, and show progress."""
    for i, r, old in collected:
        if r.get("error"):
            print(f"schedule {i} (seed {r['seed']}): raised\n{r['error']}", file=sys.stderr)
        if any(r["violation_counts"].values()):
            print(f"schedule {i} (seed {r['seed']}): {r['violation_counts']} after {r['done']}", file=sys.stderr)
        if out is not None and not old:
            tmp = out / f".run-{i:05d}.json.tmp"
            tmp.write_text(json.dumps(r, indent=1))
            tmp.replace(out / f"run-{i:05d}.json")
        if a.progress and (i + 1) % a.progress == 0:
            print(f"{i + 1}/{a.schedules} schedules, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        yield r


def _fault_kinds(results: list[dict[str, Any]]) -> dict[str, int]:
    """How many faults of each kind the schedules injected (`partition bridge`, `restart-cluster rolling`,
    `wipe-data-dir after-accept`: kinds with a mode or a point keep it), most frequent first."""
    n: dict[str, int] = {}
    for r in results:
        for line in r.get("lines") or []:
            w = line.split()
            if not w or w[0] in ("tick", "add-nodes", "stabilize", "heal", "clear-link"):
                continue
            moded = w[0] in ("partition", "restart-cluster") and len(w) > 1 and not w[1].startswith("n")
            armed = len(w) > 2 and w[2].startswith("after-")  # `crash voter after-commit`: crash after-commit
            k = " ".join(w[:2]) if moded else f"{w[0]} {w[2]}" if armed else w[0]
            n[k] = n.get(k, 0) + 1
    return dict(sorted(n.items(), key=lambda kv: (-kv[1], kv[0])))


def _recheck(done: dict[int, dict[str, Any]], jobs: list[Any], k: int) -> list[str]:
    """Re-run the `k` cheapest kept schedules that committed something and compare their reports with the
    kept ones in every field but CPU time: a run resumed by other code (a later commit, another session)
    must produce the same reports, or its totals mix two programs. Returns one line per mismatch."""
    kept = sorted((r.get("cpu_s", 0.0), i) for i, r in done.items() if r.get("commits") and not r.get("error"))
    bad = []
    for _, i in kept[:k]:
        t0 = time.perf_counter()
        new = run_job(jobs[i])
        diff = sorted(f for f in set(done[i]) | set(new) if f != "cpu_s" and done[i].get(f) != new.get(f))
        print(f"recheck schedule {i} (seed {new['seed']}): "
              f"{'differs in ' + ', '.join(diff) if diff else 'identical'} ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr)
        if diff:
            bad.append(f"schedule {i} differs in {', '.join(diff)}")
    return bad


def run_sim(a: argparse.Namespace) -> int:
    from chaos.schedules import load

    files = [Path(f) for f in a.schedule or []]
    jobs: list[tuple[int, int, list[str] | None, dict[str, Any]]] = []
    shape = dict(layers=a.layers, experts=a.experts, ranks_per_node=1, slots_per_rank=a.slots, top_k=2)
    for i in range(a.schedules):
        seed = a.seed * 1_000_003 + i
        lines = load(files[i % len(files)]) if files else None
        kw: dict[str, Any] = dict(shape=dict(shape), faults=a.faults, profile=a.profile)
        if a.skew:
            kw["skew"] = True
        if a.disks:
            kw["disks"] = True
        kw["shifts"] = not a.no_shifts  # (reports of runs from before shifts existed have no key: not resumed)
        jobs.append((a.nodes, seed, lines, kw))
    t0 = time.perf_counter()
    totals = dict.fromkeys(INVARIANTS, 0)
    conv: list[float] = []
    detect: list[float] = []
    commits = 0
    cpu = 0.0
    out = Path(a.out) if a.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    done: dict[int, dict[str, Any]] = {}
    if a.resume:  # reports of an earlier, interrupted run of the same command: kept, not re-run
        if out is None:
            print("--resume needs --out DIR", file=sys.stderr)
            return 2
        for i, (nodes, seed, lines, kw) in enumerate(jobs):
            f = out / f"run-{i:05d}.json"
            try:
                r = json.loads(f.read_text()) if f.exists() else None
            except ValueError:
                r = None  # cut off mid-write: run it again
            if (r is not None and (r.get("seed"), r.get("nodes"), r.get("config")) == (seed, nodes, kw)
                    and (lines is None or r.get("lines") == lines)):
                done[i] = r
        if done:
            print(f"resuming: {len(done)} of {len(jobs)} schedules already in {out}", file=sys.stderr)
    if a.tally and not a.resume:
        print("--tally needs --resume --out DIR (it sums the reports an earlier run wrote there)", file=sys.stderr)
        return 2
    if a.recheck:
        if not a.resume:
            print("--recheck needs --resume --out DIR (it re-runs reports an earlier run wrote there)",
                  file=sys.stderr)
            return 2
        bad = _recheck(done, jobs, a.recheck)
        if bad:
            print(f"--recheck: this tree does not reproduce the reports in {out}: {'; '.join(bad)}; not resuming "
                  f"(continue the run from the code that wrote them, or start a new --out)", file=sys.stderr)
            return 2
    todo = [] if a.tally else [i for i in range(len(jobs)) if i not in done]
    ex: ProcessPoolExecutor | None = None
    if a.jobs > 1 and len(todo) > 1:
        import multiprocessing as mp

        ex = ProcessPoolExecutor(min(a.jobs, len(todo)), mp_context=mp.get_context("spawn"))
        fresh = ex.map(run_job, [jobs[i] for i in todo])  # in order, as each finishes
    else:
        fresh = (run_job(jobs[i]) for i in todo)

    def collected() -> Any:
        it = iter(fresh)
        for i in range(len(jobs)):
            if i in done:
                yield i, done[i], True
            elif not a.tally:
                yield i, next(it), False

    try:
        results = list(_tally(collected(), a, out, t0))
    finally:
        if ex is not None:
            ex.shutdown(cancel_futures=True)
    errors = [r["seed"] for r in results if r.get("error")]
    for r in results:
        for k, v in r["violation_counts"].items():
            totals[k] += v
        conv += r["convergence_s"]
        detect += r["detect_s"]
        commits += r["commits"]
        cpu += r["cpu_s"]
    took = time.perf_counter() - t0
    tokens: dict[str, int] = {}
    for r in results:
        for k, v in r.get("tokens", {}).items():
            tokens[k] = tokens.get(k, 0) + v
    summary = {"runner": "sim", "nodes": a.nodes, "schedules": a.schedules, "done": len(results),
               "seeds": [results[0]["seed"], results[-1]["seed"]] if results else [], "violations": totals,
               "convergence_p99_s": round(p99(conv), 3), "convergence_max_s": round(max(conv, default=0.0), 3),
               "detection_p99_s": round(p99(detect), 3), "commits": commits, "wall_s": round(took, 1),
               "cpu_s": round(cpu, 1), "cpu_s_per_schedule": round(cpu / max(1, len(results)), 2),
               "shape": shape, "profile": a.profile, "skew": a.skew, "disks": a.disks, "resumed": len(done),
               "shifts": not a.no_shifts,
               "errors": len(errors), "error_seeds": errors[:20], "repairs": sum(r.get("repairs", 0) for r in results),
               "rollbacks": sum(r.get("rollbacks", 0) for r in results),
               "wipes": sum(r.get("wipes", 0) for r in results),
               "wipes_at_genesis": sum(r.get("wipes_at_genesis", 0) for r in results),
               "i6_judged": sum(r.get("i6_judged", 0) for r in results), "tokens": tokens,
               "faults": _fault_kinds(results)}
    if out is not None:
        (out / ("tally.json" if a.tally else "summary.json")).write_text(json.dumps(summary, indent=1))
    if a.json:
        print(json.dumps(summary))
    else:
        print(" ".join(f"{k}={v}" for k, v in summary.items()))
    return 1 if any(totals.values()) or errors else 0


def run_processes(a: argparse.Namespace) -> int:
    """Hook for the real-process runner (chaos/procmain.py: `main(args) -> int`)."""
    try:
        from chaos import procmain
    except ImportError:
        print("--runner processes: chaos/procmain.py is not available in this tree", file=sys.stderr)
        return 2
    return int(procmain.main(a))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chaos", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run fault schedules and check invariants I1-I7")
    r.add_argument("--runner", choices=("sim", "processes"), default="sim")
    r.add_argument("--nodes", type=int, default=8)
    r.add_argument("--schedules", type=int, default=10)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--faults", type=int, default=3, help="faults per generated schedule")
    r.add_argument("--skew", action="store_true", help="generated schedules may also skew node clocks")
    r.add_argument("--disks", action="store_true",
                   help="generated schedules may also restart the whole cluster (at once or rolling), lose or "
                        "corrupt a node's store, fill its disk, and wipe one node's whole data_dir (store and "
                        "IDENTITY), at once or at a step of a version (processes: data_dirs on tmpfs, needs root)")
    r.add_argument("--no-shifts", action="store_true",
                   help="generated schedules end without the load shift that makes a committed rebalance realise "
                        "worse than its parent (whose rollback I6 then requires)")
    r.add_argument("--no-netns", action="store_true",
                   help="processes runner: agents on loopback, partitions through the transport's fault file "
                        "(the default, as root with nftables, puts each agent in a network namespace)")
    r.add_argument("--schedule", action="append", help="scenario file(s) to play instead of generated ones")
    r.add_argument("--layers", type=int, default=4)
    r.add_argument("--experts", type=int, default=16)
    r.add_argument("--slots", type=int, default=0, help="slots per rank (default: room for 2x the experts)")
    r.add_argument("--profile", default="test", choices=("test", "local", "lan"))
    r.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="worker processes for the sim runner (default: one per CPU)")
    r.add_argument("--resume", action="store_true",
                   help="with --out: keep the reports an interrupted run of the same command wrote there")
    r.add_argument("--out", help="directory for one JSON report per run and summary.json")
    r.add_argument("--recheck", type=int, default=0, metavar="K",
                   help="with --resume: first re-run K of the kept schedules (the cheapest that committed) and "
                        "resume only if this tree reproduces their reports (all fields but CPU time)")
    r.add_argument("--tally", action="store_true",
                   help="with --resume --out DIR: run nothing, sum the reports DIR holds for this command "
                        "(a run still going, or cut off, so far) into DIR/tally.json")
    r.add_argument("--progress", type=int, default=0, help="print progress every N schedules (stderr)")
    r.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # agents log each fault they see; the report says what matters
    if a.nodes < 1 or a.schedules < 1 or a.jobs < 1:
        ap.error(f"--nodes {a.nodes} --schedules {a.schedules} --jobs {a.jobs}: expected all >= 1")
    if a.slots == 0:
        a.slots = max(2, -(-2 * a.experts // a.nodes))
    if a.runner == "processes":
        return run_processes(a)
    return run_sim(a)


if __name__ == "__main__":
    sys.exit(main())
