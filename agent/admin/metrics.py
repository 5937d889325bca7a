"""Prometheus metrics of one agent (`[metrics] listen`, off by default), served as cached text.

A scrape never makes the agent render its metrics anew: the page is rendered at most once a second (REFRESH_S),
whatever the number of scrapers, and every scraper in between is served the same bytes. A page takes one
snapshot of the agent's read-only AdminView on the agent's event loop (the HTTP server runs on threads of its
own; reading the agent's state from there could see it mid-change), then renders it on the scraper's thread:
the small families through prometheus-client, and the newest window's families (per layer, per rank and, with
`[metrics] per_expert = true`, L x E series per expert: 14,848 at DeepSeek-V3 shape) once per new window or new
committed table, by `text_rows`, a vectorised kernel (no Python loop over series). Concurrent scrapers share one
render: the first renders while the others wait for its page. So scrapers cost the agent one small snapshot a
second and one render of the expert series a window, never the GIL for long (at 67b8e70 each of 8 concurrent
scrapers rendered 14,944 series through prometheus-client, ~100 ms of Python each, and the event loop starved
until peers suspected the agent; tests/agent/test_metrics_scrapers.py). Values are at most REFRESH_S old.

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
    emoe_plan_seconds_total                ... their wall seconds (computed off the event loop: agent.decision.offloop)
    emoe_plan_last_seconds                 the last one's (absent before one)
    emoe_moved_bytes_total                 weight bytes the commits this agent learned copy
    emoe_reports_dropped_total             load reports this node's engines dropped (agent slow or absent)
    emoe_reports_unsampled_total           load reports used for their totals only (no or mismatched samples)
    emoe_reports_refused_total{reason}     load reports refused by code (agent.link.reportguard: rank_not_here, ...)
    emoe_partial_windows_total             windows without a lagging or absent node's load: not decided on
    emoe_control_refused_total{code}       control records (pause/resume) this agent refused, by ControlRefusal code
    emoe_windows_refused_total{reason}     peers' load windows refused by code (agent.gossip.windowguard: unsigned,
                                           stale_incarnation, ...)
"""

from __future__ import annotations

import asyncio
import gzip
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from controlplane.load import rank_load
from controlplane.table import RoutingTable
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import gossip_pb2 as gpb

# A page is served to every scraper for this long before the next scrape takes a new snapshot: the agent pays
# one snapshot and one small render a second however many scrape (Prometheus scrapes every 15-60 s, so a
# value a second old is below its resolution), and the expert series are rendered again only for a new window.
REFRESH_S = 1.0
SNAPSHOT_TIMEOUT_S = 5.0  # an event loop that cannot take a snapshot within this: the scrape gets a 503
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricsView(Protocol):
    """What the metrics read (agent.admin.adminview.AdminView)."""

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

    def control_refusals(self) -> dict[str, int]: ...

    def windows_refused(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class Window:
    """The newest window's load, copied on the loop: counts int64 [L, E] (None before the first window) and
    the committed table its rank shares are counted under."""

    counts: npt.NDArray[np.int64] | None
    head: RoutingTable


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
    ranks: list[apb.RankInstall] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    bytes_moved: int = 0
    dropped: int = 0
    unsampled: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    partial: int = 0
    plans: tuple[int, float, float] = (0, 0.0, 0.0)  # planned, their seconds, the last one's
    control_refused: dict[str, int] = field(default_factory=dict)  # by ControlRefusal name
    windows_refused: dict[str, int] = field(default_factory=dict)  # by windowguard.Refusal value
    window: Window | None = None  # a window or head other than the last page's (None: the same)


def snapshot(view: MetricsView, seen: tuple[object, object] | None = None) -> tuple[Snapshot, tuple[object, object]]:
    """The view now, on the agent's loop, and the (newest window, head) objects it held. `seen`: those of the
    last page; the window is copied into the snapshot only when either changed (windows and tables are
    replaced, never changed in place)."""
    head = view.head()
    load = view.cluster_load()
    hist = view.imbalance_history()
    s = Snapshot(head.version, view.health() == "SERVING", view.paused(), view.window_seq(), hist[-1] if hist else None,
                 view.seconds_since_commit(),
                 Counter(gpb.MemberStatus.Name(m.status).lower() for m in view.member_states()),
                 dict(view.peer_versions()), ranks=list(view.rank_installs()), outcomes=view.decision_outcomes(),
                 bytes_moved=view.bytes_moved(), dropped=view.reports_dropped(), unsampled=view.reports_unsampled(),
                 plans=view.plan_stats(), partial=view.partial_windows(), refused=view.reports_refused())
    s.control_refused = view.control_refusals()
    s.windows_refused = view.windows_refused()
    if seen is None or seen[0] is not load or seen[1] is not head:
        s.window = Window(None if load is None else np.array(load, dtype=np.int64), head)
    return s, (load, head)


def families(s: Snapshot) -> Iterator[Any]:
    """The families of one snapshot but the window's (window_text)."""
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
    cr = CounterMetricFamily("emoe_control_refused", "Control records (pause/resume) this agent refused, by code "
                             "(consensus.proto ControlRefusal: CONTROL_NOT_WRITER, CONTROL_UNKNOWN_WRITER, ...)",
                             labels=["code"])
    for code, count in sorted(s.control_refused.items()):
        cr.add_metric([code], count)
    yield cr
    wr = CounterMetricFamily("emoe_windows_refused", "Peers' load windows this agent refused, by code "
                             "(agent.gossip.windowguard: unsigned, bad_signature, stale_incarnation, ...)", labels=["reason"])
    for code, count in sorted(s.windows_refused.items()):
        wr.add_metric([code], count)
    yield wr
    yield CounterMetricFamily("emoe_partial_windows", "Cluster windows closed without a lagging or absent node's "
                              "load, not decided on", value=s.partial)


def text_rows(parts: Sequence[bytes | npt.NDArray[np.integer]]) -> bytes:
    """Rows of text, vectorised: each part is a constant (bytes, the same in every row) or integers >= 0 [N],
    one per row, in decimal; returns the N rows' bytes, concatenated. Each row is a fixed-width uint8 block of
    its parts (an integer right-aligned in its column's widest width) and a mask of the bytes it uses."""
    ints = [np.asarray(p) for p in parts if not isinstance(p, bytes)]
    if not ints:
        raise ValueError("text_rows needs one integer column at least")
    n = len(ints[0])
    blocks: list[npt.NDArray[np.uint8]] = []
    masks: list[npt.NDArray[np.bool_]] = []
    for p in parts:
        if isinstance(p, bytes):
            blocks.append(np.broadcast_to(np.frombuffer(p, np.uint8), (n, len(p))))
            masks.append(np.ones((n, len(p)), np.bool_))
            continue
        v = np.asarray(p)
        if v.shape != (n,) or (v.size and int(v.min()) < 0):
            raise ValueError(f"text_rows: an integer column of shape {v.shape}, least {v.min() if v.size else '-'}: "
                             f"expected [{n}], >= 0")
        v = v.astype(np.uint64)
        width = len(str(int(v.max()))) if n else 1
        pow10 = np.uint64(10) ** np.arange(width - 1, -1, -1, dtype=np.uint64)  # [width]
        blocks.append(((v[:, None] // pow10) % np.uint64(10) + np.uint64(ord("0"))).astype(np.uint8))
        masks.append((v[:, None] >= pow10) | (pow10 == 1))  # no leading zeros; 0 is "0"
    rows, used = np.concatenate(blocks, axis=1), np.concatenate(masks, axis=1)
    return bytes(rows[used].tobytes())


def _family(name: str, doc: str, labels: Sequence[tuple[str, npt.NDArray[np.integer]]],
            values: npt.NDArray[np.integer]) -> bytes:
    """A gauge family's text (`# HELP`, `# TYPE`, one line a series), its label values and values integers."""
    head = f"# HELP {name} {doc}\n# TYPE {name} gauge\n".encode()
    if not values.size:
        return head
    parts: list[bytes | npt.NDArray[np.integer]] = []
    for i, (label, column) in enumerate(labels):
        parts += [f'{"," if i else name + "{"}{label}="'.encode(), column, b'"']
    return head + text_rows([*parts, b"} ", values, b"\n"])


def window_text(w: Window, per_expert: bool) -> bytes:
    """The newest window's families: tokens per layer, per rank (under w.head) and, `per_expert`, per expert."""
    if w.counts is None:
        layer = rank = np.zeros(0, np.int64)
    else:
        layer = w.counts.sum(axis=1)
        rank = rank_load(w.head, w.counts[None])[0].sum(axis=0)
    out = _family("emoe_layer_tokens", "Tokens per MoE layer in the newest window",
                  [("layer", np.arange(len(layer)))], layer)
    out += _family("emoe_rank_tokens", "Tokens per EP rank in the newest window, under the committed table",
                   [("rank", np.arange(len(rank)))], rank)
    if per_expert and w.counts is not None:
        layers, experts = w.counts.shape
        out += _family("emoe_expert_tokens", "Tokens per logical expert in the newest window",
                       [("layer", np.repeat(np.arange(layers), experts)), ("expert", np.tile(np.arange(experts), layers))],
                       w.counts.reshape(-1))
    return out


def render(s: Snapshot) -> bytes:
    """The text of `families(s)`, through prometheus-client (imported only when metrics are on)."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import Collector

    class Families(Collector):
        def collect(self) -> Iterator[Any]:
            return families(s)

    return generate_latest(Families())


class Pages:
    """The /metrics page, rendered at most once every REFRESH_S and shared by every scraper meanwhile; the
    window's families rendered once per new window or head."""

    def __init__(self, view: MetricsView, loop: asyncio.AbstractEventLoop, per_expert: bool) -> None:
        self.view, self.loop, self.per_expert = view, loop, per_expert
        self._lock = threading.Lock()  # one render at a time; the scrapers waiting for it take its page
        self._page = b""
        self._gzipped: bytes | None = None  # the page gzipped, once a scraper asked for it
        self._at = -float("inf")  # time.monotonic() of the page's snapshot
        self._seen: tuple[object, object] | None = None  # the (window, head) objects _window was rendered from
        self._window = b""
        self.renders = 0  # pages rendered (snapshots taken)
        self.window_renders = 0  # ... of which rendered the window's families anew

    def page(self, gzipped: bool = False) -> bytes:
        """The current page (gzip-compressed if `gzipped`). Raises TimeoutError when the agent's loop does not
        take the snapshot within SNAPSHOT_TIMEOUT_S."""
        with self._lock:
            if time.monotonic() - self._at >= REFRESH_S:
                seen = self._seen

                async def take() -> tuple[Snapshot, tuple[object, object]]:
                    return snapshot(self.view, seen)

                at = time.monotonic()
                s, self._seen = asyncio.run_coroutine_threadsafe(take(), self.loop).result(SNAPSHOT_TIMEOUT_S)
                if s.window is not None:
                    self._window = window_text(s.window, self.per_expert)
                    self.window_renders += 1
                self._page = render(s) + self._window
                self._gzipped, self._at = None, at
                self.renders += 1
            if not gzipped:
                return self._page
            if self._gzipped is None:
                self._gzipped = gzip.compress(self._page, compresslevel=1)  # (zlib lets go of the GIL)
            return self._gzipped


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily, pages: Pages) -> None:
        self.address_family, self.pages = family, pages  # (the socket is made with this family on __init__)
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    """GET (any path but /favicon.ico, as prometheus-client's server): the cached page."""

    server: _Server

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/favicon.ico":
            self.send_error(404)
            return
        gz = "gzip" in self.headers.get("Accept-Encoding", "").lower()
        try:
            body = self.server.pages.page(gz)
        except TimeoutError:
            self.send_error(503, f"the agent did not take a metrics snapshot within {SNAPSHOT_TIMEOUT_S} s")
            return
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        if gz:
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass  # a scrape a second from each scraper: not worth a log line


class MetricsServer:
    """The /metrics HTTP endpoint on threads of its own; `close()` stops it."""

    def __init__(self, listen: str, view: MetricsView, loop: asyncio.AbstractEventLoop, per_expert: bool) -> None:
        host, _, port = listen.rpartition(":")
        family, _, _, _, addr = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]  # (an IPv6 host: AF_INET6)
        self.pages = Pages(view, loop, per_expert)
        self.server = _Server((str(addr[0]), int(port)), family, self.pages)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, name="emoe-metrics", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
