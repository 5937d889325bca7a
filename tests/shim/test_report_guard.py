"""agent.link.reportguard, pure: each bound of a shim report by its code, at and past its edge; the plugin's own reports
(dataplane_shim.plugin.PluginCore, declaring its batch or not) within them. The same bounds on a real agent's
socket: tests/shim/test_implausible_reports.py."""

from __future__ import annotations

import numpy as np
import pytest

from agent.link.reportguard import DEFAULT_MAX_BATCH_TOKENS, MAX_BATCH_TOKENS, Refusal, ReportGuard
from controlplane.topology import Topology
from dataplane_shim.genesis import genesis_table
from dataplane_shim.link import make_load_report
from dataplane_shim.plugin import PluginCore
from elasticmoe.v1 import dataplane_pb2 as dpb

L, E, TOP_K, HEAD = 2, 8, 2, 5
MINE = (2, 3)  # this node's ranks, of 3 nodes x 2


def guard(batch: int = DEFAULT_MAX_BATCH_TOKENS) -> ReportGuard:
    return ReportGuard(MINE, 6, TOP_K, batch, lambda: HEAD)


def ones(c: int = 1) -> np.ndarray:
    return np.full((L, E), c, np.uint32)


def judged(r: dpb.LoadReport, batch: int = DEFAULT_MAX_BATCH_TOKENS) -> tuple[Refusal | None, str]:
    g = guard(batch)
    got = g.check(r)
    counted = {k: n for k, n in g.refused.items() if n}
    assert counted == ({} if got is None else {got.code: 1})  # one count, under its code
    return (None, "") if got is None else (got.code, got.why)


@pytest.mark.parametrize("rank, code", [(2, None), (3, None), (-1, Refusal.RANK_NOT_HERE), (0, Refusal.RANK_NOT_HERE),
                                        (4, Refusal.RANK_NOT_HERE), (2**31 - 1, Refusal.RANK_NOT_HERE)])
def test_ranks_are_this_nodes(rank: int, code: Refusal | None) -> None:
    got, why = judged(dpb.LoadReport(shim_id="s", rank=rank, first_step=0, steps=1, version=1, layers=L, experts=E,
                                     counts=ones().tobytes()))
    assert got is code and (code is None or f"rank = {rank}" in why), why


@pytest.mark.parametrize("version, code", [(0, None), (1, None), (HEAD, None), (HEAD + 1, Refusal.VERSION_AHEAD),
                                           (2**64 - 1, Refusal.VERSION_AHEAD)])
def test_versions_are_at_most_the_committed_head(version: int, code: Refusal | None) -> None:
    got, why = judged(make_load_report("s", 2, 0, 1, version, ones()))
    assert got is code and (code is None or f"version = {version}" in why and str(HEAD) in why), why


@pytest.mark.parametrize("steps", [1, 7])
def test_an_experts_count_is_at_most_the_batch_each_step(steps: int) -> None:
    c = ones()
    c[1, 5] = 100 * steps
    assert judged(make_load_report("s", 2, 0, steps, 1, c, max_batch_tokens=100)) == (None, "")
    c[1, 5] += 1
    got, why = judged(make_load_report("s", 2, 0, steps, 1, c, max_batch_tokens=100))
    assert got is Refusal.COUNT_ABOVE_BATCH and f"counts[1, 5] = {100 * steps + 1}" in why, why
    assert "declared max_batch_tokens 100" in why


def test_a_layers_sum_is_at_most_batch_x_top_k_each_step() -> None:
    c = np.zeros((L, E), np.uint32)
    c[0, :4] = 50  # 4 x 50 = 100 x top_k 2
    assert judged(make_load_report("s", 2, 0, 1, 1, c, max_batch_tokens=100)) == (None, "")
    c[0, 4] = 1
    got, why = judged(make_load_report("s", 2, 0, 1, 1, c, max_batch_tokens=100))
    assert got is Refusal.LAYER_ABOVE_BATCH and "sum of counts[0, :] = 201" in why, why


def test_the_default_bound_refuses_2_to_the_32_in_one_step_and_any_window_of_the_default_length() -> None:
    c = ones()
    c[0, 0] = 2**32 - 1
    for steps in (1, 100, 255):
        got, why = judged(make_load_report("s", 2, 0, steps, 1, c))
        assert got is Refusal.COUNT_ABOVE_BATCH and "engine.max_batch_tokens" in why, why
    c[0, 0] = DEFAULT_MAX_BATCH_TOKENS  # a whole default batch on one expert in one step: possible
    assert judged(make_load_report("s", 2, 0, 1, 1, c)) == (None, "")


def test_an_operators_bound_applies_where_the_engine_declares_none() -> None:
    c = np.zeros((L, E), np.uint32)
    c[1, 1] = 11
    got, _ = judged(make_load_report("s", 2, 0, 1, 1, c), batch=10)
    assert got is Refusal.COUNT_ABOVE_BATCH
    assert judged(make_load_report("s", 2, 0, 1, 1, c, max_batch_tokens=11), batch=10) == (None, "")


def test_a_declared_batch_past_any_engines_is_refused() -> None:
    assert judged(make_load_report("s", 2, 0, 1, 1, ones(), max_batch_tokens=MAX_BATCH_TOKENS)) == (None, "")
    got, why = judged(make_load_report("s", 2, 0, 1, 1, ones(), max_batch_tokens=MAX_BATCH_TOKENS + 1))
    assert got is Refusal.BATCH_IMPLAUSIBLE and f"max_batch_tokens = {MAX_BATCH_TOKENS + 1}" in why, why


def test_each_sampled_step_is_bounded_as_one_step() -> None:
    rows = np.stack([ones(), ones()])  # steps 0 and 5 of 0..9, sample_every 5
    assert judged(make_load_report("s", 2, 0, 10, 1, ones(10), samples=rows, sample_every=5,
                                   max_batch_tokens=10)) == (None, "")
    rows[1, 1, 2] = 11  # within the totals' 10 x 10 steps, past one step's batch
    got, why = judged(make_load_report("s", 2, 0, 10, 1, ones(10), samples=rows, sample_every=5,
                                       max_batch_tokens=10))
    assert got is Refusal.COUNT_ABOVE_BATCH and "samples[1, 1, 2] = 11" in why, why
    rows[1, 1, 2] = 1
    rows[0, 0, :] = 3  # 8 x 3 = 24 > 10 x top_k 2
    got, why = judged(make_load_report("s", 2, 0, 10, 1, ones(10), samples=rows, sample_every=5,
                                       max_batch_tokens=10))
    assert got is Refusal.LAYER_ABOVE_BATCH and "sum of samples[0, 0, :] = 24" in why, why


@pytest.mark.parametrize("unreachable, code", [([0, 5], None), ([6], Refusal.UNREACHABLE_NOT_EP),
                                               ([1, 2**31 - 1], Refusal.UNREACHABLE_NOT_EP)])
def test_unreachable_ranks_are_ep_ranks_of_the_cluster(unreachable: list[int], code: Refusal | None) -> None:
    got, why = judged(make_load_report("s", 2, 0, 0, 1, np.zeros((L, E), np.uint32), unreachable_ranks=unreachable))
    assert got is code and (code is None or "unreachable_ranks" in why), why


class _Link:
    def __init__(self) -> None:
        self.sent: list[dpb.LoadReport] = []
        self.dropped = self.next_step = 0

    def drain(self) -> list[object]:
        return []

    def offer(self, report: dpb.LoadReport) -> None:
        self.sent.append(report)

    def go_on_from(self, step: int) -> None: ...

    def report(self, report: dpb.LoadReport, timeout: float) -> object:
        self.sent.append(report)
        return None


@pytest.mark.parametrize("declared", [0, 64])
def test_the_plugins_own_reports_are_within_every_bound(declared: int) -> None:
    """A rank serving batches of up to 64 tokens, each picking TOP_K distinct experts a layer, sampled."""
    topo = Topology(3, 2, 4)
    link = _Link()
    core = PluginCore(link, topo, L, E, 3, genesis_table("static", topo, L, E).phy2log,  # type: ignore[arg-type]
                      genesis="static", report_every=25, sample_every=10, max_batch_tokens=declared)
    rng = np.random.default_rng(0)
    for _ in range(100):
        c = np.zeros((L, E), np.int64)
        for layer in range(L):
            for _token in range(int(rng.integers(0, 65))):
                c[layer, rng.choice(E, TOP_K, replace=False)] += 1
        core.add_load(c, 1, c[None] if core.is_sampled(0) else np.zeros((0, L, E), np.int64))
        core.maybe_report()
    core.peer_unreachable(0)
    core.report_evidence()
    assert len(link.sent) == 5 and all(r.max_batch_tokens == declared for r in link.sent)
    g = guard()
    assert [g.check(r) for r in link.sent] == [None] * 5 and not any(g.refused.values())


@pytest.mark.parametrize("us, code", [(1, None), (1_350_000, None), (600_000_000, None),
                                      (0, Refusal.STEP_TIME_IMPLAUSIBLE), (600_000_001, Refusal.STEP_TIME_IMPLAUSIBLE),
                                      (2**32 - 1, Refusal.STEP_TIME_IMPLAUSIBLE)])
def test_a_sampled_steps_wall_time_is_more_than_nothing_and_at_most_ten_minutes(us: int, code: Refusal | None) -> None:
    rows = np.stack([ones(), ones()])
    r = make_load_report("s", 2, 0, 4, 1, ones(4), samples=rows, sample_every=2, step_us=[700, us])
    got, why = judged(r)
    assert got is code and (code is None or f"step_us[1] = {us}" in why), why
    r = make_load_report("s", 2, 0, 4, 1, ones(4), samples=rows, sample_every=2, step_us=[700, 700],
                         stride_us=[700, us])  # a stride's mean, the same bounds
    got, why = judged(r)
    assert got is code and (code is None or f"stride_us[1] = {us}" in why), why
