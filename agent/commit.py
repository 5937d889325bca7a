"""What the agent needs of a commit backend: the quorum consensus (agent.consensus.node.ConsensusNode) and
etcd (agent.etcd.etcd_backend.EtcdBackend) both provide it, so NodeState holds one typed `CommitBackend` and
never asks which one it has; and of the cluster's pause switch beside it (`PauseSwitch`: the quorum's control
records, ConsensusNode.control, or etcd's key, agent.etcd.etcd_pause.EtcdPause)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from agent.consensus.controlnode import ControlCallback, ControlOutcome
from agent.consensus.node import CommitCallback, Outcome
from controlplane.table import RoutingTable
from elasticmoe.v1 import consensus_pb2 as pb


class CommitBackend(Protocol):
    @property
    def head(self) -> RoutingTable:
        """The newest committed table this node holds."""
        ...

    @property
    def role(self) -> str:
        """voter, non-voter, learner (with what it waits for), or the backend's own word (etcd client)."""
        ...

    @property
    def failure(self) -> str:
        """Why this node neither votes nor commits now ("" while it can)."""
        ...

    @property
    def abstains(self) -> str:
        """Why this node may neither vote nor propose now, so that the others plan in its place ("" while it
        may; a new node still asking whether it may vote is not counted: it knows within a round trip)."""
        ...

    def start(self) -> None:
        """Recover the committed log (the head is the recovered one from here on) and start serving."""
        ...

    def stop(self) -> None: ...

    async def close(self) -> None: ...

    def on_commit(self, cb: CommitCallback) -> None: ...

    def propose(self, table: RoutingTable, plan: pb.Plan, on_done: Callable[[Outcome], None]) -> None:
        """Commit `table` (version head + 1) or say why not; `on_done` runs exactly once."""
        ...

    def committed(self, version: int) -> pb.Commit | None: ...

    def commits_since(self, version: int) -> list[pb.Commit]: ...

    def peer_heads(self) -> dict[str, int]:
        """The committed version each node is known to hold (this node's included)."""
        ...


class PauseSwitch(Protocol):
    """The cluster's pause switch: a record committed apart from the tables (agent/consensus/control.py)."""

    @property
    def record(self) -> pb.ControlCommit | None:
        """The newest certified record this node knows (None: nobody ever paused this cluster)."""
        ...

    def on_change(self, cb: ControlCallback) -> None:
        """`cb(commit)` each time a newer certified record is durable here."""
        ...

    def write(self, paused: bool, note: str, on_done: Callable[[ControlOutcome], None], admin: str = "") -> None:
        """Commit a record saying `paused` (written by this node, `note` the operator's words, `admin` the admin
        who asked this node); `on_done` once."""
        ...

    def unready(self) -> str:
        """Why a write here would be refused at once now ("" when it would be tried)."""
        ...

    @property
    def refused(self) -> dict[str, int]:
        """Records (or values of the switch) refused here since start, by consensus.proto ControlRefusal name."""
        ...

    def stop(self) -> None: ...
