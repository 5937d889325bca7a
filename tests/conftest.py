from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED_TRACES = ROOT.parent / "shared" / "traces"
# Every process a test starts (agents, engine ranks run by .venv-engine, whose editable install may point at
# another checkout) runs this tree's code.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def until(what: str, ok: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll `ok` every 0.2 s until it holds; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.2)


def engine_missing(why: str) -> NoReturn:
    """The engine environment (.venv-engine) is missing or broken: a skip when run by hand, a failure under
    `make test` and `make test-engine`, which set EMOE_REQUIRE_ENGINES=1 after installing it (so that a
    failed install can never pass as a green run whose engine tests quietly skipped)."""
    if os.environ.get("EMOE_REQUIRE_ENGINES") == "1":
        pytest.fail(f"{why} (EMOE_REQUIRE_ENGINES=1: the engine tests must run)", pytrace=False)
    pytest.skip(why)


def need_shared_traces() -> Path:
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"real traces not found at {SHARED_TRACES}")
    return SHARED_TRACES


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real etcd (chaos.etcdserver.EtcdProcess) for one test module; skipped when etcd is not installed."""
    from chaos.etcdserver import EtcdProcess

    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd binary not found (Debian: apt-get install etcd-server, or `make etcd`)")
    p = EtcdProcess(binary, str(tmp_path_factory.mktemp("etcd")))
    try:
        p.wait_ready()
        yield p
    finally:
        p.stop()
