"""What an agent's config says about credentials, turned into gRPC credentials, interceptors and the vote
signer (all None or plain in a plaintext config, i.e. without `tls.cert_dir`)."""

from __future__ import annotations

from typing import Any

import grpc

from agent.config import AgentConfig
from agent.consensus.signing import VoteSigner


def server_credentials(cfg: AgentConfig) -> grpc.ServerCredentials | None:
    if not cfg.tls.cert_dir:
        return None
    from agent.security import server_credentials as make

    return make(cfg.tls.cert_dir, cfg.node_id)


def channel_credentials(cfg: AgentConfig) -> grpc.ChannelCredentials | None:
    if not cfg.tls.cert_dir:
        return None
    from agent.security import channel_credentials as make

    return make(cfg.tls.cert_dir, cfg.node_id)


def vote_signer(cfg: AgentConfig) -> VoteSigner | None:
    """Under mTLS, this node's vote signer (agent.consensus.signing); None in plaintext."""
    return VoteSigner.from_cert_dir(cfg.tls.cert_dir, cfg.node_id) if cfg.tls.cert_dir else None


def interceptors(cfg: AgentConfig) -> list[Any]:
    """The caller's wire version first (agent.wireversion); mTLS authorisation: consensus and gossip only from
    members, mutating admin calls only from admins; then malformed protobufs answered with INVALID_ARGUMENT
    (agent.decode_guard)."""
    from agent.decode_guard import DecodeGuardInterceptor
    from agent.wireversion import WireInterceptor

    guard: list[Any] = [WireInterceptor(), DecodeGuardInterceptor()]
    if not cfg.tls.cert_dir:
        return guard
    from agent.security import AuthzInterceptor, policy_from_config

    policy = policy_from_config(cfg)
    return guard if policy is None else [guard[0], AuthzInterceptor(policy), *guard[1:]]
