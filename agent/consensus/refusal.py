"""Why a voter refused, as a code: the one place that reads a code from a refusal's words.

Every refusal this release sends carries a code beside its reason (consensus.proto `Refusal` on Promise,
Accepted and CommitAck; `ControlRefusal` on ControlAck), and the code is what the proposer and the control
writer branch on. A reply of a release before codes has none (UNSPECIFIED) and says why only in words: these
functions give it the code its words meant by the rules that release's peers applied to them, so that a mixed
cluster retries and gives up as an all-old one did. Nothing else reads a reason (tests/project/
test_typed_outcomes.py).
"""

from __future__ import annotations

from typing import Protocol

from elasticmoe.v1 import consensus_pb2 as pb

Refusal = pb.Refusal  # the code of a Promise, Accepted or CommitAck refusal
# refused for now, not for good: the voter may take the version at a higher ballot (the proposer retries)
CONTESTED: frozenset[Refusal] = frozenset({pb.REFUSAL_COMMITTED, pb.REFUSAL_PROMISED, pb.REFUSAL_PARENT_MISMATCH,
                                           pb.REFUSAL_UNAVAILABLE})


class Reply(Protocol):
    """A Promise, an Accepted or a CommitAck: a refusal's code and its words."""

    @property
    def code(self) -> Refusal: ...

    @property
    def reason(self) -> str: ...


def refusal(reply: Reply) -> Refusal:
    """The code of a refused Promise, Accepted or CommitAck (REFUSAL_UNSPECIFIED for an ok one of this release)."""
    return reply.code if reply.code != pb.REFUSAL_UNSPECIFIED else legacy_refusal(reply.reason)


def legacy_refusal(reason: str) -> Refusal:
    """The code of a refusal from a release before codes, by the rules that release applied to its words: a
    reason that mentions "promised" (a higher ballot is promised there: the proposer also moves its round past
    its own), then one that starts with UNAVAILABLE, mentions "parent" or "committed" is contested (retried at a
    higher ballot); any other is the voter's verdict, not retried."""
    if "promised" in reason:
        return pb.REFUSAL_PROMISED
    if reason.startswith("UNAVAILABLE"):
        return pb.REFUSAL_UNAVAILABLE
    if "parent" in reason:
        return pb.REFUSAL_PARENT_MISMATCH
    if "committed" in reason:
        return pb.REFUSAL_COMMITTED
    return pb.REFUSAL_REJECTED


def control_refusal(ack: pb.ControlAck) -> pb.ControlRefusal:
    """The code of a refused ControlAck. One from a release before codes is CONTROL_UNAVAILABLE (asked again)
    iff its reason starts with UNAVAILABLE, as that release read it; any other stays CONTROL_REFUSAL_UNSPECIFIED,
    a refusal that stands whose why is in its words only."""
    if ack.code != pb.CONTROL_REFUSAL_UNSPECIFIED:
        return ack.code
    return pb.CONTROL_UNAVAILABLE if ack.reason.startswith("UNAVAILABLE") else pb.CONTROL_REFUSAL_UNSPECIFIED
