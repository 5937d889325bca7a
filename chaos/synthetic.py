"""Synthetic skewed, drifting routing traces at any shape (labelled `synthetic`).

Each segment draws, per layer, Zipf-like expert popularities (rank r gets weight (r + 1) ** -skew) over a
fresh seeded permutation of the experts, so the hot set moves at every segment boundary (abrupt drift) or
over `ramp_steps` steps (a linear mix of the two segments). Per step, each expert's expected tokens
batch x top_k x p are modulated by a mean-one gamma factor (burstiness) and drawn as Poisson counts.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from controlplane.tracefile import Trace

F64 = npt.NDArray[np.float64]


def popularity(rng: np.random.Generator, layers: int, experts: int, skew: float) -> F64:
    """[L, E] per-layer probabilities: Zipf weights over a random permutation of the experts."""
    w = (np.arange(experts, dtype=np.float64) + 1.0) ** -skew
    perm = np.argsort(rng.random((layers, experts)), axis=1)
    p = w[perm]
    out: F64 = p / p.sum(axis=1, keepdims=True)
    return out


def synthetic_trace(
    layers: int,
    experts: int,
    steps_per_segment: int,
    segments: int = 2,
    *,
    top_k: int = 8,
    batch: int = 2048,
    skew: float = 0.5,
    burst: float = 8.0,
    ramp_steps: int = 0,
    seed: int = 0,
    chunk: int = 250,
) -> Trace:
    """counts uint32 [segments x steps_per_segment, L, E]; drift_steps marks each segment start after the first.

    burst: gamma shape of the per-step factor (larger = steadier). ramp_steps: the first `ramp_steps` of
    each later segment mix the previous and the new popularity linearly.
    """
    for name, v in (("layers", layers), ("experts", experts), ("steps_per_segment", steps_per_segment),
                    ("segments", segments), ("top_k", top_k), ("batch", batch)):
        if v < 1:
            raise ValueError(f"synthetic trace: {name}={v}: expected >= 1")
    if not 0 <= ramp_steps <= steps_per_segment:
        raise ValueError(f"synthetic trace: ramp_steps={ramp_steps}: expected 0..{steps_per_segment}")
    rng = np.random.default_rng(seed)
    pops = [popularity(rng, layers, experts, skew) for _ in range(segments)]
    T = segments * steps_per_segment
    counts = np.empty((T, layers, experts), dtype=np.uint32)
    seg_of = np.arange(T) // steps_per_segment
    pos = np.arange(T) % steps_per_segment
    for a in range(0, T, chunk):  # chunks of steps keep memory bounded at large shapes
        b = min(T, a + chunk)
        s, q = seg_of[a:b], pos[a:b]
        mix = np.where((s > 0) & (q < ramp_steps), (q + 1) / max(ramp_steps, 1), 1.0)[:, None, None]
        stacked = np.stack(pops)
        p = mix * stacked[s] + (1.0 - mix) * stacked[np.maximum(s - 1, 0)]
        lam = batch * top_k * p * rng.gamma(burst, 1.0 / burst, size=p.shape)
        counts[a:b] = rng.poisson(lam).astype(np.uint32)
    drift = [k * steps_per_segment for k in range(1, segments)]
    src = f"synthetic zipf {skew} seed {seed}, {segments} segments" + (f", ramp {ramp_steps}" if ramp_steps else "")
    return Trace(counts, f"synthetic {layers}x{experts}", top_k, src, "synthetic", drift)
