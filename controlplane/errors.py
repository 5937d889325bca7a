"""Typed, expected failures of the decision core, each with a stable code."""

from __future__ import annotations

from enum import StrEnum


class ControlPlaneError(Exception):
    """Base of expected outcomes that callers handle; `code` is stable across releases."""

    code = "CONTROLPLANE_ERROR"

    def __init__(self, message: str) -> None:
        super().__init__(f"{self.code}: {message}")
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str, ...]]:
        # rebuilt from what __init__ took (the default would pass the formatted text back in): an error raised
        # in a worker process reaches its pool intact
        return type(self), (self.message,)


class InvalidTable(ControlPlaneError):
    code = "INVALID_TABLE"


class InvalidTopology(ControlPlaneError):
    code = "INVALID_TOPOLOGY"


class InvalidShape(ControlPlaneError):
    code = "INVALID_SHAPE"


class InvalidReason(StrEnum):
    """Why an operation cannot apply to a table (InvalidOperation.reason)."""

    UNKNOWN_LAYER = "UNKNOWN_LAYER"
    UNKNOWN_EXPERT = "UNKNOWN_EXPERT"
    UNKNOWN_RANK = "UNKNOWN_RANK"
    UNKNOWN_KIND = "UNKNOWN_KIND"
    RANK_INACTIVE = "RANK_INACTIVE"
    RANK_ACTIVE = "RANK_ACTIVE"  # a restore of a rank that is active already
    ALREADY_ON_RANK = "ALREADY_ON_RANK"
    NOT_ON_RANK = "NOT_ON_RANK"
    NO_FREE_SLOT = "NO_FREE_SLOT"
    SAME_RANK = "SAME_RANK"
    LAST_REPLICA = "LAST_REPLICA"  # a drop of an expert's only replica
    BAD_TRANSITION = "BAD_TRANSITION"  # a lifecycle move its transition table does not allow


class InvalidOperation(ControlPlaneError):
    """An operation that cannot apply to a table; `reason` is a stable reason code (InvalidReason)."""

    code = "INVALID_OPERATION"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.detail = reason, message

    def __reduce__(self) -> tuple[type, tuple[str, ...]]:
        return type(self), (self.reason, self.detail)
