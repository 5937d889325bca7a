"""Typed, expected failures of the decision core, each with a stable code."""

from __future__ import annotations


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


class InvalidOperation(ControlPlaneError):
    """An operation that cannot apply to a table; `reason` is a stable reason code."""

    code = "INVALID_OPERATION"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.detail = reason, message

    def __reduce__(self) -> tuple[type, tuple[str, ...]]:
        return type(self), (self.reason, self.detail)
