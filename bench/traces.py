"""Trace importers (ESFT, OLMoE, SGLang dumps) into the native format (controlplane.tracefile), and the
segment tools the benchmarks play them with."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import numpy as np
import numpy.typing as npt

from controlplane.tracefile import Trace, load_trace

__all__ = ["Trace", "load_trace"]  # the native format, re-exported for the benchmarks

SHARED_TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
ESFT_DIR = SHARED_TRACES / "esft-deepseek-v2-lite-task-routing" / "results" / "expert_scores"
OLMOE_DIR = SHARED_TRACES / "olmoe-mixtral-domain-expert-counts" / "counts"
SGLANG_DIR = SHARED_TRACES / "sglang-deepseek-v3-ep-statistics"
BUNDLED = Path(str(resources.files("bench").joinpath("data")))  # package data: found in a wheel install too


def concat(traces: list[Trace], segment_steps: int | None = None) -> Trace:
    """Play traces as consecutive segments (abrupt switches); `drift_steps` marks each switch."""
    parts = [t.counts if segment_steps is None else _fit(t.counts, segment_steps) for t in traces]
    drift = list(np.cumsum([p.shape[0] for p in parts])[:-1].tolist())
    first = traces[0]
    src = " -> ".join(t.source for t in traces)
    return Trace(np.concatenate(parts, axis=0), first.model, first.top_k, src, first.step_model, drift)


def ramp(traces: list[Trace], segment_steps: int, ramp_steps: int) -> Trace:
    """Consecutive segments whose first `ramp_steps` steps mix the previous segment into the new one:
    at ramp step i (0-based) a fraction (i + 1) / ramp_steps of each expert's tokens comes from the new
    trace (counts mixed and rounded, so the total per step stays the segments' common total)."""
    if not 0 <= ramp_steps <= segment_steps:
        raise ValueError(f"ramp_steps={ramp_steps}: expected 0..segment_steps ({segment_steps})")
    out = concat(traces, segment_steps)
    if ramp_steps == 0:
        return out
    mixed = out.counts.astype(np.float64)
    alpha = ((np.arange(ramp_steps) + 1.0) / ramp_steps)[:, None, None]
    for d in out.drift_steps:
        prev = out.counts[d - ramp_steps:d]  # the old workload's last steps, continuing into the ramp
        new = out.counts[d:d + ramp_steps].astype(np.float64)
        mixed[d:d + ramp_steps] = alpha * new + (1.0 - alpha) * prev
    out.counts = np.rint(mixed).astype(np.uint32)
    out.source += f" (ramp {ramp_steps} steps)"
    return out


def _fit(counts: npt.NDArray[np.uint32], steps: int) -> npt.NDArray[np.uint32]:
    """First `steps` steps, cycling the trace when it is shorter."""
    reps = -(-steps // counts.shape[0])
    return np.concatenate([counts] * reps, axis=0)[:steps]


# ---- ESFT per-token top-k text (pseudo-decode step model) -----------------------------------------

def read_esft_task(task_dir: Path) -> list[npt.NDArray[np.int16]]:
    """Per-sample top-k ids of every MoE layer: list of int16 [n_tokens, L, k]."""
    files = sorted(task_dir.glob("expert_weights_*.txt"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    if not files:
        raise ValueError(f"{task_dir}: no expert_weights_*.txt files")
    per_layer: list[list[npt.NDArray[np.int16]]] = []
    for f in files:
        rows = []
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            ids = line.split("\t\t", 1)[0]
            rows.append(np.array(ids.split("\t"), dtype=np.int16))
        per_layer.append(rows)
    n_samples = len(per_layer[0])
    if any(len(r) != n_samples for r in per_layer):
        raise ValueError(f"{task_dir}: layers disagree on the number of samples")
    k = 6
    return [np.stack([per_layer[j][s].reshape(-1, k) for j in range(len(files))], axis=1) for s in range(n_samples)]


def pseudo_decode(
    samples: list[npt.NDArray[np.int16]], experts: int, batch: int, steps: int, seed: int, stagger: bool = False
) -> npt.NDArray[np.uint32]:
    """Continuous batching: `batch` lanes each decode one sample token by token; a lane that finishes takes
    the next sample of a seeded shuffled order, cycling. Step t counts token t of every lane.

    samples: list of int [n_tokens, L, k] -> counts uint32 [steps, L, E].
    """
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(samples))
    lengths = np.array([s.shape[0] for s in samples])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    L, k = samples[0].shape[1], samples[0].shape[2]
    tokens = np.concatenate(samples, axis=0)  # [N, L, k]
    N = tokens.shape[0]
    # per-token count rows [N, L*E] (each token adds 1 at k experts of each layer)
    flat = (np.arange(L)[None, :, None] * experts + tokens.astype(np.int64)).reshape(N, L * k)
    C = np.zeros((N, L * experts), dtype=np.float32)
    np.put_along_axis(C, flat, 1.0, axis=1)
    # token ids taken at each step by the lanes: A[t, n] = how many lanes hold token n at step t
    A = np.zeros((steps, N), dtype=np.float32)
    nxt = 0
    lane_sample = np.empty(batch, dtype=np.int64)
    lane_pos = np.zeros(batch, dtype=np.int64)
    if stagger:  # steady-state continuous batching: each lane starts at a seeded position of its first sample
        lane_pos = rng.integers(0, lengths[order[np.arange(batch) % len(order)]])
    for b in range(batch):
        lane_sample[b] = order[nxt % len(order)]
        nxt += 1
    for t in range(steps):
        tok = offsets[lane_sample] + lane_pos
        np.add.at(A[t], tok, 1.0)
        lane_pos += 1
        done = np.flatnonzero(lane_pos >= lengths[lane_sample])
        for b in done.tolist():
            lane_sample[b] = order[nxt % len(order)]
            lane_pos[b] = 0
            nxt += 1
    counts = np.rint(A @ C).astype(np.uint32)
    return counts.reshape(steps, L, experts)


def import_esft(task: str, batch: int = 2048, steps: int = 2000, seed: int = 0, root: Path = ESFT_DIR,
                stagger: bool = False) -> Trace:
    """stagger: lanes start at seeded random positions of their first sample (steady state) instead of all at
    token 0 (a cold start, where lanes run in lockstep through the samples' shared prompt template)."""
    samples = read_esft_task(root / task)
    counts = pseudo_decode(samples, experts=64, batch=batch, steps=steps, seed=seed, stagger=stagger)
    label = f"pseudo-decode batch {batch}" + (", staggered start" if stagger else "")
    return Trace(counts, "ESFT-vanilla-lite (DeepSeek-V2-Lite)", 6, f"esft:{task}", label)


# ---- counts-only data (sampled step model) --------------------------------------------------------

def sample_steps(
    totals: npt.NDArray[np.integer], top_k: int, batch: int, steps: int, seed: int
) -> npt.NDArray[np.uint32]:
    """Multinomial draws of batch x top_k choices per layer per step from aggregate `totals [L, E]`."""
    rng = np.random.default_rng(seed)
    p = totals.astype(np.float64)
    p = p / p.sum(axis=1, keepdims=True)
    out = np.stack([rng.multinomial(batch * top_k, p[j], size=steps) for j in range(p.shape[0])], axis=1)
    return out.astype(np.uint32)


# ---- counts-only data from a cold start (burst construction) ---------------------------------------
# Counts-only data (OLMoE, Mixtral, the SGLang DeepSeek-V3 statistics) has no token order, so the lockstep
# lanes that make ESFT's cold start cannot be built from it. What a cold start does to such a trace is the
# batch: requests that arrive together (a server start, a batch job submitted at once) are admitted together,
# decode together and finish together, so the batch fills, holds and drains in waves. `burst_batches` models
# that; each step's expert counts are then multinomial draws of that step's batch from the source's
# distribution (as `sample_steps` draws a constant batch: steady state). The parameters below were committed
# before any bench case was run with them, and are not tuned on results (issue 49):
# - BURST_MEAN_STEPS: a wave's mean decode length in steps. The only per-request lengths in shared/traces are
#   ESFT's samples (median 65 tokens for intent, 226 for law), which set how often its lockstep lanes restart;
#   128 sits between them, so both cold-start constructions restart on the same time scale. It is longer than
#   the agents' window (decision.window, 50) and about the bench's W (100): windows fall on every phase of a
#   wave, which is what a decision must not chase.
BURST_MEAN_STEPS = 128
# - BURST_WAVE_JITTER: each wave's mean length is drawn uniformly within +-25% of BURST_MEAN_STEPS (waves are
#   different jobs), so the waves have no fixed period a window could lock onto.
BURST_WAVE_JITTER = 0.25
# - BURST_SPREAD: a wave's requests' decode lengths are uniform within +-50% of the wave's mean (ESFT law's
#   10th-90th percentile lengths are 143-364 tokens about a median of 226), so once the shortest finish the
#   batch drains linearly, over the wave's last 2 x 0.5 x its mean length.
BURST_SPREAD = 0.5
# - BURST_FILL_STEPS: a burst's prompts are prefilled over a few steps (chunked prefill at a token budget of a
#   few decode batches): the batch fills linearly over 8 steps.
BURST_FILL_STEPS = 8
# - BURST_FLOOR: the next burst arrives when the batch has drained to 1/8 of its size (a server that takes work
#   in waves, or batch jobs submitted back to back); the last eighth of a wave's requests decode on under the
#   next wave's fill. No step carries fewer than 1/8 of the batch: a nearly empty step has no balance to judge.
BURST_FLOOR = 0.125


def burst_batches(batch: int, steps: int, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """Tokens in each step's batch from a cold start: waves that fill, hold and drain (constants above).

    Wave w's mean decode length m_w ~ U[(1 - BURST_WAVE_JITTER) m, (1 + BURST_WAVE_JITTER) m] (m =
    BURST_MEAN_STEPS); its requests' lengths are uniform on [(1 - BURST_SPREAD) m_w, (1 + BURST_SPREAD) m_w].
    Its batch fraction: BURST_FLOOR rising linearly to 1 over BURST_FILL_STEPS, 1 until the shortest request
    finishes, then falling linearly (the uniform lengths' survival) to BURST_FLOOR, where the next wave starts.
    -> int [steps], each in [ceil(BURST_FLOOR x batch), batch].
    """
    fracs: list[npt.NDArray[np.float64]] = []
    total = 0
    while total < steps:
        m = BURST_MEAN_STEPS * rng.uniform(1.0 - BURST_WAVE_JITTER, 1.0 + BURST_WAVE_JITTER)
        fill = BURST_FLOOR + (1.0 - BURST_FLOOR) * (np.arange(BURST_FILL_STEPS) + 1.0) / BURST_FILL_STEPS
        hold = np.ones(max(0, round((1.0 - BURST_SPREAD) * m) - BURST_FILL_STEPS))
        drain_steps = max(1, round(2.0 * BURST_SPREAD * m * (1.0 - BURST_FLOOR)))
        drain = 1.0 - (1.0 - BURST_FLOOR) * (np.arange(drain_steps) + 1.0) / drain_steps
        wave = np.concatenate([fill, hold, drain])
        fracs.append(wave)
        total += wave.size
    frac = np.concatenate(fracs)[:steps]
    out: npt.NDArray[np.int64] = np.clip(np.ceil(frac * batch), np.ceil(BURST_FLOOR * batch), batch).astype(np.int64)
    return out


def burst_steps(
    totals: npt.NDArray[np.integer], top_k: int, batch: int, steps: int, seed: int
) -> npt.NDArray[np.uint32]:
    """A cold start of counts-only data: step t draws burst_batches(...)[t] x top_k choices per layer from the
    aggregate `totals [L, E]` (multinomial, as `sample_steps`). Seeded: the same arguments give the same counts.

    Models: the batch's fill, hold and drain in waves of requests that arrive and finish together. Does not
    model: which experts a burst picks (every step draws from the source's own distribution: counts-only data
    has no token order, so a wave's content cannot be told from it, and ESFT's lockstep lanes through a shared
    prompt template have no analogue here), prefill steps (the trace is of decode steps), or any correlation
    between a request's tokens. -> uint32 [steps, L, E]."""
    rng = np.random.default_rng(seed)
    sizes = burst_batches(batch, steps, rng)
    p = totals.astype(np.float64)
    p = p / p.sum(axis=1, keepdims=True)
    out = np.stack([rng.multinomial(sizes * top_k, p[j]) for j in range(p.shape[0])], axis=1)
    return out.astype(np.uint32)


def burst_parameters() -> dict[str, float]:
    """The burst construction's constants, as results.json records them."""
    return {"mean_steps": BURST_MEAN_STEPS, "wave_jitter": BURST_WAVE_JITTER, "spread": BURST_SPREAD,
            "fill_steps": BURST_FILL_STEPS, "floor": BURST_FLOOR}


# ---- skewed expert shares built from a description (no recorded data) ---------------------------------
# For model families the repository has no data of (issue 49 describes two: a top-1-of-128 model whose hottest
# expert takes about a quarter of a layer's tokens, a top-4-of-32 model). Each layer's expert shares fall as a
# power of their rank, the exponent set so that the hottest takes `hot`; which expert holds which rank is a
# seeded permutation per layer (another seed: another mix, a drift). Steps are drawn from the shares as for
# counts-only data (`sample_steps`, `burst_steps`).


def zipf_totals(layers: int, experts: int, hot: float, seed: int) -> npt.NDArray[np.int64]:
    """[layers, experts] totals (shares x 1e9) whose hottest expert takes `hot` of each layer's tokens."""
    if not (layers >= 1 and experts >= 2 and 1.0 / experts < hot < 1.0):
        raise ValueError(f"zipf: layers={layers}, experts={experts}, hot={hot}: expected layers >= 1, experts >= 2 "
                         f"and 1/experts < hot < 1")
    r = np.arange(1, experts + 1, dtype=np.float64)
    lo, hi = 0.0, 20.0
    for _ in range(100):  # the hottest's share rises with the exponent: bisect for it
        mid = 0.5 * (lo + hi)
        w = r ** -mid
        lo, hi = (mid, hi) if w[0] / w.sum() < hot else (lo, mid)
    w = r ** -(0.5 * (lo + hi))
    rng = np.random.default_rng([seed, 1])
    shares = np.stack([rng.permutation(w / w.sum()) for _ in range(layers)])
    return np.rint(shares * 1e9).astype(np.int64)


def import_zipf(spec: str, batch: int = 2048, steps: int = 2000, seed: int = 0, burst: bool = False) -> Trace:
    """spec EXPERTS/TOP_K/HOT/LAYERS/MIX_SEED (e.g. 128/1/0.25/6/7): `zipf_totals` drawn as a constant batch, or
    in burst waves (a cold start)."""
    try:
        e, k, hot, layers, mix = spec.split("/")
        E, K, H, L, M = int(e), int(k), float(hot), int(layers), int(mix)
    except ValueError:
        raise ValueError(f"zipf:{spec}: expected EXPERTS/TOP_K/HOT/LAYERS/MIX_SEED, e.g. zipf:128/1/0.25/6/7") from None
    if not 1 <= K <= E:
        raise ValueError(f"zipf:{spec}: top_k {K} must be within 1..{E}")
    totals = zipf_totals(L, E, H, M)
    counts = (burst_steps if burst else sample_steps)(totals, K, batch, steps, seed)
    return Trace(counts, f"zipf-{E}x{K}", K, f"zipf:{spec}",
                 "sampled" + (", burst waves (cold start)" if burst else ""))


def import_olmoe(model: str, domain: str, batch: int = 2048, steps: int = 2000, seed: int = 0,
                 kind: str = "expert_counts", root: Path = OLMOE_DIR, burst: bool = False) -> Trace:
    """burst: a cold start (burst_steps: the batch fills and drains in waves) instead of a constant batch."""
    d = json.loads((root / model / kind / f"{domain}.json").read_text())
    totals = np.array(d["counts"], dtype=np.int64)
    counts = (burst_steps if burst else sample_steps)(totals, int(d["top_k"]), batch, steps, seed)
    return Trace(counts, d["model"], int(d["top_k"]), f"olmoe:{model}/{domain} layers {d['layers']}",
                 "sampled" + (", burst waves (cold start)" if burst else ""))


def read_sglang_logical_count(path: Path) -> npt.NDArray[np.int64]:
    """Totals [L, E] of an SGLang expert-distribution dump (`logical_count` [.., L, E], any leading dims
    summed); all-zero rows (dense layers, e.g. DeepSeek-V3's first 3) are dropped, so L counts MoE layers."""
    if not path.exists():
        raise ValueError(f"{path}: no such file (sglang:NAME looks in {SGLANG_DIR})")
    if path.suffix == ".json":
        d = json.loads(path.read_text())
        if "logical_count" not in d:
            raise ValueError(f"{path}: no 'logical_count' field")
        arr = np.array(d["logical_count"], dtype=np.int64)
    else:
        with np.load(path, allow_pickle=False) as z:
            if "logical_count" not in z:
                raise ValueError(f"{path}: no 'logical_count' array")
            arr = np.asarray(z["logical_count"], dtype=np.int64)
    while arr.ndim > 2:
        arr = arr.sum(axis=0)
    if arr.ndim != 2 or (arr < 0).any():
        raise ValueError(f"{path}: logical_count has shape {arr.shape}; expected non-negative [.., L, E]")
    arr = arr[arr.sum(axis=1) > 0]
    if arr.shape[0] == 0:
        raise ValueError(f"{path}: every layer's count is zero")
    out: npt.NDArray[np.int64] = arr
    return out


def sglang_path(spec: str) -> Path:
    """`decode_in500out1500` (in the shared DeepSeek-V3 folder, .json implied) or a path to a dump."""
    p = Path(spec)
    if p.suffix in (".json", ".npz") and (p.exists() or p.parent != Path(".")):
        return p
    return SGLANG_DIR / (spec if spec.endswith(".json") else spec + ".json")


def import_sglang_logical_count(path: Path, top_k: int, batch: int, steps: int, seed: int,
                                burst: bool = False) -> Trace:
    """A per-step series sampled from an SGLang dump's totals: batch x top_k multinomial draws per layer
    (burst: from a cold start, burst_steps, the batch filling and draining in waves up to `batch`)."""
    arr = read_sglang_logical_count(path)
    counts = (burst_steps if burst else sample_steps)(arr, top_k, batch, steps, seed)
    model = "DeepSeek-V3" if arr.shape == (58, 256) else "unknown"
    return Trace(counts, model, top_k, f"sglang:{path.stem}",
                 f"sampled, batch {batch}" + (", burst waves (cold start)" if burst else ""))


def moving_average(x: npt.NDArray[np.float64], w: int) -> npt.NDArray[np.float64]:
    """Trailing mean over the last `w` values (fewer at the start). [T] -> [T]."""
    c = np.concatenate([[0.0], np.cumsum(x)])
    idx = np.arange(1, x.size + 1)
    lo = np.maximum(0, idx - w)
    out: npt.NDArray[np.float64] = (c[idx] - c[lo]) / (idx - lo)
    return out
