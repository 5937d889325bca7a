"""The decision core on the real routing data in ../shared/traces (skipped where it is absent)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from bench import decisions, traces
from controlplane.profile import spearman
from tests.conftest import need_shared_traces


def test_olmoe_profile_across_domains() -> None:
    need_shared_traces()
    out = decisions.olmoe_profile(steps=200, batch=512, window=100)
    assert out["layers"] == [0, 7, 15] and len(out["spearman"]) == 3  # type: ignore[arg-type]
    classes = out["classes"]
    assert isinstance(classes, dict)
    assert [sum(c[i] for c in classes.values()) for i in range(3)] == [64, 64, 64]
    # the profile's Spearman (on sampled steps) agrees with the raw aggregate counts
    raw = {d: np.array(json.loads((traces.OLMOE_DIR / "olmoe" / "expert_counts" / f"{d}.json").read_text())["counts"])
           for d in decisions.OLMOE_DOMAINS}
    pairs = list(itertools.combinations(decisions.OLMOE_DOMAINS, 2))
    ref = np.mean([spearman(raw[a], raw[b]) for a, b in pairs], axis=0)
    assert np.allclose(out["spearman"], ref, atol=0.05), (out["spearman"], ref)  # type: ignore[arg-type]


def test_esft_intent_then_law_decisions() -> None:
    need_shared_traces()
    out = decisions.esft_decisions(steps=600, batch=2048, window=100, seed=0)
    committed = [d for d in out["decisions"] if d["committed"]]  # type: ignore[union-attr, index]
    assert committed, out
    for d in committed:
        if d["kind"] == "rebalance":
            assert d["verified_gain"] >= out["tau"]  # type: ignore[operator]
    assert out["every_committed_rebalance_gain_ge_tau"] is True
    imb = out["mean_step_imbalance"]
    assert isinstance(imb, dict)
    for seg in ("intent", "law"):
        assert imb[seg]["controller"] <= imb[seg]["static_ep"] + 1e-9
    if len(committed) == 0:  # pragma: no cover
        pytest.fail("no decision committed on ESFT")
