"""A canonical digest of a model-checking world (chaos/mcworld.py), and a deep copy of one.

The digest walks the whole object graph the nodes hold (acceptors, attempts, pending proposals, the rebuild,
the committed log, armed timers with what their closures captured, calls in flight with their callbacks) with
shared objects written as back-references, so two worlds with one digest hold the same structure: exploring
one of them explores both. Left out, each because nothing the nodes decide depends on it:
- the node's random generator (it only draws timer delays, and timers fire by choice here), its clock and
  transport (the world's), its config, verifier and callbacks (the same in every state), and the same
  collaborators where its parts (Proposer, Recovery, Timers) hold them too;
- `rejections`, `Pending.votes` and `Pending.reasons` (written for explain and outcomes, never read back);
- the store's counters (`appends`, `size`, the high-water mark: compaction is off and nothing cuts a log);
  the disk is written as what a restart recovers from it (commits in order, the last acceptor state of each
  version, the known voters, the last rebuild mark, whether it holds any record), not as its bytes;
- the proposer's `_rtt`: only its order is kept (it only sorts the thrifty first wave);
- a part of a node that is down or replaced (a callback still in flight holds it): written as that node is.

The copy is `copy.deepcopy` with closures copied too (the standard one shares a function's cells, so a
copied timer would still act on the original node): one call copies the whole world, keeping its aliasing.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import random
import types
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from google.protobuf.message import Message

from agent.consensus.node import ConsensusNode
from agent.consensus.proposer import Proposer
from agent.consensus.recovery import Recovery
from agent.storage.store import MemoryDisk, Store, parse
from chaos.mcworld import World
from controlplane.table import RoutingTable

_SKIP_NODE = {"rng", "cfg", "verifier", "clock", "transport", "live_voters", "members", "_callbacks", "signer",
              "timeout", "voters", "quorum"}
_FIXED = {"cfg", "clock", "transport", "store", "timeout", "voters"}  # what a part is given, the node's own
_SKIP = {"Pending": {"votes", "reasons"}, "CommittedLog": {"store", "on_install", "ride_along", "verify_qc"},
         "Proposer": _FIXED | {"rng", "live_voters", "rejections", "_rtt"}, "Recovery": _FIXED,
         "Timers": {"clock", "running"}}


class Canon:
    def __init__(self, world: World) -> None:
        self.world = world
        self.seen: dict[int, int] = {}

    def enc(self, x: Any) -> Any:
        if x is None or isinstance(x, (bool, int, float, str, bytes)):
            return x
        if isinstance(x, Message):
            return ("pb", type(x).__name__, x.SerializeToString(deterministic=True))
        if isinstance(x, RoutingTable):
            return ("table", x.digest)
        if isinstance(x, tuple):
            return ("t", *[self.enc(i) for i in x])
        if isinstance(x, ConsensusNode):
            return ("node", x.node_id, self._live(x))
        if isinstance(x, (Proposer, Recovery)) and not self._live(x.node):
            return (type(x).__name__, self.enc(x.node))
        if isinstance(x, (World, random.Random)):
            return (type(x).__name__,)
        i = id(x)
        if i in self.seen:
            return ("ref", self.seen[i])
        self.seen[i] = len(self.seen)
        if isinstance(x, (list, deque)):
            return ("l", *[self.enc(v) for v in x])
        if isinstance(x, dict):
            return ("d", *[(self.enc(k), self.enc(x[k])) for k in sorted(x, key=repr)])
        if isinstance(x, (set, frozenset)):
            return ("s", *sorted((self.enc(v) for v in x), key=repr))
        if isinstance(x, functools.partial):
            return ("p", self.enc(x.func), self.enc(x.args), self.enc(x.keywords))
        if isinstance(x, types.MethodType):
            return ("m", x.__func__.__qualname__, self.enc(x.__self__))
        if isinstance(x, types.FunctionType):
            cells = tuple(self.enc(c.cell_contents) if _full(c) else ("empty",) for c in x.__closure__ or ())
            return ("f", x.__qualname__, cells)
        if isinstance(x, Store):
            return ("store", x.failed, x.lost, x._opened, self.enc(x.known), self.enc(x.rebuild), self.enc(x._disk))
        if isinstance(x, MemoryDisk):
            return ("disk", disk_digest(x))
        return self.obj(x, _SKIP.get(type(x).__name__, set()))

    def _live(self, n: Any) -> bool:
        return self.world.nodes.get(n.node_id) is n and n.node_id in self.world.up

    def obj(self, x: Any, skip: set[str]) -> Any:
        names = sorted(vars(x)) if hasattr(x, "__dict__") else sorted(
            s for c in type(x).__mro__ for s in getattr(c, "__slots__", ()))
        return (type(x).__name__, *[(k, self.enc(getattr(x, k))) for k in names if k not in skip])

    def node(self, n: ConsensusNode) -> Any:
        rank = sorted(n.proposer._rtt.items(), key=lambda kv: (kv[1], kv[0]))
        order = tuple((p, sum(1 for _, r in rank if r < t)) for p, t in rank)
        self.seen[id(n)] = len(self.seen)
        return ("N", order, self.obj(n, _SKIP_NODE))


def _full(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


_DISKS: dict[bytes, bytes] = {}


def disk_digest(d: MemoryDisk) -> bytes:
    """What a restart recovers from `d` (see the module docstring), as a digest."""
    raw = bytes(d.data)
    key = hashlib.blake2b(raw, digest_size=16).digest()
    got = _DISKS.get(key)
    if got is None:
        got = _DISKS[key] = _recovered_digest(raw)
    return got


def _recovered_digest(raw: bytes) -> bytes:
    rec, end = parse(raw)
    if end != len(raw):
        raise AssertionError("a simulated disk holds a torn record: the model never tears one")
    h = hashlib.blake2b(digest_size=16)
    for c in rec.commits:
        h.update(b"C" + c.SerializeToString(deterministic=True))
    for v in sorted(rec.acceptor):
        h.update(b"A" + rec.acceptor[v].SerializeToString(deterministic=True))
    h.update(repr(sorted(rec.known.items())).encode())
    if rec.rebuild is not None:
        h.update(b"R" + rec.rebuild.SerializeToString(deterministic=True))
    h.update(b"1" if rec.records else b"0")
    return h.digest()


def fingerprint(w: World) -> bytes:
    """The canonical digest of `w` (see the module docstring)."""
    c = Canon(w)
    head = (sorted(w.up), sorted(w.inc.items()), sorted(w.had_store.items()), w.crashes, w.wipes, w.proposals,
            w.fired, sorted(w.conflicts), sorted((k, sorted(v)) for k, v in w.votes.items()),
            sorted((k, sorted(v)) for k, v in w.installed.items()), sorted((k, sorted(v)) for k, v in w.reported.items()))
    parts: list[Any] = [head, [(n, disk_digest(w.disks[n])) for n in w.ids]]
    parts += [c.node(w.nodes[n]) for n in w.ids if n in w.up]

    for m in sorted(w.msgs, key=lambda m: (m.reply, m.src, m.dst, m.method, m.data or b"")):  # ties: fewer merges
        parts.append(("msg", m.reply, m.src, m.dst, m.method, m.data, w.is_current(m.src if not m.reply else m.dst,
                                                                                 m.caller_inc), c.enc(m.call)))
    for t in sorted(w.timers, key=lambda t: (t.node, t.fn.__qualname__)):
        parts.append(("timer", t.node, c.enc(t.fn)))
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def _copy_function(f: types.FunctionType, memo: dict[int, Any]) -> types.FunctionType:
    if not f.__closure__:
        return f
    cells = tuple(types.CellType(copy.deepcopy(c.cell_contents, memo)) if _full(c) else types.CellType()
                  for c in f.__closure__)
    g = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, cells)
    g.__qualname__, g.__kwdefaults__ = f.__qualname__, f.__kwdefaults__
    return g


@contextmanager
def _closures_copied() -> Iterator[None]:
    table: dict[type, Any] = copy._deepcopy_dispatch  # type: ignore[attr-defined]
    old = table.get(types.FunctionType)
    table[types.FunctionType] = _copy_function
    try:
        yield
    finally:
        table[types.FunctionType] = old


def snapshot(w: World) -> World:
    """An independent copy of `w`. Shared, not copied: the config, the genesis table, the bound (never changed)
    and the nodes' random generators (they only draw timer delays, which mean nothing here)."""
    memo: dict[int, Any] = {id(w.cfg): w.cfg, id(w.genesis): w.genesis, id(w.bound): w.bound}
    memo.update((id(n.rng), n.rng) for n in w.nodes.values())
    with _closures_copied():
        return copy.deepcopy(w, memo)
