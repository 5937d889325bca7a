"""The agreement the EP ranks of a collective engine run at each agreement step, and its encoding: one place.

Every EP rank encodes what it holds as int64 [6], the engine's glue takes the element-wise MIN of the ranks'
vectors over the EP CPU group (one all-reduce), and every rank decodes the same reduced vector: it decides alike
(`PluginCore.decide`, `Installer.agreed`). A quantity whose largest value is wanted is sent negated; a yes/no
whose "every rank" is wanted is sent as 0/1. So the MIN of the ranks' encodings is the encoding of their
`merge`, and the decoded fields read:

    slot  sent            field            a rank's value                         after the MIN (every rank alike)
    0     newest          versions.newest  newest certified version it holds      the newest version EVERY rank holds
    1     -oldest         versions.oldest  oldest held newer than the installed   the largest of them (the floor)
    2     step            step_lo          the Installer's step                   the smallest step
    3     -step           step_hi          the Installer's step                   the largest step (equal: lockstep)
    4     -go_on          go_on            the step its agent said to go on from  the largest (0: no agent said one)
                                           (ReportLoadAck.next_step, 0: none)
    5     go_on_said      go_on_said       whether its agent said one             whether EVERY rank's agent said one

Slots 0-1 are the plugin core's own part (`Versions`, int64 [2]: `PluginCore.agreement_vector`, what a
harness that runs cores without an Installer reduces). The layout is the wire format of the all-reduce: the
slots and their order are fixed (every rank of an EP group must run the same layout; a new field takes a new
slot at the end, in every rank at once).

`Collective` is what the engine's glue provides for one rank: the MIN all-reduce of a vector, started at an
agreement step and taken at once (synchronous, or a group of one) or at a later step (overlapped). numpy only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import reduce
from typing import ClassVar, Protocol

import numpy as np
import numpy.typing as npt

from dataplane_shim.errors import BadInput, ShimError

I64 = npt.NDArray[np.int64]


def _slots(values: npt.ArrayLike, n: int, what: str) -> list[int]:
    red = np.asarray(values, dtype=np.int64).reshape(-1)
    if red.shape != (n,):  # the reduced vector of our own collective: a wrong length is a broken invariant
        raise ShimError(f"{what}: expected int64 [{n}], got shape {red.shape}")
    return [int(x) for x in red]


@dataclass(frozen=True)
class Versions:
    """The plugin core's part of the agreement (slots 0-1). From one rank: the newest certified version it holds
    and the oldest it holds newer than the installed one (both the installed version when it holds nothing
    newer). Merged over the ranks (the MIN of the encodings): `newest` is the newest version every rank holds (the
    agreed version), `oldest` the largest oldest (the floor): streams deliver versions in order, so every rank
    holds every version in [oldest, newest] when newest >= oldest."""

    newest: int  # sent as +newest: MIN -> the smallest newest
    oldest: int  # sent as -oldest: MIN -> the largest oldest

    SLOTS: ClassVar[int] = 2

    def encode(self) -> I64:
        """int64 [2]: (newest, -oldest)."""
        return np.array([self.newest, -self.oldest], dtype=np.int64)

    @classmethod
    def decode(cls, values: npt.ArrayLike) -> Versions:
        newest, neg_oldest = _slots(values, cls.SLOTS, "the versions agreement")
        return cls(newest, -neg_oldest)

    def merge(self, other: Versions) -> Versions:
        """What the MIN of the two encodings decodes to."""
        return Versions(min(self.newest, other.newest), max(self.oldest, other.oldest))


@dataclass(frozen=True)
class Agreement:
    """The whole agreement (slots 0-5): the core's `Versions`, then the Installer's schedule and renumbering.
    `step_lo == step_hi` after the MIN proves every rank is at the same step of the schedule; `go_on` is the
    largest step any rank's agent said to go on from (its engine restarted: `Installer.renumber`) and `go_on_said`
    whether every rank's agent has said one. A rank's own value: `Agreement.of_rank`."""

    versions: Versions
    step_lo: int      # sent as +step: MIN -> the smallest step
    step_hi: int      # sent as -step: MIN -> the largest step
    go_on: int        # sent as -go_on: MIN -> the largest go-on step (0: none)
    go_on_said: bool  # sent as 0/1: MIN -> whether every rank's agent said one

    SLOTS: ClassVar[int] = Versions.SLOTS + 4

    @classmethod
    def of_rank(cls, versions: Versions, step: int, go_on: int) -> Agreement:
        """One rank's agreement: what its core holds, its step, the step its agent said to go on from (0: none)."""
        return cls(versions, step, step, go_on, go_on > 0)

    def encode(self) -> I64:
        """int64 [6]: (newest, -oldest, step_lo, -step_hi, -go_on, go_on_said)."""
        return np.concatenate([self.versions.encode(),
                               np.array([self.step_lo, -self.step_hi, -self.go_on, int(self.go_on_said)], np.int64)])

    @classmethod
    def decode(cls, values: npt.ArrayLike) -> Agreement:
        s = _slots(values, cls.SLOTS, "the agreement")
        return cls(Versions.decode(s[:Versions.SLOTS]), s[2], -s[3], -s[4], s[5] > 0)

    def merge(self, other: Agreement) -> Agreement:
        """What the MIN of the two encodings decodes to."""
        return Agreement(self.versions.merge(other.versions), min(self.step_lo, other.step_lo),
                         max(self.step_hi, other.step_hi), max(self.go_on, other.go_on),
                         self.go_on_said and other.go_on_said)

    @staticmethod
    def merged(agreements: Iterable[Agreement]) -> Agreement:
        """The ranks' agreements merged: what every rank decodes from the MIN all-reduce of their encodings."""
        return reduce(Agreement.merge, agreements)


class Collective(Protocol):
    """One rank's side of the agreement's MIN all-reduce over the EP group, provided by the engine's glue."""

    def start_agreement(self, vector: I64) -> I64 | None:
        """Start the MIN all-reduce of this rank's `vector` (every rank at the same step). Returns the reduced
        vector when it completed at once (a synchronous collective, a group of one), else None: it is in flight,
        and `take_agreement` returns it at a later step."""
        ...

    def take_agreement(self) -> I64 | None:
        """The reduced vector of an agreement started at an earlier step, to be taken at this step (on every rank
        at the same step), or None when none is in flight."""
        ...


def check_agree_every(every: int, reduce_min: Callable[[I64], npt.ArrayLike], rank: int) -> None:
    """One collective at attach, on every EP rank: the agreement period must be equal everywhere (the agreement
    is a collective: a rank that enters it at other steps than its peers hangs them). `reduce_min`: the engine's
    all-reduce MIN over the EP group, of int64 [2] (every, -every): after it (smallest, -largest)."""
    lo, neg_hi = _slots(reduce_min(np.array([every, -every], dtype=np.int64)), 2, "the agreement period check")
    if lo != -neg_hi:
        raise BadInput(f"EMOE_AGREE_EVERY differs across the EP ranks ({lo} .. {-neg_hi}; rank {rank} has "
                       f"{every}): set the same value on every rank")
