"""Which table version each of this node's engine ranks has installed, and since when.

Every load report a rank's plugin sends carries the version its engine runs (`LoadReport.version`: the
version installed, not merely received). `Installs` keeps, per rank of this node, that version, when it
last changed and when the rank last reported, and the time this agent learned each committed version; from
those `lagging` says which ranks have stayed behind the committed head longer than a bound: the watchdog for
an engine that silently stops installing (its rebalancing stalled, a rearrangement hung, a plugin wedged).

A rank lags from the later of (a) when the first version newer than the one it runs was committed here and
(b) when it installed the one it runs: a stream of commits every second does not reset the clock of a rank
that installs none of them. Only this node's ranks report here; other nodes' ranks are their agents'.

A report with an error is its plugin's last word before it stops (GENESIS_MISMATCH: the engine booted with
another placement than the agents' genesis): kept for the rank, whose process then leaves, until the rank
reports a version again.

A report with version 0 says nothing about the install (an evidence-only or tool client that does not fill
it): it counts as a report, not as a version. A rank that never reported a version has no engine attached
as far as installs go: it is never lagging and nothing waits for it. A rank whose link closed is forgotten
(its next process reports afresh). No IO and no clock: times are passed in (seconds, any monotonic base).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

KEEP_COMMITS = 4096  # commit times remembered; a rank further behind than this lags from the oldest one kept


@dataclass(frozen=True)
class RankInstall:
    """One rank's install as this agent knows it at time `now` (seconds); a value to print and compare."""

    rank: int
    installed: int        # the version its engine runs (0: it has not said)
    installed_age_s: float  # since `installed` last changed (-1: never reported a version)
    report_age_s: float   # since it last reported (-1: never)
    lag_s: float          # how long it has been behind the committed head (0: not behind)
    lagging: bool         # behind for longer than the bound
    error: str = ""       # the last fatal error its plugin reported ("" none since it last reported a version)


class Installs:
    """rank -> (installed version, since, last report) for this node's `ranks`, and commit times."""

    def __init__(self, ranks: Iterable[int], bound_s: float) -> None:
        if not bound_s > 0:
            raise ValueError(f"bound_s = {bound_s}: expected > 0")
        self.ranks = frozenset(int(r) for r in ranks)
        self.bound_s = bound_s
        self._installed: dict[int, tuple[int, float]] = {}  # rank -> (version, since)
        self._last: dict[int, float] = {}  # rank -> its last report
        self._versions: list[int] = []  # committed versions learned here, ascending ...
        self._times: list[float] = []   # ... and when each was learned
        self._warned: set[tuple[int, int]] = set()  # (rank, installed version) already reported lagging
        self._errors: dict[int, str] = {}  # rank -> its plugin's last fatal error (kept when its link closes)

    def reported(self, rank: int, version: int, now: float) -> None:
        """A load report from `rank` (ignored if not this node's) saying its engine runs `version`."""
        if rank not in self.ranks:
            return
        self._last[rank] = now
        if version > 0:
            self._errors.pop(rank, None)
        if version > 0 and self._installed.get(rank, (0, 0.0))[0] != version:
            self._installed[rank] = (version, now)

    def failed(self, rank: int, error: str) -> None:
        """`rank`'s plugin reported a fatal error (ignored if not this node's rank)."""
        if rank in self.ranks:
            self._errors[rank] = error

    def committed(self, version: int, now: float) -> None:
        """This agent learned committed `version` at `now` (the recovered head at start, then each commit)."""
        if self._versions and version <= self._versions[-1]:
            return
        self._versions.append(version)
        self._times.append(now)
        if len(self._versions) > KEEP_COMMITS:
            del self._versions[0], self._times[0]

    def forget(self, ranks: Iterable[int]) -> None:
        """The ranks' engine processes left (their links closed): what they ran is no longer known."""
        for r in ranks:
            self._installed.pop(r, None)
            self._last.pop(r, None)

    def last_report(self, rank: int) -> float | None:
        return self._last.get(rank)

    def installed(self, rank: int) -> int:
        """The version `rank`'s engine last said it runs, 0 if it never said."""
        return self._installed.get(rank, (0, 0.0))[0]

    def lag_s(self, rank: int, head: int, now: float) -> float:
        """How long `rank` has been behind committed `head`: 0 if it is not, or never reported a version."""
        got = self._installed.get(rank)
        if got is None or got[0] >= head:
            return 0.0
        version, since = got
        i = bisect.bisect_right(self._versions, version)  # the first version newer than the one it runs
        newer = self._times[i] if i < len(self._times) else now
        return max(0.0, now - max(since, newer))

    def lagging(self, head: int, now: float) -> list[int]:
        """The ranks behind committed `head` for longer than the bound, ascending (the pure watchdog)."""
        return [r for r in sorted(self._installed) if self.lag_s(r, head, now) > self.bound_s]

    def newly_lagging(self, head: int, now: float) -> list[tuple[int, int, float]]:
        """(rank, installed version, lag_s) of each rank lagging now that was not lagging on that version when
        last asked: what the agent logs once per stuck version."""
        out = []
        for r in self.lagging(head, now):
            key = (r, self.installed(r))
            if key not in self._warned:
                self._warned.add(key)
                out.append((r, key[1], self.lag_s(r, head, now)))
        self._warned = {k for k in self._warned if self._installed.get(k[0], (0, 0.0))[0] == k[1]}
        return out

    def view(self, head: int, now: float) -> list[RankInstall]:
        """Every rank of this node, ascending, as of `now` against committed `head`."""
        out = []
        for r in sorted(self.ranks):
            got = self._installed.get(r)
            last = self._last.get(r)
            lag = self.lag_s(r, head, now)
            out.append(RankInstall(r, got[0] if got else 0, now - got[1] if got else -1.0,
                                   now - last if last is not None else -1.0, lag, lag > self.bound_s,
                                   self._errors.get(r, "")))
        return out
