"""What an operator sees of an agent and how they act on it: the Admin gRPC service, its read side, metrics.

- admin.py: the Admin gRPC service behind the `emoe` CLI (agent.cli.admin is its client);
- adminview.py: the read side of a node (Status, Members, History, Explain, LoadView, Placement);
- metrics.py: Prometheus metrics (`[metrics] listen`), served as cached text;
- telemetry.py: OpenTelemetry traces and metrics (`[telemetry]`, off by default).

May import: every subsystem it reports on (agent.consensus, agent.decision, agent.gossip, agent.link) and
agent.clock, agent.commit, agent.fingerprint, agent.security, agent.wire; nothing imports it but agent.state,
agent.process and agent.cli (tests/project/test_layering.py). Entry points: `AdminService` (agent.admin.admin),
`AdminView` (agent.admin.adminview).
"""
