"""A node's load window on the wire (the gossip `LoadWindow`): built by its node, checked by every receiver before
anything is stored (bad input changes no state), and decoded for the cluster view. Signatures are
agent/gossip/windowguard.py's; who sends what to whom is agent/gossip/loadgossip.py's."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from agent.gossip.claims import MAX_CERT_BYTES, MAX_SIGNATURE_BYTES
from agent.gossip.membership import MAX_COUNTER
from agent.link.reportguard import MAX_STEP_US
from agent.transport import InvalidArgument
from elasticmoe.loadcodec import RowsError, pack_rows, sample_steps, unpack_rows
from elasticmoe.v1 import gossip_pb2 as pb


@dataclass(frozen=True)
class NodeWindow:
    node_id: str
    incarnation: int
    window_seq: int
    first_step: int
    steps: int
    counts: npt.NDArray[np.uint32]  # [L, E], read-only
    samples: npt.NDArray[np.uint32] | None = None  # [S, L, E]: the sampled steps' counts (loadcodec), or None
    step_us: npt.NDArray[np.uint32] | None = None  # [S]: the sampled steps' wall times (LoadWindow.step_us), or None
    step_version: npt.NDArray[np.uint32] | None = None  # [S]: the version each ran on (LoadWindow.step_version), or None
    stride_us: npt.NDArray[np.uint32] | None = None  # [S]: their strides' mean times (LoadWindow.stride_us), or None


def check_windows(windows: Iterable[pb.LoadWindow], shape: tuple[int, int] | None) -> None:
    """Reject malformed windows before any is stored (bad input changes no state)."""
    for w in windows:
        if not w.node_id or w.layers < 1 or w.experts < 1:
            raise InvalidArgument(f"window of {w.node_id!r} with shape [{w.layers}, {w.experts}]: expected a node "
                                  "id and a shape of at least [1, 1]")
        if max(w.incarnation, w.window_seq) >= 2**63:  # newest-wins: such a window could never be replaced
            raise InvalidArgument(f"window of {w.node_id!r} with incarnation {w.incarnation}, window_seq "
                                  f"{w.window_seq}: expected both < 2^63")
        if len(w.counts) != 4 * w.layers * w.experts:
            raise InvalidArgument(f"window of {w.node_id!r}: {len(w.counts)} count bytes, expected "
                                  f"4 x {w.layers} x {w.experts} = {4 * w.layers * w.experts}")
        if w.incarnation >= MAX_COUNTER or w.window_seq >= MAX_COUNTER:
            raise InvalidArgument(f"window of {w.node_id!r}: incarnation {w.incarnation} or window_seq "
                                  f"{w.window_seq} >= 2^63")
        if len(w.signature) > MAX_SIGNATURE_BYTES or len(w.certificate) > MAX_CERT_BYTES:
            raise InvalidArgument(f"window of {w.node_id!r}: signature of {len(w.signature)} bytes, certificate of "
                                  f"{len(w.certificate)}: expected at most {MAX_SIGNATURE_BYTES} and {MAX_CERT_BYTES}")
        if shape is not None and (w.layers, w.experts) != shape:
            raise InvalidArgument(f"window of {w.node_id!r} has shape [{w.layers}, {w.experts}], expected "
                                  f"[{shape[0]}, {shape[1]}]")
        if bool(w.samples) != bool(w.sample_every):
            raise InvalidArgument(f"window of {w.node_id!r}: {len(w.samples)} bytes of samples with sample_every "
                                  f"{w.sample_every}: expected both or neither")
        if w.samples:
            try:
                window_samples(w)
            except RowsError as e:
                raise InvalidArgument(f"window of {w.node_id!r}: {e}") from None
        if w.step_us:
            n = len(sample_steps(w.first_step, w.steps, w.sample_every)) if w.samples else 0
            if len(w.step_us) != 4 * n:
                raise InvalidArgument(f"window of {w.node_id!r}: step_us of {len(w.step_us)} bytes: expected one "
                                      f"little-endian uint32 per sampled step its samples hold ({n} x 4)")
            t = np.frombuffer(w.step_us, dtype="<u4")
            if n and not (int(t.min()) >= 1 and int(t.max()) <= MAX_STEP_US):
                i = int(np.flatnonzero((t < 1) | (t > MAX_STEP_US))[0])
                raise InvalidArgument(f"window of {w.node_id!r}: step_us[{i}] = {int(t[i])}: expected a sampled step's "
                                      f"wall time of 1 .. {MAX_STEP_US} microseconds")
        if w.step_version:
            v = _beside_step_us(w, "step_version", w.step_version)
            if int(v.min()) < 1:
                i = int(np.flatnonzero(v < 1)[0])
                raise InvalidArgument(f"window of {w.node_id!r}: step_version[{i}] = 0: expected the table version "
                                      "the step ran on, >= 1")
        if w.stride_us:
            t = _beside_step_us(w, "stride_us", w.stride_us)
            if not (int(t.min()) >= 1 and int(t.max()) <= MAX_STEP_US):
                i = int(np.flatnonzero((t < 1) | (t > MAX_STEP_US))[0])
                raise InvalidArgument(f"window of {w.node_id!r}: stride_us[{i}] = {int(t[i])}: expected a mean wall "
                                      f"time of 1 .. {MAX_STEP_US} microseconds")


def _beside_step_us(w: pb.LoadWindow, name: str, raw: bytes) -> npt.NDArray[np.uint32]:
    """A per-sampled-step field that comes with step_us (step_version, stride_us), decoded: one uint32 for each
    of step_us's, else InvalidArgument naming it."""
    n = len(w.step_us) // 4
    if len(raw) != 4 * n or not n:
        raise InvalidArgument(f"window of {w.node_id!r}: {name} of {len(raw)} bytes: expected one little-endian "
                              f"uint32 per sampled step its step_us holds ({n} x 4)")
    return np.frombuffer(raw, dtype="<u4")


def make_window(node_id: str, incarnation: int, window_seq: int, first_step: int, steps: int,
                counts: npt.NDArray[np.integer], learner: bool = False, samples: npt.NDArray[np.uint32] | None = None,
                sample_every: int = 0, step_us: npt.NDArray[np.uint32] | None = None,
                step_version: npt.NDArray[np.uint32] | None = None,
                stride_us: npt.NDArray[np.uint32] | None = None) -> pb.LoadWindow:
    """A node's LoadWindow, unsigned: counts uint32 [L, E] and, with `sample_every`, its sampled steps' counts
    [S, L, E] zlib-compressed, their wall times `step_us` [S] (microseconds; None: not measured), the table
    version each ran on `step_version` [S] (None: not known) and their strides' mean times `stride_us` [S]
    (None: not measured); ValueError names what does not fit."""
    c = np.asarray(counts)
    if c.ndim != 2 or c.size == 0:
        raise ValueError(f"counts shape {c.shape}: expected [layers, experts]")
    shape = (int(c.shape[0]), int(c.shape[1]))
    if (np.issubdtype(c.dtype, np.signedinteger) and c.min() < 0) or int(c.max()) > 0xFFFFFFFF:
        raise ValueError("counts must fit in uint32")
    w = pb.LoadWindow(node_id=node_id, incarnation=incarnation, window_seq=window_seq, layers=shape[0],
                      experts=shape[1], counts=np.ascontiguousarray(c, dtype="<u4").tobytes(), steps=steps,
                      first_step=first_step, learner=learner)
    if samples is not None and sample_every > 0:
        n = len(sample_steps(first_step, steps, sample_every))
        if samples.shape != (n, *shape):
            raise ValueError(f"samples shape {samples.shape}: expected {(n, *shape)}")
        w.samples, w.sample_every = pack_rows(samples), sample_every
        if step_us is not None:
            if np.shape(step_us) != (n,):
                raise ValueError(f"step_us shape {np.shape(step_us)}: expected {(n,)}")
            w.step_us = np.ascontiguousarray(step_us, dtype="<u4").tobytes()
            if step_version is not None:
                v = np.asarray(step_version)
                if v.shape != (n,) or (n and int(v.min()) < 1) or (n and int(v.max()) > 0xFFFFFFFF):
                    raise ValueError(f"step_version {v.tolist()}: expected {n} versions in 1 .. 2^32 - 1")
                w.step_version = np.ascontiguousarray(v, dtype="<u4").tobytes()
            if stride_us is not None:
                if np.shape(stride_us) != (n,):
                    raise ValueError(f"stride_us shape {np.shape(stride_us)}: expected {(n,)}")
                w.stride_us = np.ascontiguousarray(stride_us, dtype="<u4").tobytes()
    return w


def node_window(w: pb.LoadWindow) -> NodeWindow:
    """A checked LoadWindow (check_windows) decoded: counts [L, E] and sampled steps [S, L, E] read-only."""
    counts = np.frombuffer(w.counts, dtype="<u4").reshape(w.layers, w.experts)
    times = np.frombuffer(w.step_us, dtype="<u4") if w.step_us and w.samples else None
    ran = np.frombuffer(w.step_version, dtype="<u4") if times is not None and w.step_version else None
    strides = np.frombuffer(w.stride_us, dtype="<u4") if times is not None and w.stride_us else None
    return NodeWindow(w.node_id, w.incarnation, w.window_seq, w.first_step, w.steps, counts, window_samples(w), times,
                      ran, strides)


def window_samples(w: pb.LoadWindow) -> npt.NDArray[np.uint32] | None:
    """A window's sampled steps [S, L, E] (the steps s of [first_step, first_step + steps) with
    s % sample_every == 0), None when it carries none; RowsError when they do not decode to that shape."""
    if not w.samples:
        return None
    n = len(sample_steps(w.first_step, w.steps, w.sample_every))
    return unpack_rows(w.samples, n, w.layers, w.experts)
