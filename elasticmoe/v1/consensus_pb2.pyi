from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OP_KIND_UNSPECIFIED: _ClassVar[OpKind]
    REPLICATE: _ClassVar[OpKind]
    CONSOLIDATE: _ClassVar[OpKind]
    MIGRATE: _ClassVar[OpKind]
    DRAIN: _ClassVar[OpKind]
    RESTORE: _ClassVar[OpKind]
    REPAIR: _ClassVar[OpKind]
    ROLLBACK: _ClassVar[OpKind]
    SWAP: _ClassVar[OpKind]
    DROP: _ClassVar[OpKind]

class PlanKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLAN_KIND_UNSPECIFIED: _ClassVar[PlanKind]
    PLAN_REBALANCE: _ClassVar[PlanKind]
    PLAN_ROLLBACK: _ClassVar[PlanKind]
    PLAN_MANUAL: _ClassVar[PlanKind]
    PLAN_REPAIR: _ClassVar[PlanKind]

class Refusal(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFUSAL_UNSPECIFIED: _ClassVar[Refusal]
    REFUSAL_COMMITTED: _ClassVar[Refusal]
    REFUSAL_PROMISED: _ClassVar[Refusal]
    REFUSAL_PARENT_MISMATCH: _ClassVar[Refusal]
    REFUSAL_UNAVAILABLE: _ClassVar[Refusal]
    REFUSAL_INVALID_ARGUMENT: _ClassVar[Refusal]
    REFUSAL_REJECTED: _ClassVar[Refusal]
    REFUSAL_CONFLICT: _ClassVar[Refusal]

class ControlRefusal(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTROL_REFUSAL_UNSPECIFIED: _ClassVar[ControlRefusal]
    CONTROL_MALFORMED: _ClassVar[ControlRefusal]
    CONTROL_SUPERSEDED: _ClassVar[ControlRefusal]
    CONTROL_UNAVAILABLE: _ClassVar[ControlRefusal]
    CONTROL_NOT_WRITER: _ClassVar[ControlRefusal]
    CONTROL_UNKNOWN_WRITER: _ClassVar[ControlRefusal]
    CONTROL_WRITER_UNSIGNED: _ClassVar[ControlRefusal]
    CONTROL_WRITER_BAD_SIGNATURE: _ClassVar[ControlRefusal]
    CONTROL_BAD_COMMIT: _ClassVar[ControlRefusal]
OP_KIND_UNSPECIFIED: OpKind
REPLICATE: OpKind
CONSOLIDATE: OpKind
MIGRATE: OpKind
DRAIN: OpKind
RESTORE: OpKind
REPAIR: OpKind
ROLLBACK: OpKind
SWAP: OpKind
DROP: OpKind
PLAN_KIND_UNSPECIFIED: PlanKind
PLAN_REBALANCE: PlanKind
PLAN_ROLLBACK: PlanKind
PLAN_MANUAL: PlanKind
PLAN_REPAIR: PlanKind
REFUSAL_UNSPECIFIED: Refusal
REFUSAL_COMMITTED: Refusal
REFUSAL_PROMISED: Refusal
REFUSAL_PARENT_MISMATCH: Refusal
REFUSAL_UNAVAILABLE: Refusal
REFUSAL_INVALID_ARGUMENT: Refusal
REFUSAL_REJECTED: Refusal
REFUSAL_CONFLICT: Refusal
CONTROL_REFUSAL_UNSPECIFIED: ControlRefusal
CONTROL_MALFORMED: ControlRefusal
CONTROL_SUPERSEDED: ControlRefusal
CONTROL_UNAVAILABLE: ControlRefusal
CONTROL_NOT_WRITER: ControlRefusal
CONTROL_UNKNOWN_WRITER: ControlRefusal
CONTROL_WRITER_UNSIGNED: ControlRefusal
CONTROL_WRITER_BAD_SIGNATURE: ControlRefusal
CONTROL_BAD_COMMIT: ControlRefusal

class Ballot(_message.Message):
    __slots__ = ("round", "node_id")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    round: int
    node_id: str
    def __init__(self, round: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class RoutingTable(_message.Message):
    __slots__ = ("version", "parent", "layers", "slots", "experts", "slots_per_rank", "phy2log", "active_ranks", "content_hash", "parent_hash")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_RANKS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    version: int
    parent: int
    layers: int
    slots: int
    experts: int
    slots_per_rank: int
    phy2log: bytes
    active_ranks: _containers.RepeatedScalarFieldContainer[int]
    content_hash: bytes
    parent_hash: bytes
    def __init__(self, version: _Optional[int] = ..., parent: _Optional[int] = ..., layers: _Optional[int] = ..., slots: _Optional[int] = ..., experts: _Optional[int] = ..., slots_per_rank: _Optional[int] = ..., phy2log: _Optional[bytes] = ..., active_ranks: _Optional[_Iterable[int]] = ..., content_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ...) -> None: ...

class Operation(_message.Message):
    __slots__ = ("kind", "layer", "experts", "src", "dst", "rank", "source")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    kind: OpKind
    layer: int
    experts: _containers.RepeatedScalarFieldContainer[int]
    src: int
    dst: int
    rank: int
    source: int
    def __init__(self, kind: _Optional[_Union[OpKind, str]] = ..., layer: _Optional[int] = ..., experts: _Optional[_Iterable[int]] = ..., src: _Optional[int] = ..., dst: _Optional[int] = ..., rank: _Optional[int] = ..., source: _Optional[int] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("ops", "estimated_gain", "verified_gain", "cost", "trigger", "replay_from_step", "replay_to_step", "kind", "forced", "proposed_at_unix_ms", "load_ms")
    OPS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_GAIN_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_GAIN_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    REPLAY_TO_STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LOAD_MS_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[Operation]
    estimated_gain: float
    verified_gain: float
    cost: float
    trigger: str
    replay_from_step: int
    replay_to_step: int
    kind: PlanKind
    forced: bool
    proposed_at_unix_ms: int
    load_ms: float
    def __init__(self, ops: _Optional[_Iterable[_Union[Operation, _Mapping]]] = ..., estimated_gain: _Optional[float] = ..., verified_gain: _Optional[float] = ..., cost: _Optional[float] = ..., trigger: _Optional[str] = ..., replay_from_step: _Optional[int] = ..., replay_to_step: _Optional[int] = ..., kind: _Optional[_Union[PlanKind, str]] = ..., forced: _Optional[bool] = ..., proposed_at_unix_ms: _Optional[int] = ..., load_ms: _Optional[float] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("version", "ballot", "table", "plan", "proposer")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BALLOT_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    version: int
    ballot: Ballot
    table: RoutingTable
    plan: Plan
    proposer: str
    def __init__(self, version: _Optional[int] = ..., ballot: _Optional[_Union[Ballot, _Mapping]] = ..., table: _Optional[_Union[RoutingTable, _Mapping]] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., proposer: _Optional[str] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("version", "ballot", "from_node")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BALLOT_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    version: int
    ballot: Ballot
    from_node: str
    def __init__(self, version: _Optional[int] = ..., ballot: _Optional[_Union[Ballot, _Mapping]] = ..., from_node: _Optional[str] = ...) -> None: ...

class Promise(_message.Message):
    __slots__ = ("ok", "from_node", "promised", "accepted_ballot", "accepted", "reason", "committed_head", "code")
    OK_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    PROMISED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BALLOT_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_HEAD_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    from_node: str
    promised: Ballot
    accepted_ballot: Ballot
    accepted: Proposal
    reason: str
    committed_head: int
    code: Refusal
    def __init__(self, ok: _Optional[bool] = ..., from_node: _Optional[str] = ..., promised: _Optional[_Union[Ballot, _Mapping]] = ..., accepted_ballot: _Optional[_Union[Ballot, _Mapping]] = ..., accepted: _Optional[_Union[Proposal, _Mapping]] = ..., reason: _Optional[str] = ..., committed_head: _Optional[int] = ..., code: _Optional[_Union[Refusal, str]] = ...) -> None: ...

class AcceptRequest(_message.Message):
    __slots__ = ("proposal", "from_node")
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    proposal: Proposal
    from_node: str
    def __init__(self, proposal: _Optional[_Union[Proposal, _Mapping]] = ..., from_node: _Optional[str] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ("ok", "from_node", "ballot", "reason", "committed_head", "verified_gain", "signature", "certificate", "code")
    OK_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    BALLOT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_HEAD_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_GAIN_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    from_node: str
    ballot: Ballot
    reason: str
    committed_head: int
    verified_gain: float
    signature: bytes
    certificate: bytes
    code: Refusal
    def __init__(self, ok: _Optional[bool] = ..., from_node: _Optional[str] = ..., ballot: _Optional[_Union[Ballot, _Mapping]] = ..., reason: _Optional[str] = ..., committed_head: _Optional[int] = ..., verified_gain: _Optional[float] = ..., signature: _Optional[bytes] = ..., certificate: _Optional[bytes] = ..., code: _Optional[_Union[Refusal, str]] = ...) -> None: ...

class VoteSignature(_message.Message):
    __slots__ = ("voter", "certificate", "signature")
    VOTER_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    voter: str
    certificate: bytes
    signature: bytes
    def __init__(self, voter: _Optional[str] = ..., certificate: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Vote(_message.Message):
    __slots__ = ("voter", "accept", "reason", "verified_gain")
    VOTER_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_GAIN_FIELD_NUMBER: _ClassVar[int]
    voter: str
    accept: bool
    reason: str
    verified_gain: float
    def __init__(self, voter: _Optional[str] = ..., accept: _Optional[bool] = ..., reason: _Optional[str] = ..., verified_gain: _Optional[float] = ...) -> None: ...

class QuorumCertificate(_message.Message):
    __slots__ = ("version", "ballot", "table_hash", "voters", "quorum", "signatures")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BALLOT_FIELD_NUMBER: _ClassVar[int]
    TABLE_HASH_FIELD_NUMBER: _ClassVar[int]
    VOTERS_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    version: int
    ballot: Ballot
    table_hash: bytes
    voters: _containers.RepeatedScalarFieldContainer[str]
    quorum: int
    signatures: _containers.RepeatedCompositeFieldContainer[VoteSignature]
    def __init__(self, version: _Optional[int] = ..., ballot: _Optional[_Union[Ballot, _Mapping]] = ..., table_hash: _Optional[bytes] = ..., voters: _Optional[_Iterable[str]] = ..., quorum: _Optional[int] = ..., signatures: _Optional[_Iterable[_Union[VoteSignature, _Mapping]]] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("table", "qc", "plan", "votes", "proposer", "committed_at_ms")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    QC_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    VOTES_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    table: RoutingTable
    qc: QuorumCertificate
    plan: Plan
    votes: _containers.RepeatedCompositeFieldContainer[Vote]
    proposer: str
    committed_at_ms: int
    def __init__(self, table: _Optional[_Union[RoutingTable, _Mapping]] = ..., qc: _Optional[_Union[QuorumCertificate, _Mapping]] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., votes: _Optional[_Iterable[_Union[Vote, _Mapping]]] = ..., proposer: _Optional[str] = ..., committed_at_ms: _Optional[int] = ...) -> None: ...

class CommitAck(_message.Message):
    __slots__ = ("ok", "from_node", "committed_head", "reason", "code")
    OK_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_HEAD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    from_node: str
    committed_head: int
    reason: str
    code: Refusal
    def __init__(self, ok: _Optional[bool] = ..., from_node: _Optional[str] = ..., committed_head: _Optional[int] = ..., reason: _Optional[str] = ..., code: _Optional[_Union[Refusal, str]] = ...) -> None: ...

class CatchUpRequest(_message.Message):
    __slots__ = ("from_version", "from_node", "limit", "enrolment")
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    ENROLMENT_FIELD_NUMBER: _ClassVar[int]
    from_version: int
    from_node: str
    limit: int
    enrolment: int
    def __init__(self, from_version: _Optional[int] = ..., from_node: _Optional[str] = ..., limit: _Optional[int] = ..., enrolment: _Optional[int] = ...) -> None: ...

class CatchUpReply(_message.Message):
    __slots__ = ("commits", "committed_head", "acceptor_high", "rebuilding", "snapshot", "knew_you", "control")
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_HEAD_FIELD_NUMBER: _ClassVar[int]
    ACCEPTOR_HIGH_FIELD_NUMBER: _ClassVar[int]
    REBUILDING_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    KNEW_YOU_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    commits: _containers.RepeatedCompositeFieldContainer[Commit]
    committed_head: int
    acceptor_high: int
    rebuilding: bool
    snapshot: bool
    knew_you: bool
    control: ControlCommit
    def __init__(self, commits: _Optional[_Iterable[_Union[Commit, _Mapping]]] = ..., committed_head: _Optional[int] = ..., acceptor_high: _Optional[int] = ..., rebuilding: _Optional[bool] = ..., snapshot: _Optional[bool] = ..., knew_you: _Optional[bool] = ..., control: _Optional[_Union[ControlCommit, _Mapping]] = ...) -> None: ...

class ControlRecord(_message.Message):
    __slots__ = ("seq", "node_id", "paused", "at_ms", "note", "admin")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    seq: int
    node_id: str
    paused: bool
    at_ms: int
    note: str
    admin: str
    def __init__(self, seq: _Optional[int] = ..., node_id: _Optional[str] = ..., paused: _Optional[bool] = ..., at_ms: _Optional[int] = ..., note: _Optional[str] = ..., admin: _Optional[str] = ...) -> None: ...

class ControlCommit(_message.Message):
    __slots__ = ("record", "voters", "quorum", "signatures", "writer")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    VOTERS_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    record: ControlRecord
    voters: _containers.RepeatedScalarFieldContainer[str]
    quorum: int
    signatures: _containers.RepeatedCompositeFieldContainer[VoteSignature]
    writer: VoteSignature
    def __init__(self, record: _Optional[_Union[ControlRecord, _Mapping]] = ..., voters: _Optional[_Iterable[str]] = ..., quorum: _Optional[int] = ..., signatures: _Optional[_Iterable[_Union[VoteSignature, _Mapping]]] = ..., writer: _Optional[_Union[VoteSignature, _Mapping]] = ...) -> None: ...

class ControlAcceptRequest(_message.Message):
    __slots__ = ("record", "from_node", "writer")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    record: ControlRecord
    from_node: str
    writer: VoteSignature
    def __init__(self, record: _Optional[_Union[ControlRecord, _Mapping]] = ..., from_node: _Optional[str] = ..., writer: _Optional[_Union[VoteSignature, _Mapping]] = ...) -> None: ...

class ControlAck(_message.Message):
    __slots__ = ("ok", "from_node", "reason", "accepted", "certified", "signature", "certificate", "code")
    OK_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    CERTIFIED_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    from_node: str
    reason: str
    accepted: ControlRecord
    certified: ControlCommit
    signature: bytes
    certificate: bytes
    code: ControlRefusal
    def __init__(self, ok: _Optional[bool] = ..., from_node: _Optional[str] = ..., reason: _Optional[str] = ..., accepted: _Optional[_Union[ControlRecord, _Mapping]] = ..., certified: _Optional[_Union[ControlCommit, _Mapping]] = ..., signature: _Optional[bytes] = ..., certificate: _Optional[bytes] = ..., code: _Optional[_Union[ControlRefusal, str]] = ...) -> None: ...

class KnownVoters(_message.Message):
    __slots__ = ("enrolment",)
    class EnrolmentEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ENROLMENT_FIELD_NUMBER: _ClassVar[int]
    enrolment: _containers.ScalarMap[str, int]
    def __init__(self, enrolment: _Optional[_Mapping[str, int]] = ...) -> None: ...

class RebuildMark(_message.Message):
    __slots__ = ("enrolment", "strict", "done")
    ENROLMENT_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    enrolment: int
    strict: bool
    done: bool
    def __init__(self, enrolment: _Optional[int] = ..., strict: _Optional[bool] = ..., done: _Optional[bool] = ...) -> None: ...

class AcceptorState(_message.Message):
    __slots__ = ("version", "promised", "accepted_ballot", "accepted", "proposer_round")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMISED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BALLOT_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_ROUND_FIELD_NUMBER: _ClassVar[int]
    version: int
    promised: Ballot
    accepted_ballot: Ballot
    accepted: Proposal
    proposer_round: int
    def __init__(self, version: _Optional[int] = ..., promised: _Optional[_Union[Ballot, _Mapping]] = ..., accepted_ballot: _Optional[_Union[Ballot, _Mapping]] = ..., accepted: _Optional[_Union[Proposal, _Mapping]] = ..., proposer_round: _Optional[int] = ...) -> None: ...

class ControlState(_message.Message):
    __slots__ = ("accepted", "certified", "writer")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    CERTIFIED_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    accepted: ControlRecord
    certified: ControlCommit
    writer: VoteSignature
    def __init__(self, accepted: _Optional[_Union[ControlRecord, _Mapping]] = ..., certified: _Optional[_Union[ControlCommit, _Mapping]] = ..., writer: _Optional[_Union[VoteSignature, _Mapping]] = ...) -> None: ...
