"""What ConsensusNode's parts share: how a proposal ended (`Outcome`) and the node's timers (`Timers`).

ConsensusNode (node.py) is one Paxos node: its lifecycle, the acceptor's handlers and the learner. It holds
two parts by name, each constructed whole with its collaborators passed in and declaring its own state:
`proposer` (proposer.py: this node's proposals, their ballots and outcomes) and `recovery` (recovery.py:
rebuild after store loss, snapshots, fail-stop on a failed store). A part reaches back to the node only
through a small Protocol declared beside it (ProposerNode, RecoveryNode). The node and both parts arm
their timers in one `Timers` table, so stop() cancels every one and the model checker (chaos/mcworld.py)
names each armed timer by its kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from agent.clock import Clock, Timer
from elasticmoe.v1 import consensus_pb2 as pb


@dataclass
class Outcome:
    """How one `propose` ended. `committed`: our table is the one chosen for `version`.

    A success is reported as soon as the quorum certificate forms (a quorum of voters has the table
    durably accepted: it is chosen); this node's own log write and its install (on_commit) follow at once.
    """

    committed: bool
    version: int
    reason: str = ""
    votes: list[pb.Vote] = field(default_factory=list)
    latency: float = 0.0  # seconds on the node's clock, proposal to commit known here
    commit: pb.Commit | None = None


class Timers:
    """A node's timers, one per kind and version ("takeover", "attempt", "thrifty", "rebuild", "disk", "sync");
    arming one replaces the one armed before it, and a timer fires only while `running()` says the node runs."""

    def __init__(self, clock: Clock, running: Callable[[], bool]) -> None:
        self.clock = clock
        self.running = running
        self.armed: dict[tuple[str, int], Timer] = {}

    def arm(self, kind: str, v: int, delay: float, fn: Callable[[], None]) -> None:
        key = (kind, v)
        old = self.armed.pop(key, None)
        if old is not None:
            old.cancel()

        def fire() -> None:
            self.armed.pop(key, None)
            if self.running():
                fn()

        self.armed[key] = self.clock.call_later(delay, fire)

    def disarm(self, kind: str, v: int) -> None:
        t = self.armed.pop((kind, v), None)
        if t is not None:
            t.cancel()

    def cancel_all(self) -> None:
        for t in self.armed.values():
            t.cancel()
        self.armed.clear()
