"""Stability profile: which experts are hot everywhere, hot only sometimes, or cold everywhere.

Built offline from two or more traces (workloads, domains, days), each counts uint32 [T, L, E]:
- share: each expert's share of its layer's tokens, per trace; popularity rank 0 = most popular on average;
- stability: Spearman rank correlation of expert popularity between every pair of traces, per layer;
- burstiness: coefficient of variation of the expert's share over windows of `window` steps (all traces
  pooled), and, for reference, the lag-1 autocorrelation of that windowed share within traces.
Classes (uniform share u = 1/E): stable_hot = share >= hot x u in every trace and burstiness <= bursty_cv;
bursty_hot = otherwise hot in some trace or some window; stable_cold = share <= cold x u in every trace and
never above u in any window; neutral = the rest. The planner uses them as its prior: pre-replicate
stable_hot, keep headroom beside bursty_hot, consolidate stable_cold first.

Serialised as `.npz` bytes (`to_bytes` / `from_bytes`): controlplane does no file IO.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from controlplane.errors import InvalidShape

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
FORMAT = 1


class ExpertClass(IntEnum):
    NEUTRAL = 0
    STABLE_HOT = 1
    BURSTY_HOT = 2
    STABLE_COLD = 3


CLASS_NAMES = tuple(c.name.lower() for c in ExpertClass)


def rankdata(x: npt.ArrayLike) -> F64:
    """Ranks along the last axis, 1 = smallest, ties get their average rank. [..., n] -> [..., n]."""
    a = np.asarray(x, dtype=np.float64)
    n = a.shape[-1]
    flat = a.reshape(-1, n)
    out = np.empty_like(flat)
    for i in range(flat.shape[0]):  # rows are layers (or layer pairs): a few dozen
        order = np.argsort(flat[i], kind="stable")
        v = flat[i][order]
        start = np.r_[True, v[1:] != v[:-1]]
        run = np.cumsum(start) - 1
        first = np.flatnonzero(start)
        last = np.r_[first[1:], n] - 1
        avg = (first + last) / 2.0 + 1.0
        out[i, order] = avg[run]
    return out.reshape(a.shape)


def spearman(a: npt.ArrayLike, b: npt.ArrayLike) -> F64:
    """Spearman correlation of a and b along the last axis ([..., n] each) -> [...]; nan if constant."""
    ra, rb = rankdata(a), rankdata(b)
    ra = ra - ra.mean(axis=-1, keepdims=True)
    rb = rb - rb.mean(axis=-1, keepdims=True)
    den = np.sqrt((ra * ra).sum(axis=-1) * (rb * rb).sum(axis=-1))
    num = (ra * rb).sum(axis=-1)
    return np.asarray(np.divide(num, den, out=np.full(num.shape, np.nan), where=den > 0), dtype=np.float64)


@dataclass(frozen=True, eq=False)
class StabilityProfile:
    """classes int8 [L, E] (ExpertClass); rank int64 [L, E] (0 = most popular); share float64 [L, E] (mean
    share across traces); spearman float64 [L] (mean over trace pairs); burstiness float64 [L, E] (CV of the
    windowed share); autocorr float64 [L, E]; sources: one label per trace; window: steps per window."""

    classes: npt.NDArray[np.int8]
    rank: I64
    share: F64
    spearman: F64
    burstiness: F64
    autocorr: F64
    sources: tuple[str, ...]
    window: int

    @property
    def shape(self) -> tuple[int, int]:
        L, E = self.classes.shape
        return int(L), int(E)

    def class_counts(self) -> I64:
        """[L, 4] number of experts of each class per layer (columns in ExpertClass order)."""
        L, _ = self.shape
        out = np.zeros((L, len(ExpertClass)), dtype=np.int64)
        for c in ExpertClass:
            out[:, int(c)] = (self.classes == int(c)).sum(axis=1)
        return out

    def mask(self, cls: ExpertClass) -> npt.NDArray[np.bool_]:
        return np.asarray(self.classes == int(cls))

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        np.savez_compressed(
            buf, format=np.array(FORMAT), classes=self.classes, rank=self.rank, share=self.share,
            spearman=self.spearman, burstiness=self.burstiness, autocorr=self.autocorr,
            sources=np.array(self.sources, dtype=np.str_), window=np.array(self.window),
            class_names=np.array(CLASS_NAMES, dtype=np.str_),
        )
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> StabilityProfile:
        """Decode `to_bytes` output; raises InvalidShape naming the missing or malformed field."""
        try:
            z = np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError) as e:
            raise InvalidShape(f"stability profile: not an .npz archive ({e})") from e
        with z:
            need = ("format", "classes", "rank", "share", "spearman", "burstiness", "autocorr", "sources", "window")
            for k in need:
                if k not in z:
                    raise InvalidShape(f"stability profile: no '{k}' array")
            if int(z["format"]) != FORMAT:
                raise InvalidShape(f"stability profile: format {int(z['format'])}, expected {FORMAT}")
            classes = z["classes"].astype(np.int8)
            if classes.ndim != 2 or classes.min(initial=0) < 0 or classes.max(initial=0) >= len(ExpertClass):
                raise InvalidShape(f"stability profile: classes shape {classes.shape} or values out of range")
            L, E = classes.shape
            p = cls(classes, z["rank"].astype(np.int64), z["share"].astype(np.float64),
                    z["spearman"].astype(np.float64), z["burstiness"].astype(np.float64),
                    z["autocorr"].astype(np.float64), tuple(str(s) for s in z["sources"].tolist()),
                    int(z["window"]))
        for name in ("rank", "share", "burstiness", "autocorr"):
            if getattr(p, name).shape != (L, E):
                raise InvalidShape(f"stability profile: {name} shape {getattr(p, name).shape}, expected {(L, E)}")
        if p.spearman.shape != (L,):
            raise InvalidShape(f"stability profile: spearman shape {p.spearman.shape}, expected ({L},)")
        return p


def _windowed_share(counts: npt.NDArray[np.integer], window: int) -> F64:
    """[T, L, E] -> [nw, L, E] share of each window's layer tokens (a trailing partial window is dropped
    unless it is the only one)."""
    c = np.asarray(counts, dtype=np.int64)
    T = c.shape[0]
    nw = max(1, T // window)
    w = min(window, T)
    tot = c[: nw * w].reshape(nw, w, *c.shape[1:]).sum(axis=1)
    den = tot.sum(axis=-1, keepdims=True)
    return np.asarray(np.divide(tot, den, out=np.zeros(tot.shape, dtype=np.float64), where=den > 0), dtype=np.float64)


def build_profile(
    traces: list[npt.NDArray[np.integer]],
    sources: tuple[str, ...] = (),
    window: int = 100,
    hot: float = 1.5,
    cold: float = 0.5,
    bursty_cv: float = 0.5,
) -> StabilityProfile:
    """Profile of two or more traces, each counts [T, L, E] with the same L and E."""
    if len(traces) < 2:
        raise InvalidShape(f"a stability profile needs two or more traces, got {len(traces)}")
    shapes = {tuple(np.asarray(t).shape[1:]) for t in traces}
    if len(shapes) != 1 or any(np.asarray(t).ndim != 3 or np.asarray(t).shape[0] < 1 for t in traces):
        raise InvalidShape(f"traces must all be [T >= 1, L, E] with one L and E, got {sorted(shapes)}")
    if window < 1:
        raise InvalidShape(f"window={window}: expected >= 1")
    L, E = next(iter(shapes))
    totals = np.stack([np.asarray(t, dtype=np.int64).sum(axis=0) for t in traces])  # [K, L, E]
    den = totals.sum(axis=-1, keepdims=True)
    share_k = np.divide(totals, den, out=np.zeros(totals.shape, dtype=np.float64), where=den > 0)
    share = share_k.mean(axis=0)
    # popularity rank: descending mean share, ties to the lower expert id
    order = np.lexsort((np.broadcast_to(np.arange(E), (L, E)), -share), axis=-1)
    rank = np.empty((L, E), dtype=np.int64)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(E), (L, E)), axis=-1)
    K = len(traces)
    pairs = [(i, j) for i in range(K) for j in range(i + 1, K)]
    rho = np.stack([spearman(share_k[i], share_k[j]) for i, j in pairs])  # [pairs, L]
    ok = ~np.isnan(rho)
    n_ok = ok.sum(axis=0)
    spear = np.divide(np.where(ok, rho, 0.0).sum(axis=0), n_ok, out=np.full(L, np.nan), where=n_ok > 0)
    wins = [_windowed_share(t, window) for t in traces]
    pooled = np.concatenate(wins, axis=0)  # [NW, L, E]
    mu = pooled.mean(axis=0)
    cv = np.divide(pooled.std(axis=0), mu, out=np.zeros((L, E)), where=mu > 0)
    ac = _lag1_autocorr(wins, (L, E))
    u = 1.0 / E
    hot_all = (share_k >= hot * u).all(axis=0)
    hot_any = (share_k >= hot * u).any(axis=0) | (pooled >= hot * u).any(axis=0)
    cold_all = (share_k <= cold * u).all(axis=0) & (pooled <= u).all(axis=0)
    classes = np.full((L, E), int(ExpertClass.NEUTRAL), dtype=np.int8)
    stable_hot = hot_all & (cv <= bursty_cv)
    classes[hot_any & ~stable_hot] = int(ExpertClass.BURSTY_HOT)
    classes[stable_hot] = int(ExpertClass.STABLE_HOT)
    classes[cold_all] = int(ExpertClass.STABLE_COLD)
    labels = tuple(sources) if sources else tuple(f"trace{i}" for i in range(K))
    return StabilityProfile(classes, rank, share, spear.astype(np.float64), cv, ac, labels, window)


def _lag1_autocorr(wins: list[F64], shape: tuple[int, int]) -> F64:
    """Pooled lag-1 autocorrelation of windowed share within each trace -> [L, E] (0 where undefined)."""
    num, den = np.zeros(shape), np.zeros(shape)
    for w in wins:
        if w.shape[0] < 2:
            continue
        d = w - w.mean(axis=0)
        num += (d[1:] * d[:-1]).sum(axis=0)
        den += (d * d).sum(axis=0)
    return np.divide(num, den, out=np.zeros(shape), where=den > 0)
