"""The router's CUDA kernel: compiled by nvcc wherever nvcc exists; run against the torch router on a GPU."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from dataplane_shim.cuda import nvcc_compile


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: the CUDA kernel is not compiled")
@pytest.mark.parametrize("ptx", [True, False], ids=["ptx", "object"])
def test_kernel_compiles_with_nvcc(tmp_path: Path, ptx: bool) -> None:
    out = nvcc_compile(tmp_path, ptx=ptx)
    assert out.stat().st_size > 0
    if ptx:
        assert ".entry emoe_route" in out.read_text()


def test_gpu_kernel_equals_torch_router() -> None:
    torch = pytest.importorskip("torch")
    cp = pytest.importorskip("cupy", reason="cupy (the `cuda` extra) is not installed: kernel not run")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device: kernel not run")
    except cp.cuda.runtime.CUDARuntimeError as exc:
        pytest.skip(f"no usable CUDA device: {exc}")
    from bench.shim import replicated_table, skewed_topk
    from controlplane.topology import Topology
    from dataplane_shim.cuda import CudaRouter
    from dataplane_shim.router import Router, RouteTables

    topo = Topology(8, 8, 5)
    table = replicated_table(topo, 2, 256, seed=0)
    rt = RouteTables(2, 256, topo.slots)
    rt.load(table, 3)
    ref = Router(2, 256)
    gpu = CudaRouter(rt.pref[1].numpy(), rt.logcnt[1].numpy())
    for seed in range(3):  # several calls in one step: loads accumulate identically
        ids = skewed_topk(4096, 256, 8, seed)
        want = ref.route(rt, 1, torch.from_numpy(ids)).numpy()
        got = cp.asnumpy(gpu.route(ids))
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(cp.asnumpy(gpu.counts), ref.counts[1].numpy())
