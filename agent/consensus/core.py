"""What the three parts of ConsensusNode share: the node's fields, its timers, and the operations one part
asks of another, as abstract methods.

ConsensusNode is one Paxos node whose parts share the ballot state closely (a proposer's attempt ends in the
learner; a learner's commit unblocks the proposer; recovery re-enters both), so it stays one object, written
in three files by role: node.py (lifecycle, the acceptor's handlers, the learner), proposer.py (attempts
and their outcomes), recovery.py (rebuild after store loss, snapshots, fail-stop). A part calls another
only through the methods declared here; ConsensusNode cannot be built while one is missing (abc), so the
contract is checked at construction, not at the first call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agent.clock import Clock, Timer
from agent.config import ConsensusConfig
from agent.consensus.paxos import Acceptor, BallotAttempt, Verdict
from agent.consensus.refusal import Refusal
from agent.storage.store import Store
from agent.transport import Transport
from controlplane.table import RoutingTable
from elasticmoe.v1 import consensus_pb2 as pb

if TYPE_CHECKING:
    from agent.consensus.controlnode import ControlNode
    from agent.consensus.log import CommittedLog


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


class NodeCore(ABC):
    node_id: str
    voters: list[str]
    cfg: ConsensusConfig
    clock: Clock
    transport: Transport
    store: Store
    timeout: float
    running: bool
    log: CommittedLog
    control: ControlNode
    acceptor: Acceptor
    _peer_heads: dict[str, int]
    _timers: dict[tuple[str, int], Timer]

    # ---- timers (one per kind and version; a timer fires only while the node runs) -----------------
    def _arm(self, kind: str, v: int, delay: float, fn: Callable[[], None]) -> None:
        key = (kind, v)
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()

        def fire() -> None:
            self._timers.pop(key, None)
            if self.running:
                fn()

        self._timers[key] = self.clock.call_later(delay, fire)

    def _disarm(self, kind: str, v: int) -> None:
        t = self._timers.pop((kind, v), None)
        if t is not None:
            t.cancel()

    # ---- node.py --------------------------------------------------------------------------------
    @abstractmethod
    def propose(self, table: RoutingTable, plan: pb.Plan, on_done: Callable[[Outcome], None]) -> None:
        """Propose `table` as the next version; `on_done` gets the outcome."""

    @abstractmethod
    def catch_up(self, peer: str) -> None:
        """Fetch and install the commits `peer` has beyond our head."""

    @abstractmethod
    def _check(self, p: pb.Proposal) -> Verdict:
        """This node's verdict on a proposal as a voter: (ok, gain, reason, code)."""

    @abstractmethod
    def _learned(self, c: pb.Commit, src: str | None, broadcast: bool,
                 attempt: BallotAttempt | None = None) -> tuple[Refusal, str]:
        """Learn a commit (validate, persist, install); (REFUSAL_UNSPECIFIED, "") or why it was refused."""

    # ---- recovery.py ----------------------------------------------------------------------------
    @abstractmethod
    def _persist(self, st: pb.AcceptorState) -> bool:
        """Make the acceptor's state durable before a reply leaves; False when the store failed."""

    @abstractmethod
    def _sign(self, reply: pb.Accepted, p: pb.Proposal) -> pb.Accepted:
        """Sign an accept (under mTLS), or return it as it is."""
