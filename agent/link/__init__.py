"""The engine side of the agent: where a load report enters and where a committed table leaves for the ranks.

- shim_link.py: the `elasticmoe.v1.DataplaneLink` servicer on the node's unix socket (WatchTables, ReportLoad);
- loadpath.py: shim reports -> this node's windows -> gossip (the first step of a load report's trip);
- reportguard.py: what a report may say of this node's ranks (asked before a report counts);
- ranklink.py: a rank's link closing, first-hand evidence that its engine process left;
- installs.py: which table version each of this node's ranks has installed, and since when.

May import: agent.clock, agent.decode_guard, agent.wireversion (and agent.security beneath them); never
gossip, decision, consensus, etcd or admin (tests/project/test_layering.py). Entry points: `DataplaneLinkServicer`
(agent.link.shim_link), `LoadPath` (agent.link.loadpath); agent.state.NodeState wires them.
"""
