"""The etcd commit backend: the same interface as ConsensusNode (agent.commit.CommitBackend), etcd's Raft as quorum.

- etcd_backend.py: EtcdBackend, tables and members under `/emoe/<cluster>/`;
- etcd_pause.py: the pause switch, the quorum's control records in one etcd key;
- etcd_seed.py: the backend's head brought up to this node's at the start of each session.

May import: agent.consensus (its records and callbacks), agent.storage; nothing of gossip, decision, link or
admin (tests/project/test_layering.py). Entry points: `EtcdBackend`, `EtcdPause`; agent.state.NodeState
picks them when `[consensus] backend = "etcd"`.
"""
