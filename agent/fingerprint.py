"""The cluster fingerprint: what every agent of a cluster must agree on, compared over gossip.

Fields: the cluster shape (`nodes`, `ranks_per_node`, `slots_per_rank`), the model shape (`layers`,
`experts`, `top_k`) and the genesis table's content digest (its first 8 bytes: what
dataplane_shim.genesis.content_hex prints, so the agent and the plugin name a genesis alike). Tunable
parameters (decision.theta, the window, timeouts) are left out, so a rolling config change still works.

Each agent carries its own fingerprint in its gossip member state (MemberState.fingerprint, its own word like
its ranks, in its signed claim under mTLS): member states travel only when they change and in push-pull when
member tables differ, so a converged cluster pays nothing for it, where a load window goes out every window.
A member too old to send one is not judged.

`FingerprintCheck.verdict` is why this node must abstain: its fingerprint is not the cluster's. The cluster's
fingerprint is the one a quorum of the configured voters was last heard to hold (as far as this node has heard:
its own and its live members'), remembered across members going down and across this node's restarts (the
data_dir's FINGERPRINT file). Why that one: every commit needs a quorum of accepts and a voter accepts only
while its fingerprint is the cluster's, so the tables committed since a quorum held it were accepted under it;
a quorum heard holding another (every voter restarted with a new config, a rolling change past its majority)
makes that one the cluster's. A drifted node therefore abstains while the quorum is up and goes on abstaining
when a member of that quorum goes down (before: with node2 down, node3's top_k = 8 against node1's 6 was one
against one, no quorum, and node3 voted again), and after its own restart; it votes again once its config
matches. Then it neither votes nor proposes (agent.consensus.node.ConsensusNode `gate`; its load windows say
it abstains, so the others plan without it) and reports NOT_SERVING with the differing fields. A node in the
majority keeps serving and names the mismatched members in `emoe status`. A node that never heard a quorum
on any fingerprint (a new cluster coming up, or a new data_dir while a majority is down) keeps voting, the
mismatch shown (the tables' own checks refuse a table of another shape).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path

from agent.config import ClusterConfig
from agent.consensus.paxos import quorum_size
from agent.storage.datadir import DataDirError
from agent.storage.disk import write_atomic
from controlplane.table import RoutingTable
from elasticmoe.v1 import gossip_pb2 as pb

log = logging.getLogger(__name__)
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


def parse(text: str) -> pb.Fingerprint:
    """The fingerprint `describe` wrote; ValueError names what is wrong."""
    fields = dict(kv.split("=", 1) for kv in text.split() if "=" in kv)
    want = (*SHAPE, "genesis")
    if sorted(fields) != sorted(want) or len(text.split()) != len(want):
        raise ValueError(f"{text.strip()[:200]!r}: expected {' '.join(f + '=...' for f in want)}")
    try:
        return pb.Fingerprint(**{f: int(fields[f]) for f in SHAPE}, genesis=bytes.fromhex(fields["genesis"]))
    except ValueError as e:
        raise ValueError(f"{text.strip()[:200]!r}: {e}") from None


def load_cluster(path: Path) -> pb.Fingerprint | None:
    """The cluster's fingerprint kept in `path` (None: none kept yet); DataDirError when it cannot be read."""
    try:
        return parse(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataDirError(f"{path}: cannot read the cluster fingerprint this node last heard a quorum of the "
                           f"voters hold ({e}); remove the file to learn it again from the voters") from None


class FingerprintCheck:
    """This node's fingerprint against the cluster's: the one a quorum of the voters was last heard to hold
    (`heard()`: node -> fingerprint, gossip's), kept in `keep` (the data_dir's FINGERPRINT; None: in memory)."""

    def __init__(self, node_id: str, mine: pb.Fingerprint, voters: Iterable[str],
                 heard: Callable[[], dict[str, pb.Fingerprint]], keep: Path | None = None) -> None:
        """Raises agent.storage.datadir.DataDirError when `keep` holds something else than a fingerprint."""
        self.node_id, self.mine, self.voters, self.heard = node_id, mine, sorted(set(voters)), heard
        self.keep = keep
        self.cluster = load_cluster(keep) if keep is not None else None  # the quorum's, last heard (sticky)
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

    def _quorum(self) -> tuple[pb.Fingerprint, list[str]] | None:
        """The fingerprint a quorum of the voters holds now, as heard, and those voters (None: no quorum holds
        one; two quorums intersect, so at most one fingerprint has one)."""
        groups: dict[bytes, list[str]] = {}
        fps: dict[bytes, pb.Fingerprint] = {}
        self._others()  # (logs each member's mismatch)
        for n, fp in self.heard().items():
            if n in self.voters:
                k = fp.SerializeToString(deterministic=True)
                groups.setdefault(k, []).append(n)
                fps[k] = fp
        need = quorum_size(len(self.voters))
        return next(((fps[k], sorted(nodes)) for k, nodes in groups.items() if len(nodes) >= need), None)

    def _remember(self, fp: pb.Fingerprint) -> None:
        """`fp` is the cluster's now: kept (durably first, where there is a `keep`: an IO error is logged, and
        the fingerprint kept in memory, as the next quorum heard writes it again)."""
        if self.keep is not None:
            try:
                write_atomic(self.keep, f"{describe(fp)}\n".encode())
            except OSError as e:
                log.error("%s: cannot keep the cluster fingerprint in %s: %s", self.node_id, self.keep, e)
        if self.cluster is not None:
            log.warning("%s: a quorum of the voters holds another cluster fingerprint now: %s", self.node_id,
                        differences(fp, self.cluster, "before"))
        self.cluster = fp

    def verdict(self) -> str:
        """Why this node must neither vote nor propose ("" while it may): its fingerprint differs from the one a
        quorum of the voters holds, or (none holding one now) last held."""
        q = self._quorum()
        if q is not None and q[0] != self.cluster:
            self._remember(q[0])
        why = ""
        if q is not None and q[0] != self.mine:
            fp, nodes = q
            why = (f"cluster fingerprint differs from the one {len(nodes)} of {len(self.voters)} voters hold "
                   f"({', '.join(nodes)}): {differences(self.mine, fp, 'on ' + nodes[0])}: "
                   f"this node neither votes nor proposes until its config agrees")
        elif q is None and self.cluster is not None and self.cluster != self.mine:
            why = (f"cluster fingerprint differs from the one a quorum of the {len(self.voters)} voters last held "
                   f"(no quorum holds one now; kept across restarts): "
                   f"{differences(self.mine, self.cluster, 'in the cluster')}: "
                   f"this node neither votes nor proposes until its config agrees")
        if why != self._said:
            self._said = why
            if why:
                log.error("%s: %s", self.node_id, why)
            else:
                log.warning("%s: its cluster fingerprint agrees with the voters' again: it votes again", self.node_id)
        return why
