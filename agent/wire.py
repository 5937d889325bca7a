"""Operations and plans <-> their protobuf form (consensus_pb2.Operation / Plan)."""

from __future__ import annotations

from collections.abc import Iterable

from controlplane.ops import (
    Consolidate,
    Drain,
    Drop,
    Migrate,
    Operation,
    Repair,
    Replicate,
    Restore,
    Swap,
    describe,
)
from elasticmoe.v1 import consensus_pb2 as pb


class WireError(ValueError):
    """A malformed operation from the network; the message names the field."""


def op_to_pb(op: Operation) -> pb.Operation:
    if isinstance(op, Replicate):
        return pb.Operation(kind=pb.REPLICATE, layer=op.layer, experts=[op.expert], dst=op.dst, src=-1, rank=-1, source=-1)
    if isinstance(op, Consolidate):
        return pb.Operation(kind=pb.CONSOLIDATE, layer=op.layer, experts=list(op.experts), dst=op.dst, src=-1, rank=-1, source=-1)
    if isinstance(op, Migrate):
        return pb.Operation(kind=pb.MIGRATE, layer=op.layer, experts=[op.expert], src=op.src, dst=op.dst, rank=-1, source=-1)
    if isinstance(op, Drain):
        return pb.Operation(kind=pb.DRAIN, rank=op.rank, layer=-1, src=-1, dst=-1, source=-1)
    if isinstance(op, Restore):
        return pb.Operation(kind=pb.RESTORE, rank=op.rank, layer=-1, src=-1, dst=-1, source=-1)
    if isinstance(op, Swap):
        return pb.Operation(kind=pb.SWAP, layer=op.layer, experts=[op.expert, op.other], src=op.src, dst=op.dst,
                            rank=-1, source=-1)
    if isinstance(op, Drop):
        return pb.Operation(kind=pb.DROP, layer=op.layer, experts=[op.expert], src=op.src, dst=-1, rank=-1, source=-1)
    return pb.Operation(kind=pb.REPAIR, layer=op.layer, experts=[op.expert], dst=op.dst, source=op.source, src=-1, rank=-1)


def _one_expert(m: pb.Operation) -> int:
    if len(m.experts) != 1:
        raise WireError(f"operation.experts has {len(m.experts)} entries: expected exactly 1 for {pb.OpKind.Name(m.kind)}")
    return int(m.experts[0])


def op_from_pb(m: pb.Operation) -> Operation:
    k = m.kind
    if k == pb.REPLICATE:
        return Replicate(m.layer, _one_expert(m), m.dst)
    if k == pb.CONSOLIDATE:
        if not m.experts:
            raise WireError("operation.experts is empty: expected the experts to consolidate")
        return Consolidate(m.layer, tuple(int(e) for e in m.experts), m.dst)
    if k == pb.MIGRATE:
        return Migrate(m.layer, _one_expert(m), m.src, m.dst)
    if k == pb.DRAIN:
        return Drain(m.rank)
    if k == pb.RESTORE:
        return Restore(m.rank)
    if k == pb.REPAIR:
        return Repair(m.layer, _one_expert(m), m.dst, m.source)
    if k == pb.SWAP:
        if len(m.experts) != 2:
            raise WireError(f"operation.experts has {len(m.experts)} entries: expected 2 for SWAP (on src, on dst)")
        return Swap(m.layer, int(m.experts[0]), m.src, int(m.experts[1]), m.dst)
    if k == pb.DROP:
        return Drop(m.layer, _one_expert(m), m.src)
    raise WireError(f"operation.kind = {k}: expected one of REPLICATE, CONSOLIDATE, MIGRATE, DRAIN, RESTORE, REPAIR, "
                    "SWAP, DROP")


def ops_from_pb(ms: Iterable[pb.Operation]) -> tuple[Operation, ...]:
    return tuple(op_from_pb(m) for m in ms)


def describe_pb(m: pb.Operation) -> str:
    try:
        return describe(op_from_pb(m))
    except WireError as e:
        return f"<invalid operation: {e}>"


PLAN_KINDS = {"rebalance": pb.PLAN_REBALANCE, "rollback": pb.PLAN_ROLLBACK, "manual": pb.PLAN_MANUAL,
              "repair": pb.PLAN_REPAIR}
_KIND_OF_PB = {v: k for k, v in PLAN_KINDS.items()}


def make_plan(ops: Iterable[Operation], estimated_gain: float, verified_gain: float, cost: float, trigger: str,
              replay_from_step: int = 0, replay_to_step: int = 0, *, kind: str, forced: bool = False,
              load_ms: float = 0.0) -> pb.Plan:
    """A Plan message; `kind` is a Decision's kind (PLAN_KINDS); `load_ms`: the step time it was judged with."""
    if kind not in PLAN_KINDS:
        raise WireError(f"plan kind {kind!r}: expected one of {sorted(PLAN_KINDS)}")
    return pb.Plan(ops=[op_to_pb(o) for o in ops], estimated_gain=estimated_gain, verified_gain=verified_gain,
                   cost=cost, trigger=trigger, replay_from_step=replay_from_step, replay_to_step=replay_to_step,
                   kind=PLAN_KINDS[kind], forced=forced, load_ms=load_ms)


def legacy_plan(trigger: str) -> tuple[str, bool]:
    """The kind and whether an operator forced it of a plan written before Plan.kind and Plan.forced existed
    (PLAN_KIND_UNSPECIFIED), from its trigger's prefix as the release that wrote it meant them: "rollback:",
    "manual:", "repair:", anything else a rebalance; an operator's forced plan reads "manual --force: ...", still
    manual (observed as a rebalance it could be rolled back). The one place that reads a trigger's words."""
    head = trigger.split(":", 1)[0].split(" ", 1)[0]
    return head if head in ("rollback", "manual", "repair") else "rebalance", trigger.startswith("manual --force")


def kind_of_trigger(trigger: str) -> str:
    """A plan's kind from its trigger alone, as a release before Plan.kind read it (legacy_plan)."""
    return legacy_plan(trigger)[0]


def plan_kind(plan: pb.Plan) -> str:
    """A committed plan's kind ("rebalance", "rollback", "manual", "repair") from its `kind` field; a plan
    written before the field existed (UNSPECIFIED) is read from its trigger's prefix."""
    kind = _KIND_OF_PB.get(plan.kind)
    return kind if kind is not None else kind_of_trigger(plan.trigger)


def plan_forced(plan: pb.Plan) -> bool:
    """Whether an operator forced the plan (past tau and the cost budget: drains and restores are); for a plan
    written before the field existed, its trigger's "manual --force" prefix."""
    return plan.forced or (plan.kind == pb.PLAN_KIND_UNSPECIFIED and legacy_plan(plan.trigger)[1])
