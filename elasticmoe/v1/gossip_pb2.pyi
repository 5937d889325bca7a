from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemberStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_STATUS_UNSPECIFIED: _ClassVar[MemberStatus]
    ALIVE: _ClassVar[MemberStatus]
    SUSPECT: _ClassVar[MemberStatus]
    DEAD: _ClassVar[MemberStatus]
    LEFT: _ClassVar[MemberStatus]
MEMBER_STATUS_UNSPECIFIED: MemberStatus
ALIVE: MemberStatus
SUSPECT: MemberStatus
DEAD: MemberStatus
LEFT: MemberStatus

class MemberState(_message.Message):
    __slots__ = ("node_id", "address", "incarnation", "status", "ranks", "from_node", "claim", "claim_signature", "claim_certificate", "fingerprint")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    CLAIM_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CLAIM_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    incarnation: int
    status: MemberStatus
    ranks: _containers.RepeatedScalarFieldContainer[int]
    from_node: str
    claim: bytes
    claim_signature: bytes
    claim_certificate: bytes
    fingerprint: Fingerprint
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., incarnation: _Optional[int] = ..., status: _Optional[_Union[MemberStatus, str]] = ..., ranks: _Optional[_Iterable[int]] = ..., from_node: _Optional[str] = ..., claim: _Optional[bytes] = ..., claim_signature: _Optional[bytes] = ..., claim_certificate: _Optional[bytes] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ...) -> None: ...

class Fingerprint(_message.Message):
    __slots__ = ("nodes", "ranks_per_node", "slots_per_rank", "layers", "experts", "top_k", "genesis")
    NODES_FIELD_NUMBER: _ClassVar[int]
    RANKS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    GENESIS_FIELD_NUMBER: _ClassVar[int]
    nodes: int
    ranks_per_node: int
    slots_per_rank: int
    layers: int
    experts: int
    top_k: int
    genesis: bytes
    def __init__(self, nodes: _Optional[int] = ..., ranks_per_node: _Optional[int] = ..., slots_per_rank: _Optional[int] = ..., layers: _Optional[int] = ..., experts: _Optional[int] = ..., top_k: _Optional[int] = ..., genesis: _Optional[bytes] = ...) -> None: ...

class LoadWindow(_message.Message):
    __slots__ = ("node_id", "incarnation", "window_seq", "layers", "experts", "counts", "steps", "first_step", "signature", "certificate", "learner", "samples", "sample_every", "step_us", "step_version", "stride_us")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    LEARNER_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_EVERY_FIELD_NUMBER: _ClassVar[int]
    STEP_US_FIELD_NUMBER: _ClassVar[int]
    STEP_VERSION_FIELD_NUMBER: _ClassVar[int]
    STRIDE_US_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    window_seq: int
    layers: int
    experts: int
    counts: bytes
    steps: int
    first_step: int
    signature: bytes
    certificate: bytes
    learner: bool
    samples: bytes
    sample_every: int
    step_us: bytes
    step_version: bytes
    stride_us: bytes
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., window_seq: _Optional[int] = ..., layers: _Optional[int] = ..., experts: _Optional[int] = ..., counts: _Optional[bytes] = ..., steps: _Optional[int] = ..., first_step: _Optional[int] = ..., signature: _Optional[bytes] = ..., certificate: _Optional[bytes] = ..., learner: _Optional[bool] = ..., samples: _Optional[bytes] = ..., sample_every: _Optional[int] = ..., step_us: _Optional[bytes] = ..., step_version: _Optional[bytes] = ..., stride_us: _Optional[bytes] = ...) -> None: ...

class Digest(_message.Message):
    __slots__ = ("node_id", "incarnation", "window_seq")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SEQ_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    window_seq: int
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., window_seq: _Optional[int] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("from_node", "seq", "target", "piggyback", "digests")
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    PIGGYBACK_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    seq: int
    target: str
    piggyback: _containers.RepeatedCompositeFieldContainer[MemberState]
    digests: _containers.RepeatedCompositeFieldContainer[Digest]
    def __init__(self, from_node: _Optional[str] = ..., seq: _Optional[int] = ..., target: _Optional[str] = ..., piggyback: _Optional[_Iterable[_Union[MemberState, _Mapping]]] = ..., digests: _Optional[_Iterable[_Union[Digest, _Mapping]]] = ...) -> None: ...

class ProbeAck(_message.Message):
    __slots__ = ("from_node", "seq", "ok", "piggyback", "digests")
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    PIGGYBACK_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    seq: int
    ok: bool
    piggyback: _containers.RepeatedCompositeFieldContainer[MemberState]
    digests: _containers.RepeatedCompositeFieldContainer[Digest]
    def __init__(self, from_node: _Optional[str] = ..., seq: _Optional[int] = ..., ok: _Optional[bool] = ..., piggyback: _Optional[_Iterable[_Union[MemberState, _Mapping]]] = ..., digests: _Optional[_Iterable[_Union[Digest, _Mapping]]] = ...) -> None: ...

class IndirectProbeRequest(_message.Message):
    __slots__ = ("from_node", "seq", "target", "target_address", "piggyback", "timeout_ms")
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TARGET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PIGGYBACK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    seq: int
    target: str
    target_address: str
    piggyback: _containers.RepeatedCompositeFieldContainer[MemberState]
    timeout_ms: int
    def __init__(self, from_node: _Optional[str] = ..., seq: _Optional[int] = ..., target: _Optional[str] = ..., target_address: _Optional[str] = ..., piggyback: _Optional[_Iterable[_Union[MemberState, _Mapping]]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class PushPullRequest(_message.Message):
    __slots__ = ("from_node", "members", "digests", "windows", "join", "members_hash")
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_HASH_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    members: _containers.RepeatedCompositeFieldContainer[MemberState]
    digests: _containers.RepeatedCompositeFieldContainer[Digest]
    windows: _containers.RepeatedCompositeFieldContainer[LoadWindow]
    join: bool
    members_hash: int
    def __init__(self, from_node: _Optional[str] = ..., members: _Optional[_Iterable[_Union[MemberState, _Mapping]]] = ..., digests: _Optional[_Iterable[_Union[Digest, _Mapping]]] = ..., windows: _Optional[_Iterable[_Union[LoadWindow, _Mapping]]] = ..., join: _Optional[bool] = ..., members_hash: _Optional[int] = ...) -> None: ...

class PushPullReply(_message.Message):
    __slots__ = ("from_node", "members", "windows", "digests", "members_hash")
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_HASH_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    members: _containers.RepeatedCompositeFieldContainer[MemberState]
    windows: _containers.RepeatedCompositeFieldContainer[LoadWindow]
    digests: _containers.RepeatedCompositeFieldContainer[Digest]
    members_hash: int
    def __init__(self, from_node: _Optional[str] = ..., members: _Optional[_Iterable[_Union[MemberState, _Mapping]]] = ..., windows: _Optional[_Iterable[_Union[LoadWindow, _Mapping]]] = ..., digests: _Optional[_Iterable[_Union[Digest, _Mapping]]] = ..., members_hash: _Optional[int] = ...) -> None: ...

class BroadcastRequest(_message.Message):
    __slots__ = ("from_node", "members", "digests")
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    members: _containers.RepeatedCompositeFieldContainer[MemberState]
    digests: _containers.RepeatedCompositeFieldContainer[Digest]
    def __init__(self, from_node: _Optional[str] = ..., members: _Optional[_Iterable[_Union[MemberState, _Mapping]]] = ..., digests: _Optional[_Iterable[_Union[Digest, _Mapping]]] = ...) -> None: ...

class BroadcastReply(_message.Message):
    __slots__ = ("from_node", "members", "digests")
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    members: _containers.RepeatedCompositeFieldContainer[MemberState]
    digests: _containers.RepeatedCompositeFieldContainer[Digest]
    def __init__(self, from_node: _Optional[str] = ..., members: _Optional[_Iterable[_Union[MemberState, _Mapping]]] = ..., digests: _Optional[_Iterable[_Union[Digest, _Mapping]]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("from_node", "want")
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    WANT_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    want: _containers.RepeatedCompositeFieldContainer[Digest]
    def __init__(self, from_node: _Optional[str] = ..., want: _Optional[_Iterable[_Union[Digest, _Mapping]]] = ...) -> None: ...

class PullReply(_message.Message):
    __slots__ = ("from_node", "windows")
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    windows: _containers.RepeatedCompositeFieldContainer[LoadWindow]
    def __init__(self, from_node: _Optional[str] = ..., windows: _Optional[_Iterable[_Union[LoadWindow, _Mapping]]] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("from_node", "windows", "members")
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    windows: _containers.RepeatedCompositeFieldContainer[LoadWindow]
    members: _containers.RepeatedCompositeFieldContainer[MemberState]
    def __init__(self, from_node: _Optional[str] = ..., windows: _Optional[_Iterable[_Union[LoadWindow, _Mapping]]] = ..., members: _Optional[_Iterable[_Union[MemberState, _Mapping]]] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("from_node",)
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    def __init__(self, from_node: _Optional[str] = ...) -> None: ...
