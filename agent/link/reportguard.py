"""Shim reports held to what this node's engines can say; agent/link/loadpath.py asks this before a report counts.

A load report on the shim socket (elasticmoe.v1.DataplaneLink) is the engine's word for this node's ranks
only. Past its shape (dataplane_shim.link.check_load_report), a report is refused, whole, when no honest plugin
of this node could have sent it; nothing of a refused one reaches the load path, the installs or membership:

- RANK_NOT_HERE: its rank is not one of this node's ranks (`emoe status` would show another node's rank, or
  a negative one, as this node's; the evidence it carries would be no rank's of this node).
- VERSION_AHEAD: the version its engine runs is above this node's committed head. An engine installs only
  tables its own agent streamed to it (WatchTables sends committed versions, never a newer one), and a node's
  head never goes back (a node whose store was lost restarts at genesis: its engines' reports are refused
  until it has caught up from its peers, which takes a catch-up round; the log says so once).
- BATCH_IMPLAUSIBLE: the engine declares a largest batch (LoadReport.max_batch_tokens) above MAX_BATCH_TOKENS.
- COUNT_ABOVE_BATCH: an expert's count above B x steps, B the largest batch the engine declares (or, where it
  declares none, engine.max_batch_tokens): a token picks an expert at most once a step.
- LAYER_ABOVE_BATCH: a layer's counts sum above B x top_k x steps: a token picks top_k experts a layer.
  Both also for each sampled step's counts (LoadReport.samples), with steps = 1.
- UNREACHABLE_NOT_EP: unreachable_ranks names a rank that is no EP rank of the cluster (>= its ranks).
- STEP_TIME_IMPLAUSIBLE: a sampled step's wall time (LoadReport.step_us), or its stride's mean (stride_us), of 0
  or above MAX_STEP_US: no engine step takes no time, nor ten minutes (a collective times out first); the agents
  fit their step time from these.

Evidence (unreachable_ranks) from an accepted report suspects the named ranks' nodes (agent.gossip.gossip_node
suspect_ranks: Lifeguard's local evidence, accused by this node); it never declares one dead: a suspect that is
alive refutes, and only a suspicion that runs out unrefuted ends in dead, as after a failed probe.

A refusal has a code (`Refusal`), a reason naming the field and its value, and is counted by code (`refused`,
emoe_reports_refused_total); it is logged once per code and shim. No IO, no clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from elasticmoe.loadcodec import sample_steps
from elasticmoe.v1 import dataplane_pb2 as dpb

log = logging.getLogger(__name__)

# The largest batch an engine may declare (tokens in one step, LoadReport.max_batch_tokens): 4x the default
# bound below. A larger one is no engine's: 2^26 tokens of DeepSeek-V3's hidden state (7168 bf16) are 0.9 TiB.
MAX_BATCH_TOKENS = 1 << 26
# engine.max_batch_tokens, the bound for a plugin that declares no batch (an older release's): the largest EP
# group the design serves (128 nodes x 8 GPUs = 1024 ranks) x 16,384 tokens a step each (vLLM's largest
# default max_num_batched_tokens; SGLang's chunked prefill is 8192): SGLang's rank 0 reports its group's sum,
# the most one report's count can honestly cover. A count of 2^32 - 1 is then refused in any report of up to
# 255 steps (the default window is 100).
DEFAULT_MAX_BATCH_TOKENS = 1 << 24
# The longest step an engine may report (LoadReport.step_us): 600 s. A DeepSeek-V3 prefill step at EP32 takes
# about 1.35 s; NCCL's and Gloo's default collective timeouts (10 and 30 min) are past it, but a step that
# long is a stall, not a step time to plan with.
MAX_STEP_US = 600_000_000
_LOGGED = 4096  # (code, shim) pairs logged before the set starts again: a hostile client cannot grow it


class Refusal(StrEnum):
    RANK_NOT_HERE = "rank_not_here"            # rank not one of this node's
    VERSION_AHEAD = "version_ahead"            # version above this node's committed head
    BATCH_IMPLAUSIBLE = "batch_implausible"    # declared max_batch_tokens above MAX_BATCH_TOKENS
    COUNT_ABOVE_BATCH = "count_above_batch"    # an expert's count above batch x steps
    LAYER_ABOVE_BATCH = "layer_above_batch"    # a layer's sum above batch x top_k x steps
    UNREACHABLE_NOT_EP = "unreachable_not_ep"  # unreachable_ranks names no EP rank of the cluster
    STEP_TIME_IMPLAUSIBLE = "step_time_implausible"  # a sampled step's wall time of 0 or past MAX_STEP_US


@dataclass(frozen=True)
class Refused:
    code: Refusal
    why: str  # names the field and its value

    def __str__(self) -> str:
        return f"{self.code.value}: {self.why}"


class ReportGuard:
    """Judges one node's shim reports: `ranks` this node's, `cluster_ranks` the cluster's EP ranks (0 ..
    cluster_ranks - 1), `top_k` experts a token picks a layer, `max_batch_tokens` the batch bound where an engine
    declares none (engine.max_batch_tokens), `head()` this node's committed head version."""

    def __init__(self, ranks: Iterable[int], cluster_ranks: int, top_k: int, max_batch_tokens: int,
                 head: Callable[[], int]) -> None:
        if not 1 <= max_batch_tokens <= MAX_BATCH_TOKENS or top_k < 1:
            raise ValueError(f"max_batch_tokens = {max_batch_tokens}, top_k = {top_k}: expected 1 .. "
                             f"{MAX_BATCH_TOKENS} and >= 1")
        self.ranks = frozenset(int(r) for r in ranks)
        self.cluster_ranks, self.top_k, self.max_batch_tokens, self.head = cluster_ranks, top_k, max_batch_tokens, head
        self.refused: dict[Refusal, int] = dict.fromkeys(Refusal, 0)
        self.refused_why = ""
        self._logged: set[tuple[Refusal, str]] = set()

    def check(self, r: dpb.LoadReport) -> Refused | None:
        """None if `r` (well formed: check_load_report) may count here; else why not, counted and logged."""
        got = self._judge(r)
        if got is not None:
            self.refused[got.code] += 1
            self.refused_why = str(got)
            key = (got.code, r.shim_id)
            if key not in self._logged:
                if len(self._logged) >= _LOGGED:
                    self._logged.clear()
                self._logged.add(key)
                log.warning("refused a load report from %s (%s): %s", r.shim_id or r.rank, got.code.value, got.why)
        return got

    def _judge(self, r: dpb.LoadReport) -> Refused | None:
        if r.rank not in self.ranks:
            return Refused(Refusal.RANK_NOT_HERE, f"rank = {r.rank}: expected one of this node's ranks "
                                                  f"{sorted(self.ranks)}")
        head = self.head()
        if r.version > head:
            return Refused(Refusal.VERSION_AHEAD, f"version = {r.version}: expected at most this node's committed "
                                                  f"version {head} (an engine runs only versions its agent sent)")
        bad = [g for g in r.unreachable_ranks if not 0 <= g < self.cluster_ranks]
        if bad:
            return Refused(Refusal.UNREACHABLE_NOT_EP, f"unreachable_ranks {sorted(bad)[-4:]}: expected EP ranks "
                                                       f"of the cluster, 0 .. {self.cluster_ranks - 1}")
        if r.max_batch_tokens > MAX_BATCH_TOKENS:
            return Refused(Refusal.BATCH_IMPLAUSIBLE, f"max_batch_tokens = {r.max_batch_tokens}: expected at most "
                                                      f"{MAX_BATCH_TOKENS} tokens in one step")
        for name, raw in (("step_us", r.step_us), ("stride_us", r.stride_us)):
            t = np.frombuffer(raw, dtype="<u4")
            bad_t = np.flatnonzero((t == 0) | (t > MAX_STEP_US))
            if bad_t.size:
                i = int(bad_t[0])
                return Refused(Refusal.STEP_TIME_IMPLAUSIBLE, f"{name}[{i}] = {int(t[i])}: expected a sampled step's "
                                                              f"wall time of 1 .. {MAX_STEP_US} microseconds")
        batch = int(r.max_batch_tokens) or self.max_batch_tokens
        said = "declared max_batch_tokens" if r.max_batch_tokens else "engine.max_batch_tokens"
        counts = np.frombuffer(r.counts, dtype="<u4").reshape(r.layers, r.experts)
        got = self._bounded("counts", counts[None], max(1, int(r.steps)), batch, said)
        if got is None and r.samples:
            n = len(sample_steps(r.first_step, r.steps, r.sample_every))
            rows = np.frombuffer(r.samples, dtype="<u4").reshape(n, r.layers, r.experts)
            got = self._bounded("samples", rows, 1, batch, said)
        return got

    def _bounded(self, field: str, c: npt.NDArray[np.uint32], steps: int, batch: int, said: str) -> Refused | None:
        """`c` [n, L, E]: each count at most batch x steps, each layer's sum at most batch x top_k x steps."""
        cap = batch * steps
        if c.size and int(c.max()) > cap:
            i, layer, expert = (int(x) for x in np.unravel_index(int(np.argmax(c)), c.shape))
            at = f"{field}[{i}, {layer}, {expert}]" if field == "samples" else f"{field}[{layer}, {expert}]"
            return Refused(Refusal.COUNT_ABOVE_BATCH, f"{at} = {int(c[i, layer, expert])}: expected at most {cap} "
                                                      f"({said} {batch} x {steps} step(s))")
        sums = c.sum(axis=2, dtype=np.uint64)  # [n, L]
        if sums.size and int(sums.max()) > cap * self.top_k:
            i, layer = (int(x) for x in np.unravel_index(int(np.argmax(sums)), sums.shape))
            at = f"{field}[{i}, {layer}, :]" if field == "samples" else f"{field}[{layer}, :]"
            return Refused(Refusal.LAYER_ABOVE_BATCH, f"sum of {at} = {int(sums[i, layer])}: expected at most "
                                                      f"{cap * self.top_k} ({said} {batch} x top_k {self.top_k} x "
                                                      f"{steps} step(s))")
        return None
