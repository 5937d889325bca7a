"""What tests of real agent processes ask them: the `emoe` CLI as an operator runs it, and Admin/Status."""

from __future__ import annotations

import subprocess
import sys

import grpc

from chaos.localcluster import ROOT
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import admin_pb2_grpc


def emoe(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """`python -m agent.cli ARGS` from the checkout, its output captured."""
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def status(address: str, timeout: float = 5) -> apb.StatusReply:
    """The agent's Admin/Status at `address` (plaintext)."""
    with grpc.insecure_channel(address) as ch:
        r: apb.StatusReply = admin_pb2_grpc.AdminStub(ch).Status(apb.StatusRequest(), timeout=timeout)  # type: ignore[no-untyped-call]
        return r
