"""The decision path: from a closed cluster window to a proposal at the commit backend, and back to the ranks.

- pipeline.py: DecisionPipeline, the controller (controlplane.controller) and its Ready loop;
- voter.py: a voter's own check of a proposed table (the commit backend's verifier);
- offloop.py: OffLoopPlanner, planning on a worker thread, off the event loop;
- manual.py: the operator's path into the decision core (Admin Propose, Drain, Restore, Pause);
- reactions.py / rejoin.py: ranks coming and going; a drained rank's return;
- hooks.py: what a harness may observe of a node.

May import: agent.clock, agent.commit, agent.wire, agent.consensus, agent.gossip, agent.link; never etcd or
admin (tests/project/test_layering.py). Entry points: `DecisionPipeline` (agent.decision.pipeline), `ManualPath`
(agent.decision.manual), `MembershipReactions` (agent.decision.reactions); agent.state.NodeState wires them.
"""
