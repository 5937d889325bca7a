"""`emoe explain` (version 0: the newest window's decision) says why nothing was proposed, with the figures:
a rebalance whose replayed gain is one burst step's (issue 49, finding 3) shows GAIN_NOT_SIGNIFICANT, its
verified gain and the lower bound that refused it. Driven through the agent's decision pipeline alone."""

from __future__ import annotations

import numpy as np

from agent.admin.telemetry import Telemetry
from agent.decision.pipeline import DecisionPipeline
from agent.decision.voter import Voter
from controlplane.controller import DecisionParams
from controlplane.table import initial_table
from controlplane.topology import Topology
from tests.agent.test_pipeline import Backend, Clock  # the pipeline tests' stand-ins

W = 20


def test_explain_names_the_refusal_and_its_bound() -> None:
    head = initial_table(Topology(2, 4, 3), 4, 16)  # 8 ranks x 3 slots: 2 experts a rank and a spare slot
    params = DecisionParams(window=W, expert_bytes=1 << 24, sample_every=1)
    backend = Backend(head)
    p = DecisionPipeline("a", params, backend, Voter(params, 0.05), voters=["a"], live_voters=lambda: ["a"],
                         handover_windows=2, clock=Clock(), telemetry=Telemetry(enabled=False))
    rng = np.random.default_rng(0)
    for seq in range(3):  # about 100 tokens an expert a step; the third window's last step: a burst on expert 0
        rows = (np.full((W, 4, 16), 100) + rng.integers(0, 5, size=(W, 4, 16))).astype(np.uint32)
        if seq == 2:
            rows[-1, :, 0] = 30000
        p.close_window(seq, rows.sum(axis=0, dtype=np.uint64), rows)
    assert not backend.proposed, "a plan that only gains on the burst step was proposed"
    ex = p.latest_explain
    assert ex is not None and ex.outcome == "GAIN_NOT_SIGNIFICANT", ex
    assert ex.plan.verified_gain >= params.tau and "lower bound -" in ex.trigger and "replay rows" in ex.trigger
