"""`emoe profile`: build a stability profile from two or more native traces and save it as .npz."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from controlplane.errors import ControlPlaneError
from controlplane.profile import CLASS_NAMES, StabilityProfile, build_profile


def load_profile(path: str | Path) -> StabilityProfile:
    """Read a profile written by `emoe profile` (raises controlplane.errors.InvalidShape if malformed)."""
    return StabilityProfile.from_bytes(Path(path).read_bytes())


def save_profile(profile: StabilityProfile, path: str | Path) -> None:
    Path(path).write_bytes(profile.to_bytes())


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("profile", help="stability profile (stable_hot, bursty_hot, neutral, stable_cold) from traces")
    p.add_argument("--trace", action="append", type=Path, required=True, metavar="FILE",
                   help="a native .npz trace (emoe trace import); give two or more")
    p.add_argument("--out", type=Path, required=True, help="where to write the profile (.npz)")
    p.add_argument("--window", type=int, default=100, help="steps per window for burstiness (default 100)")
    p.add_argument("--hot", type=float, default=1.5, help="hot: share >= HOT / experts (default 1.5)")
    p.add_argument("--cold", type=float, default=0.5, help="cold: share <= COLD / experts (default 0.5)")
    p.add_argument("--bursty-cv", type=float, default=0.5, help="bursty: windowed-share CV above this (default 0.5)")
    p.set_defaults(func=profile_cmd)


def profile_cmd(args: argparse.Namespace) -> int:
    from controlplane.tracefile import load_trace

    if len(args.trace) < 2:
        print("emoe profile: give two or more --trace files", file=sys.stderr)
        return 2
    if args.window < 1:
        print(f"emoe profile: --window {args.window}: expected >= 1", file=sys.stderr)
        return 2
    try:
        traces = [load_trace(p) for p in args.trace]
        prof = build_profile([t.counts for t in traces], tuple(t.source or str(p) for t, p in zip(traces, args.trace,
                             strict=True)), args.window, args.hot, args.cold, args.bursty_cv)
    except (OSError, ValueError, ControlPlaneError) as e:  # an unreadable, malformed or mismatched trace
        print(f"emoe profile: {e}", file=sys.stderr)
        return 2
    try:
        save_profile(prof, args.out)
    except OSError as e:
        print(f"emoe profile: {args.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    L, E = prof.shape
    print(f"wrote {args.out}: {L} layers x {E} experts from {len(traces)} traces, window {prof.window}")
    for i, src in enumerate(prof.sources):
        print(f"  trace {i}: {src}")
    counts = prof.class_counts()
    print(f"{'layer':>5}  {'spearman':>8}  " + "  ".join(f"{n:>11}" for n in CLASS_NAMES))
    for layer in range(L):
        rho = prof.spearman[layer]
        cells = "  ".join(f"{int(c):>11}" for c in counts[layer])
        print(f"{layer:>5}  {rho:>8.3f}  {cells}")
    tot = counts.sum(axis=0)
    print(f"{'all':>5}  {float(prof.spearman.mean()):>8.3f}  " + "  ".join(f"{int(c):>11}" for c in tot))
    return 0
