"""Stability profile: Spearman against a brute-force reference, classes, serialisation, `emoe profile`."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.cli import main as emoe
from bench.traces import Trace
from controlplane.errors import InvalidShape
from controlplane.profile import ExpertClass, StabilityProfile, build_profile, rankdata, spearman


def brute_spearman(a: list[float], b: list[float]) -> float:
    """Pearson correlation of average ranks, ranks counted pair by pair."""
    def ranks(x: list[float]) -> list[float]:
        return [sum(1 for y in x if y < v) + (sum(1 for y in x if y == v) + 1) / 2 for v in x]
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den else float("nan")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=2, max_size=12))
def test_spearman_equals_brute_force(pairs: list[tuple[int, int]]) -> None:
    a = [float(x) for x, _ in pairs]
    b = [float(y) for _, y in pairs]
    got, want = float(spearman(a, b)), brute_spearman(a, b)
    assert (np.isnan(got) and np.isnan(want)) or got == pytest.approx(want, abs=1e-12)


def test_rankdata_ties() -> None:
    assert rankdata([10, 20, 10, 30]).tolist() == [1.5, 3.0, 1.5, 4.0]
    assert rankdata([[3, 1, 2], [1, 1, 1]]).tolist() == [[3.0, 1.0, 2.0], [2.0, 2.0, 2.0]]


def _trace(rng: np.random.Generator, p: np.ndarray, steps: int, tokens: int = 4000) -> np.ndarray:
    return np.stack([rng.multinomial(tokens, p[i], size=steps) for i in range(p.shape[0])], axis=1).astype(np.uint32)


def test_classes() -> None:
    rng = np.random.default_rng(0)
    E = 16
    base = np.ones((1, E))
    base[0, 0] = 6.0  # hot in both traces: stable_hot
    base[0, 15] = 0.1  # cold in both: stable_cold
    a, b = base.copy(), base.copy()
    a[0, 7] = 6.0  # hot only in trace a: bursty_hot
    t1 = _trace(rng, a / a.sum(axis=1, keepdims=True), 300)
    t2 = _trace(rng, b / b.sum(axis=1, keepdims=True), 300)
    # expert 9 bursts: hot in one window of trace b only
    t2[100:200, 0, 9] += 2000
    prof = build_profile([t1, t2], ("a", "b"), window=100)
    assert prof.classes[0, 0] == ExpertClass.STABLE_HOT
    assert prof.classes[0, 15] == ExpertClass.STABLE_COLD
    assert prof.classes[0, 7] == ExpertClass.BURSTY_HOT
    assert prof.classes[0, 9] == ExpertClass.BURSTY_HOT and prof.burstiness[0, 9] > 0.5
    assert prof.classes[0, 3] == ExpertClass.NEUTRAL
    assert prof.rank[0, 0] == 0 and sorted(prof.rank[0].tolist()) == list(range(E))
    assert prof.class_counts().sum() == E and prof.spearman.shape == (1,)
    assert -1.0 <= float(prof.spearman[0]) <= 1.0


def test_roundtrip_and_errors() -> None:
    rng = np.random.default_rng(1)
    p = np.full((2, 8), 1 / 8)
    prof = build_profile([_trace(rng, p, 50), _trace(rng, p, 50), _trace(rng, p, 50)], window=10)
    back = StabilityProfile.from_bytes(prof.to_bytes())
    for f in ("classes", "rank", "share", "spearman", "burstiness", "autocorr"):
        assert np.array_equal(getattr(back, f), getattr(prof, f), equal_nan=True)
    assert back.sources == ("trace0", "trace1", "trace2") and back.window == 10
    with pytest.raises(InvalidShape):
        StabilityProfile.from_bytes(b"not an npz")
    with pytest.raises(InvalidShape):
        build_profile([_trace(rng, p, 5)])
    with pytest.raises(InvalidShape):
        build_profile([_trace(rng, p, 5), _trace(rng, np.full((3, 8), 1 / 8), 5)])


def test_spearman_of_identical_and_reversed_traces() -> None:
    rng = np.random.default_rng(2)
    p = np.arange(1, 17, dtype=float)[None] ** 2
    t = _trace(rng, p / p.sum(), 100, tokens=100000)
    rev = t[:, :, ::-1].copy()
    assert build_profile([t, t]).spearman[0] == pytest.approx(1.0)
    assert build_profile([t, rev]).spearman[0] == pytest.approx(-1.0, abs=0.01)
    combos = list(itertools.combinations(range(3), 2))
    assert len(combos) == 3  # three traces -> three pairs averaged
    assert build_profile([t, t, rev]).spearman[0] == pytest.approx((1 - 1 - 1) / 3, abs=0.01)


def test_emoe_profile_cli(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(3)
    p = np.ones((2, 8))
    p[:, 0] = 5
    p /= p.sum(axis=1, keepdims=True)
    paths = []
    for i in range(2):
        path = tmp_path / f"t{i}.npz"
        Trace(_trace(rng, p, 120), "m", 2, f"src{i}", "synthetic").save(path)
        paths.append(path)
    out = tmp_path / "p.npz"
    assert emoe(["profile", "--trace", str(paths[0]), "--trace", str(paths[1]), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "spearman" in text and "stable_hot" in text and "src0" in text
    from agent.cli.profile import load_profile

    prof = load_profile(out)
    assert prof.shape == (2, 8) and prof.classes[0, 0] == ExpertClass.STABLE_HOT
    assert emoe(["profile", "--trace", str(paths[0]), "--out", str(out)]) == 2
    assert emoe(["profile", "--trace", str(tmp_path / "missing.npz"), "--trace", str(paths[0]),
                 "--out", str(out)]) == 2  # bad input (agent.cli.exits)
