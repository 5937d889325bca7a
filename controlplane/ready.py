"""What the decision controller hands its caller (controlplane.controller.Controller.step returns a Ready):
records to persist, proposals to send, tables to install, telemetry events, and plans to compute."""

from __future__ import annotations

from dataclasses import dataclass, field

from controlplane.decision import Decision, DecisionOutcome
from controlplane.errors import InvalidReason, InvalidTable
from controlplane.monitor import WindowReport
from controlplane.planner import Reason, Refused
from controlplane.requests import PlanRequest
from controlplane.table import RoutingTable


@dataclass(frozen=True)
class ProposalRecord:
    """Persist before sending: this node proposed `digest` for `version`."""

    version: int
    parent: int
    digest: bytes
    kind: str


@dataclass(frozen=True)
class Resolution:
    """Persist: how this node's proposal for `version` ended (COMMITTED, LOST, FAILED)."""

    version: int
    outcome: str
    reason: str


@dataclass(frozen=True)
class OpTransition:
    """A decision's lifecycle moved (telemetry)."""

    version: int
    kind: str
    state: str
    reason: str


# Every code an Explain's outcome may hold, from the enums that define them (each code is listed once, there):
# the decision's own (decision.DecisionOutcome: PROPOSED, BELOW_THETA, NOT_DESIGNATED, ...), a refused plan's
# planner Reason (GAIN_BELOW_TAU, OVER_BUDGET, ...), an operator's operation that does not apply
# (errors.InvalidReason) and a table that is not valid (errors.InvalidTable.code).
OUTCOMES: frozenset[str] = frozenset({*DecisionOutcome, *Reason, *InvalidReason, InvalidTable.code})


@dataclass(frozen=True)
class Explain:
    """Why the controller did or did not act. outcome is a stable code, one of OUTCOMES."""

    window_seq: int
    head_version: int
    imbalance: float
    trigger: str
    outcome: str
    detail: str = ""
    decision: Decision | None = None
    refused: tuple[Refused, ...] = ()
    estimated_gain: float = 0.0
    verified_gain: float = 0.0
    cost: float = 0.0


Record = ProposalRecord | Resolution
TelemetryEvent = Explain | WindowReport | OpTransition


@dataclass
class Ready:
    persist: list[Record] = field(default_factory=list)
    proposals: list[Decision] = field(default_factory=list)
    install: list[RoutingTable] = field(default_factory=list)
    events: list[TelemetryEvent] = field(default_factory=list)
    plans: list[PlanRequest] = field(default_factory=list)  # to run, then step(PlanReady(...)) (defer_plans)

    def empty(self) -> bool:
        return not (self.persist or self.proposals or self.install or self.events or self.plans)
