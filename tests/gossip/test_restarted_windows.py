"""A node's window that holds only part of some rank's steps is not published (issue 49, finding 5, found by the
kill/restart soak, chaos/soak.py): an agent killed and restarted beside serving engines hears its ranks' links
again mid-window (their reports while it was down went nowhere), so its first window holds half of its ranks'
steps. Published, it read as those ranks half idle: at e7b8dc9 the soak's survivors committed a 205-operation
rebalance on it (trigger "step imbalance 1.272", the real one 1.13-1.15) and its rollback 2 s later."""

from __future__ import annotations

import numpy as np

from agent.link.loadpath import LoadPath, LocalWindows
from agent.link.reportguard import DEFAULT_MAX_BATCH_TOKENS, ReportGuard
from controlplane.topology import Topology
from dataplane_shim.link import make_load_report

L, E, W = 1, 4, 10
LOAD = np.array([[10, 10, 10, 10]], np.uint32)  # each rank's tokens in each report of 5 steps


class _Gossip:
    def __init__(self) -> None:
        self.published: list[tuple[int, list[list[int]]]] = []

    def suspect_ranks(self, ranks: object) -> list[str]:
        return []

    def publish_window(self, window_seq: int, first_step: int, steps: int, counts: np.ndarray, learner: bool = False,
                       samples: object = None, sample_every: int = 0, step_us: object = None,
                       step_version: object = None, stride_us: object = None) -> None:
        self.published.append((window_seq, counts.tolist()))

    def live_nodes(self) -> list[str]:
        return ["n1"]


def test_a_window_a_shim_reported_only_part_of_is_named_short() -> None:
    lw = LocalWindows(L, E, window=W)
    closed = []
    for first in (5, 10, 15, 20):  # both joined mid-window 0; window 0 closes as a report reaches window 2
        closed += lw.add("a", first, 5, LOAD) + lw.add("b", first, 5, LOAD)
    assert [(w.seq, w.short) for w in closed] == [(0, ("a", "b")), (1, ())]
    assert closed[1].counts.tolist() == [[40, 40, 40, 40]]


def test_a_restarted_agent_publishes_no_window_its_ranks_came_back_in_the_middle_of() -> None:
    """Ranks 0 and 1 serve at steps 25..; their agent (re)starts and hears them from step 25, mid-window 2 (W = 10
    steps, a report every 5): window 2 holds 5 of its 10 steps, so it is withheld; windows 3 and 4 are whole and
    published with both ranks' load (40 tokens an expert: 2 ranks x 2 reports x 10)."""
    g = _Gossip()
    closed: list[int] = []
    path = LoadPath("n1", Topology(1, 2, 4), L, E, W, g, lambda seq, *_: closed.append(seq), lambda r, v: None,
                    lambda: "", ReportGuard([0, 1], 2, 2, DEFAULT_MAX_BATCH_TOKENS, lambda: 1))
    for first in range(25, 55, 5):
        for rank in (0, 1):
            path.on_report(make_load_report(f"rank{rank}", rank, first, 5, 1, LOAD))
    assert g.published == [(3, [[40, 40, 40, 40]]), (4, [[40, 40, 40, 40]])]
    assert path.withheld == 1
    assert 2 not in closed  # nor decided on by this node as its own (its cluster window lacks it)
