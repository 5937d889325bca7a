"""The router's CUDA kernel (`csrc/router.cu`): compile with nvcc, launch with CuPy where a GPU is.

`nvcc_compile` is what CI runs wherever `nvcc` exists (no GPU needed); `CudaRouter` runs the kernel
(needs `cupy`, the `cuda` extra, and a GPU) with the same tables as the torch `RouteTables`.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from dataplane_shim.errors import BadInput

KERNEL = Path(__file__).resolve().parent / "csrc" / "router.cu"
BLOCK = 256


def nvcc_compile(out_dir: Path, *, ptx: bool = True, arch: str = "sm_90") -> Path:
    """Compile the kernel with nvcc (`--ptx`, or `-c` to an object file); raises FileNotFoundError without nvcc."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc not on PATH")
    out = out_dir / ("router.ptx" if ptx else "router.o")
    cmd = [nvcc, f"-arch={arch}", "-std=c++17", "-O3", "--ptx" if ptx else "-c", str(KERNEL), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"nvcc failed ({r.returncode}): {r.stderr.strip()}")
    return out


class CudaRouter:
    """Routes one layer on the GPU. pref [E, W], logcnt [E] (int64, any array CuPy accepts)."""

    def __init__(self, pref: Any, logcnt: Any) -> None:
        import cupy as cp

        self.cp = cp
        self.pref = cp.ascontiguousarray(cp.asarray(pref, dtype=cp.int64))
        self.logcnt = cp.ascontiguousarray(cp.asarray(logcnt, dtype=cp.int64))
        self.E, self.W = int(self.pref.shape[0]), int(self.pref.shape[1])
        self.counts = cp.zeros(self.E, dtype=cp.int64)
        self.kernel = cp.RawModule(code=KERNEL.read_text(), options=("-std=c++17",)).get_function("emoe_route")

    def route(self, topk_ids: Any) -> Any:
        cp = self.cp
        ids = cp.ascontiguousarray(cp.asarray(topk_ids, dtype=cp.int64))
        flat = ids.reshape(-1)
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= self.E):
            raise BadInput(f"topk_ids outside 0..{self.E - 1}")
        out = cp.full(flat.shape, -1, dtype=cp.int64)
        self.kernel((self.E,), (BLOCK,), (flat, cp.int64(flat.size), self.pref, self.logcnt, self.counts, out,
                                         cp.int32(self.E), cp.int32(self.W)))
        return out.reshape(ids.shape)
