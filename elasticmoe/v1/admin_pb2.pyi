from elasticmoe.v1 import consensus_pb2 as _consensus_pb2
from elasticmoe.v1 import gossip_pb2 as _gossip_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("node_id", "committed_version", "members", "paused", "health", "step_imbalance", "window_seq", "peer_versions", "role", "ranks", "install_lag_bound_s", "pause", "planner", "fingerprint", "fingerprint_mismatches")
    class PeerVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    STEP_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SEQ_FIELD_NUMBER: _ClassVar[int]
    PEER_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    INSTALL_LAG_BOUND_S_FIELD_NUMBER: _ClassVar[int]
    PAUSE_FIELD_NUMBER: _ClassVar[int]
    PLANNER_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    committed_version: int
    members: _containers.RepeatedCompositeFieldContainer[_gossip_pb2.MemberState]
    paused: bool
    health: str
    step_imbalance: float
    window_seq: int
    peer_versions: _containers.ScalarMap[str, int]
    role: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankInstall]
    install_lag_bound_s: float
    pause: _consensus_pb2.ControlCommit
    planner: str
    fingerprint: _gossip_pb2.Fingerprint
    fingerprint_mismatches: _containers.RepeatedCompositeFieldContainer[FingerprintMismatch]
    def __init__(self, node_id: _Optional[str] = ..., committed_version: _Optional[int] = ..., members: _Optional[_Iterable[_Union[_gossip_pb2.MemberState, _Mapping]]] = ..., paused: _Optional[bool] = ..., health: _Optional[str] = ..., step_imbalance: _Optional[float] = ..., window_seq: _Optional[int] = ..., peer_versions: _Optional[_Mapping[str, int]] = ..., role: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankInstall, _Mapping]]] = ..., install_lag_bound_s: _Optional[float] = ..., pause: _Optional[_Union[_consensus_pb2.ControlCommit, _Mapping]] = ..., planner: _Optional[str] = ..., fingerprint: _Optional[_Union[_gossip_pb2.Fingerprint, _Mapping]] = ..., fingerprint_mismatches: _Optional[_Iterable[_Union[FingerprintMismatch, _Mapping]]] = ...) -> None: ...

class FingerprintMismatch(_message.Message):
    __slots__ = ("node_id", "fields")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    fields: str
    def __init__(self, node_id: _Optional[str] = ..., fields: _Optional[str] = ...) -> None: ...

class RankInstall(_message.Message):
    __slots__ = ("rank", "installed_version", "installed_age_s", "report_age_s", "lag_s", "lagging", "attached", "active", "error")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INSTALLED_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTALLED_AGE_S_FIELD_NUMBER: _ClassVar[int]
    REPORT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    LAG_S_FIELD_NUMBER: _ClassVar[int]
    LAGGING_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    rank: int
    installed_version: int
    installed_age_s: float
    report_age_s: float
    lag_s: float
    lagging: bool
    attached: bool
    active: bool
    error: str
    def __init__(self, rank: _Optional[int] = ..., installed_version: _Optional[int] = ..., installed_age_s: _Optional[float] = ..., report_age_s: _Optional[float] = ..., lag_s: _Optional[float] = ..., lagging: _Optional[bool] = ..., attached: _Optional[bool] = ..., active: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class PlacementRequest(_message.Message):
    __slots__ = ("layer", "version")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    layer: int
    version: int
    def __init__(self, layer: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class PlacementReply(_message.Message):
    __slots__ = ("table", "ranks_per_node", "expert_load", "rank_nodes")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    RANKS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    EXPERT_LOAD_FIELD_NUMBER: _ClassVar[int]
    RANK_NODES_FIELD_NUMBER: _ClassVar[int]
    table: _consensus_pb2.RoutingTable
    ranks_per_node: int
    expert_load: bytes
    rank_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, table: _Optional[_Union[_consensus_pb2.RoutingTable, _Mapping]] = ..., ranks_per_node: _Optional[int] = ..., expert_load: _Optional[bytes] = ..., rank_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class HistoryRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class HistoryEntry(_message.Message):
    __slots__ = ("version", "parent", "plan", "votes", "proposer", "committed_at_ms", "committed_at_unix_ms", "copy_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    VOTES_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    COPY_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    parent: int
    plan: _consensus_pb2.Plan
    votes: _containers.RepeatedCompositeFieldContainer[_consensus_pb2.Vote]
    proposer: str
    committed_at_ms: int
    committed_at_unix_ms: int
    copy_bytes: int
    def __init__(self, version: _Optional[int] = ..., parent: _Optional[int] = ..., plan: _Optional[_Union[_consensus_pb2.Plan, _Mapping]] = ..., votes: _Optional[_Iterable[_Union[_consensus_pb2.Vote, _Mapping]]] = ..., proposer: _Optional[str] = ..., committed_at_ms: _Optional[int] = ..., committed_at_unix_ms: _Optional[int] = ..., copy_bytes: _Optional[int] = ...) -> None: ...

class HistoryReply(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[HistoryEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[HistoryEntry, _Mapping]]] = ...) -> None: ...

class ExplainRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("op", "reason", "gain", "cost")
    OP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GAIN_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    op: _consensus_pb2.Operation
    reason: str
    gain: float
    cost: float
    def __init__(self, op: _Optional[_Union[_consensus_pb2.Operation, _Mapping]] = ..., reason: _Optional[str] = ..., gain: _Optional[float] = ..., cost: _Optional[float] = ...) -> None: ...

class ExplainReply(_message.Message):
    __slots__ = ("version", "trigger", "plan", "refused", "votes", "outcome", "copy_bytes", "step_time", "copy_cost")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    VOTES_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    COPY_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_FIELD_NUMBER: _ClassVar[int]
    COPY_COST_FIELD_NUMBER: _ClassVar[int]
    version: int
    trigger: str
    plan: _consensus_pb2.Plan
    refused: _containers.RepeatedCompositeFieldContainer[Candidate]
    votes: _containers.RepeatedCompositeFieldContainer[_consensus_pb2.Vote]
    outcome: str
    copy_bytes: int
    step_time: str
    copy_cost: str
    def __init__(self, version: _Optional[int] = ..., trigger: _Optional[str] = ..., plan: _Optional[_Union[_consensus_pb2.Plan, _Mapping]] = ..., refused: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., votes: _Optional[_Iterable[_Union[_consensus_pb2.Vote, _Mapping]]] = ..., outcome: _Optional[str] = ..., copy_bytes: _Optional[int] = ..., step_time: _Optional[str] = ..., copy_cost: _Optional[str] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("ops", "force")
    OPS_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[_consensus_pb2.Operation]
    force: bool
    def __init__(self, ops: _Optional[_Iterable[_Union[_consensus_pb2.Operation, _Mapping]]] = ..., force: _Optional[bool] = ...) -> None: ...

class ProposeReply(_message.Message):
    __slots__ = ("committed", "version", "reason", "plan")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    committed: bool
    version: int
    reason: str
    plan: _consensus_pb2.Plan
    def __init__(self, committed: _Optional[bool] = ..., version: _Optional[int] = ..., reason: _Optional[str] = ..., plan: _Optional[_Union[_consensus_pb2.Plan, _Mapping]] = ...) -> None: ...

class RankRequest(_message.Message):
    __slots__ = ("rank",)
    RANK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    def __init__(self, rank: _Optional[int] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdminAck(_message.Message):
    __slots__ = ("ok", "reason", "version")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    version: int
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class LoadViewRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadViewReply(_message.Message):
    __slots__ = ("layers", "experts", "counts", "rank_load", "step_imbalance", "imbalance_history", "window", "window_seq")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    RANK_LOAD_FIELD_NUMBER: _ClassVar[int]
    STEP_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    IMBALANCE_HISTORY_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SEQ_FIELD_NUMBER: _ClassVar[int]
    layers: int
    experts: int
    counts: bytes
    rank_load: bytes
    step_imbalance: float
    imbalance_history: _containers.RepeatedScalarFieldContainer[float]
    window: int
    window_seq: int
    def __init__(self, layers: _Optional[int] = ..., experts: _Optional[int] = ..., counts: _Optional[bytes] = ..., rank_load: _Optional[bytes] = ..., step_imbalance: _Optional[float] = ..., imbalance_history: _Optional[_Iterable[float]] = ..., window: _Optional[int] = ..., window_seq: _Optional[int] = ...) -> None: ...
