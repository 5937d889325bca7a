from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED_TRACES = ROOT.parent / "shared" / "traces"


def need_shared_traces() -> Path:
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"real traces not found at {SHARED_TRACES}")
    return SHARED_TRACES
