"""Cost model of a change: weight bytes over the tier's bandwidth, plus the traffic a swap disturbs.

    cost(move) = bytes / bandwidth(tier(src, dst)) + downtime_steps x expected tokens per step x penalty_s

in seconds. A copy within a rank or over NVLink is cheap, over RDMA dearer, from host dearest (topology's
H200 figures). The second term charges the tokens of the moved expert that may be re-routed or wait while
the new table activates at a step boundary. A plan also has a replica-memory budget: the number of extra
replicas (slots beyond one per expert), summed over layers, may be capped below what the slots allow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from controlplane.errors import ControlPlaneError
from controlplane.table import RoutingTable, TableDiff
from controlplane.topology import Tier, Topology

F64 = npt.NDArray[np.float64]

# DeepSeek-V3 routed expert: gate, up and down projections, 7168 x 2048 each, FP8 weights.
DEEPSEEK_V3_EXPERT_BYTES = 3 * 7168 * 2048


class InvalidCostModel(ControlPlaneError):
    code = "INVALID_COST_MODEL"


@dataclass(frozen=True)
class CostModel:
    """expert_bytes: weight bytes of one expert replica.
    budget_s: most seconds of cost one decision may spend (summed over its copies, as if they ran one after
      another: an upper bound on their time, which overlaps serving). 50 ms is ~45 cross-node DeepSeek-V3
      expert copies at 40 GB/s, and 1/20 of the shortest full EPLB rebalance pause (0.9 s); the decision
      core uses 0.1 s (DecisionParams.cost_budget_s) so that one plan can answer a drift.
    downtime_steps: steps of a moved expert's traffic that the swap may delay (one step boundary).
    penalty_s: seconds charged per delayed token (~ a decode step's per-token cost on an H200 rank).
    replica_budget: most extra replicas summed over layers; None: as many as the free slots allow.
    """

    expert_bytes: int = DEEPSEEK_V3_EXPERT_BYTES
    budget_s: float = 0.05
    downtime_steps: float = 1.0
    penalty_s: float = 1e-7
    replica_budget: int | None = None

    def __post_init__(self) -> None:
        if self.expert_bytes < 1:
            raise InvalidCostModel(f"expert_bytes={self.expert_bytes}: expected >= 1")
        if not self.budget_s >= 0 or not self.downtime_steps >= 0 or not self.penalty_s >= 0:
            raise InvalidCostModel(
                f"budget_s={self.budget_s}, downtime_steps={self.downtime_steps}, penalty_s={self.penalty_s}: "
                "expected non-negative figures"
            )
        if self.replica_budget is not None and self.replica_budget < 0:
            raise InvalidCostModel(f"replica_budget={self.replica_budget}: expected >= 0 or None")

    def transfer_s(self, topo: Topology, tier: Tier | int) -> float:
        """Seconds to copy one expert over `tier` (a same-rank copy is a device-local memcpy)."""
        return self.expert_bytes / float(topo.tier_bandwidth[int(tier)])

    def move_s(self, topo: Topology, tier: Tier | int, tokens_per_step: float) -> float:
        """Cost of one weight move of an expert that receives `tokens_per_step` on average."""
        return self.transfer_s(topo, tier) + self.downtime_steps * tokens_per_step * self.penalty_s

    def tier_costs(self, topo: Topology) -> F64:
        """[4] transfer seconds by tier, for vectorised scoring."""
        return np.array([self.transfer_s(topo, t) for t in Tier], dtype=np.float64)

    def diff_cost(self, d: TableDiff, topo: Topology, tokens_per_step: npt.NDArray[np.floating] | None = None) -> float:
        """Cost of every move of a table diff; tokens_per_step [L, E] (None: no downtime term)."""
        total = 0.0
        for m in d.moves:
            tok = 0.0 if tokens_per_step is None else float(tokens_per_step[m.layer, m.expert])
            total += self.move_s(topo, m.tier, tok)
        return total


def _copy_costs(cm: CostModel, a: RoutingTable, b: RoutingTable,
                tokens_per_step: npt.NDArray[np.floating] | None) -> tuple[npt.NDArray[np.int64], F64]:
    """(layer, cost) of every slot of `b` whose expert differs from `a`'s (in slot order): a copy from the
    nearest rank holding the expert in `a` and active in `b`, else from host."""
    topo = a.topology
    S = topo.slots_per_rank
    li, pi = np.nonzero((a.phy2log != b.phy2log) & (b.phy2log >= 0))
    if li.size == 0:
        return li.astype(np.int64), np.zeros(0)
    e = b.phy2log[li, pi]
    has = a.holders & b.active_mask[None, None, :]
    tier = np.where(has[li, e], tier_matrix(topo)[:, pi // S].T, int(Tier.HOST)).min(axis=1)
    per = cm.tier_costs(topo)[tier]
    if tokens_per_step is not None:
        per = per + cm.downtime_steps * np.asarray(tokens_per_step, dtype=np.float64)[li, e] * cm.penalty_s
    return li.astype(np.int64), np.asarray(per, dtype=np.float64)


def change_cost(cm: CostModel, a: RoutingTable, b: RoutingTable,
                tokens_per_step: npt.NDArray[np.floating] | None = None) -> float:
    """`cm.diff_cost(diff(a, b), ...)` without building the moves: every slot of `b` whose expert differs
    from `a`'s is a copy from the nearest rank holding the expert in `a` and active in `b`, else from host
    (vectorised over the changed slots; summed in slot order, as diff lists them)."""
    _, per = _copy_costs(cm, a, b, tokens_per_step)
    total = 0.0
    for x in per.tolist():  # sequential float sum in diff's order: the same figure bit for bit
        total += x
    return total


def layer_costs(cm: CostModel, a: RoutingTable, b: RoutingTable,
                tokens_per_step: npt.NDArray[np.floating] | None = None) -> F64:
    """[L]: change_cost split by layer."""
    li, per = _copy_costs(cm, a, b, tokens_per_step)
    out: F64 = np.bincount(li, weights=per, minlength=a.layers).astype(np.float64)
    return out


def extra_replicas(table: RoutingTable) -> int:
    """Replicas beyond one per expert, summed over layers."""
    return int((table.logcnt - 1).clip(min=0).sum())


def tier_matrix(topo: Topology) -> npt.NDArray[np.int64]:
    """[G, G] tier of a copy from rank a to rank b (0 same rank, 1 same node, 2 other node)."""
    node = np.arange(topo.ranks) // topo.ranks_per_node
    out = np.where(node[:, None] == node[None, :], int(Tier.SAME_NODE), int(Tier.OTHER_NODE))
    np.fill_diagonal(out, int(Tier.SAME_RANK))
    return out.astype(np.int64)
