from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED_TRACES = ROOT.parent / "shared" / "traces"


def need_shared_traces() -> Path:
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"real traces not found at {SHARED_TRACES}")
    return SHARED_TRACES


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real etcd (agent.etcd_backend.EtcdProcess) for one test module; skipped when etcd is not installed."""
    from agent.etcd_backend import EtcdProcess

    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd binary not found (Debian: apt-get install etcd-server, or `make etcd`)")
    p = EtcdProcess(binary, str(tmp_path_factory.mktemp("etcd")))
    try:
        p.wait_ready()
        yield p
    finally:
        p.stop()
