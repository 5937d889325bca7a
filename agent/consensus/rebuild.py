"""Rebuild after store loss: a node that may have voted before, and no longer remembers how, must not vote
again on any version it might have voted on (a forgotten promise or accept lets two values be chosen for one
version: I1). It stays a learner until it has caught up past all of them (Paxos Made Live, section 5.1: a
replica with a lost disk rejoins as a non-voting member until it has seen a complete instance that started
after it began to rebuild).

Notation: n configured voters, quorum q = n // 2 + 1, and `need = n - q + 1` of the n - 1 other voters.
Two facts about sets of the other voters carry the whole argument:
- (A) `need` of them meet every quorum that contains this node: such a quorum holds q - 1 others, and only
  (n - 1) - (q - 1) = n - q others lie outside it.
- (B) any two sets of `need` of them meet: 2 (n - q + 1) > n - 1 for every n >= 1 with a majority quorum.

Strict rebuild (the node may have voted before). It asks the other voters for `max(committed head, highest
version with acceptor state)`. By (A), reports from `need` peers that are not rebuilding themselves include
one from a member of every quorum that could have counted this node's vote, so the highest report M bounds
every version the node could have helped choose or promise, and the node abstains through M + 1 (M + 1 may
be in flight with a promise it gave before it lost its store). Acceptors accept only on their head + 1, and
a proposer's attempt times out within `accept_timeout_ms`, far sooner than an agent restarts, so no attempt
outlives the node's old promises.

Whether it may have voted before is not the data_dir's to say, since a wiped data_dir looks new. So every
node that starts from an empty store enrols: its CatchUp requests carry `enrol` and an enrolment id drawn
afresh at each start, and each voter that answers records (voter, enrolment id) durably before it replies
(agent/storage/store.py KIND_KNOWN), and says `knew_you` when it has recorded this voter under another id (it keeps
the first id it saw, never replaced: a voter seen under two ids is never new again). A node writes a rebuild mark (its id and
whether it is strict) before its first request and marks it done before its first vote; a restart in between
resumes the same rebuild under the same id (it has not voted since), so a founding member restarted before the
others came up is still a founding member, not a stranger to its own records. A node votes only after `need`
peers answered it, so by then `need` peers hold its record; whenever it starts again
from an empty store, by (B) the `need` answers it waits for include one of those records (unless that peer
lost its store too: this protects against one lost store at a time, as the strict rule does). The node is
strict from the start when:
- `had_store`: the data_dir's marker says this node ran before (its log was lost or moved aside by `emoe
  store repair`, or cut below its high-water mark);
- `consensus.initial_cluster_state = "existing"`: the operator says the cluster exists already (etcd's
  `initial-cluster-state`), so an empty disk is a lost one;
and becomes strict at the first answer that says `knew_you` or shows history (a committed head beyond
genesis). Otherwise it is a founding member of a new cluster: `need` answers from any peers (those still
deciding too: every member of a truly new cluster starts this way, so not counting them would deadlock it)
that neither knew it nor hold history let it vote at once. So a new cluster starts voting once `need + 1`
of its voters are up (3 of 3, 4 of 5, 5 of 7), and a founder cut off from that many waits: by (B) that is
the least that tells a wiped voter from a new one.

What an operator may wipe: any one voter's whole data_dir at a time, while at least `need` of the others
keep theirs; that voter rejoins as a learner and votes again once it has caught up. Two data_dirs lost
before either has caught up can pass for a new cluster; rebuild such a cluster from the survivors' logs.
Pure state: the consensus node feeds it replies, and asks it whether it may vote.
"""

from __future__ import annotations

from agent.consensus.paxos import quorum_size


class Rebuild:
    def __init__(self, node_id: str, voters: list[str], genesis: int, why_strict: str = "") -> None:
        """`why_strict`: why this node may have voted before (strict from the start); "" for a founding member."""
        self.others = sorted(set(voters) - {node_id})
        n = len(set(voters) | {node_id})
        self.need = min(n - quorum_size(n) + 1, len(self.others))
        self.genesis = genesis
        self.strict = bool(why_strict)
        self.reports: dict[str, int] = {}  # peer -> max(head, acceptor_high), from peers not rebuilding
        self.strangers: set[str] = set()  # peers that answered without knowing this node or any history
        self.why_strict = why_strict
        self.early: set[str] = set()  # peers asked again this round because they called us
        self.abstain_through: int | None = 0 if self.need == 0 else None

    @property
    def decided(self) -> bool:
        return self.abstain_through is not None

    def report(self, peer: str, head: int, acceptor_high: int, rebuilding: bool, knew_you: bool = False) -> None:
        """One peer's CatchUp reply to an enrolling request."""
        if peer not in self.others or self.decided:
            return
        high = max(head, acceptor_high)
        if not self.strict and (knew_you or head > self.genesis):
            # this node ran before, or the cluster committed versions it may have voted on (a store from before
            # enrolment); a peer's acceptor state alone is not history: a founder's first proposal leaves some
            self.strict = True
            self.why_strict = f"{peer} knew it" if knew_you else f"{peer} committed version {head}"
        if not rebuilding:
            self.reports[peer] = high
        if self.strict:
            if len(self.reports) >= self.need:
                self.abstain_through = max(self.reports.values()) + 1
            return
        self.strangers.add(peer)
        if len(self.strangers) >= self.need:
            self.abstain_through = 0  # a founding member of a new cluster: nothing to forget

    def answered(self, peer: str) -> bool:
        return peer in self.reports or peer in self.strangers

    def may_vote(self, head: int) -> bool:
        return self.abstain_through is not None and head >= self.abstain_through

    def describe(self, head: int) -> str:
        if self.abstain_through is None:
            if self.strict:
                return (f"learner (lost its store: {self.why_strict}): asking the other voters which versions it "
                        f"may have voted on ({len(self.reports)} of {self.need} reports)")
            return (f"learner (empty store): asking the other voters whether it ran before "
                    f"({len(self.strangers)} of {self.need} answers)")
        return (f"learner (rebuilding after store loss): votes again once it holds version "
                f"{self.abstain_through} (head {head})")
