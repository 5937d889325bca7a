"""The wheel works away from the checkout: built with `pip wheel .` (not editable), unpacked in a temporary
directory and imported from another directory, its CLI runs and the demo's bundled traces are inside it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_the_wheel_carries_what_it_needs(tmp_path: Path) -> None:
    import shutil

    wheels = tmp_path / "wheels"
    had_build = (ROOT / "build").exists()
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(wheels), str(ROOT)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f"cannot build a wheel here: {r.stderr.strip().splitlines()[-1]}")
    if not had_build:  # setuptools builds in the checkout: leave it as it was
        shutil.rmtree(ROOT / "build", ignore_errors=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = wheels.glob("elasticmoe-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(site)
    assert "bench/data/esft-intent-b256.npz" in names and "bench/data/esft-law-b256.npz" in names
    assert not any(n.startswith(("tests/", "data/")) for n in names)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    probe = ("import bench.traces as t, agent, sys; assert str(t.BUNDLED).startswith(sys.argv[1]), t.BUNDLED; "
             "assert agent.__file__.startswith(sys.argv[1]), agent.__file__; "
             "print(t.load_trace(t.BUNDLED / 'esft-intent-b256.npz').counts.shape)")
    r = subprocess.run([sys.executable, "-c", probe, str(site)], cwd=elsewhere, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    # the engine pins, read by an installed plugin from the wheel's metadata (no pyproject.toml beside it)
    probe = ("import dataplane_shim.engine_version as ev, sys; assert ev.__file__.startswith(sys.argv[1]); "
             "print(ev.tested_version('vllm'), ev.tested_version('sglang'))")
    r = subprocess.run([sys.executable, "-c", probe, str(site)], cwd=elsewhere, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert r.stdout.split() == [extras["vllm"][0].split("==")[1], extras["sglang"][0].split("==")[1]], r.stdout
    for args in (["--help"], ["demo", "--help"], ["agent", "--config", str(ROOT / "deploy/configs/local-node1.toml"),
                                                  "--check"]):
        r = subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=elsewhere, env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, (args, r.stderr[-2000:])
