"""Prometheus metrics of one agent (`[metrics] listen`, off by default), served by prometheus-client.

A scrape takes one snapshot of the agent's read-only AdminView on the agent's event loop (the HTTP server runs
on a thread of its own; reading the agent's state from there could see it mid-change), then renders it:

    emoe_committed_version                 the committed routing-table version this agent holds
    emoe_serving                           1 while SERVING (health), else 0
    emoe_rebalancing_paused                1 while the cluster's pause switch, as this agent knows it, says paused
    emoe_window_seq                        the newest closed cluster window
    emoe_step_imbalance                    its mean step imbalance under the table then committed (absent before
                                           one; what `emoe status` shows)
    emoe_seconds_since_commit              since this agent learned its newest commit (or started, before one)
    emoe_members{status}                   members by SWIM status (alive, suspect, dead, left)
    emoe_member_committed_version{member}  the committed version each member last reported
    emoe_layer_tokens{layer}               the newest window's tokens per MoE layer
    emoe_rank_tokens{rank}                 ... per EP rank under the committed table (its replicas' share)
    emoe_expert_tokens{layer,expert}       ... per logical expert (`[metrics] per_expert = true`: L x E series)
    emoe_rank_installed_version{rank}      the version each of this node's engine ranks runs (its reports)
    emoe_rank_install_lag_seconds{rank}    how long it has been behind the committed version (0: not behind)
    emoe_rank_report_age_seconds{rank}     since its last load report (absent: never reported)
    emoe_rank_installed_age_seconds{rank}  since its last install (how long it has run its version)
    emoe_decisions_total{outcome}          the controller's decisions by outcome (PROPOSED, BELOW_THETA, ...)
    emoe_plans_total                       plans this agent computed: rebalances (its turn), repairs, rollbacks, fills
    emoe_plan_seconds_total                ... their wall seconds (computed off the event loop: agent.offloop)
    emoe_plan_last_seconds                 the last one's (absent before one)
    emoe_moved_bytes_total                 weight bytes the commits this agent learned copy
    emoe_reports_dropped_total             load reports this node's engines dropped (agent slow or absent)
    emoe_reports_unsampled_total           load reports used for their totals only (no or mismatched samples)
    emoe_reports_refused_total{reason}     load reports refused by code (agent.reportguard: rank_not_here, ...)
    emoe_partial_windows_total             cluster windows closed without a lagging node's load: not decided on
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from controlplane.load import rank_load
from controlplane.table import RoutingTable
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import gossip_pb2 as gpb


class MetricsView(Protocol):
    """What the metrics read (agent.adminview.AdminView)."""

    def head(self) -> RoutingTable: ...

    def member_states(self) -> list[gpb.MemberState]: ...

    def peer_versions(self) -> dict[str, int]: ...

    def health(self) -> str: ...

    def window_seq(self) -> int: ...

    def imbalance_history(self) -> list[float]: ...

    def cluster_load(self) -> npt.NDArray[Any] | None: ...

    def rank_installs(self) -> list[apb.RankInstall]: ...

    def seconds_since_commit(self) -> float: ...

    def paused(self) -> bool: ...

    def decision_outcomes(self) -> dict[str, int]: ...

    def bytes_moved(self) -> int: ...

    def plan_stats(self) -> tuple[int, float, float]: ...

    def reports_dropped(self) -> int: ...

    def reports_unsampled(self) -> int: ...

    def reports_refused(self) -> dict[str, int]: ...

    def partial_windows(self) -> int: ...


@dataclass
class Snapshot:
    version: int
    serving: bool
    paused: bool
    window_seq: int
    imbalance: float | None
    since_commit: float
    members: Counter[str]
    peer_versions: dict[str, int]
    layer_tokens: list[float] = field(default_factory=list)
    rank_tokens: list[float] = field(default_factory=list)
    expert_tokens: npt.NDArray[np.float64] | None = None
    ranks: list[apb.RankInstall] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    bytes_moved: int = 0
    dropped: int = 0
    unsampled: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    partial: int = 0
    plans: tuple[int, float, float] = (0, 0.0, 0.0)  # planned, their seconds, the last one's


def snapshot(view: MetricsView, per_expert: bool) -> Snapshot:
    head = view.head()
    load = view.cluster_load()
    hist = view.imbalance_history()
    s = Snapshot(head.version, view.health() == "SERVING", view.paused(), view.window_seq(), hist[-1] if hist else None,
                 view.seconds_since_commit(),
                 Counter(gpb.MemberStatus.Name(m.status).lower() for m in view.member_states()),
                 dict(view.peer_versions()), ranks=list(view.rank_installs()), outcomes=view.decision_outcomes(),
                 bytes_moved=view.bytes_moved(), dropped=view.reports_dropped(), unsampled=view.reports_unsampled(),
                 plans=view.plan_stats(), partial=view.partial_windows(), refused=view.reports_refused())
    if load is not None:
        counts = np.asarray(load, dtype=np.int64)
        s.layer_tokens = counts.sum(axis=1).astype(np.float64).tolist()
        s.rank_tokens = rank_load(head, counts[None])[0].sum(axis=0).astype(np.float64).tolist()
        if per_expert:
            s.expert_tokens = counts.astype(np.float64)
    return s


def families(s: Snapshot) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def one(name: str, doc: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, value=value)

    yield one("emoe_committed_version", "The committed routing-table version this agent holds", s.version)
    yield one("emoe_serving", "1 while the agent is SERVING", float(s.serving))
    yield one("emoe_rebalancing_paused", "1 while the cluster's pause switch, as this agent knows it, says paused", float(s.paused))
    yield one("emoe_window_seq", "The newest closed cluster window", s.window_seq)
    if s.imbalance is not None:
        yield one("emoe_step_imbalance", "Mean step imbalance of the newest window, as emoe status shows it",
                  s.imbalance)
    yield one("emoe_seconds_since_commit", "Seconds since this agent learned its newest commit", s.since_commit)
    m = GaugeMetricFamily("emoe_members", "Cluster members by SWIM status", labels=["status"])
    for status in ("alive", "suspect", "dead", "left"):
        m.add_metric([status], s.members.get(status, 0))
    yield m
    pv = GaugeMetricFamily("emoe_member_committed_version", "Committed version each member last reported",
                           labels=["member"])
    for member, version in sorted(s.peer_versions.items()):
        pv.add_metric([member], version)
    yield pv
    lt = GaugeMetricFamily("emoe_layer_tokens", "Tokens per MoE layer in the newest window", labels=["layer"])
    for layer, tokens in enumerate(s.layer_tokens):
        lt.add_metric([str(layer)], tokens)
    yield lt
    rt = GaugeMetricFamily("emoe_rank_tokens", "Tokens per EP rank in the newest window, under the committed table",
                           labels=["rank"])
    for rank, tokens in enumerate(s.rank_tokens):
        rt.add_metric([str(rank)], tokens)
    yield rt
    if s.expert_tokens is not None:
        et = GaugeMetricFamily("emoe_expert_tokens", "Tokens per logical expert in the newest window",
                               labels=["layer", "expert"])
        for (layer, expert), n in np.ndenumerate(s.expert_tokens):
            et.add_metric([str(layer), str(expert)], float(n))
        yield et
    iv = GaugeMetricFamily("emoe_rank_installed_version", "Version each engine rank of this node runs",
                           labels=["rank"])
    lag = GaugeMetricFamily("emoe_rank_install_lag_seconds", "Seconds an engine rank has been behind the "
                            "committed version", labels=["rank"])
    age = GaugeMetricFamily("emoe_rank_report_age_seconds", "Seconds since an engine rank's last load report",
                            labels=["rank"])
    held = GaugeMetricFamily("emoe_rank_installed_age_seconds", "Seconds an engine rank has run its installed "
                             "version (since its last install)", labels=["rank"])
    for r in s.ranks:
        if r.installed_version:
            iv.add_metric([str(r.rank)], r.installed_version)
        lag.add_metric([str(r.rank)], r.lag_s)
        if r.report_age_s >= 0:
            age.add_metric([str(r.rank)], r.report_age_s)
        if r.installed_age_s >= 0:
            held.add_metric([str(r.rank)], r.installed_age_s)
    yield from (iv, lag, age, held)
    dec = CounterMetricFamily("emoe_decisions", "The controller's decisions since start, by outcome",
                              labels=["outcome"])
    for outcome, count in sorted(s.outcomes.items()):
        dec.add_metric([outcome], count)
    yield dec
    yield CounterMetricFamily("emoe_plans", "Plans this agent computed: rebalances, repairs, rollbacks, fills",
                              value=s.plans[0])
    yield CounterMetricFamily("emoe_plan_seconds", "Wall seconds this agent spent computing plans", value=s.plans[1])
    if s.plans[0]:
        yield one("emoe_plan_last_seconds", "Wall seconds of this agent's last plan", s.plans[2])
    yield CounterMetricFamily("emoe_moved_bytes", "Weight bytes the commits this agent learned copy",
                              value=s.bytes_moved)
    yield CounterMetricFamily("emoe_reports_dropped", "Load reports this node's engines dropped before sending",
                              value=s.dropped)
    yield CounterMetricFamily("emoe_reports_unsampled", "Load reports used for their totals only", value=s.unsampled)
    ref = CounterMetricFamily("emoe_reports_refused", "Load reports this node's shim link refused, by code",
                              labels=["reason"])
    for code, count in sorted(s.refused.items()):
        ref.add_metric([code], count)
    yield ref
    yield CounterMetricFamily("emoe_partial_windows", "Cluster windows closed without a lagging live node's load, "
                              "not decided on", value=s.partial)


class _Collector:
    """A prometheus-client collector that snapshots the view on the agent's loop at each scrape."""

    def __init__(self, view: MetricsView, loop: asyncio.AbstractEventLoop, per_expert: bool) -> None:
        self.view, self.loop, self.per_expert = view, loop, per_expert

    def collect(self) -> Iterator[Any]:
        async def take() -> Snapshot:
            return snapshot(self.view, self.per_expert)

        s = asyncio.run_coroutine_threadsafe(take(), self.loop).result(timeout=5.0)
        yield from families(s)


class MetricsServer:
    """The /metrics HTTP endpoint on its own thread; `close()` stops it."""

    def __init__(self, listen: str, view: MetricsView, loop: asyncio.AbstractEventLoop, per_expert: bool) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        host, _, port = listen.rpartition(":")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(view, loop, per_expert))
        self.server, self.thread = start_http_server(int(port), addr=host.strip("[]"), registry=registry)
        self.port = int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
