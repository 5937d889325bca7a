"""Cost-benefit: whether a change repays its copies at the engine's step time, and when to look for one.

A step's time grows with its busiest rank's load (a layer waits for its slowest rank); `load_ms` is the part
of a step that does (the step's time minus what it would take with no routed tokens). Step imbalance is the
busiest ranks' load over the mean (`verify`), so a plan that lowers the mean step imbalance by the relative
gain g saves g x load_ms a step, and over a horizon of H steps

    gain_s = H x g x load_ms / 1000.

Its copies cost `cost.change_cost` seconds summed over copies; copies into different ranks run side by side
(the cost budget's own assumption), so serving pays about cost / ranks. A plan is worth it when

    gain_s >= (1 + margin) x copy_x x cost / ranks,

at any imbalance. copy_x is what the copies were measured to cost the steps they overlapped over cost / ranks
(controlplane.copycost: link bandwidth shared with the all-to-all, every layer waiting for its slowest rank),
1 until the installs measured it. The trigger follows: a window is worth planning on when even a perfect plan (to imbalance
1.0, g = (I - 1) / I) would gain `tau` (the smallest verified gain a plan may claim, beneath which replay
cannot tell a gain from the noise of the windows). Above theta the error budget fires as before (a breach
is acted on); under it, a worth window is planned on after the same `budget_windows` in a row, and an attempt
that finds nothing worth proposing backs off (2, 4, ... up to `max_backoff` windows), so a cluster that is as
balanced as its slots allow is not re-planned every window; a commit, or the imbalance rising `band` above the
refused attempt's, ends the back-off.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Worth:
    """load_ms: milliseconds of a step that scale with its busiest rank's load (0: no cost-benefit test: the
    theta trigger and the tau gate alone); horizon_steps: steps a plan is expected to keep paying; margin:
    how much more than its copy cost a plan must repay."""

    load_ms: float
    horizon_steps: int
    margin: float
    tau: float
    source: str = ""  # where load_ms came from (controlplane.steptime: fitted from N steps, override, default)
    copy_x: float = 1.0  # what copies cost the steps they overlap over cost / ranks (controlplane.copycost)
    copy_source: str = ""  # where copy_x came from ("": the model as it stands)

    @property
    def enabled(self) -> bool:
        return self.load_ms > 0

    def gain_s(self, gain: float) -> float:
        """Serving seconds saved over the horizon by a relative gain of the mean step imbalance."""
        return self.horizon_steps * gain * self.load_ms / 1e3

    def charge_s(self, cost_s: float, ranks: int) -> float:
        """Serving seconds a change's copies cost: cost / ranks (side by side), times what they were measured
        to cost the steps they overlap over that (copy_x)."""
        return self.copy_x * cost_s / max(ranks, 1)

    def repays(self, gain: float, cost_s: float, ranks: int) -> bool:
        return self.gain_s(gain) >= (1.0 + self.margin) * self.charge_s(cost_s, ranks)

    def explain(self, gain: float, cost_s: float, ranks: int) -> str:
        said = f" ({self.source})" if self.source else ""
        copies = (f" x{self.copy_x:.3g} ({self.copy_source})" if self.copy_source else
                  f" x{self.copy_x:.3g}" if self.copy_x != 1.0 else "")
        return (f"gain {gain:.4f} over {self.horizon_steps} steps at {self.load_ms:.4g} ms of load a step{said} saves "
                f"{self.gain_s(gain) * 1e3:.1f} ms of serving; its copies cost {self.charge_s(cost_s, ranks) * 1e3:.1f} "
                f"ms ({cost_s * 1e3:.1f} ms over {ranks} ranks side by side{copies}), x{1 + self.margin:g} needed")

    def worth_planning(self, imbalance: float) -> bool:
        """Whether a perfect plan from this imbalance would gain tau."""
        return self.enabled and imbalance > 1.0 and (imbalance - 1.0) / imbalance >= self.tau


class WorthTrigger:
    """Under theta: `budget_windows` worth windows in a row fire an attempt; a refused attempt backs off."""

    def __init__(self, worth: Worth, budget_windows: int, band: float, max_backoff: int = 32) -> None:
        self.worth, self.windows, self.band, self.max_backoff = worth, budget_windows, band, max_backoff
        self.count = 0
        self.backoff = 0  # windows to wait after the last refused attempt (0: none)
        self.retry_at = -1  # the first window seq that may attempt again
        self.refused_at = float("inf")  # the imbalance of the last refused attempt

    def observe(self, seq: int, imbalance: float) -> bool:
        """Count one window under theta; True when an attempt is due now."""
        if not self.worth.worth_planning(imbalance):
            self.count = 0
            return False
        self.count += 1
        if imbalance >= self.refused_at + self.band:
            self.reset()  # the load moved since the refusal: look again
            self.count = self.windows
        return self.count >= self.windows and seq >= self.retry_at

    def waiting(self, seq: int) -> int:
        """Windows left in the back-off (0: none)."""
        return max(self.retry_at - seq, 0)

    def refused(self, seq: int, imbalance: float) -> None:
        self.backoff = min(max(2 * self.backoff, 2), self.max_backoff)
        self.retry_at, self.refused_at, self.count = seq + self.backoff, imbalance, 0

    def reset(self) -> None:
        self.count, self.backoff, self.retry_at, self.refused_at = 0, 0, -1, float("inf")
