"""The agents' step time from the engines' measured steps, through the load path as `emoe bench` drives it: the
engines' reports carry each sampled step's wall time, the deciding node fits its step time from the gossiped
windows, and `emoe explain` says which step time it decided with and where it came from."""

from __future__ import annotations

import io

import numpy as np
from rich.console import Console

from bench.policies import Elastic
from controlplane.steptime import StepTimeSource, step_points
from controlplane.table import RoutingTable, initial_table
from controlplane.topology import Topology

W = 50


def _trace(seed: int, steps: int, layers: int, experts: int) -> np.ndarray:
    """Steps whose skew varies from step to step (the busiest rank's load by tens of percent)."""
    rng = np.random.default_rng(seed)
    out = np.zeros((steps, layers, experts), np.int64)
    for s in range(steps):
        p = rng.dirichlet(np.full(experts, rng.uniform(0.5, 20.0)))
        out[s] = rng.multinomial(512, p, size=layers)
    return out


def test_the_deciding_node_fits_the_step_time_the_engines_measured_and_explain_says_so(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    head = initial_table(Topology(2, 2, 3), 4, 8)
    rng = np.random.default_rng(1)
    a, b = 1.5, 0.02

    def measured(table: RoutingTable, counts: np.ndarray) -> np.ndarray:
        busiest, _ = step_points(table, counts)
        return (a + b * busiest) * (1 + 0.10 * rng.standard_normal(len(busiest)))

    pol = Elastic(W, params={"theta": 1e6, "fast_theta": 1e6, "sample_every": 5})
    pol.step_ms = measured
    counts = _trace(1, 40 * W, head.layers, head.experts)
    pol.start(head, counts, [])
    for k in range(40):
        pol.on_window(k * W, (k + 1) * W, counts)
    st = pol.pipeline.controller.step_time
    held = pol.pipeline.controller.steptime._windows  # the windows the fit held, under the tables that served them
    truth = b * float(np.concatenate([w[2] for w in held]).mean())
    assert st.source is StepTimeSource.FITTED and abs(st.load_ms - truth) <= 0.10 * truth, (st, truth)
    said = pol.pipeline.latest_explain.step_time
    assert said.startswith(f"{st.load_ms:.4g} ms, fitted from ") and "measured steps" in said, said

    from agent.cli import render

    out = io.StringIO()
    monkeypatch.setattr(render, "_console", lambda: Console(file=out, width=200))
    render.explain(pol.pipeline.latest_explain)
    assert f"step time: {said}" in out.getvalue()


def test_the_reference_figure_is_taken_under_the_tables_that_served_the_fitted_steps() -> None:
    """results.json's `load_ms_engine` for a decision is the engine's figure over the sampled steps of the
    windows the fit held, each under the table that served it, not under the table the decision committed."""
    from types import SimpleNamespace

    from bench.engine import H200, EPCluster, shape_for
    from bench.measured import step_time_entry

    topo = Topology(2, 2, 3)
    served = initial_table(topo, 4, 8)
    spread = served.phy2log.copy()
    spread[:, [5, 8, 11]] = 0  # replicas of expert 0 in the free slot of every other rank
    committed = served.successor(spread)
    counts = _trace(2, 4 * W, served.layers, served.experts)
    counts[:, :, 0] *= 8  # one hot expert: where it sits decides the busiest rank
    cluster = EPCluster(topo, shape_for(4, 8, 2), H200)
    pol = Elastic(W)
    pol.pipeline = SimpleNamespace(controller=SimpleNamespace(step_time=SimpleNamespace(source="fitted", why="")))
    pol.backend = SimpleNamespace(head=committed)  # the head once the decision committed
    pol.decisions = [{"load_ms_estimated": 1.0}]
    pol.fits = [[(k * W, (k + 1) * W, served) for k in range(4)]]
    step_time_entry(pol, cluster, counts, 5)
    sampled = counts[::5]
    want, other = cluster.load_ms(served, sampled), cluster.load_ms(committed, sampled)
    assert abs(want - other) > 0.05 * want  # the two tables give the engine different figures
    assert pol.decisions[0]["load_ms_engine"] == round(want, 4), (pol.decisions[0], want, other)
    # the figure scales with the load: what 10% more load on every expert adds to the MoE part, per 10%
    up = cluster.moe_ms(served, np.rint(sampled * 1.1).astype(np.int64)).mean()
    assert abs((up - cluster.moe_ms(served, sampled).mean()) / 0.1 - want) <= 0.1 * want
