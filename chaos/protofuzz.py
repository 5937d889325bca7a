"""Hypothesis strategies for hostile protobuf messages, built from the message descriptor.

Three sources, mixed by `hostile(cls, seeds)`:
- `messages(cls)`: every field independently unset or a random value of its type: extreme integers (0, -1,
  the type's min and max), NaN, +-inf and subnormal floats, random bytes and text, unknown enum numbers,
  nested messages to a bounded depth, repeated fields and maps of random length.
- `mutated(seeds)`: a valid seed message with a few fields (at any depth) replaced by such values, or a
  bytes field resized by a few bytes: the input that gets past the first checks and reaches the deep ones.
- `wire(cls, seeds)`: raw bytes (random, or a seed's encoding bit-flipped, truncated or spliced) parsed
  with `FromString`; what does not parse is yielded as the bytes themselves (a malformed protobuf that
  the transport's decoder must refuse before any handler runs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import strategies as st

FD = FieldDescriptor
_INT_RANGES: dict[int, tuple[int, int]] = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1), FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FD.TYPE_UINT32: (0, 2**32 - 1), FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_INT64: (-(2**63), 2**63 - 1), FD.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1), FD.TYPE_UINT64: (0, 2**64 - 1), FD.TYPE_FIXED64: (0, 2**64 - 1),
}
_SPECIAL_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 5e-324, 1e308, -1e308, -1.0]
_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=24)


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    special = sorted({x for x in (0, 1, -1, 2, lo, hi, hi - 1, lo + 1, 2**31 - 1, 2**32 - 1) if lo <= x <= hi})
    return st.one_of(st.sampled_from(special), st.integers(-3, 64).filter(lambda x: lo <= x <= hi),
                     st.integers(lo, hi))


def scalar(fd: FieldDescriptor, max_bytes: int = 96) -> st.SearchStrategy[Any]:
    """Random values for one (non-message) field, extremes included."""
    t = fd.type
    if t in _INT_RANGES:
        return _ints(*_INT_RANGES[t])
    if t == FD.TYPE_DOUBLE:
        return st.one_of(st.sampled_from(_SPECIAL_FLOATS), st.floats(allow_nan=True, allow_infinity=True))
    if t == FD.TYPE_FLOAT:
        return st.one_of(st.sampled_from(_SPECIAL_FLOATS[:4]), st.floats(width=32))
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t == FD.TYPE_STRING:
        return _TEXT
    if t == FD.TYPE_BYTES:
        return st.binary(max_size=max_bytes)
    if t == FD.TYPE_ENUM:
        known = [v.number for v in fd.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-(2**31), 2**31 - 1))
    raise TypeError(f"field {fd.full_name}: unsupported type {t}")


def _is_map(fd: FieldDescriptor) -> bool:
    return fd.type == FD.TYPE_MESSAGE and fd.message_type.GetOptions().map_entry


def _is_repeated(fd: FieldDescriptor) -> bool:
    return bool(fd.is_repeated)


def _field_value(fd: FieldDescriptor, depth: int, max_repeated: int) -> st.SearchStrategy[Any]:
    if _is_map(fd):
        k, v = fd.message_type.fields_by_name["key"], fd.message_type.fields_by_name["value"]
        vs = _message_dict(v.message_type, depth - 1, max_repeated) if v.type == FD.TYPE_MESSAGE else scalar(v)
        return st.dictionaries(scalar(k), vs, max_size=max_repeated)
    one = _message_dict(fd.message_type, depth - 1, max_repeated) if fd.type == FD.TYPE_MESSAGE else scalar(fd)
    if _is_repeated(fd):
        return st.lists(one, max_size=max_repeated)
    return one


def _message_dict(desc: Descriptor, depth: int, max_repeated: int) -> st.SearchStrategy[dict[str, Any]]:
    """A dict {field name: value} (a nested message is a nested dict); unset fields are absent."""
    if depth < 0:
        return st.just({})
    parts = {}
    for fd in desc.fields:
        if fd.type == FD.TYPE_MESSAGE and depth == 0 and not _is_map(fd):
            continue
        parts[fd.name] = st.one_of(st.none(), _field_value(fd, depth, max_repeated))
    return st.fixed_dictionaries(parts).map(lambda d: {k: v for k, v in d.items() if v is not None})


def _set(msg: Message, name: str, value: Any) -> None:
    fd = msg.DESCRIPTOR.fields_by_name[name]
    if _is_map(fd):
        m = getattr(msg, name)
        vfd = fd.message_type.fields_by_name["value"]
        for k, v in value.items():
            if vfd.type == FD.TYPE_MESSAGE:
                fill(m[k], v)
            else:
                m[k] = v
    elif _is_repeated(fd):
        rep = getattr(msg, name)
        del rep[:]
        for v in value:
            if fd.type == FD.TYPE_MESSAGE:
                fill(rep.add(), v)
            else:
                rep.append(v)
    elif fd.type == FD.TYPE_MESSAGE:
        sub = getattr(msg, name)
        sub.SetInParent()
        fill(sub, value)
    else:
        setattr(msg, name, value)


def fill(msg: Message, values: dict[str, Any]) -> Message:
    """Set `values` (as drawn by `_message_dict`) on `msg`; returns it."""
    for name, value in values.items():
        _set(msg, name, value)
    return msg


def messages(cls: type[Message], depth: int = 3, max_repeated: int = 5) -> st.SearchStrategy[Message]:
    """Arbitrary messages of `cls` from its descriptor (nested messages to `depth` levels)."""
    return _message_dict(cls.DESCRIPTOR, depth, max_repeated).map(lambda d: fill(cls(), d))


def _paths(msg: Message, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every (set or unset) field path of `msg` down through its set sub-messages and repeated items."""
    out: list[tuple[Any, ...]] = []
    for fd in msg.DESCRIPTOR.fields:
        out.append((*prefix, fd.name))
        if _is_map(fd):
            continue
        if fd.type == FD.TYPE_MESSAGE:
            if _is_repeated(fd):
                for i, sub in enumerate(getattr(msg, fd.name)):
                    out.extend(_paths(sub, (*prefix, fd.name, i)))
            elif msg.HasField(fd.name):
                out.extend(_paths(getattr(msg, fd.name), (*prefix, fd.name)))
    return out


def _resolve(msg: Message, path: tuple[Any, ...]) -> tuple[Message, str]:
    for step in path[:-1]:
        msg = msg[step] if isinstance(step, int) else getattr(msg, step)  # type: ignore[index]
    return msg, path[-1]


@st.composite
def mutated(draw: st.DrawFn, seeds: Sequence[Message], max_mutations: int = 3) -> Message:
    """A copy of one of `seeds` with 1..max_mutations fields replaced by hostile values."""
    seed = draw(st.sampled_from(list(seeds)))
    msg = type(seed)()
    msg.CopyFrom(seed)
    for _ in range(draw(st.integers(1, max_mutations))):
        paths = _paths(msg)
        if not paths:  # a message without fields: only unknown fields (wire()) can vary it
            break
        parent, name = _resolve(msg, draw(st.sampled_from(paths)))
        fd = parent.DESCRIPTOR.fields_by_name[name]
        if fd.type == FD.TYPE_BYTES and not _is_repeated(fd) and draw(st.booleans()):
            old = getattr(parent, name)
            how = draw(st.sampled_from(["grow", "shrink", "flip", "same-length"]))
            if how == "grow":
                new = old + draw(st.binary(min_size=1, max_size=16))
            elif how == "shrink":
                new = old[: max(0, len(old) - draw(st.integers(1, 16)))]
            elif how == "flip" and old:
                i = draw(st.integers(0, len(old) - 1))
                new = old[:i] + bytes([old[i] ^ (1 << draw(st.integers(0, 7)))]) + old[i + 1:]
            else:
                new = draw(st.binary(min_size=len(old), max_size=len(old)))
            setattr(parent, name, new)
            continue
        if fd.type == FD.TYPE_MESSAGE and not _is_repeated(fd) and not _is_map(fd) and draw(st.booleans()):
            parent.ClearField(name)
            continue
        _set(parent, name, draw(_field_value(fd, 1, 4)))
    return msg


@st.composite
def raw_bytes(draw: st.DrawFn, seeds: Sequence[Message]) -> bytes:
    """Random bytes, or a seed's encoding with a bit flipped, truncated, or spliced with random bytes."""
    encodings = [s.SerializeToString() for s in seeds] or [b""]
    how = draw(st.sampled_from(["random", "flip", "truncate", "splice"]))
    if how == "random":
        return draw(st.binary(max_size=256))
    b = draw(st.sampled_from(encodings))
    if not b:
        return draw(st.binary(max_size=64))
    i = draw(st.integers(0, len(b) - 1))
    if how == "flip":
        return b[:i] + bytes([b[i] ^ (1 << draw(st.integers(0, 7)))]) + b[i + 1:]
    if how == "truncate":
        return b[:i]
    return b[:i] + draw(st.binary(max_size=32)) + b[i:]


def parse(cls: type[Message], data: bytes) -> Message | bytes:
    """`cls.FromString(data)`, or `data` itself when it is not a valid encoding."""
    try:
        return cls.FromString(data)
    except (DecodeError, ValueError, RuntimeError):
        return data


def wire(cls: type[Message], seeds: Sequence[Message]) -> st.SearchStrategy[Message | bytes]:
    return raw_bytes(seeds).map(lambda b: parse(cls, b))


def hostile(cls: type[Message], seeds: Sequence[Message] = ()) -> st.SearchStrategy[Message | bytes]:
    """The mix the fuzzer feeds each handler: descriptor-random, mutated seeds, raw wire bytes."""
    parts: list[st.SearchStrategy[Message | bytes]] = [messages(cls), wire(cls, seeds)]
    if seeds:
        parts += [mutated(seeds), mutated(seeds)]  # weighted: most examples start from a valid message
    return st.one_of(parts)
