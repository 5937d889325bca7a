"""Version counters: each rank publishes the table version it runs; senders read them before a dispatch.

Two implementations of one small interface (`publish`, `read`, `close`):
- `SharedCounters`: a `multiprocessing.shared_memory` block holding int64 `[G]`, one slot per rank, for
  engine processes on one host (aligned 8-byte stores and loads are single instructions: a reader sees the
  old or the new version, never a torn one).
- `DeviceCounters`: a torch int64 `[G]` tensor on the engine's device, for ranks simulated in one process.

Mapping onto RDMA immediate-data counters (pplx-garden style). On a fabric, a rank does not poll a remote
integer; every one-sided write that carries tokens also carries a 32-bit immediate, and the receiver's
completion queue bumps a per-sender counter. The shim puts the low `IMM_VERSION_BITS` bits of the sending
version in that immediate (`imm_encode`); the receiver reconstructs the full version against its own
(`imm_decode`, exact while the two differ by less than 2**(bits-1), which the bounded wait guarantees) and
compares it with the version it runs: equal -> consume; older -> stale, NACK so the sender refreshes and
re-sends; newer -> hold until it swaps. The version each rank runs is published the same way, as an
immediate-only write to every peer at each swap, so `read()` is a local load on every fabric.
"""

from __future__ import annotations

import time
from multiprocessing import shared_memory
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from dataplane_shim.errors import BadInput

I64 = npt.NDArray[np.int64]
IMM_VERSION_BITS = 16


class VersionCounters(Protocol):
    def publish(self, rank: int, version: int) -> None: ...

    def read(self) -> I64:
        """[G] int64 snapshot of every rank's running version."""
        ...


class SharedCounters:
    """int64 [ranks] in shared memory named `name`; `create=True` makes (and `unlink` removes) it."""

    def __init__(self, name: str, ranks: int, *, create: bool = False) -> None:
        if ranks < 1:
            raise BadInput(f"ranks={ranks}: expected >= 1")
        self.ranks = ranks
        self._shm = shared_memory.SharedMemory(name=name, create=create, size=8 * ranks)
        self._arr: I64 = np.ndarray((ranks,), dtype=np.int64, buffer=self._shm.buf)
        if create:
            self._arr[:] = 0

    @property
    def name(self) -> str:
        return self._shm.name

    def publish(self, rank: int, version: int) -> None:
        self._arr[rank] = version

    def read(self) -> I64:
        return self._arr.copy()

    def close(self) -> None:
        del self._arr
        self._shm.close()

    def unlink(self) -> None:
        self._shm.unlink()


class DeviceCounters:
    """int64 [ranks] torch tensor on `device` (imports torch when built)."""

    def __init__(self, ranks: int, device: Any = "cpu") -> None:
        import torch

        if ranks < 1:
            raise BadInput(f"ranks={ranks}: expected >= 1")
        self.ranks = ranks
        self.tensor = torch.zeros(ranks, dtype=torch.int64, device=device)
        # on the CPU, a numpy view of the same memory: 8-byte stores and loads without torch dispatch
        self._host: I64 | None = self.tensor.numpy() if self.tensor.device.type == "cpu" else None

    def publish(self, rank: int, version: int) -> None:
        if self._host is not None:
            self._host[rank] = version
        else:
            self.tensor.narrow(0, rank, 1).fill_(version)

    def read(self) -> I64:
        if self._host is not None:
            return self._host.copy()
        out: I64 = self.tensor.cpu().numpy().copy()
        return out

    def close(self) -> None:
        pass


def imm_encode(version: int, bits: int = IMM_VERSION_BITS) -> int:
    """The low `bits` bits of `version`, as carried in an RDMA immediate."""
    return version & ((1 << bits) - 1)


def imm_decode(imm: int, reference: int, bits: int = IMM_VERSION_BITS) -> int:
    """The version nearest `reference` whose low `bits` bits are `imm` (exact within +-2**(bits-1))."""
    mod = 1 << bits
    delta = (imm - reference) % mod
    if delta >= mod // 2:
        delta -= mod
    return reference + delta


def wait_until_caught_up(
    counters: VersionCounters, ranks: I64, version: int, *, polls: int = 200, sleep_s: float = 50e-6
) -> I64:
    """Bounded wait for `ranks` to reach `version`: poll at most `polls` times. Returns their last versions."""
    seen = counters.read()[ranks]
    for _ in range(polls):
        if (seen >= version).all():
            break
        time.sleep(sleep_s)
        seen = counters.read()[ranks]
    return seen
