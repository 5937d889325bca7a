"""Replay verification: rank loads of a replay buffer under a table, fast, and the gain of a change.

The routing model is `controlplane.load`'s (an expert's tokens split evenly over its replicas, the remainder
one each to the lowest-numbered slots); `RankLoadKernel` computes exactly `load.rank_load` with one gather
and S contiguous adds instead of fancy indexing plus a reduction over a short axis (about 10x faster at
DeepSeek-V3 shape). Step imbalance only needs, per step and layer, the max over ranks and the layer's total
(mean over active ranks = total / active ranks, because a valid table puts every token on an active rank),
so a change that touches a few layers is verified by recomputing only those layers. The gain of a change is
additive over layers:

    gain = (I_head - I_new) / I_head,  I = mean_t sum_l max_lt / D_t,  D_t = sum_l total_lt / active
    gain = sum_l mean_t (max_head_lt - max_new_lt) / D_t / I_head

Everything is integer until the final ratios, so every node computes identical figures.

Whether replay can tell a gain from the noise (`gain_bound`): the gain is the mean over the buffer's rows (each
a sampled step, standing for the `sample_every` steps it was drawn from; or a window's mean step) of each row's
own contribution, so the rows are disjoint blocks of the replay, and their spread says how far the mean can be
trusted: the one-sided lower confidence bound of that mean (Student's t over the rows) must be above 0. A
change that gains on a burst and loses elsewhere has a large spread and a bound at or below 0; a steady gain
has almost none. While the expert mix is still moving (into each of the last two windows: lanes started
together run through their prompts in waves) a rebalance is verified on both (`verify_windows`), not on the
newest alone, and since the rows of one window are steps a few apart, alike in a wave, the bound is then also
taken over the two windows' mean gains (`gain_bound`'s blocks), and the lower one counts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from controlplane.errors import InvalidShape, InvalidTable
from controlplane.table import RoutingTable, layer_views

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]



class VoterCode(StrEnum):
    """A voter's verdict on a proposal (verify_decision's reason; agent.decision.voter's refusals lead with it)."""

    OK = "OK"
    GAIN_BELOW_TAU = "GAIN_BELOW_TAU"
    PARENT_MISMATCH = "PARENT_MISMATCH"
    INVALID_TABLE = "INVALID_TABLE"
    SHAPE_MISMATCH = "SHAPE_MISMATCH"
    EMPTY_REPLAY = "EMPTY_REPLAY"
    GAIN_NOT_SIGNIFICANT = "GAIN_NOT_SIGNIFICANT"  # a gain >= tau whose lower confidence bound is not above 0
    # a voter's own (agent.decision.voter): the step time a rebalance was judged with is not the one this node fits
    STEP_TIME_DISAGREES = "STEP_TIME_DISAGREES"


# the module's names for them, as callers import them
OK = VoterCode.OK
GAIN_BELOW_TAU = VoterCode.GAIN_BELOW_TAU
PARENT_MISMATCH = VoterCode.PARENT_MISMATCH
INVALID_TABLE = VoterCode.INVALID_TABLE
SHAPE_MISMATCH = VoterCode.SHAPE_MISMATCH
EMPTY_REPLAY = VoterCode.EMPTY_REPLAY
GAIN_NOT_SIGNIFICANT = VoterCode.GAIN_NOT_SIGNIFICANT
STEP_TIME_DISAGREES = VoterCode.STEP_TIME_DISAGREES


class RankLoadKernel:
    """A table's placement compiled into a gather plan for `layers` (default: all).

    `rank_load(counts [T, L, E]) -> [T, n, G]` int64 equals `load.rank_load(table, counts)[:, layers]`.
    Layout: gather index [n, S, G] into the selected layers' flattened counts plus one zero column (for
    empty slots), so that summing the S slots of a rank adds contiguous [T, n, G] blocks.
    """

    def __init__(self, table: RoutingTable, layers: npt.ArrayLike | None = None) -> None:
        L, E = table.layers, table.experts
        G, S = table.topology.ranks, table.topology.slots_per_rank
        ls = np.arange(L, dtype=np.int64) if layers is None else np.asarray(layers, dtype=np.int64).reshape(-1)
        n = int(ls.size)
        self.table, self.layers, self.all_layers = table, ls, layers is None
        self.shape = (L, E, G, S)
        phy = table.phy2log[ls].reshape(n, G, S).transpose(0, 2, 1)  # [n, S, G]
        valid = phy >= 0
        e = np.where(valid, phy, 0)
        self.idx = np.where(valid, np.arange(n)[:, None, None] * E + e, n * E).reshape(-1)
        if self.all_layers:
            lc, ri = table.logcnt, table.replica_index
        else:  # only the selected layers' views: a fresh proposal need not derive all of them
            lc, ri = layer_views(table.phy2log[ls], E)
        cnt = lc[np.arange(n)[:, None, None], e].reshape(-1)  # lc [n, E], ri [n, P] for the selected layers
        j = ri.reshape(n, G, S).transpose(0, 2, 1).reshape(-1)
        # A replicated slot reads its share from a column after the zero column: share of replica j of an
        # expert with c tokens over r replicas = c // r + (j < c % r) = (c + r - 1 - j) // r. Shares are
        # computed per replica count r (a division by a scalar is ~7x faster than by an array).
        rep = np.flatnonzero(valid.reshape(-1) & (cnt > 1))
        rep = rep[np.argsort(cnt[rep], kind="stable")]
        self.rep_src = self.idx[rep]
        self.rep_off = cnt[rep] - 1 - j[rep]
        self.idx[rep] = n * E + 1 + np.arange(rep.size)
        rs, starts = np.unique(cnt[rep], return_index=True)
        bounds = [*starts.tolist(), int(rep.size)]
        self.groups = [(int(r), bounds[i], bounds[i + 1]) for i, r in enumerate(rs.tolist())]

    def rank_load(self, counts: npt.NDArray[np.integer]) -> I64:
        """counts uint [T, L, E] (all layers) -> tokens per rank [T, n, G] int64."""
        return self._loads(counts).astype(np.int64, copy=False)

    def layer_max(self, counts: npt.NDArray[np.integer]) -> I64:
        """counts [T, L, E] -> max tokens over ranks [T, n] int64 (inactive ranks hold nothing)."""
        return np.asarray(self._loads(counts).max(axis=-1, initial=0), dtype=np.int64)

    def _loads(self, counts: npt.NDArray[np.integer]) -> npt.NDArray[np.signedinteger]:
        """[T, n, G] in int32 when S x the largest count fits, else int64."""
        L, E, G, S = self.shape
        c = np.asarray(counts)
        if c.ndim != 3 or c.shape[1:] != (L, E):
            raise InvalidShape(f"counts shape {c.shape}: expected [steps, {L}, {E}]")
        T, n = c.shape[0], int(self.layers.size)
        if T == 0 or n == 0:
            return np.zeros((T, n, G), dtype=np.int64)
        top = int(c.max())
        dt = np.int32 if top < (2**31 - 1) // max(S, 2) else np.int64
        Q = int(self.rep_src.size)
        buf = np.empty((T, n * E + 1 + Q), dtype=dt)
        src = c if self.all_layers else c[:, self.layers, :]
        buf[:, : n * E] = src.reshape(T, n * E)
        buf[:, n * E] = 0
        base = n * E + 1
        for r, a, b in self.groups:
            part = buf[:, base + a : base + b]
            np.take(buf, self.rep_src[a:b], axis=1, out=part)
            part += self.rep_off[a:b].astype(dt)
            np.floor_divide(part, dt(r), out=part)
        s = np.take(buf, self.idx, axis=1)  # [T, n*S*G]
        s3 = s.reshape(T, n, S, G)
        out = s3[:, :, 0, :].copy()
        for k in range(1, S):  # S adds of contiguous [T, n, G] blocks; no overflow: S x top fits dt
            out += s3[:, :, k, :]
        return out


def layer_totals(counts: npt.NDArray[np.integer]) -> I64:
    """counts [T, L, E] -> tokens per layer [T, L] int64."""
    return np.asarray(np.asarray(counts).sum(axis=-1, dtype=np.int64), dtype=np.int64)


@dataclass(frozen=True)
class ReplayStats:
    """Per-step figures of a replay buffer under one table: all that step imbalance needs.

    layer_max [T, L] int64 (max rank load), totals [T, L] int64 (tokens), active: number of active ranks.
    """

    layer_max: I64
    totals: I64
    active: int

    def step_imbalance(self) -> F64:
        """[T] sum_l max / sum_l mean; 1.0 for a step without tokens (as load.step_imbalance)."""
        return _ratio(self.layer_max.sum(axis=1), self.totals.sum(axis=1), self.active)

    def mean_imbalance(self) -> float:
        """Mean step imbalance over the buffer (1.0 when empty)."""
        if self.layer_max.shape[0] == 0:
            return 1.0
        return float(self.step_imbalance().mean())


def _ratio(num: I64, tot: I64, active: int) -> F64:
    den = tot.astype(np.float64) / active
    return np.divide(num.astype(np.float64), den, out=np.ones(num.shape, dtype=np.float64), where=tot > 0)


def replay_stats(table: RoutingTable, counts: npt.NDArray[np.integer]) -> ReplayStats:
    """Stats of `counts [T, L, E]` under `table` (every layer)."""
    return ReplayStats(RankLoadKernel(table).layer_max(counts), layer_totals(counts), len(table.active_ranks))


def changed_layers(a: RoutingTable, b: RoutingTable) -> I64:
    """Layers whose placement differs between two tables of one shape -> sorted layer ids [k]."""
    return np.flatnonzero((a.phy2log != b.phy2log).any(axis=1)).astype(np.int64)


def stats_with(base: ReplayStats, table: RoutingTable, counts: npt.NDArray[np.integer], base_table: RoutingTable) -> ReplayStats:
    """Stats of `counts` under `table`, reusing `base` (the same counts under `base_table`) for every
    layer the two tables place identically; a different active set recomputes everything."""
    if table.active_ranks != base_table.active_ranks:
        return replay_stats(table, counts)
    ls = changed_layers(base_table, table)
    mx = base.layer_max.copy()
    if ls.size:
        mx[:, ls] = RankLoadKernel(table, ls).layer_max(counts)
    return ReplayStats(mx, base.totals, base.active)


def gain(head: ReplayStats, new: ReplayStats) -> float:
    """Relative reduction of mean step imbalance, (I_head - I_new) / I_head; 0.0 on an empty buffer."""
    if head.layer_max.shape[0] == 0:
        return 0.0
    ih = head.mean_imbalance()
    return (ih - new.mean_imbalance()) / ih


def row_gains(head: ReplayStats, new: ReplayStats) -> F64:
    """Each row's contribution to `gain(head, new)`: [T] (I_head_t - I_new_t) / I_head, whose mean is the gain."""
    if head.layer_max.shape[0] == 0:
        return np.zeros(0, dtype=np.float64)
    return np.asarray((head.step_imbalance() - new.step_imbalance()) / head.mean_imbalance(), dtype=np.float64)


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with `df` >= 1 degrees of freedom (Abramowitz & Stegun 26.7.3-4: closed forms
    for an integer df, pure Python, so every node computes the same figure)."""
    if df < 1:
        raise ValueError(f"df={df!r}: expected >= 1")
    th = math.atan(t / math.sqrt(df))
    s, c = math.sin(th), math.cos(th)
    c2, acc = c * c, 0.0
    if df % 2:  # odd: (2/pi) (theta + sin theta (cos + 2/3 cos^3 + ... + (2.4..(df-3))/(1.3..(df-2)) cos^(df-2)))
        term = c
        for k in range(1, df - 1, 2):
            acc += term
            term *= c2 * (k + 1) / (k + 2)
        a = 2.0 / math.pi * (th + s * acc)
    else:  # even: sin theta (1 + 1/2 cos^2 + (1.3)/(2.4) cos^4 + ... + (1.3..(df-3))/(2.4..(df-2)) cos^(df-2))
        term = 1.0
        for k in range(0, df - 1, 2):
            acc += term
            term *= c2 * (k + 1) / (k + 2)
        a = s * acc
    return 0.5 * (1.0 + a)


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, df: int) -> float:
    """The p-quantile (p in [0.5, 1)) of Student's t with `df` degrees of freedom, by bisection on `t_cdf`;
    past 1000 degrees of freedom, 1000's (within 0.1% of the normal quantile, and a little larger: a bound
    as strict or stricter, at a bounded cost)."""
    if not 0.5 <= p < 1.0:
        raise ValueError(f"p={p!r}: expected a probability in [0.5, 1)")
    df = min(df, 1000)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, 2.0 * hi
    for _ in range(64):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return hi


def _t_bound(r: F64, confidence: float) -> float:
    """mean - t x sd / sqrt(n) of `r` [n], t Student's `confidence` quantile with n - 1 degrees of freedom; the mean
    with fewer than 2 values or confidence 0.5; 0.0 for none."""
    n = int(r.size)
    if n == 0:
        return 0.0
    m = float(r.mean())
    if n < 2 or confidence <= 0.5:
        return m
    return m - t_quantile(confidence, n - 1) * float(r.std(ddof=1)) / math.sqrt(n)


def gain_bound(rows: F64, confidence: float, blocks: Sequence[int] = ()) -> float:
    """The one-sided `confidence` lower bound of the gain over `rows` [T] (`row_gains`): mean - t x sd / sqrt(T), t
    Student's `confidence` quantile with T - 1 degrees of freedom; with fewer than 2 rows there is no spread to
    judge by: the mean itself (0.0 for none); with confidence 0.5, the mean.

    `blocks`: the rows each replayed window holds, in order (summing to T), given while the mix is still moving
    (`verify_windows`). The rows of one window are steps a few apart, alike when the load moves in waves (lanes in
    lockstep after a cold start), so their spread understates how the gain varies from window to window: with 2
    windows or more, the bound is also taken over the windows' mean gains (df: windows - 1), and the lower of the
    two is the bound: the gain must hold across steps and across windows."""
    r = np.asarray(rows, dtype=np.float64)
    bound = _t_bound(r, confidence)
    if len(blocks) >= 2 and sum(blocks) == r.size and min(blocks) > 0 and confidence > 0.5:
        means = np.array([b.mean() for b in np.split(r, np.cumsum(blocks)[:-1])], dtype=np.float64)
        bound = min(bound, _t_bound(means, confidence))
    return bound


def layer_gains(head: ReplayStats, new: ReplayStats, layers: I64) -> F64:
    """Contribution of each of `layers` to `gain(head, new)` (same active set): [k], summing to the gain."""
    T = head.layer_max.shape[0]
    if T == 0 or layers.size == 0:
        return np.zeros(layers.size, dtype=np.float64)
    den = head.totals.sum(axis=1).astype(np.float64) / head.active  # [T]
    d = (head.layer_max[:, layers] - new.layer_max[:, layers]).astype(np.float64)  # [T, k]
    per = np.divide(d, den[:, None], out=np.zeros_like(d), where=den[:, None] > 0)
    return np.asarray(per.mean(axis=0) / head.mean_imbalance(), dtype=np.float64)


def mix_moves(totals: npt.ArrayLike) -> tuple[F64, F64]:
    """Of consecutive rows of `totals [n, L, E]` (tokens per window): how far each row's expert shares are from the
    next newer row's, total variation per layer, mean over layers [n - 1]; and how far two samples of that many
    tokens from one mix would be expected to fall by chance [n - 1] (sum over experts of the mean absolute
    difference of two binomial shares, sqrt(2/pi) x sqrt(p (1 - p) (1/N_i + 1/N_i+1)), p the pair's pooled
    share; halved, mean over layers). The second is what a window of few tokens (a top-1 model, a small batch,
    the rows of sampled steps) moves by with no change of mix at all."""
    t = np.asarray(totals, dtype=np.float64)
    n = t.sum(axis=2, keepdims=True)  # [n, L, 1]
    share = t / np.maximum(n, 1.0)
    d = 0.5 * np.abs(share[1:] - share[:-1]).sum(axis=2).mean(axis=1)
    pooled = (t[1:] + t[:-1]) / np.maximum(n[1:] + n[:-1], 1.0)
    inv = 1.0 / np.maximum(n[1:], 1.0) + 1.0 / np.maximum(n[:-1], 1.0)
    chance = 0.5 * math.sqrt(2.0 / math.pi) * np.sqrt(pooled * (1.0 - pooled) * inv).sum(axis=2).mean(axis=1)
    return np.asarray(d, dtype=np.float64), np.asarray(chance, dtype=np.float64)


def same_mix(totals: npt.NDArray[np.integer], tv: float) -> int:
    """How many trailing rows of `totals [n, L, E]` (tokens per window) share the newest row's expert mix:
    walking back from the newest, a row joins while its expert shares differ from the next newer row's by at
    most `tv` (total variation per layer, mean over layers) beyond what sampling that many tokens moves them by
    (`mix_moves`). 1 right after a drift; n in steady state."""
    t = np.asarray(totals, dtype=np.float64)
    if t.shape[0] == 0:
        return 0
    d, chance = mix_moves(t)
    over = np.flatnonzero(d > tv + chance)
    return int(t.shape[0] - (over[-1] + 1)) if over.size else int(t.shape[0])


def verify_windows(totals: npt.NDArray[np.integer], tv: float) -> int:
    """How many trailing windows of `totals [n, L, E]` (tokens per window) a rebalance is verified on: those that
    share the newest window's mix (`same_mix`), but at least the last two while the mix moved by more than `tv`
    into each of them. A drift moves the mix once, and the windows since are what the cluster now serves; load
    still in transit (lanes started together run through their prompts in waves after a cold start) moves it
    window after window, and a plan the newest window alone verifies chases a phase of it: it must also hold on
    the window before (and across the two: `gain_bound`'s blocks)."""
    k = same_mix(totals, tv)
    t = np.asarray(totals, dtype=np.float64)
    if k >= 2 or t.shape[0] < 3:
        return k
    d, chance = mix_moves(t[-3:])
    return 2 if bool((d > tv + chance).all()) else k


def verify_decision(
    head: RoutingTable, proposed: RoutingTable, replay: npt.NDArray[np.integer], tau: float,
    drift_tv: float | None = None, confidence: float = 0.5, blocks: Sequence[int] = (),
) -> tuple[bool, float, str]:
    """A voter's independent re-verification of a proposed successor of `head`.

    replay: uint32 [T, L, E] per-step counts (or per-window totals). Returns (ok, verified_gain, reason) with
    reason one of OK, GAIN_BELOW_TAU, GAIN_NOT_SIGNIFICANT, PARENT_MISMATCH, INVALID_TABLE, SHAPE_MISMATCH,
    EMPTY_REPLAY. ok iff the proposal is a valid table whose parent is head's version, whose gain on the buffer
    is >= tau and, with `confidence` above 0.5 (DecisionParams.gain_confidence), whose gain's lower confidence
    bound (`gain_bound`; `blocks`: the rows of each replayed window) is above 0. A rollback or a repair is
    checked with tau = 0.0 and no bound (it must not make things worse). drift_tv: with rows that are window
    totals, replay only the trailing rows that share the newest row's mix (`same_mix`), as the
    proposer planned and verified on the windows since a drift (DecisionParams.drift_tv).
    """
    if proposed.parent != head.version or proposed.version != head.version + 1:
        return False, 0.0, PARENT_MISMATCH
    if (proposed.layers, proposed.experts, proposed.slots) != (head.layers, head.experts, head.slots):
        return False, 0.0, SHAPE_MISMATCH
    c = np.asarray(replay)
    if c.ndim != 3 or c.shape[1:] != (head.layers, head.experts):
        return False, 0.0, SHAPE_MISMATCH
    try:
        proposed.validate()
    except InvalidTable:
        return False, 0.0, INVALID_TABLE
    if c.shape[0] == 0:
        return False, 0.0, EMPTY_REPLAY
    if drift_tv is not None:
        c = c[c.shape[0] - same_mix(c, drift_tv):]
    base = replay_stats(head, c)
    new = stats_with(base, proposed, c, head)
    g = gain(base, new)
    if g < tau:
        return False, g, GAIN_BELOW_TAU
    if confidence > 0.5 and gain_bound(row_gains(base, new), confidence, blocks) <= 0.0:
        return False, g, GAIN_NOT_SIGNIFICANT
    return True, g, OK
