"""Judge `emoe bench` results against the elastic policy's acceptance conditions, side by side.

    python -m bench.verdict OUT_DIR [OUT_DIR ...]

Per run: elastic's mean step imbalance below periodic EPLB's and CRAFT's (both variants); its excess over
hindsight at most 1/3 of the best baseline's (eplb, craft, craft-periodic); recovery after every drift at
most hindsight's own recovery plus 2W; bytes moved at most the larger of 1/5 of EPLB's and hindsight's (what
the best placement in hindsight had to move: a drift that needs more than a fifth of EPLB's bytes is not held
against elastic); modelled tokens per second (the step-time model's, bench.engine) at least every baseline's,
static included; no regression. Where these conflict, 0 regressions and tokens/s >= static's come first: the
row says which checks failed, and `first` whether those two held. Also reported, not judged: the gain in
modelled tokens per second over each baseline and hindsight, hindsight's bytes, and the run's construction
(steady state or a cold start: results.json's `construction`), one row per run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

BASELINES = ("eplb", "craft", "craft-periodic")
CHECKS = ("below_baselines", "excess_le_third", "recovery_le_hindsight_2w", "bytes_le_max_fifth_eplb_hindsight",
          "tokens_per_s_ge_baselines", "no_regressions")


def verdict(res: dict[str, Any]) -> dict[str, Any]:
    p = res["policies"]
    el, hs = p["elastic"], p["hindsight"]
    w = int(res["cluster"]["window"])
    best = min(p[b]["mean_step_imbalance"] for b in BASELINES if b in p)
    excess = el["mean_step_imbalance"] - hs["mean_step_imbalance"]
    checks = {
        "below_baselines": all(el["mean_step_imbalance"] < p[b]["mean_step_imbalance"] for b in BASELINES if b in p),
        "excess_le_third": excess <= (best - hs["mean_step_imbalance"]) / 3,
        "recovery_le_hindsight_2w": all(e <= h + 2 * w for e, h in zip(el["recovery_steps"], hs["recovery_steps"],
                                                                        strict=True)),
        "bytes_le_max_fifth_eplb_hindsight": el["bytes_moved"] <= max(p["eplb"]["bytes_moved"] / 5,
                                                                      hs["bytes_moved"]),
        "tokens_per_s_ge_baselines": all(el["modelled_tokens_per_s"] >= p[b]["modelled_tokens_per_s"]
                                         for b in (*BASELINES, "static") if b in p),
        "no_regressions": el["regressions"] == 0,
    }
    first = el["regressions"] == 0 and ("static" not in p or el["modelled_tokens_per_s"]
                                        >= p["static"]["modelled_tokens_per_s"])
    return {"elastic": el["mean_step_imbalance"], "hindsight": hs["mean_step_imbalance"], "best_baseline": best,
            "excess": excess, "allowed_excess": (best - hs["mean_step_imbalance"]) / 3,
            "recovery": el["recovery_steps"], "hindsight_recovery": hs["recovery_steps"],
            "gb": el["bytes_moved"] / 1e9, "eplb_gb": p["eplb"]["bytes_moved"] / 1e9,
            "hindsight_gb": hs["bytes_moved"] / 1e9, "regressions": el["regressions"],
            "construction": res.get("construction", {}).get("name", "unrecorded"),
            "tokens_per_s": el.get("modelled_tokens_per_s", 0.0), **checks,
            # modelled throughput gain over each baseline (total tokens over total modelled time)
            "modelled_tokens_per_s_gain": {b: el["modelled_tokens_per_s"] / p[b]["modelled_tokens_per_s"] - 1.0
                                           for b in (*BASELINES, "static", "hindsight")
                                           if b in p and p[b].get("modelled_tokens_per_s")},
            "first": first, "pass": all(checks.values())}


def main(argv: list[str] | None = None) -> int:
    dirs = argv if argv is not None else sys.argv[1:]
    if not dirs:
        print("usage: python -m bench.verdict OUT_DIR [OUT_DIR ...]", file=sys.stderr)
        return 2
    print("| run | construction | elastic imb | hindsight | best baseline | excess / allowed | recovery (hindsight) "
          "| GB (EPLB, hindsight) | regressions | elastic tokens/s (modelled) | vs each baseline and hindsight | 0 regr. "
          "and >= static | pass |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for d in dirs:
        try:
            v = verdict(json.loads((Path(d) / "results.json").read_text()))
        except (OSError, KeyError, ValueError) as e:
            print(f"| {d} | unreadable: {e} |||||||||||")
            ok = False
            continue
        ok &= v["pass"]
        fails = [k for k in CHECKS if not v[k]]
        print(f"| {Path(d).name} | {v['construction']} | {v['elastic']:.4f} | {v['hindsight']:.4f} "
              f"| {v['best_baseline']:.4f} | {v['excess']:.4f} / {v['allowed_excess']:.4f} "
              f"| {v['recovery']} ({v['hindsight_recovery']}) | {v['gb']:.1f} ({v['eplb_gb']:.1f}, "
              f"{v['hindsight_gb']:.1f}) | {v['regressions']} | {v['tokens_per_s']:,.0f} | "
              f"{', '.join(f'{b} {g:+.1%}' for b, g in v['modelled_tokens_per_s_gain'].items())} | "
              f"{'yes' if v['first'] else 'no'} | {'yes' if v['pass'] else 'no: ' + ', '.join(fails)} |")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
