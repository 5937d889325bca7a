from elasticmoe.v1 import consensus_pb2 as _consensus_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchTablesRequest(_message.Message):
    __slots__ = ("from_version", "shim_id", "ranks")
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHIM_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    from_version: int
    shim_id: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, from_version: _Optional[int] = ..., shim_id: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class TableUpdate(_message.Message):
    __slots__ = ("commit",)
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    commit: _consensus_pb2.Commit
    def __init__(self, commit: _Optional[_Union[_consensus_pb2.Commit, _Mapping]] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("shim_id", "rank", "first_step", "steps", "version", "layers", "experts", "counts", "stale_dispatches", "dropped_tokens", "dropped_reports", "unreachable_ranks", "samples", "sample_every", "error", "max_batch_tokens", "step_us", "stride_us")
    SHIM_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    STALE_DISPATCHES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_REPORTS_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_RANKS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_EVERY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_US_FIELD_NUMBER: _ClassVar[int]
    STRIDE_US_FIELD_NUMBER: _ClassVar[int]
    shim_id: str
    rank: int
    first_step: int
    steps: int
    version: int
    layers: int
    experts: int
    counts: bytes
    stale_dispatches: int
    dropped_tokens: int
    dropped_reports: int
    unreachable_ranks: _containers.RepeatedScalarFieldContainer[int]
    samples: bytes
    sample_every: int
    error: str
    max_batch_tokens: int
    step_us: bytes
    stride_us: bytes
    def __init__(self, shim_id: _Optional[str] = ..., rank: _Optional[int] = ..., first_step: _Optional[int] = ..., steps: _Optional[int] = ..., version: _Optional[int] = ..., layers: _Optional[int] = ..., experts: _Optional[int] = ..., counts: _Optional[bytes] = ..., stale_dispatches: _Optional[int] = ..., dropped_tokens: _Optional[int] = ..., dropped_reports: _Optional[int] = ..., unreachable_ranks: _Optional[_Iterable[int]] = ..., samples: _Optional[bytes] = ..., sample_every: _Optional[int] = ..., error: _Optional[str] = ..., max_batch_tokens: _Optional[int] = ..., step_us: _Optional[bytes] = ..., stride_us: _Optional[bytes] = ...) -> None: ...

class ReportLoadAck(_message.Message):
    __slots__ = ("accepted", "rejected", "reason", "next_step")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    rejected: int
    reason: str
    next_step: int
    def __init__(self, accepted: _Optional[int] = ..., rejected: _Optional[int] = ..., reason: _Optional[str] = ..., next_step: _Optional[int] = ...) -> None: ...
