"""The plugins' engine version check through the engines' own plugin loaders (run by
tests/engines/test_engine_version.py with the engine virtualenv; prints one JSON line):

- the installed vLLM and SGLang are the releases pyproject.toml pins (the Makefile installs them): `check` says
  TESTED for both, from their own version modules;
- vLLM's `load_general_plugins()` with EMOE_SOCKET set and its version faked (`vllm.version.__version__`, which
  the check reads): our `register()` refuses and vLLM lets the refusal out (the process would stop); run again
  with EMOE_ALLOW_UNTESTED_ENGINE=1 it patches `EplbState.add_model`;
- SGLang's `load_plugins()`, its version faked the same way: SGLang logs our refusal and goes on, and the
  `EPLBManager` its `ModelRunner` would build raises the refusal.
Warnings logged by `dataplane_shim.engine_version` are counted (one per process and engine under the override).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_ranks import stub_torchvision  # noqa: E402


class Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def refusal(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - what the engine's loader lets out is the finding
        return f"{type(e).__name__}: {e}"
    return ""


def main() -> None:
    stub_torchvision()
    warned = Count()
    logging.getLogger("dataplane_shim.engine_version").addHandler(warned)
    from dataplane_shim import engine_version as ev

    doc: dict[str, Any] = {e: {"running": ev.running_version(e), "tested": ev.tested_version(e),
                               "check": ev.check(e, {}).value} for e in ("vllm", "sglang")}
    os.environ["EMOE_SOCKET"] = "/nonexistent/shim{rank}.sock"
    os.environ.pop(ev.ALLOW_ENV, None)

    import vllm.plugins
    import vllm.version
    from vllm.distributed.eplb.eplb_state import EplbState

    from dataplane_shim import vllm_plugin

    vllm.version.__version__ = "0.31.9"
    original = EplbState.add_model
    doc["vllm"]["refused"] = refusal(vllm.plugins.load_general_plugins)
    doc["vllm"]["patched_when_refused"] = EplbState.add_model is not original
    os.environ[ev.ALLOW_ENV] = "1"
    vllm.plugins.plugins_loaded = False
    doc["vllm"]["allowed"] = refusal(vllm.plugins.load_general_plugins)
    doc["vllm"]["patched_when_allowed"] = EplbState.add_model is not original and vllm_plugin.status()["patched"]
    ev.check("vllm")  # a second check in this process: no second warning

    del os.environ[ev.ALLOW_ENV]
    import sglang.srt.model_executor.model_runner as mr
    import sglang.srt.plugins
    import sglang.version

    sglang.version.__version__ = "0.5.22"
    doc["sglang"]["refused"] = refusal(sglang.srt.plugins.load_plugins)  # SGLang logs it and goes on
    doc["sglang"]["eplb_manager_refuses"] = refusal(lambda: mr.EPLBManager(model_config=None))
    doc["warnings"] = warned.messages
    print("RESULT " + json.dumps(doc), flush=True)


if __name__ == "__main__":
    main()
