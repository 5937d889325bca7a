"""Quorum commit of versioned routing tables: one single-decree Paxos slot per table version.

- paxos.py: the sans-IO acceptor, the proposer's ballot (`Attempt`) and certificate checks;
- node.py / proposer.py: ConsensusNode, which drives them over a Transport, a Clock and a Store;
- log.py: CommittedLog, the certified commits a node installs in version order (persist, send, install);
- wire.py: RoutingTable <-> consensus_pb2.RoutingTable;
- simcluster.py: a simulated cluster (SimNetwork, MemoryDisk) that records histories for chaos/checkers.py;
- serve.py: `python -m agent.consensus.serve`, a consensus-only process (bench/commit.py's worker).
"""
