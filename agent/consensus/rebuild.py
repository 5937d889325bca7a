"""Rebuild after store loss: a node that may have voted before, and no longer remembers how, must not vote
again on any version it might have voted on (a forgotten promise or accept lets two values be chosen for one
version: I1). It stays a learner until it has caught up past all of them (Paxos Made Live, section 5.1: a
replica with a lost disk rejoins as a non-voting member until it has seen a complete instance that started
after it began to rebuild).

Which versions: the node asks the other voters for `max(committed head, highest version with acceptor
state)`. Reports from `n - q + 1` of them meet every quorum that could have counted this node's vote, so the
highest report M bounds every version the node could have helped choose or promise in a quorum, and the
node abstains through M + 1 (M + 1 may be in flight with a promise it gave before it lost its store).
Acceptors accept only on their head + 1, and a proposer's attempt times out within `accept_timeout_ms`,
far sooner than an agent restarts, so no attempt outlives the node's old promises.

Two kinds of empty store:
- `had_store` (the data_dir's marker says this node ran before: its log was lost or moved aside by `emoe
  store repair`): strict from the start.
- a new data_dir: a new node, or one whose whole data_dir was wiped. The first report decides: one that
  shows history (anything beyond genesis) makes it strict; one that shows a new cluster (genesis, no
  acceptor state: the replier may be new too) lets it vote at once. A node whose whole data_dir was wiped
  hears history from any peer that was not wiped too; only the loss of two data_dirs at once, each hearing
  first from the other, would pass for a new cluster (say `emoe store repair` instead of wiping a data_dir:
  the marker then makes the node strict).
Pure state: the consensus node feeds it replies, and asks it whether it may vote.
"""

from __future__ import annotations

from agent.consensus.paxos import quorum_size


class Rebuild:
    def __init__(self, node_id: str, voters: list[str], genesis: int, had_store: bool) -> None:
        self.others = sorted(set(voters) - {node_id})
        n = len(set(voters) | {node_id})
        self.need = min(n - quorum_size(n) + 1, len(self.others))
        self.genesis = genesis
        self.strict = had_store
        self.reports: dict[str, int] = {}  # peer -> max(head, acceptor_high), from peers not rebuilding
        self.abstain_through: int | None = 0 if self.need == 0 else None

    @property
    def decided(self) -> bool:
        return self.abstain_through is not None

    def report(self, peer: str, head: int, acceptor_high: int, rebuilding: bool) -> None:
        """One peer's CatchUp reply."""
        if peer not in self.others or self.decided:
            return
        high = max(head, acceptor_high)
        if high > self.genesis:
            self.strict = True  # the cluster has history: this node may have voted in it
        elif not self.strict:
            self.abstain_through = 0  # a new node in a new cluster: nothing to forget
            return
        if not rebuilding:
            self.reports[peer] = high
        if self.strict and len(self.reports) >= self.need:
            self.abstain_through = max(self.reports.values()) + 1

    def may_vote(self, head: int) -> bool:
        return self.abstain_through is not None and head >= self.abstain_through

    def describe(self, head: int) -> str:
        if self.abstain_through is None:
            kind = "lost its store" if self.strict else "new data_dir"
            return (f"learner ({kind}): asking the other voters which versions it may have voted on "
                    f"({len(self.reports)} of {self.need} reports)")
        return (f"learner (rebuilding after store loss): votes again once it holds version "
                f"{self.abstain_through} (head {head})")
