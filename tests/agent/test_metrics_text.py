"""agent/admin/metrics.py's page, without agents: the vectorised text of the window's series parses (prometheus-client's
parser) to exactly the counts a plain loop writes; concurrent scrapers share one render; the window's series are
rendered again only for a new window or head."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.admin import metrics
from controlplane.load import rank_load
from controlplane.table import RoutingTable
from controlplane.topology import Topology
from dataplane_shim.genesis import genesis_table
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import gossip_pb2 as gpb

L, E = 58, 256  # DeepSeek-V3
TOPO = Topology(3, 2, 48)
HEAD = genesis_table("static", TOPO, L, E)


class View:
    """A MetricsView over fixed values; `load` is the newest window (replace it for a new one)."""

    def __init__(self, load: np.ndarray | None) -> None:
        self.load = load

    def head(self) -> RoutingTable:
        return HEAD

    def member_states(self) -> list[gpb.MemberState]:
        return [gpb.MemberState(node_id=f"node{i}", status=gpb.ALIVE) for i in (1, 2, 3)]

    def peer_versions(self) -> dict[str, int]:
        return {"node2": 1, "node3": 1}

    def health(self) -> str:
        return "SERVING"

    def window_seq(self) -> int:
        return 7

    def imbalance_history(self) -> list[float]:
        return [1.25]

    def cluster_load(self) -> np.ndarray | None:
        return self.load

    def rank_installs(self) -> list[apb.RankInstall]:
        return [apb.RankInstall(rank=0, installed_version=1, report_age_s=0.5, installed_age_s=2.0)]

    def seconds_since_commit(self) -> float:
        return 3.5

    def paused(self) -> bool:
        return False

    def decision_outcomes(self) -> dict[str, int]:
        return {"BELOW_THETA": 5}

    def bytes_moved(self) -> int:
        return 0

    def plan_stats(self) -> tuple[int, float, float]:
        return (0, 0.0, 0.0)

    def reports_dropped(self) -> int:
        return 0

    def reports_unsampled(self) -> int:
        return 0

    def partial_windows(self) -> int:
        return 0

    def reports_refused(self) -> dict[str, int]:
        return {}

    def control_refusals(self) -> dict[str, int]:
        return {"CONTROL_NOT_WRITER": 2, "CONTROL_WRITER_UNSIGNED": 1}

    def windows_refused(self) -> dict[str, int]:
        return {"stale_incarnation": 3, "unsigned": 0}


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    th = threading.Thread(target=lp.run_forever, daemon=True)
    th.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    th.join(5)
    lp.close()


def _samples(text: bytes) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_text_rows_writes_integers_in_decimal_and_refuses_negatives() -> None:
    values = np.array([0, 7, 10, 99, 100, 2**32 - 1, 2**64 - 1], dtype=np.uint64)
    assert metrics.text_rows([b"v=", values, b"\n"]) == b"".join(b"v=%d\n" % v for v in values.tolist())
    assert metrics.text_rows([b"x", np.zeros(0, np.int64)]) == b""
    with pytest.raises(ValueError, match="least -1"):
        metrics.text_rows([b"x", np.array([3, -1])])


def test_the_window_series_parse_to_the_counts_a_plain_loop_writes(loop: asyncio.AbstractEventLoop) -> None:
    counts = np.random.default_rng(1).integers(0, 2**40, (L, E)).astype(np.uint64)
    counts[0, 0], counts[3, 5] = 0, 2**52  # (sums below 2^53: exact as the parser's floats)
    pages = metrics.Pages(View(counts), loop, per_expert=True)
    got = _samples(pages.page())
    want = {(("expert", str(e)), ("layer", str(layer))): float(counts[layer, e]) for layer in range(L) for e in range(E)}
    assert got["emoe_expert_tokens"] == want
    assert got["emoe_layer_tokens"] == {(("layer", str(layer)),): float(n) for layer, n in
                                        enumerate(counts.astype(np.int64).sum(axis=1).tolist())}
    ranks = rank_load(HEAD, counts.astype(np.int64)[None])[0].sum(axis=0)
    assert got["emoe_rank_tokens"] == {(("rank", str(r)),): float(n) for r, n in enumerate(ranks.tolist())}
    assert got["emoe_window_seq"] == {(): 7.0} and got["emoe_members"][(("status", "alive"),)] == 3.0
    assert got["emoe_control_refused_total"] == {(("code", "CONTROL_NOT_WRITER"),): 2.0,
                                                 (("code", "CONTROL_WRITER_UNSIGNED"),): 1.0}
    assert got["emoe_windows_refused_total"] == {(("reason", "stale_incarnation"),): 3.0, (("reason", "unsigned"),): 0.0}
    # off by default, and before the first window: the layer and rank families, with no series
    assert "emoe_expert_tokens" not in _samples(metrics.Pages(View(counts), loop, per_expert=False).page())
    empty = _samples(metrics.Pages(View(None), loop, per_expert=True).page())
    assert "emoe_layer_tokens" not in empty and "emoe_expert_tokens" not in empty and "emoe_window_seq" in empty


def test_concurrent_scrapers_share_one_render_and_a_window_is_rendered_once(
        loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch) -> None:
    view = View(np.ones((L, E), np.uint64))
    pages = metrics.Pages(view, loop, per_expert=True)
    got: list[bytes] = []
    threads = [threading.Thread(target=lambda: got.append(pages.page())) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert len(got) == 8 and len(set(got)) == 1 and pages.renders == 1 and pages.window_renders == 1
    monkeypatch.setattr(metrics, "REFRESH_S", 0.0)  # every scrape takes a snapshot from here
    pages.page()
    pages.page()
    assert pages.renders == 3 and pages.window_renders == 1  # the same window: its series not rendered again
    view.load = np.full((L, E), 2, np.uint64)  # a new window
    assert _samples(pages.page())["emoe_expert_tokens"][(("expert", "0"), ("layer", "0"))] == 2.0
    assert pages.renders == 4 and pages.window_renders == 2
