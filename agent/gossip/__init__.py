"""Gossip: SWIM + Lifeguard membership and load gossip over one Transport and Clock (memberlist's design).

- gossip_node.py: GossipNode, which owns what the two share (the rumour queue, piggybacking, push-pull);
- membership.py / probe.py / suspicion.py: the member table, the failure detector, Lifeguard's timer (sans-IO);
- loadgossip.py / windowguard.py: every node's latest load window and the cluster view; a window's checks;
- broadcasts.py: the rumour queue; claims.py: signed member claims; gossipconfig.py: the `[gossip]` section.

May import: agent.clock, agent.config, agent.transport, agent.link (reportguard: what a report may say);
never decision, consensus, etcd or admin (tests/project/test_layering.py). agent.config may import the two
leaf modules gossipconfig.py and claims.py only. Entry point: `GossipNode` (agent.gossip.gossip_node).
"""
