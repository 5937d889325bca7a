"""How the admin API marks an answer that is the agent's own, not the transport's.

gRPC's transport and the agent both answer UNAVAILABLE: the transport when nothing answered (no agent there, a
closed connection), the agent when it answered that it cannot serve the call yet (STARTING, NOT_SERVING). The
CLI exits 3 (unreachable) for the first and 1 (the agent answered) for the second, and shows the agent's words
as they are. The agent says which it is in the call's trailing metadata, `ANSWER_KEY: NOT_SERVING`, so that the
CLI branches on a code, not on the words (issue 50, typed outcomes). Light on purpose: the CLI imports it.
"""

from __future__ import annotations

from collections.abc import Iterable

ANSWER_KEY = "emoe-answer"  # trailing metadata key (gRPC metadata keys are lower case)
NOT_SERVING = "not-serving"  # the agent answered: it is STARTING or not SERVING, and says so in the details


def is_own_answer(trailing: Iterable[tuple[str, str | bytes]] | None) -> bool:
    """Whether a failed call's trailing metadata says the agent itself answered (not the transport)."""
    return any(k == ANSWER_KEY and v == NOT_SERVING for k, v in (trailing or ()))


def legacy_own_answer(detail: str) -> bool:
    """An agent of a release before ANSWER_KEY says it is not serving in words only: "agent X is STARTING" or
    "agent X is NOT_SERVING". The one place its words are read (tests/project/test_typed_outcomes.py)."""
    return detail.startswith("agent ")
