"""The cluster fingerprint: what every agent of a cluster must agree on, compared over gossip.

Fields: the cluster shape (`nodes`, `ranks_per_node`, `slots_per_rank`), the model shape (`layers`,
`experts`, `top_k`) and the genesis table's content digest (its first 8 bytes: what
dataplane_shim.genesis.content_hex prints, so the agent and the plugin name a genesis alike). Tunable
parameters (decision.theta, the window, timeouts) are left out, so a rolling config change still works.

Each agent carries its own fingerprint in its gossip member state (MemberState.fingerprint, its own word like
its ranks, in its signed claim under mTLS): member states travel only when they change and in push-pull when
member tables differ, so a converged cluster pays nothing for it, where a load window goes out every window.
A member too old to send one is not judged.

`FingerprintCheck.verdict` is why this node must abstain: another fingerprint is held by a quorum of the
configured voters (as far as this node has heard: its own and its live members'). Then it neither votes nor
proposes (agent.consensus.node.ConsensusNode `gate`; its load windows say it abstains, so the others plan
without it) and reports NOT_SERVING with the differing fields. A node in the majority keeps serving and names
the mismatched members in `emoe status`. With no quorum on any fingerprint but its own differing from some,
a node keeps voting (the tables' own checks refuse a table of another shape) and shows the mismatch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from agent.config import ClusterConfig
from agent.consensus.paxos import quorum_size
from controlplane.table import RoutingTable
from elasticmoe.v1 import gossip_pb2 as pb

log = logging.getLogger("emoe.agent")
SHAPE = ("nodes", "ranks_per_node", "slots_per_rank", "layers", "experts", "top_k")


def fingerprint(cluster: ClusterConfig, genesis: RoutingTable) -> pb.Fingerprint:
    """This agent's fingerprint: its config's cluster and model shape, and its genesis table's content digest."""
    return pb.Fingerprint(**{f: int(getattr(cluster, f)) for f in SHAPE}, genesis=genesis.content_digest[:8])


def differences(here: pb.Fingerprint, there: pb.Fingerprint, where: str = "there") -> str:
    """The fields that differ, in words: 'slots_per_rank = 5 here, 4 there; genesis = 1a2b... here, ...'."""
    out = [f"{f} = {getattr(here, f)} here, {getattr(there, f)} {where}" for f in SHAPE
           if getattr(here, f) != getattr(there, f)]
    if here.genesis != there.genesis:
        out.append(f"genesis = {here.genesis.hex()} here, {there.genesis.hex()} {where}")
    return "; ".join(out)


def describe(fp: pb.Fingerprint) -> str:
    return " ".join(f"{f}={getattr(fp, f)}" for f in SHAPE) + f" genesis={fp.genesis.hex()}"


class FingerprintCheck:
    """This node's fingerprint against those its live members said (`heard()`: node -> fingerprint, gossip's)."""

    def __init__(self, node_id: str, mine: pb.Fingerprint, voters: Iterable[str],
                 heard: Callable[[], dict[str, pb.Fingerprint]]) -> None:
        self.node_id, self.mine, self.voters, self.heard = node_id, mine, sorted(set(voters)), heard
        self._said = ""  # the verdict last logged
        self._logged: dict[str, pb.Fingerprint] = {}  # the mismatched fingerprint last logged, per member

    def _others(self) -> dict[str, pb.Fingerprint]:
        out = {n: fp for n, fp in self.heard().items() if n != self.node_id and fp != self.mine}
        for n, fp in out.items():  # each member's mismatch logged once (until it changes)
            if self._logged.get(n) != fp:
                self._logged[n] = fp
                log.warning("%s: member %s's cluster fingerprint differs: %s", self.node_id, n,
                            differences(self.mine, fp))
        return out

    def mismatches(self) -> list[tuple[str, str]]:
        """(member, its differing fields in words) for each live member whose fingerprint differs from this node's."""
        return [(n, differences(self.mine, fp)) for n, fp in sorted(self._others().items())]

    def verdict(self) -> str:
        """Why this node must neither vote nor propose ("" while it may): a quorum of the voters holds a
        fingerprint other than this node's."""
        groups: dict[bytes, list[str]] = {}
        fps: dict[bytes, pb.Fingerprint] = {}
        for n, fp in self._others().items():
            if n in self.voters:
                k = fp.SerializeToString(deterministic=True)
                groups.setdefault(k, []).append(n)
                fps[k] = fp
        need = quorum_size(len(self.voters))
        why = next((f"cluster fingerprint differs from the one {len(nodes)} of {len(self.voters)} voters hold "
                    f"({', '.join(sorted(nodes))}): {differences(self.mine, fps[k], 'on ' + sorted(nodes)[0])}: "
                    f"this node neither votes nor proposes until its config agrees"
                    for k, nodes in sorted(groups.items(), key=lambda kv: -len(kv[1])) if len(nodes) >= need), "")
        if why != self._said:
            self._said = why
            if why:
                log.error("%s: %s", self.node_id, why)
            else:
                log.warning("%s: its cluster fingerprint agrees with the voters' again: it votes again", self.node_id)
        return why
