"""bench.verdict judges a run by issue 49's rules: bytes within the larger of EPLB's fifth and hindsight's,
modelled tokens/s at least every baseline's (static included), and the two that come first when rules conflict
(0 regressions, tokens/s >= static's)."""

from __future__ import annotations

import copy
from typing import Any

from bench.verdict import CHECKS, verdict

GB = 1e9


def run(**elastic: Any) -> dict[str, Any]:
    def pol(imb: float, gb: float, tps: float) -> dict[str, Any]:
        return {"mean_step_imbalance": imb, "bytes_moved": gb * GB, "modelled_tokens_per_s": tps,
                "recovery_steps": [100], "regressions": 0}

    p = {"static": pol(1.50, 0, 1000), "eplb": pol(1.30, 50, 1100), "craft": pol(1.28, 40, 1110),
         "craft-periodic": pol(1.29, 45, 1105), "hindsight": pol(1.10, 20, 1200), "elastic": pol(1.15, 8, 1150)}
    p["elastic"].update(elastic)
    return {"cluster": {"window": 100}, "policies": p, "construction": {"name": "steady"}}


def test_a_run_within_every_rule_passes() -> None:
    v = verdict(run())
    assert v["pass"] and v["first"] and all(v[c] for c in CHECKS)


def test_bytes_are_held_to_the_larger_of_eplbs_fifth_and_hindsights() -> None:
    # EPLB/5 = 10 GB, hindsight 20 GB: 15 GB is past the fifth but within what hindsight moved
    assert verdict(run(bytes_moved=15 * GB))["bytes_le_max_fifth_eplb_hindsight"]
    over = verdict(run(bytes_moved=21 * GB))
    assert not over["bytes_le_max_fifth_eplb_hindsight"] and not over["pass"] and over["first"]
    r = run(bytes_moved=11 * GB)
    r["policies"]["hindsight"]["bytes_moved"] = 5 * GB  # now the fifth of EPLB's (10 GB) is the bound
    assert not verdict(r)["bytes_le_max_fifth_eplb_hindsight"]


def test_modelled_tokens_per_second_must_reach_every_baseline_and_static_comes_first() -> None:
    below_craft = verdict(run(modelled_tokens_per_s=1105))  # above static and EPLB, below CRAFT's 1110
    assert not below_craft["tokens_per_s_ge_baselines"] and not below_craft["pass"] and below_craft["first"]
    below_static = verdict(run(modelled_tokens_per_s=990))
    assert not below_static["tokens_per_s_ge_baselines"] and not below_static["first"]
    r = copy.deepcopy(run())
    r["policies"]["elastic"]["regressions"] = 1
    v = verdict(r)
    assert not v["no_regressions"] and not v["first"] and not v["pass"]
