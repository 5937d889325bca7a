"""Quorum commit of versioned routing tables: one single-decree Paxos slot per table version.

- paxos.py: the sans-IO acceptor, the proposer's ballot (`BallotAttempt`) and certificate checks;
- node.py: ConsensusNode, which drives them over a Transport, a Clock and a Store: its lifecycle, the acceptor's
  handlers and the learner. It holds two named parts, each declaring its own state and reaching the node only
  through a small Protocol beside it: `proposer` (proposer.py: Proposer, this node's proposals, their ballots,
  retries and outcomes) and `recovery` (recovery.py: Recovery, rebuilding after store loss with rebuild.py,
  snapshot catch-up, fail-stop on a failed store); core.py: what they share (Outcome, one Timers table);
- log.py: CommittedLog, the certified commits a node installs in version order (persist, send, install);
- signing.py: signed votes (and member claims) under mTLS.

Tables go on the wire through elasticmoe.codec (one encoder, one decoder, shared with the shim). The
harnesses live outside the product: chaos/quorumsim.py (a simulated cluster that records histories for
chaos/checkers.py) and bench/consensus_serve.py (a consensus-only process, bench/commit.py's worker).

May import: agent.clock, agent.config, agent.security, agent.storage, agent.transport; never gossip, decision,
link, etcd or admin, nor anything of the engine side, dataplane_shim (tests/project/test_layering.py).
"""
