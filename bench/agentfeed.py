"""The agents' load path, driven in-process for `emoe bench`: what a window of the trace becomes before the
decision path sees it.

Each node's engines report their load every `report_every` steps (dataplane_shim.link.make_load_report, with
the counts of the sampled steps, elasticmoe.loadcodec); the node's LoadPath (agent.link.loadpath) sums them into
its windows; each window goes out as gossip sends it (agent.gossip.windowform.make_window: serialized, parsed back,
checked and decoded as a receiving node does) to the deciding node, whose cluster windows (ClusterWindows)
sum the nodes' windows and hand each closed one to `close_window` (agent.decision.pipeline.DecisionPipeline). A node's
share of an expert's tokens is its share of the expert's replicas on active ranks (the engines split an
expert's tokens evenly over its replicas).

Not modelled here: gossip delay and loss (every window arrives before the next is fed), signatures (under
mTLS a window carries ~600 bytes more: `SIGNATURE_BYTES`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from statistics import median

import numpy as np
import numpy.typing as npt

from agent.gossip.windowform import check_windows, make_window, node_window
from agent.link.loadpath import LoadPath
from agent.link.reportguard import DEFAULT_MAX_BATCH_TOKENS, ReportGuard
from controlplane.table import RoutingTable
from controlplane.topology import Topology
from dataplane_shim.link import make_load_report
from dataplane_shim.plugin import REPORT_EVERY
from elasticmoe.loadcodec import sample_steps, stride_means
from elasticmoe.v1 import gossip_pb2 as gpb

# the engine's wall time of steps [S] (ms) served under a table: counts [S, L, E] -> [S]
StepModel = Callable[[RoutingTable, npt.NDArray[np.integer]], npt.NDArray[np.float64]]

# what mTLS adds to a window: an ECDSA P-256 signature (<= 72 bytes) and the node's DER certificate (~520)
SIGNATURE_BYTES = 600

CloseWindow = Callable[[int, npt.NDArray[np.uint64], npt.NDArray[np.uint32] | None, tuple[str, ...]], None]


def rank_shares(table: RoutingTable) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """([G, L, E] each rank's share of an expert's tokens: its replicas over the expert's replicas on active
    ranks (the engines split an expert's tokens evenly over its replicas); [L, E] the first rank holding it,
    which takes a rounding remainder and, for an expert with none on an active rank, all of it)."""
    held = (table.holders & table.active_mask[None, None, :]).astype(np.float64)  # [L, E, G]
    cnt = held.sum(axis=2, keepdims=True)
    first = np.argmax(held, axis=2)
    orphan = cnt[..., 0] == 0
    held[orphan, 0] = 1.0  # (argmax of all-zero is rank 0: the same rank)
    share: npt.NDArray[np.float64] = np.moveaxis(held / np.maximum(held.sum(axis=2, keepdims=True), 1.0), 2, 0)
    return share, first


def node_shares(table: RoutingTable) -> npt.NDArray[np.float64]:
    """[N, L, E]: the share of each expert's tokens that node n's engines serve (its ranks' `rank_shares`)."""
    topo = table.topology
    share, _ = rank_shares(table)
    out: npt.NDArray[np.float64] = share.reshape(topo.nodes, topo.ranks_per_node, *share.shape[1:]).sum(axis=1)
    return out


class _Loopback:
    """One node's gossip as its LoadPath sees it: its windows go, as bytes, to the deciding node."""

    def __init__(self, feed: LoadFeed, node: str) -> None:
        self.feed, self.node = feed, node

    def suspect_ranks(self, ranks: Iterable[int]) -> list[str]:
        return []

    def publish_window(self, window_seq: int, first_step: int, steps: int, counts: npt.NDArray[np.integer],
                       learner: bool = False, samples: npt.NDArray[np.uint32] | None = None,
                       sample_every: int = 0, step_us: npt.NDArray[np.uint32] | None = None,
                       step_version: npt.NDArray[np.uint32] | None = None,
                       stride_us: npt.NDArray[np.uint32] | None = None) -> None:
        w = make_window(self.node, 1, window_seq, first_step, steps, counts, learner, samples, sample_every, step_us,
                        step_version, stride_us)
        wire = w.SerializeToString()
        self.feed.window_bytes.append(len(wire))
        if self.node == self.feed.decider:
            return  # the deciding node's own window reaches its cluster windows directly (LoadPath.on_report)
        got = gpb.LoadWindow.FromString(wire)
        check_windows([got], (w.layers, w.experts))
        nw = node_window(got)
        self.feed.paths[self.feed.decider].on_window(self.node, nw.window_seq, nw.counts, nw.first_step, nw.steps,
                                                     nw.samples, nw.step_us, nw.step_version, nw.stride_us)

    def live_nodes(self) -> list[str]:
        return self.feed.nodes


class LoadFeed:
    """Every node's load path; `feed` plays a window of cluster counts through it."""

    def __init__(self, topo: Topology, layers: int, experts: int, window: int, sample_every: int,
                 close_window: CloseWindow, report_every: int = REPORT_EVERY, top_k: int = 0,
                 step_ms: StepModel | None = None) -> None:
        """`top_k`: the trace's, which bounds a layer's count per step with the batch (agent.link.reportguard); 0: the
        experts (a token picks each at most once). `step_ms(table, counts [S, L, E])`: the engine's wall time of
        each step in milliseconds [S], which the engines' reports carry for their sampled steps (LoadReport.step_us,
        and each one's stride's mean: stride_us; None: none)."""
        self.topo, self.window, self.sample_every, self.report_every = topo, window, sample_every, report_every
        self.step_ms = step_ms
        self.nodes = [f"n{i}" for i in range(topo.nodes)]
        self.decider = self.nodes[0]
        self.window_bytes: list[int] = []  # each node's window as gossip sends it, unsigned
        self.paths: dict[str, LoadPath] = {}
        self.head = 1  # the newest version fed (what the nodes committed, as far as their engines can tell)
        rpn = topo.ranks_per_node
        for i, n in enumerate(self.nodes):
            guard = ReportGuard(range(i * rpn, (i + 1) * rpn), topo.ranks, top_k or experts, DEFAULT_MAX_BATCH_TOKENS,
                                lambda: self.head)
            self.paths[n] = LoadPath(n, topo, layers, experts, window, _Loopback(self, n),
                                     close_window if n == self.decider else _nowhere, _nothing, _voting, guard,
                                     sample_every=sample_every)

    def feed(self, first: int, counts: npt.NDArray[np.integer], table: RoutingTable,
             served_ms: npt.NDArray[np.float64] | None = None, served_version: npt.ArrayLike | None = None) -> None:
        """Steps [first, first + len(counts)) of cluster counts [T, L, E], served under `table`: each node's
        engines report their share every `report_every` global steps. served_ms [T]: each step's time as the
        bench served it (copies in flight included), which the engines report through `step_ms.served` where
        the step model has one; else the step model's time under `table`. served_version [T]: the table version
        each step ran on (an older one while `table`'s copies were in flight); a plugin reports the steps before
        an install apart from those after it (dataplane_shim.plugin flushes before it installs), so a report
        splits where the version changes. None: all on `table`."""
        shares = node_shares(table)
        self.head = max(self.head, table.version)
        end = first + counts.shape[0]
        ran = (np.full(end - first, table.version, dtype=np.int64) if served_version is None
               else np.asarray(served_version, dtype=np.int64).reshape(-1))
        if ran.shape != (end - first,):
            raise ValueError(f"served_version of {ran.shape[0]} steps: expected {end - first}")
        at = first
        while at < end:
            nxt = min(end, (at // self.report_every + 1) * self.report_every)
            changes = np.flatnonzero(ran[at - first + 1:nxt - first] != ran[at - first])
            nxt = at + 1 + int(changes[0]) if changes.size else nxt  # a report runs on one version
            version = int(ran[at - first]) or table.version
            chunk = np.asarray(counts[at - first:nxt - first], dtype=np.int64)
            offs = [s - at for s in sample_steps(at, nxt - at, self.sample_every)]
            left = chunk.copy()
            took = strides = None
            if self.step_ms is not None and self.sample_every and offs:  # the EP step's time: every rank waits for it
                report = getattr(self.step_ms, "served", None)
                us = 1e3 * np.asarray(report(served_ms[at - first:nxt - first], chunk)
                                      if served_ms is not None and report is not None else self.step_ms(table, chunk))
                # each sampled step's own time, and the mean of its stride's, as dataplane_shim.plugin reports them
                took = np.maximum(us[offs], 1.0)
                strides = np.maximum(np.asarray(stride_means(us, at, self.sample_every), dtype=np.float64), 1.0)
            for i, n in enumerate(self.nodes):
                mine = left if i == len(self.nodes) - 1 else np.floor(chunk * shares[i]).astype(np.int64)
                if i < len(self.nodes) - 1:
                    left -= mine
                rows = mine[offs] if self.sample_every else None
                r = make_load_report(f"{n}-engine", i * self.topo.ranks_per_node, at, nxt - at, version,
                                     mine.sum(axis=0), samples=rows, sample_every=self.sample_every, step_us=took,
                                     stride_us=strides)
                self.paths[n].on_report(r)
            at = nxt

    def bytes_per_window(self) -> dict[str, float]:
        """A node's window as gossip sends it: median and max bytes, unsigned and with mTLS's signature."""
        if not self.window_bytes:
            return {}
        return {"median": float(median(self.window_bytes)), "max": float(max(self.window_bytes)),
                "signed_max": float(max(self.window_bytes) + SIGNATURE_BYTES)}


def _nowhere(seq: int, total: npt.NDArray[np.uint64], samples: npt.NDArray[np.uint32] | None,
             missing: tuple[str, ...] = ()) -> None:
    """Another node's cluster windows: its own decisions are not simulated."""


def _nothing(rank: int, version: int) -> None:
    """The version an engine reports it runs: installs are the bench's own accounting."""


def _voting() -> str:
    return ""
