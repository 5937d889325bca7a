"""Load gossip: every node's latest load window, digests first and payloads on demand; the cluster view.

A window is the `LoadWindow` message: uint32 counts [L, E] packed little-endian, stamped with its node's
incarnation and a window_seq; `(incarnation, window_seq)` orders a node's windows and the newest wins.
- The origin of a new window pushes it whole to `fanout` random members (nobody else has it, so none of
  these bytes is wasted) and queues its digest as a rumour.
- A node that receives a newer window queues its digest as a rumour; rumours go out at once to `fanout`
  members and then each gossip interval (retransmit-limited). A node that hears a digest newer than what
  it holds pulls the window from that digest's sender, once: concurrent digests for the same window wait
  for the pull in flight and serve as fallback sources if it fails.
- Push-pull anti-entropy (GossipNode) exchanges digests and sends only the windows the other side lacks.
So each node receives each window about once, and the rumours that buy that are ~30-byte digests.
Under mTLS each window carries its node's signature and certificate (~600 bytes, 1% of a DeepSeek-V3 window);
agent/gossip/windowguard.py checks them at every hop, and bounds how far ahead a window may be and how far behind its
member's incarnation (not at all), in plaintext too.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import numpy as np
import numpy.typing as npt

from agent.clock import Clock
from agent.config import GossipConfig
from agent.gossip.broadcasts import RumourQueue
from agent.gossip.membership import MAX_COUNTER, Member
from agent.gossip.windowform import NodeWindow, check_windows, make_window, node_window
from agent.gossip.windowguard import WINDOW_SEQ_LEAD, Refusal, WindowGuard, WindowSigner, ahead, stale
from agent.transport import InvalidArgument, Transport
from elasticmoe.v1 import gossip_pb2 as pb

# per-message bytes kept free of windows for the envelope, member states and digests
_ENVELOPE = 1024
# pulls of one window (from its announcers in turn) before waiting for the next digest or push-pull
_PULL_TRIES = 4


@dataclass(frozen=True)
class LoadView:
    """The cluster load as this node sees it: what the decision core consumes."""

    windows: dict[str, NodeWindow]   # latest window of each live node that has sent one
    total: npt.NDArray[np.uint64]    # [L, E]: sum of those windows' counts
    live: tuple[str, ...]            # live (alive or suspect) nodes, this one included
    missing: tuple[str, ...] = field(default=())  # live nodes without a window yet


class Members(Protocol):
    """What load gossip needs from membership."""

    @property
    def incarnation(self) -> int: ...

    def live_peers(self) -> list[str]: ...

    def live_nodes(self) -> list[str]: ...

    def is_known(self, node_id: str) -> bool: ...

    def is_live(self, node_id: str) -> bool: ...

    def get(self, node_id: str) -> Member | None: ...

    def heard(self, node_id: str) -> None: ...

    def report_failure(self, node_id: str) -> None: ...


# (node, window_seq, counts [L, E], first_step, steps, samples [S, L, E] or None, step_us [S] or None,
#  step_version [S] or None, stride_us [S] or None)
WindowCallback = Callable[[str, int, npt.NDArray[np.uint32], int, int, npt.NDArray[np.uint32] | None,
                           npt.NDArray[np.uint32] | None, npt.NDArray[np.uint32] | None,
                           npt.NDArray[np.uint32] | None], None]


def _key(w: pb.LoadWindow | pb.Digest) -> tuple[int, int]:
    return (w.incarnation, w.window_seq)


def check_digests(digests: Iterable[pb.Digest], bounded: bool = True) -> None:
    """Reject digests without a node id, and (`bounded`: digests we may act on) with counters >= 2^63."""
    for d in digests:
        if not d.node_id:
            raise InvalidArgument("digest without a node id")
        if max(d.incarnation, d.window_seq) >= 2**63:
            raise InvalidArgument(f"digest of {d.node_id!r} with incarnation {d.incarnation}, window_seq "
                                  f"{d.window_seq}: expected both < 2^63")
        if bounded and (d.incarnation >= MAX_COUNTER or d.window_seq >= MAX_COUNTER):
            raise InvalidArgument(f"digest of {d.node_id!r}: incarnation {d.incarnation} or window_seq "
                                  f"{d.window_seq} >= 2^63")


class LoadGossip:
    def __init__(self, node_id: str, cfg: GossipConfig, clock: Clock, transport: Transport, rng: random.Random,
                 rumours: RumourQueue, members: Members, on_window: WindowCallback,
                 shape: tuple[int, int] | None = None, signer: WindowSigner | None = None) -> None:
        """`signer` (mTLS): this node's windows are signed, and others' accepted only with their node's signature."""
        self.node_id, self.cfg, self.clock, self.transport, self.rng = node_id, cfg, clock, transport, rng
        self.rumours, self.members, self.on_window = rumours, members, on_window
        self.shape = shape
        self.guard = WindowGuard(signer)
        # a window is ~60 KiB, microseconds on a LAN: twice the probe timeout leaves room for a busy loop,
        # and a lost pull is retried (from another announcer where there is one) within 200 ms
        self.timeout = 2 * cfg.probe_timeout_ms / 1e3
        self._w: dict[str, pb.LoadWindow] = {}
        self._np: dict[str, NodeWindow] = {}
        self._pending: dict[str, tuple[tuple[int, int], float, int]] = {}  # node -> (key pulled, expiry, tries)
        self._alt: dict[str, list[str]] = {}  # node -> other members that announced its pending window
        self._view: LoadView | None = None
        self._view_live: list[str] = []
        self.samples_dropped = 0  # own windows sent without their sampled steps (over gossip.max_message_bytes)
        self.stopped = False  # set when the node stops: replies still in flight then start nothing

    # ---- this node's windows ------------------------------------------------------------------
    def publish(self, window_seq: int, first_step: int, steps: int, counts: npt.NDArray[np.integer],
                learner: bool = False, samples: npt.NDArray[np.uint32] | None = None, sample_every: int = 0,
                step_us: npt.NDArray[np.uint32] | None = None, step_version: npt.NDArray[np.uint32] | None = None,
                stride_us: npt.NDArray[np.uint32] | None = None) -> None:
        """Publish this node's window; `learner`: this node abstains from consensus now (LoadWindow.learner);
        `samples` [S, L, E]: the counts of its steps s with s % sample_every == 0 (sent zlib-compressed);
        `step_us` [S]: their wall times (LoadWindow.step_us); `step_version` [S]: the version each ran on;
        `stride_us` [S]: their strides' mean times."""
        own = self._w.get(self.node_id)
        if own is not None and window_seq <= own.window_seq:
            raise ValueError(f"window_seq = {window_seq}: expected > {own.window_seq}, the last one published")
        w = make_window(self.node_id, self.members.incarnation, window_seq, first_step, steps, counts, learner,
                        samples, sample_every, step_us, step_version, stride_us)
        shape = (w.layers, w.experts)
        if self.shape is not None and shape != self.shape:
            raise ValueError(f"counts shape {shape}: expected {self.shape}")
        self.guard.sign(w)  # once, here: relays pass the signature on unchanged
        if w.samples and w.ByteSize() > self.cfg.max_message_bytes - _ENVELOPE:  # the totals alone, then
            self.samples_dropped += 1
            w.samples, w.sample_every, w.step_us, w.step_version, w.stride_us = b"", 0, b"", b"", b""
            self.guard.sign(w)
        if w.ByteSize() > self.cfg.max_message_bytes - _ENVELOPE:  # signature and certificate included
            raise ValueError(f"a {shape} window is {w.ByteSize()} bytes: more than gossip.max_message_bytes allows")
        self.shape = shape
        self._put(w)
        peers = self.members.live_peers()
        for p in self.rng.sample(peers, min(self.cfg.fanout, len(peers))):
            req = pb.PushRequest(from_node=self.node_id, windows=[w])
            self.transport.call(p, "Gossip/Push", req, self.timeout, partial(self._acked, p))

    def restamp(self) -> None:
        """Our incarnation changed (a refutation): re-issue our window under it, so that it still wins."""
        own = self._w.get(self.node_id)
        if own is not None and own.incarnation != self.members.incarnation:
            w = pb.LoadWindow()
            w.CopyFrom(own)
            w.incarnation = self.members.incarnation
            self.guard.sign(w)
            self._put(w)

    def _acked(self, peer: str, reply: object) -> None:
        if reply is None:
            self.members.report_failure(peer)
        else:
            self.members.heard(peer)

    # ---- storing ------------------------------------------------------------------------------
    def _put(self, w: pb.LoadWindow, source: str | None = None) -> None:
        n = w.node_id
        self._w[n] = w
        self._np.pop(n, None)
        self._view = None
        pend = self._pending.get(n)
        if pend is not None and pend[0] <= _key(w):
            del self._pending[n]
            self._alt.pop(n, None)
        self.rumours.put("w", n, pb.Digest(node_id=n, incarnation=w.incarnation, window_seq=w.window_seq), source)

    def store(self, w: pb.LoadWindow, source: str | None = None) -> bool:
        """Keep `w` if it is the newest window of a known member (already checked), signed by that member under
        mTLS, neither below the member's incarnation nor from the future (agent/gossip/windowguard.py). True if kept."""
        n = w.node_id
        have = self._w.get(n)
        m = self.members.get(n)
        if n == self.node_id or (have is not None and _key(have) >= _key(w)) or m is None:
            return False
        if self.shape is not None and (w.layers, w.experts) != self.shape:
            return False
        if not self.guard.accept(w, m.incarnation, self.newest_seq(n, w.window_seq)):
            return False
        if self.shape is None:
            self.shape = (w.layers, w.experts)
        self._put(w, source)
        nw = self.node_window(n)
        self.on_window(n, w.window_seq, nw.counts, w.first_step, w.steps, nw.samples, nw.step_us, nw.step_version,
                       nw.stride_us)
        return True

    def node_window(self, node_id: str) -> NodeWindow:
        nw = self._np.get(node_id)
        if nw is None:
            nw = self._np[node_id] = node_window(self._w[node_id])
        return nw

    def learners(self) -> set[str]:
        """The nodes whose newest window held here says they abstain from consensus (this node's own included)."""
        return {n for n, w in self._w.items() if w.learner}

    def newest_seq(self, node_id: str, window_seq: int) -> int | None:
        """The newest window_seq held of `node_id`, of this node or of any live member (a window at
        `window_seq` is measured against it), or None when none is held."""
        have = self._w.get(node_id)
        if have is not None and window_seq <= have.window_seq + WINDOW_SEQ_LEAD:  # the common case: no scan
            return have.window_seq
        seqs = [w.window_seq for n, w in self._w.items()
                if n == node_id or n == self.node_id or self.members.is_live(n)]
        return max(seqs) if seqs else None

    @property
    def refused(self) -> dict[Refusal, int]:
        """Windows refused, by reason: unsigned or badly signed (mTLS), from an earlier incarnation, from the future."""
        return self.guard.refused

    @property
    def refused_why(self) -> str:
        return self.guard.refused_why

    def has(self, node_id: str, incarnation: int, window_seq: int) -> bool:
        w = self._w.get(node_id)
        return w is not None and _key(w) >= (incarnation, window_seq)

    # ---- digests and pulls --------------------------------------------------------------------
    def digests(self) -> list[pb.Digest]:
        for n in [n for n in self._w if not self.members.is_known(n)]:  # reaped members
            del self._w[n]
            self._np.pop(n, None)
        return [pb.Digest(node_id=n, incarnation=w.incarnation, window_seq=w.window_seq) for n, w in self._w.items()]

    def newer_than(self, digests: Iterable[pb.Digest], budget: int) -> list[pb.LoadWindow]:
        """Our windows of live nodes that are newer than `digests` say the peer has, within `budget` bytes."""
        theirs = {d.node_id: _key(d) for d in digests}
        out: list[pb.LoadWindow] = []
        names = list(self._w)
        self.rng.shuffle(names)  # when the budget cuts, cut a different subset each time
        budget -= _ENVELOPE
        for n in names:
            w = self._w[n]
            if _key(w) > theirs.get(n, (-1, -1)) and (n == self.node_id or self.members.is_live(n)):
                size = w.ByteSize() + 8
                if size <= budget:
                    out.append(w)
                    budget -= size
        return out

    def on_digests(self, src: str, digests: Iterable[pb.Digest]) -> None:
        """Digests heard from `src`: pull the windows we lack from it (once per window)."""
        now = self.clock.now()
        want: list[pb.Digest] = []
        for d in digests:
            n = d.node_id
            if n == self.node_id or self.has(n, d.incarnation, d.window_seq):
                continue
            m = self.members.get(n)  # a stranger's, an earlier life's or one from the future: refused if pulled
            if m is None or stale(d.incarnation, m.incarnation) or ahead(d.incarnation, d.window_seq, m.incarnation,
                                                                         self.newest_seq(n, d.window_seq)):
                continue
            pend = self._pending.get(n)
            if pend is not None and pend[0] >= _key(d) and pend[1] > now:
                alt = self._alt.setdefault(n, [])
                if src not in alt and len(alt) < 4:
                    alt.append(src)
                continue
            self._pending[n] = (_key(d), now + self.timeout, 1)
            want.append(pb.Digest(node_id=n, incarnation=d.incarnation, window_seq=d.window_seq))
        if want:
            self._pull(src, want)

    def _pull(self, src: str, want: list[pb.Digest]) -> None:
        req = pb.PullRequest(from_node=self.node_id, want=want)
        self.transport.call(src, "Gossip/Pull", req, self.timeout, partial(self._on_pull, src, want))

    def _on_pull(self, src: str, want: list[pb.Digest], reply: pb.PullReply | None) -> None:
        if self.stopped:
            return
        if reply is None:
            self.members.report_failure(src)
        else:
            self.members.heard(src)
            try:
                check_windows(reply.windows, self.shape)
            except InvalidArgument:
                reply = None
            else:
                for w in reply.windows:
                    self.store(w, src)
        retry: dict[str, list[pb.Digest]] = {}
        for d in want:
            n = d.node_id
            pend = self._pending.get(n)
            if self.has(n, d.incarnation, d.window_seq) or pend is None or pend[0] != _key(d):
                continue
            del self._pending[n]
            if pend[2] >= _PULL_TRIES:
                self._alt.pop(n, None)
                continue  # the next digest, or push-pull, will bring it
            # next: another member that announced it, else (the call failed) the same one again
            alts = [a for a in self._alt.pop(n, []) if a != src and self.members.is_live(a)]
            if reply is None and self.members.is_live(src):
                alts.append(src)
            if alts:
                self._pending[n] = (_key(d), self.clock.now() + self.timeout, pend[2] + 1)
                retry.setdefault(alts[0], []).append(d)
                if len(alts) > 1:
                    self._alt[n] = alts[1:]
        for a, ds in retry.items():
            self._pull(a, ds)

    def handle_pull(self, src: str, req: pb.PullRequest) -> pb.PullReply:
        check_digests(req.want, bounded=False)  # read-only: a want we can never match gets nothing
        out = pb.PullReply(from_node=self.node_id)
        budget = self.cfg.max_message_bytes - _ENVELOPE
        for d in req.want:
            w = self._w.get(d.node_id)
            if w is not None and _key(w) >= _key(d):
                size = w.ByteSize() + 8
                if size > budget:
                    break
                out.windows.append(w)
                budget -= size
        return out

    # ---- the view -----------------------------------------------------------------------------
    def view(self) -> LoadView:
        live = self.members.live_nodes()
        if self._view is not None and live == self._view_live:
            return self._view
        shape = self.shape or (0, 0)
        total = np.zeros(shape, dtype=np.uint64)
        windows: dict[str, NodeWindow] = {}
        for n in live:
            if n in self._w:
                nw = self.node_window(n)
                windows[n] = nw
                total += nw.counts
        total.setflags(write=False)
        self._view = LoadView(windows, total, tuple(live), tuple(n for n in live if n not in windows))
        self._view_live = live
        return self._view
