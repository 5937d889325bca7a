"""The decision core on real routing data (../shared/traces): stability profile and decisions taken.

    python -m bench.decisions --json

1. Profile across the OLMoE-1B-7B domains (arxiv, book, c4, github, wikipedia, tulu; layers 0, 7, 15; step
   model `sampled`: multinomial draws of 2048 tokens x top-8 per step from each domain's aggregate counts):
   per-layer mean pairwise Spearman of expert popularity and class counts.
2. ESFT-vanilla-lite (DeepSeek-V2-Lite: 26 MoE layers x 64 experts, top-6), intent followed by law (step model
   `pseudo-decode batch 2048`), on 2 nodes x 8 ranks x 5 slots, W = 100: the controller runs window by window
   from static EP; each proposal is re-verified as a voter would (`verify_decision` on the replay buffer,
   tau for a rebalance, 0 for a rollback) and committed at once if it passes. Reports every decision and the
   mean step imbalance per segment against static EP on the same steps.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from bench import traces
from controlplane.controller import (
    Controller,
    DecisionParams,
    ProposalFailed,
    TableCommitted,
    WindowClosed,
    verify_decision,
)
from controlplane.load import table_step_imbalance
from controlplane.profile import CLASS_NAMES, build_profile
from controlplane.table import initial_table
from controlplane.topology import Topology

OLMOE_DOMAINS = ("arxiv", "book", "c4", "github", "wikipedia", "tulu")


def olmoe_profile(steps: int, batch: int, window: int) -> dict[str, object]:
    ts = [traces.import_olmoe("olmoe", d, batch, steps, seed=i) for i, d in enumerate(OLMOE_DOMAINS)]
    prof = build_profile([t.counts for t in ts], OLMOE_DOMAINS, window)
    counts = prof.class_counts()
    return {
        "data": "olmoe-mixtral-domain-expert-counts: OLMoE-1B-7B layers [0, 7, 15], 64 experts, top-8",
        "step_model": f"sampled, batch {batch}, {steps} steps per domain",
        "domains": list(OLMOE_DOMAINS),
        "layers": [0, 7, 15],
        "spearman": [round(float(x), 4) for x in prof.spearman],
        "classes": {name: [int(c) for c in counts[:, i]] for i, name in enumerate(CLASS_NAMES)},
    }


def esft_decisions(steps: int, batch: int, window: int, seed: int) -> dict[str, object]:
    a = traces.import_esft("intent", batch, steps, seed)
    b = traces.import_esft("law", batch, steps, seed)
    tr = traces.concat([a, b])
    T, L, E = tr.shape
    topo = Topology(2, 8, 5)
    static = initial_table(topo, L, E)
    params = DecisionParams(window=window)
    ctl = Controller(params, static)
    imb = np.zeros(T)
    decisions: list[dict[str, object]] = []
    outcomes: dict[str, int] = {}
    for w in range(T // window):
        lo, hi = w * window, (w + 1) * window
        imb[lo:hi] = table_step_imbalance(ctl.head, tr.counts[lo:hi])  # the table in force for these steps
        ready = ctl.step(WindowClosed(w, lo, tr.counts[lo:hi]))
        props = list(ready.proposals)
        ex = ctl.last_explain()
        if ex is not None:
            outcomes[ex.outcome] = outcomes.get(ex.outcome, 0) + 1
        ctl.advance()
        for d in props:
            tau = params.tau if d.kind == "rebalance" else 0.0
            replay = ctl.monitor.buffer.counts()
            ok, vg, reason = verify_decision(ctl.head, d.table, replay, tau, drift_tv=ctl.params.drift_tv)
            ctl.step(TableCommitted(d.table) if ok else ProposalFailed(d.table.version, reason))
            ctl.advance()
            decisions.append({
                "window": w, "version": d.table.version, "kind": d.kind, "ops": len(d.ops),
                "estimated_gain": round(d.estimated_gain, 4), "verified_gain": round(d.verified_gain, 4),
                "voter_gain": round(vg, 4), "committed": ok, "cost_ms": round(d.cost * 1e3, 3),
                "refused": len(d.refused), "trigger": d.trigger,
            })
    base = np.array([float(table_step_imbalance(static, tr.counts[s:s + 1])[0]) for s in range(T)])
    seg = [(0, steps, "intent"), (steps, T, "law")]
    committed = [d for d in decisions if d["committed"]]
    gains = [float(str(d["verified_gain"])) for d in committed if d["kind"] == "rebalance"]
    return {
        "data": "esft-deepseek-v2-lite-task-routing: intent -> law, 26 layers x 64 experts, top-6",
        "step_model": f"pseudo-decode batch {batch}, {steps} steps per task",
        "topology": "2 nodes x 8 ranks x 5 slots", "window": window, "tau": params.tau, "theta": params.theta,
        "decisions": decisions,
        "committed": len(committed),
        "min_committed_rebalance_verified_gain": round(min(gains), 4) if gains else None,
        "every_committed_rebalance_gain_ge_tau": all(g >= params.tau for g in gains),
        "window_outcomes": outcomes,
        "mean_step_imbalance": {name: {"static_ep": round(float(base[lo:hi].mean()), 4),
                                       "controller": round(float(imb[lo:hi].mean()), 4)} for lo, hi, name in seg},
        "final_version": ctl.head.version,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decisions", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=2000, help="steps per ESFT task (default 2000)")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--olmoe-steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not traces.SHARED_TRACES.is_dir():
        print(f"real traces not found at {traces.SHARED_TRACES}", file=sys.stderr)
        return 1
    out = {"olmoe_profile": olmoe_profile(args.olmoe_steps, args.batch, args.window),
           "esft_intent_then_law": esft_decisions(args.steps, args.batch, args.window, args.seed)}
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
