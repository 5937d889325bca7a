"""What every config section's validation shares: the error it raises and the checks that name the field."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field, the value and what was expected."""


def need(cond: bool, field: str, value: object, expected: str) -> None:
    if not cond:
        raise ConfigError(f"{field} = {value!r}: expected {expected}")


def bounded(section: str, obj: object, bounds: dict[str, tuple[int, int]]) -> None:
    """Each named int field of `obj` within its inclusive [lo, hi]. The upper bounds are far above any real
    deployment and low enough that a typo cannot make the agent allocate the host away or overflow a timer."""
    for f, (lo, hi) in bounds.items():
        v = getattr(obj, f)
        need(lo <= v <= hi, f"{section}.{f}", v, f"an integer in {lo}..{hi}")


# timers: one day is far beyond any sane interval and far below what asyncio's timers overflow on
DAY_MS = 86_400_000
