"""The generated protobuf code is up to date with proto/."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = mod
    spec.loader.exec_module(mod)
    mod.generate(tmp_path)
    fresh = sorted(p.relative_to(tmp_path) for p in (tmp_path / "elasticmoe" / "v1").glob("*_pb2*"))
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "elasticmoe" / "v1").glob("*_pb2*"))
    assert fresh == committed, "generated file set differs: run `make proto`"
    stale = [str(p) for p in fresh if (tmp_path / p).read_bytes() != (ROOT / p).read_bytes()]
    assert not stale, f"out of date with proto/: {stale}; run `make proto`"


def test_packed_table_round_trip() -> None:
    import numpy as np

    from elasticmoe.v1 import consensus_pb2

    phy = np.arange(12, dtype="<i8").reshape(3, 4) - 1
    msg = consensus_pb2.RoutingTable(version=7, parent=6, layers=3, slots=4, phy2log=phy.tobytes())
    back = consensus_pb2.RoutingTable.FromString(msg.SerializeToString())
    assert np.array_equal(np.frombuffer(back.phy2log, "<i8").reshape(3, 4), phy)
    assert (back.version, back.parent) == (7, 6)
