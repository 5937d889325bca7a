"""Typed, expected failures of the data-plane shim, each with a stable code."""

from __future__ import annotations


class ShimError(Exception):
    """Base of the shim's expected outcomes; `code` is stable across releases."""

    code = "SHIM_ERROR"

    def __init__(self, message: str) -> None:
        super().__init__(f"{self.code}: {message}")
        self.message = message


class StaleVersion(ShimError):
    """A table version not newer than the one installed or staged: refused, nothing changes."""

    code = "STALE_VERSION"


class Uncertified(ShimError):
    """A commit whose quorum certificate does not prove the table it carries: refused."""

    code = "UNCERTIFIED"


class BadInput(ShimError):
    """An argument of the wrong shape, dtype or range; the message names it."""

    code = "BAD_INPUT"
