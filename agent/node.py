"""One node's agent process (being built)."""

from __future__ import annotations

from agent.config import AgentConfig


def run_forever(cfg: AgentConfig) -> int:
    raise NotImplementedError(cfg.node_id)
