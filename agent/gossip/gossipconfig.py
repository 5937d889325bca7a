"""The `[gossip]` section of the agent config: SWIM + Lifeguard membership and load gossip (agent/config.py
assembles the sections)."""

from __future__ import annotations

import msgspec

from agent.configcheck import DAY_MS, bounded, need


class GossipConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """SWIM + Lifeguard membership and load gossip. Defaults are the `lan` profile (datacenter LAN,
    8-128 nodes); `bench/detect.py` and `bench/gossip.py` measure what they give."""

    # memberlist LAN: GossipInterval 200 ms. Rumours and window digests go out at once when new; this
    # tick only retransmits them, so 200 ms bounds the repair of a lost send without chatter.
    interval_ms: int = 200
    # New rumours wait this long before the immediate send, so that a burst (every node's window closes
    # at about the same step) shares messages: at 64 nodes 5x fewer Broadcast and 3x fewer Pull calls
    # for ~5 ms per hop (0: one send per arrival).
    coalesce_ms: int = 5
    # memberlist LAN: ProbeInterval 1 s. Our targets (every live member declares a crash dead within 3 s
    # at 64 nodes, a 2 s stall never does) need a short, steady probe round: 200 ms costs each node
    # 5 probes/s of ~100 bytes.
    probe_interval_ms: int = 200
    # memberlist LAN: ProbeTimeout 500 ms. LAN RTTs are < 1 ms and a probe reply is a handful of bytes, so
    # 100 ms leaves two orders of magnitude for scheduling delays; Lifeguard's awareness scales it up to
    # awareness_max_mult x on a node that is itself slow.
    probe_timeout_ms: int = 100
    # memberlist: IndirectChecks 3, so one lossy path cannot cause a suspicion on its own.
    indirect_checks: int = 3
    # Lifeguard: the suspicion timeout starts at max_mult x min and shrinks (log) to
    # min = max(suspicion_min_ms, mult x max(1, log10(N)) x probe interval) as independent confirmations
    # arrive. memberlist LAN: SuspicionMult 4, SuspicionMaxTimeoutMult 6 (at a 1 s interval: 7.2 s at 64
    # nodes); at our 200 ms interval mult 4 gives 1.4 s at 64 nodes and 2.4 s at 1024.
    suspicion_mult: float = 4.0
    suspicion_max_mult: float = 6.0
    # ... but never below 2 s: a process stalled for up to ~2 s (GC, a busy event loop, a paused VM) is
    # first suspected >= one probe round (200 ms) into the stall and refutes as soon as it runs again, so a
    # 2 s floor keeps it alive at any cluster size, and a crash is still declared dead within ~2.6 s.
    suspicion_min_ms: int = 2000
    # Lifeguard's K: confirmations that bring the timeout down to the minimum (memberlist: mult - 2).
    # Members that hear a suspicion probe the suspect themselves with probability (K + 1) / N, so K
    # independent confirmations arrive within a probe round of a real failure.
    suspicion_confirmations: int = 3
    # memberlist: RetransmitMult 4; a change is piggybacked mult x ceil(log10(N+1)) times.
    retransmit_mult: int = 4
    # memberlist GossipNodes 3: members each new rumour is sent to at once, and each tick while queued;
    # also the members a new window is pushed to by its origin.
    fanout: int = 3
    # a window vector at DeepSeek-V3 shape is 58 x 256 x 4 = 59 KiB; allow 16 per message.
    max_message_bytes: int = 1 << 20
    # rumour bytes piggybacked on one probe or ack: keeps probes small and fast (memberlist fills a UDP
    # packet, ~1400 bytes; gRPC has no such limit, 4 KiB carries ~100 rumours).
    piggyback_bytes: int = 4096
    # push-pull anti-entropy with one random member, scaled by ceil(log2(N / 32)) + 1 above 32 nodes
    # (memberlist's pushPullScale). Member tables travel only when their hashes differ, so a converged
    # cluster exchanges digests only; 1 s repairs anything the rumours missed within a second or two.
    pushpull_interval_ms: int = 1000
    # push-pull with a random dead (not left) member this often, so that the two sides of a healed
    # partition find each other again (Serf's reconnect; memberlist alone never does).
    reconnect_interval_ms: int = 2000
    # forget dead and left members after this long (memberlist GossipToTheDeadTime 30 s).
    dead_reclaim_ms: int = 30000
    # Lifeguard / memberlist AwarenessMaxMultiplier 8: a node that misses nacks or must refute scales its
    # probe timeouts by up to this factor instead of blaming others for its own slowness.
    awareness_max_mult: int = 8
    # a rank a repair drained (its node declared dead, its engine process gone) is restored by its own node
    # this long after the repair once the node serves and sees a quorum and the rank's engine is attached;
    # doubling each time it is repaired again within a minute (agent/decision/rejoin.py). 0: only `emoe restore`.
    rejoin_ms: int = 3000

    def validate(self) -> None:
        bounded("gossip", self, {
            **{f: (1, DAY_MS) for f in ("interval_ms", "probe_interval_ms", "probe_timeout_ms", "pushpull_interval_ms",
                                        "reconnect_interval_ms", "dead_reclaim_ms", "suspicion_min_ms")},
            "rejoin_ms": (0, DAY_MS),
            **{f: (1, 64) for f in ("indirect_checks", "retransmit_mult", "fanout", "suspicion_confirmations",
                                    "awareness_max_mult")},
            "piggyback_bytes": (1, 64 << 20)})
        need(0 <= self.coalesce_ms < self.interval_ms, "gossip.coalesce_ms", self.coalesce_ms,
              f"an integer in [0, gossip.interval_ms = {self.interval_ms})")
        need(self.probe_timeout_ms < self.probe_interval_ms, "gossip.probe_timeout_ms", self.probe_timeout_ms,
              f"< gossip.probe_interval_ms = {self.probe_interval_ms}")
        need(0 < self.suspicion_mult <= 100, "gossip.suspicion_mult", self.suspicion_mult, "in (0, 100]")
        need(1 <= self.suspicion_max_mult <= 100, "gossip.suspicion_max_mult", self.suspicion_max_mult, "in [1, 100]")
        # the agent's gRPC message limit is 64 MiB
        need(65536 <= self.max_message_bytes <= 64 << 20, "gossip.max_message_bytes", self.max_message_bytes,
              f"an integer in 65536..{64 << 20}")
        need(self.piggyback_bytes < self.max_message_bytes, "gossip.piggyback_bytes", self.piggyback_bytes,
              f"< gossip.max_message_bytes = {self.max_message_bytes}")
