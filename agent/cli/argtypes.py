"""argparse types with bounds: an out-of-range number on the command line is one argparse error line naming
the argument and the value (`emoe drain: error: argument rank: 99999999999: expected an integer in
0..2147483647`), never a ValueError from deep inside a protobuf constructor."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse `type` accepting integers in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer in {lo}..{hi}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{text}: expected an integer in {lo}..{hi}")
        return v

    parse.__name__ = "integer"  # argparse names the type in some messages
    return parse


def float_in(lo: float, hi: float, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse `type` accepting finite floats in [lo, hi] (or (lo, hi] when lo_open)."""
    left = "(" if lo_open else "["

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a number in {left}{lo}, {hi}]") from None
        ok = math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi
        if not ok:
            raise argparse.ArgumentTypeError(f"{text}: expected a number in {left}{lo}, {hi}]")
        return v

    parse.__name__ = "number"
    return parse
