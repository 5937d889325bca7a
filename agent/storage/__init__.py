"""Where an agent keeps its bytes: the consensus log's file, its framing and recovery, and the data directory.

- disk.py: FileDisk (write + fsync) and MemoryDisk (the simulator's disk), and durable-write helpers;
- store.py: the append-only, fsync'd log of committed tables and acceptor state;
- datadir.py: one agent per data directory (an exclusive lock), and the operator's store repair.

May import: nothing else of agent (tests/project/test_layering.py): it is the base the consensus and etcd
backends stand on. Entry points: `Store` (agent.storage.store), `DataDirLock` (agent.storage.datadir).
"""
