"""Sampled steps of a load window, one rule and one codec for the engine plugins and the agents.

A window's totals show the mean load; a step's time is set by its busiest rank, which the per-step spread
decides. So besides its totals, each load report and each gossiped window carries the per-step counts of the
*sampled* steps in its range: the global steps `s` with `s % every == 0` (every EP rank counts the same
steps, so the rows of every rank and every node line up and sum). At DeepSeek-V3 size a sampled row is a
[58, 256] uint32 matrix, mostly zeros on one node (it hosts a sixteenth of the experts at EP144), so gossip
sends them zlib-compressed (`pack_rows`); the engine link sends them raw (no compression in the engine's
process).
"""

from __future__ import annotations

import zlib

import numpy as np
import numpy.typing as npt

U32 = npt.NDArray[np.uint32]


class RowsError(ValueError):
    """Sampled rows that cannot be decoded; the message names what is wrong."""


def sample_steps(first: int, steps: int, every: int) -> range:
    """The sampled global steps in [first, first + steps): those divisible by `every` (none when every = 0)."""
    if every <= 0 or steps <= 0:
        return range(0)
    start = -(-first // every) * every
    return range(start, first + steps, every)


def rows_bytes(rows: npt.ArrayLike) -> bytes:
    """Raw little-endian uint32 bytes of rows [n, L, E] (the engine link's form)."""
    r = np.asarray(rows)
    if r.ndim != 3 or r.dtype.kind not in "iu" or (r.size and (int(r.min()) < 0 or int(r.max()) > 0xFFFFFFFF)):
        raise RowsError(f"sampled rows shape {r.shape} dtype {r.dtype}: expected uint32 [n, layers, experts]")
    return np.ascontiguousarray(r, dtype="<u4").tobytes()


def rows_from_bytes(data: bytes, n: int, layers: int, experts: int) -> U32:
    """Rows [n, L, E] from raw bytes; RowsError when the size is not n x L x E x 4."""
    if len(data) != 4 * n * layers * experts:
        raise RowsError(f"sampled rows: {len(data)} bytes, expected {n} rows x {layers} x {experts} x 4 = "
                        f"{4 * n * layers * experts}")
    return np.frombuffer(data, dtype="<u4").reshape(n, layers, experts)


def pack_rows(rows: npt.ArrayLike) -> bytes:
    """zlib (level 1: fast; the zeros of experts a node does not host are most of a row) of the raw bytes."""
    return zlib.compress(rows_bytes(rows), 1)


def unpack_rows(data: bytes, n: int, layers: int, experts: int) -> U32:
    """Rows [n, L, E] from `pack_rows` bytes, decompressing at most the expected size (a hostile peer's
    compressed bomb stops there); RowsError names what is wrong."""
    want = 4 * n * layers * experts
    d = zlib.decompressobj()
    try:
        raw = d.decompress(data, want)
    except zlib.error as e:
        raise RowsError(f"sampled rows: not zlib data ({e})") from None
    if len(raw) != want or d.unconsumed_tail or not d.eof:
        raise RowsError(f"sampled rows: expected {n} rows x {layers} x {experts} (uncompressed {want} bytes)")
    return rows_from_bytes(raw, n, layers, experts)


def stride_means(times: npt.ArrayLike, first: int, every: int) -> list[float | None]:
    """The wall time a report's sampled steps report (LoadReport.step_us): for each sampled step of the report
    (`sample_steps(first, len(times), every)`), the mean of the measured times (> 0) of the steps it stands for,
    itself and the following ones up to the next sampled step or the report's end. A step's time is noisy (a
    decode step's jitter is several % of it), its load is not: the stride's mean has a fraction of the noise
    and is set by the same load where the load moves slower than a stride. None where the sampled step itself
    was not measured."""
    t = np.asarray(times, dtype=np.float64).reshape(-1)
    out: list[float | None] = []
    for s in sample_steps(first, t.size, every):
        o = s - first
        if not t[o] > 0:
            out.append(None)
            continue
        stride = t[o:o + every]
        out.append(float(stride[stride > 0].mean()))
    return out
