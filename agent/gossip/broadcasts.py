"""The rumour queue (memberlist's TransmitLimitedQueue) shared by membership and load gossip.

Each rumour has a key: ("m", node) for a member's state, ("w", node) for a node's window digest. A newer
rumour for a key replaces the queued one (newer state invalidates queued older state). Each rumour is
piggybacked on at most `retransmit_mult x ceil(log10(N + 1))` messages, fewest-sent and newest first, then
dropped: enough sends for an infection-style spread to reach every node with high probability.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

from elasticmoe.v1 import gossip_pb2 as pb

Kind = Literal["m", "w"]
Rumour = pb.MemberState | pb.Digest


_STATUS_ORDER = {pb.ALIVE: 0, pb.SUSPECT: 1, pb.DEAD: 2, pb.LEFT: 3}


def _version(msg: Rumour) -> tuple[int, int]:
    if isinstance(msg, pb.Digest):
        return (msg.incarnation, msg.window_seq)
    return (msg.incarnation, _STATUS_ORDER.get(msg.status, -1))


def retransmit_limit(mult: int, n: int) -> int:
    """memberlist's retransmit limit: mult x ceil(log10(n + 1)), at least 1."""
    return max(1, mult * math.ceil(math.log10(n + 1)))


class _Entry:
    __slots__ = ("kind", "msg", "size", "sent", "order", "seen")

    def __init__(self, kind: Kind, msg: Rumour, size: int, order: int, source: str | None) -> None:
        self.kind = kind
        self.msg = msg
        self.size = size
        self.sent = 0
        self.order = order
        self.seen = {source} if source else set()  # members known to have it: never sent to them again


class RumourQueue:
    def __init__(self, retransmit_mult: int, cluster_size: Callable[[], int],
                 on_put: Callable[[], None] | None = None) -> None:
        self._mult = retransmit_mult
        self._n = cluster_size
        self._q: dict[tuple[Kind, str], _Entry] = {}
        self._buckets: list[dict[tuple[Kind, str], _Entry]] = [{}]  # by sends so far, oldest first within
        self._order = 0
        self.on_put = on_put  # called after each put: the owner sends news at once (infection-style)

    def __len__(self) -> int:
        return len(self._q)

    def put(self, kind: Kind, key: str, msg: Rumour, source: str | None = None) -> None:
        """Queue a rumour, replacing any queued one for the same key (the caller knows this one is newer);
        `source`: the member we heard it from (it needs no copy back)."""
        self._order += 1
        k = (kind, key)
        self.drop(kind, key)
        e = self._q[k] = _Entry(kind, msg, msg.ByteSize() + 4, self._order, source)
        self._buckets[0][k] = e
        if self.on_put is not None:
            self.on_put()

    def seen_by(self, kind: Kind, key: str, node: str, msg: Rumour) -> None:
        """`node` sent us `msg` about `key`: if that is at least as new as our queued rumour, `node` needs
        no copy of ours."""
        e = self._q.get((kind, key))
        if e is not None and _version(msg) >= _version(e.msg):
            e.seen.add(node)

    def drop(self, kind: Kind, key: str) -> None:
        e = self._q.pop((kind, key), None)
        if e is not None:
            del self._buckets[e.sent][(kind, key)]

    def queued(self, kind: Kind, key: str) -> Rumour | None:
        e = self._q.get((kind, key))
        return None if e is None else e.msg

    def take(self, budget: int, members: list[pb.MemberState], digests: list[pb.Digest] | None, dst: str = "",
             skip: set[tuple[Kind, str]] | frozenset[tuple[Kind, str]] = frozenset()) -> int:
        """Append rumours for `dst` worth at most `budget` bytes (fewest sends first, then newest; none that
        `dst` is known to have) to the lists (digests None: member rumours only), count one send for each,
        drop those that reached the limit. Returns the bytes taken."""
        if not self._q:
            return 0
        limit = retransmit_limit(self._mult, self._n())
        used = 0
        taken: list[tuple[tuple[Kind, str], _Entry]] = []
        for sent, bucket in enumerate(self._buckets):
            if sent >= limit:  # the cluster shrank: these were sent enough
                for k in bucket:
                    del self._q[k]
                bucket.clear()
                continue
            for k in reversed(bucket):
                if budget - used < 24:
                    break
                e = bucket[k]
                if k in skip or (digests is None and e.kind == "w") or dst in e.seen:
                    continue
                if used + e.size > budget:
                    continue
                used += e.size
                if e.kind == "m":
                    members.append(e.msg)
                elif digests is not None:
                    digests.append(e.msg)
                taken.append((k, e))
        for k, e in taken:
            del self._buckets[e.sent][k]
            e.sent += 1
            if dst:
                e.seen.add(dst)
            if e.sent >= limit:
                del self._q[k]
            else:
                while len(self._buckets) <= e.sent:
                    self._buckets.append({})
                self._buckets[e.sent][k] = e
        return used
