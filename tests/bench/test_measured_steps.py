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
    st = pol.pipeline.controller.measures.step_time
    held = pol.pipeline.controller.measures.steptime._windows  # the windows the fit held, under the tables that served them
    truth = b * float(np.concatenate([p.m for _, p in held]).mean())
    assert st.source is StepTimeSource.FITTED and abs(st.load_ms - truth) <= 0.10 * truth, (st, truth)
    said = pol.pipeline.latest_explain.step_time
    assert said.startswith(f"{st.load_ms:.4g} ms, fitted from ") and "measured steps" in said, said

    from agent.cli import render

    out = io.StringIO()
    monkeypatch.setattr(render, "_console", lambda: Console(file=out, width=400))
    render.explain(pol.pipeline.latest_explain)
    assert f"step time: {said}" in out.getvalue()


def test_the_reference_figure_is_taken_over_the_judged_steps_under_the_tables_that_served_them() -> None:
    """results.json's `load_ms_engine` for a decision is the engine's figure over the sampled steps of the
    windows the decision judged (where the agents read their fit), each under the table that served it, not
    under the table the decision committed; `load_ms_engine_held` is the same over all the windows the fit held."""
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
    counts[3 * W:, :, 0] *= 2  # hotter still in the last window, the one the decision judged
    cluster = EPCluster(topo, shape_for(4, 8, 2), H200)
    pol = Elastic(W)
    pol.pipeline = SimpleNamespace(controller=SimpleNamespace(measures=SimpleNamespace(
        step_time=SimpleNamespace(source="fitted", why=""))))
    pol.backend = SimpleNamespace(head=committed)  # the head once the decision committed
    pol.decisions = [{"load_ms_estimated": 1.0}]
    pol.fits = [[(k * W, (k + 1) * W, served) for k in range(4)]]
    pol.judged = [[(3 * W, 4 * W, served)]]
    step_time_entry(pol, cluster, counts, 5)
    judged, held = counts[3 * W:4 * W:5], counts[::5]
    want, other = cluster.load_ms(served, judged), cluster.load_ms(committed, judged)
    assert abs(want - other) > 0.05 * want  # the two tables give the engine different figures
    assert pol.decisions[0]["load_ms_engine"] == round(want, 4), (pol.decisions[0], want, other)
    over_held = cluster.load_ms(served, held)
    assert abs(over_held - want) > 0.05 * want  # the judged window's load is not the fitted windows' mean
    assert pol.decisions[0]["load_ms_engine_held"] == round(over_held, 4)
    # the figure scales with the load: what 10% more load on every expert adds to the MoE part, per 10%
    up = cluster.moe_ms(served, np.rint(judged * 1.1).astype(np.int64)).mean()
    assert abs((up - cluster.moe_ms(served, judged).mean()) / 0.1 - want) <= 0.1 * want


def test_the_engines_report_the_steps_as_served_copies_in_flight_included() -> None:
    """An in-process run's engines report each sampled step as the bench served it (bench.run.simulate hands the
    policy the served step times): a step a copy slowed is reported slow, where the step model under the head
    would not show it. The reference engine's jitter and batch term apply to it as to the model's steps."""
    from bench.agentfeed import LoadFeed
    from bench.engine import H200, EPCluster, shape_for
    from bench.measured import measured_steps

    head = initial_table(Topology(1, 2, 3), 2, 4)
    counts = _trace(2, W, head.layers, head.experts)
    cluster = EPCluster(head.topology, shape_for(head.layers, head.experts, 2), H200)
    model = measured_steps(cluster, head, counts, seed=0)
    got: list[np.ndarray] = []

    def close(seq, total, samples, missing=()):  # type: ignore[no-untyped-def]
        return None

    feed = LoadFeed(head.topology, head.layers, head.experts, W, 10, close, step_ms=model)
    path = feed.paths[feed.decider]
    served = np.full(W, 1e4)  # every step 10 s as served: a copy in flight, say
    feed.feed(0, counts, head, served)
    got.append(np.asarray(path.cluster.step_us.get(0)))
    feed2 = LoadFeed(head.topology, head.layers, head.experts, W, 10, close, step_ms=model)
    feed2.feed(0, counts, head)  # no served times: the model's steps under the head
    got.append(np.asarray(feed2.paths[feed2.decider].cluster.step_us.get(0)))
    assert got[0].size == got[1].size == 5
    assert (got[0] >= 0.5 * 1e7).all() and (got[0] <= 1.5 * 1.1e7).all(), got[0]  # ~10 s in us, jittered
    assert (got[1] < 1e6).all(), got[1]  # the model's steps: milliseconds


def test_the_engines_report_the_version_each_step_was_served_on() -> None:
    """While a change's copies are in flight the engines serve the old table (bench.run.simulate hands the policy
    each step's version): the reports split where the version changes, as a plugin's do at an install, and the
    window says the version of each sampled step."""
    from bench.agentfeed import LoadFeed

    head = initial_table(Topology(2, 2, 3), 2, 4)
    new = head.successor(np.roll(head.phy2log, 1, axis=1))
    counts = _trace(3, W, head.layers, head.experts)

    def close(seq, total, samples, missing=()):  # type: ignore[no-untyped-def]
        return None

    feed = LoadFeed(head.topology, head.layers, head.experts, W, 10, close, step_ms=lambda t, c: np.full(len(c), 5.0))
    ran = np.full(W, new.version)
    ran[:23] = head.version  # the install at step 23, mid-report
    feed.feed(0, counts, new, None, ran)
    path = feed.paths[feed.decider]
    assert path.cluster.step_version[0].tolist() == [1, 1, 1, 2, 2]  # sampled steps 0, 10, 20 | 30, 40


def test_each_commits_copies_are_charged_beside_what_they_cost_the_engine() -> None:
    """results.json's elastic entry sets, per commit, the serving time the cost-benefit test charged its copies
    (their cost over the ranks) beside what they cost the reference engine: the steps they overlapped as served
    minus the same steps with no copy in flight (bench.run.simulate's `copies`)."""
    from bench.run import BenchConfig, run_bench
    from bench.traces import Trace

    rng = np.random.default_rng(5)
    hot = np.zeros((2, 4, 16), np.int64)  # two segments, each a few experts hot: a drift between them
    hot[0, :, :3], hot[1, :, 8:11] = 60, 60
    counts = np.concatenate([np.stack([rng.poisson(hot[s] + 4) for _ in range(600)]) for s in (0, 1)])
    trace = Trace(counts.astype(np.uint32), "t", 2, "test", "sampled", [600])
    cfg = BenchConfig(nodes=2, ranks_per_node=2, slots_per_rank=5, window=100, policies=("static", "elastic"))
    e = run_bench(trace, cfg, progress=False, plots=False)["policies"]["elastic"]
    assert e["commits"] >= 1, e["outcomes"]
    d = e["decisions"][0]
    assert d["copy_ms_charged"] > 0 and d["copy_ms_engine"] > 0 and d["copy_steps_engine"] >= 1, d
    assert e["copy_ms_charged"] > 0 and e["copy_engine_over_charged"] > 0


def test_explain_says_what_copies_were_charged_and_where_that_came_from(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`emoe explain` prints the copy cost a decision charged beside its step time (ExplainReply.copy_cost); a
    record from an older agent, without it, prints no such line."""
    from agent.cli import render
    from elasticmoe.v1 import admin_pb2 as apb

    out = io.StringIO()
    monkeypatch.setattr(render, "_console", lambda: Console(file=out, width=400))
    said = "x1 (the model; 2 change(s) measured: ... (not used: decision.copy_cost_measured is off))"
    render.explain(apb.ExplainReply(version=3, outcome="proposed", step_time="3.6 ms, fitted", copy_cost=said))
    render.explain(apb.ExplainReply(version=4, outcome="proposed", step_time="3.6 ms, fitted"))
    text = out.getvalue()
    assert f"copy cost: {said}" in text and text.count("copy cost:") == 1, text
