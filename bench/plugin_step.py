"""Per-step cost of the vLLM plugin inside vLLM's real `EplbState.step()`: two EP ranks in gloo processes on
CPU (the engine tests' toy model, 2 MoE layers x 10 slots; reports go to an in-process link, as with an
idle connected agent),
run by the engine virtualenv (.venv-engine, `make .venv-engine`).

    python -m bench.plugin_step [--json] [--steps 512] [--rounds 5] [--every 32,25] [--mode async|sync]

Side by side in one run, in alternating rounds of `--steps` steps: version agreement and load report every
step (1,1) against every K and R steps (`--every K,R`, the plugin's EMOE_AGREE_EVERY and EMOE_REPORT_EVERY).
Per configuration, medians over rounds and ranks of: `mean_us`, the plugin's amortised cost per step (all of
its wrapper but vLLM's own step: load accumulation, fold and report, agreement, install bookkeeping);
`p99_us`; the agreement part alone; `per_30ms_step`, mean_us over a 30 ms decode step (DeepSeek-V3 at EP144;
the goal is <= 1/1000); and `worst_install_delay_ms`, what the schedule adds to an install at 30 ms a step
(the agreement is overlapped with the engine's step, its result taken at the next step: a version that
arrives just after one agreement waits K + 1 steps).

`--mode async` (the default) is vLLM's default EPLBConfig (use_async, window_size 1000): the plugin reads the
load from vLLM's own window. `--mode sync` runs the engine tests' sync config (window_size 2), where the
plugin keeps its own accumulator. The stand-in for the forward pass's collectives is a barrier on a gloo group
of its own, so the overlapped agreement runs beside it, as beside the device group's collectives in an engine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
ENGINE_PY = ROOT / ".venv-engine" / "bin" / "python"
HARNESS = ROOT / "tests" / "engine_harness" / "vllm_ranks.py"
STEP_MS = 30.0  # a DeepSeek-V3 decode step at EP144


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(steps: int = 512, rounds: int = 5, every: tuple[int, int] = (32, 32), mode: str = "async"
            ) -> dict[str, Any]:
    if not ENGINE_PY.exists():
        raise SystemExit(f"{ENGINE_PY} not found: `make .venv-engine` installs vLLM there")
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        for k in (0, 1):  # a link without an agent that is idle, as a connected one between reports
            (out / "commits" / f"rank{k}").mkdir(parents=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1"}  # one thread per rank: two ranks share the cores without oversubscribing
        r = subprocess.run(
            [str(ENGINE_PY), str(HARNESS), "--out", d, "--port", str(_port()), "--mode", mode,
             "--sockets", f"{d}/none0.sock,{d}/none1.sock", "--commits", f"{d}/commits", "--bench-only", "--bench", str(steps),
             "--bench-rounds", str(rounds), "--bench-every", f"{every[0]},{every[1]}"],
            cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
        if r.returncode != 0:
            raise SystemExit(f"the vLLM ranks failed:\n{(r.stdout + r.stderr)[-3000:]}")
        ranks = [json.loads((out / f"bench{k}.json").read_text()) for k in (0, 1)]
    result: dict[str, Any] = {"mode": mode, "steps": steps, "rounds": rounds, "step_ms": STEP_MS}
    for key, k in (("k1_r1", 1), (f"k{every[0]}_r{every[1]}", every[0])):
        row = {m: float(np.median([rk[key][m] for rk in ranks])) for m in ranks[0][key]}
        row["per_30ms_step"] = row["mean_us"] / (STEP_MS * 1000.0)
        row["worst_install_delay_ms"] = (k + 1) * STEP_MS
        result[key] = row
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ap.add_argument("--steps", type=int, default=512, help="steps per round and configuration")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--every", default="32,25", help="K,R: agreement and report period against 1,1 (the defaults: 32,25)")
    ap.add_argument("--mode", choices=("async", "sync"), default="async",
                    help="vLLM's EPLB mode: async is its default (window_size 1000)")
    a = ap.parse_args(argv)
    k, r = (int(x) for x in a.every.split(","))
    res = measure(a.steps, a.rounds, (k, r), a.mode)
    if a.json:
        print(json.dumps(res))
        return
    print(f"vLLM plugin, per step ({a.mode} mode, 2 gloo ranks, medians of {a.rounds} rounds x {a.steps} steps):")
    for key in ("k1_r1", f"k{k}_r{r}"):
        x = res[key]
        print(f"  {key:>8}: mean {x['mean_us']:7.1f} us  p99 {x['p99_us']:7.1f} us  (agreement mean "
              f"{x['agree_mean_us']:6.1f} p99 {x['agree_p99_us']:6.1f}; load out {x['load_mean_us']:5.1f})  = "
              f"{x['per_30ms_step'] * 1000:.2f}/1000 of a "
              f"30 ms step; install delay up to {x['worst_install_delay_ms']:.0f} ms")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
