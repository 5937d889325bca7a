"""Adapters between our routing tables and the engines' expert-placement formats, both directions.

All three use our slot convention (slot p on EP rank p // slots_per_rank; phy2log is authoritative):
- vLLM (0.3x) keeps the maps of each model in `EplbState.model_states[<model hash>]`, an `EplbModelState`:
  `physical_to_logical_map [L_moe, P]` (-1: an idle slot, as its elastic EP pads), `logical_to_physical_map
  [L_moe, E, 1024]` (MAX_EXPERT_REDUNDANCY + 1; ascending slots, -1 padded; updated in place with `copy_`, so
  the width must match), `logical_replica_count [L_moe, E]`. Layers are the MoE layers only.
- SGLang `ExpertLocationMetadata` spans `num_hidden_layers` (dense layers included; each row holds SGLang's
  trivial `arange(P) % E` when nothing else is known): `physical_to_logical_map [L, P]`,
  `logical_to_all_physical_map [L, E, P]` (ascending, -1 padded to P), `..._num_valid [L, E]`. SGLang builds
  its inverse map by indexing a Python list with each slot's expert id, so it cannot take -1: exports
  refuse empty slots. `--init-expert-location` reads JSON or a `torch.save`d dict holding
  `physical_to_logical_map`; expert-distribution dumps hold `logical_count` `[L, E]` or `[steps, L, E]`.
- DeepSeek EPLB `rebalance_experts` -> `(phy2log [L, P], log2phy [L, E, logcnt.max()], logcnt [L, E])`, every
  slot filled. EPLB orders a log2phy row by replica rank, not by slot: import compares rows as sets.

Imports accept what engines produce: two replicas of one expert on one rank, any log2phy width that
holds the replicas, dense layers (dropped through `moe_layer_ids`). Arrays come in as numpy or torch (CPU or
device); exports are numpy int64 unless `as_torch=True`. torch is imported only when needed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from controlplane.errors import ControlPlaneError
from controlplane.table import RoutingTable
from controlplane.topology import Topology
from dataplane_shim.errors import ShimError

I64 = npt.NDArray[np.int64]
VLLM_L2P_WIDTH = 1024  # vLLM's MAX_EXPERT_REDUNDANCY (1023) + 1: the last dim of logical_to_physical_map


class AdapterError(ShimError):
    code = "ADAPTER"


def _np(x: Any, name: str) -> I64:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise AdapterError(f"{name} has dtype {arr.dtype}: expected integers")
    return arr.astype(np.int64)


def _getter(obj: Any) -> Callable[[str], Any]:
    """Field access for a dict or an object (missing fields read as None)."""
    if isinstance(obj, dict):
        return obj.get

    def get(key: str) -> Any:
        return getattr(obj, key, None)

    return get


def _out(d: dict[str, I64], as_torch: bool) -> dict[str, Any]:
    if not as_torch:
        return dict(d)
    import torch

    return {k: torch.from_numpy(np.array(v)) for k, v in d.items()}


def _padded_log2phy(table: RoutingTable, width: int) -> I64:
    """[L, E, width] ascending slots, -1 padded."""
    base = table.log2phy
    if base.shape[2] > width:
        raise AdapterError(f"an expert has {base.shape[2]} replicas: more than the format's width {width}")
    out = np.full((table.layers, table.experts, width), -1, dtype=np.int64)
    out[:, :, : base.shape[2]] = base
    return out


def _check_full(table: RoutingTable, engine: str) -> None:
    if (table.phy2log < 0).any():
        layer, slot = (int(v) for v in np.argwhere(table.phy2log < 0)[0])
        raise AdapterError(f"version {table.version} layer {layer} slot {slot} is empty (-1): {engine} needs "
                           "every slot filled")


def _table(phy2log: I64, topo: Topology, experts: int, version: int, parent: int,
           active_ranks: tuple[int, ...]) -> RoutingTable:
    if phy2log.ndim != 2 or phy2log.shape[1] != topo.slots:
        raise AdapterError(f"physical_to_logical_map shape {phy2log.shape}: expected [layers, {topo.slots}]")
    try:
        table = RoutingTable(topo, experts, phy2log, version, parent, active_ranks)
        table.validate()
    except ControlPlaneError as exc:
        raise AdapterError(exc.message) from exc
    return table


def _check_inverse(table: RoutingTable, log2phy: I64, logcnt: I64 | None, name: str) -> None:
    """log2phy [L, E, X] must list exactly each expert's slots (any order), -1 padded; logcnt must count them."""
    if log2phy.ndim != 3 or log2phy.shape[:2] != (table.layers, table.experts):
        raise AdapterError(f"{name} shape {log2phy.shape}: expected [{table.layers}, {table.experts}, X]")
    x = log2phy.shape[2]
    if int(table.logcnt.max(initial=0)) > x:
        raise AdapterError(f"{name} has width {x}: physical_to_logical_map gives an expert "
                           f"{int(table.logcnt.max())} replicas")
    big = np.iinfo(np.int64).max
    mine = np.sort(np.where(log2phy >= 0, log2phy, big), axis=2)
    want = np.full_like(mine, big)
    w = min(x, table.log2phy.shape[2])
    want[:, :, :w] = np.where(table.log2phy[:, :, :w] >= 0, table.log2phy[:, :, :w], big)
    if not np.array_equal(mine, want):
        layer, e = (int(v) for v in np.argwhere((mine != want).any(axis=2))[0])
        raise AdapterError(f"{name}[{layer}, {e}] does not list the slots physical_to_logical_map gives it")
    if logcnt is not None and (logcnt.shape != table.logcnt.shape or not np.array_equal(logcnt, table.logcnt)):
        if logcnt.shape != table.logcnt.shape:
            raise AdapterError(f"replica count shape {logcnt.shape}: expected {table.logcnt.shape}")
        layer, e = (int(v) for v in np.argwhere(logcnt != table.logcnt)[0])
        raise AdapterError(f"replica count [{layer}, {e}] = {int(logcnt[layer, e])}: "
                           f"physical_to_logical_map gives {int(table.logcnt[layer, e])}")


# ---- vLLM -----------------------------------------------------------------------------------------
def to_vllm(table: RoutingTable, *, as_torch: bool = False) -> dict[str, Any]:
    """An EplbModelState's three maps for `table`; an empty slot stays -1 (vLLM leaves it idle)."""
    return _out({
        "physical_to_logical_map": np.array(table.phy2log),
        "logical_to_physical_map": _padded_log2phy(table, VLLM_L2P_WIDTH),
        "logical_replica_count": np.array(table.logcnt),
    }, as_torch)


def vllm_model_state(state: Any, model_key: str | None = None) -> Any:
    """The EplbModelState inside a vLLM `EplbState` (`model_states[model_key]`; the only one if no key), or
    `state` itself when it already has the maps (an EplbModelState or a dict with its field names)."""
    states = state.get("model_states") if isinstance(state, dict) else getattr(state, "model_states", None)
    if states is None:
        return state
    if model_key is not None:
        if model_key not in states:
            raise AdapterError(f"model_key={model_key!r}: EplbState.model_states holds {sorted(states)}")
        return states[model_key]
    if len(states) != 1:
        raise AdapterError(f"EplbState.model_states holds {len(states)} models {sorted(states)}: pass model_key")
    return next(iter(states.values()))


def from_vllm(state: Any, topo: Topology, *, model_key: str | None = None, version: int = 0, parent: int = 0,
              active_ranks: tuple[int, ...] = ()) -> RoutingTable:
    """A table from a vLLM EplbState, EplbModelState, or a dict with the model state's field names; the three
    maps must agree (any logical_to_physical_map width that holds the replicas)."""
    ms = vllm_model_state(state, model_key)
    get = _getter(ms)
    for field in ("physical_to_logical_map", "logical_to_physical_map", "logical_replica_count"):
        if get(field) is None:
            raise AdapterError(f"the vLLM state has no {field}")
    phy = _np(get("physical_to_logical_map"), "physical_to_logical_map")
    cnt = _np(get("logical_replica_count"), "logical_replica_count")
    table = _table(phy, topo, int(cnt.shape[-1]), version, parent, active_ranks)
    _check_inverse(table, _np(get("logical_to_physical_map"), "logical_to_physical_map"), cnt,
                   "logical_to_physical_map")
    return table


# ---- SGLang ---------------------------------------------------------------------------------------
def sglang_moe_layer_ids(num_hidden_layers: int, first_k_dense: int = 0, step: int = 1) -> list[int]:
    """The MoE layers among SGLang's `num_hidden_layers`: DeepSeek-V3 `first_k_dense_replace`=3 of 61
    -> 3..60 (58 layers); `step` is a `moe_layer_freq`/`decoder_sparse_step` style stride."""
    if not 0 <= first_k_dense < num_hidden_layers or step < 1:
        raise AdapterError(f"num_hidden_layers={num_hidden_layers}, first_k_dense={first_k_dense}, "
                           f"step={step}: expected 0 <= first_k_dense < num_hidden_layers and step >= 1")
    return [i for i in range(first_k_dense, num_hidden_layers) if (i - first_k_dense) % step == step - 1]


def _layer_ids(moe_layer_ids: Sequence[int] | None, layers: int, total: int | None) -> list[int]:
    ids = list(range(layers)) if moe_layer_ids is None else [int(i) for i in moe_layer_ids]
    n = layers if total is None else total
    if len(ids) != layers or sorted(set(ids)) != ids or (ids and not 0 <= ids[0] <= ids[-1] < n):
        raise AdapterError(f"moe_layer_ids={ids}: expected {layers} ascending distinct layers in 0..{n - 1}")
    return ids


def to_sglang(table: RoutingTable, *, moe_layer_ids: Sequence[int] | None = None,
              num_hidden_layers: int | None = None, as_torch: bool = False) -> dict[str, Any]:
    """ExpertLocationMetadata's tensor fields over `num_hidden_layers` (default: the table's layers): MoE layer
    `moe_layer_ids[i]` gets the table's layer i, every other (dense) layer SGLang's trivial `arange(P) % E`.
    The dispatch map is per-rank SGLang state and omitted. Refuses empty slots."""
    _check_full(table, "SGLang")
    total = table.layers if num_hidden_layers is None else num_hidden_layers
    ids = _layer_ids(moe_layer_ids, table.layers, total)
    phy = np.broadcast_to(np.arange(table.slots, dtype=np.int64) % table.experts, (total, table.slots)).copy()
    phy[ids] = table.phy2log
    full = RoutingTable(Topology(1, table.topology.ranks, table.topology.slots_per_rank), table.experts, phy)
    return _out({
        "physical_to_logical_map": np.array(full.phy2log),
        "logical_to_all_physical_map": _padded_log2phy(full, table.slots),
        "logical_to_all_physical_map_num_valid": np.array(full.logcnt),
    }, as_torch)


def from_sglang(meta: Any, topo: Topology, experts: int | None = None, *,
                moe_layer_ids: Sequence[int] | None = None, version: int = 0, parent: int = 0,
                active_ranks: tuple[int, ...] = ()) -> RoutingTable:
    """A table from ExpertLocationMetadata, or a dict with at least `physical_to_logical_map`; with
    `moe_layer_ids`, only those rows (SGLang's layers include the dense ones).

    `experts` defaults to the width of `logical_to_all_physical_map` if given, else max id + 1."""
    get = _getter(meta)
    if get("physical_to_logical_map") is None:
        raise AdapterError("no physical_to_logical_map in the SGLang metadata")
    phy = _np(get("physical_to_logical_map"), "physical_to_logical_map")
    l2p = get("logical_to_all_physical_map")
    num = get("logical_to_all_physical_map_num_valid")
    if experts is None:
        experts = int(_np(l2p, "logical_to_all_physical_map").shape[1]) if l2p is not None else int(phy.max()) + 1
    if phy.ndim != 2:
        raise AdapterError(f"physical_to_logical_map shape {phy.shape}: expected [layers, {topo.slots}]")
    total = int(phy.shape[0])
    ids = _layer_ids(moe_layer_ids, total if moe_layer_ids is None else len(moe_layer_ids), total)
    if l2p is not None:  # the whole metadata must agree, dense layers included
        whole = _table(phy, topo, experts, 0, 0, ())
        _check_inverse(whole, _np(l2p, "logical_to_all_physical_map"),
                       None if num is None else _np(num, "logical_to_all_physical_map_num_valid"),
                       "logical_to_all_physical_map")
    return _table(phy[ids], topo, experts, version, parent, active_ranks)


def save_sglang_location(table: RoutingTable, path: str | Path, *, moe_layer_ids: Sequence[int] | None = None,
                         num_hidden_layers: int | None = None) -> Path:
    """Write the `--init-expert-location` file: `.json` (lists) or `.pt` (torch.save of an int64 tensor),
    over `num_hidden_layers` as `to_sglang` lays them out."""
    p = Path(path)
    phy = to_sglang(table, moe_layer_ids=moe_layer_ids, num_hidden_layers=num_hidden_layers)["physical_to_logical_map"]
    if p.suffix == ".json":
        p.write_text(json.dumps({"physical_to_logical_map": phy.tolist()}))
    elif p.suffix == ".pt":
        import torch

        torch.save({"physical_to_logical_map": torch.from_numpy(phy)}, p)
    else:
        raise AdapterError(f"path {p}: expected a .json or .pt suffix (as SGLang's --init-expert-location)")
    return p


def _load(p: Path) -> Any:
    if p.suffix == ".pt":
        import torch

        return torch.load(p, weights_only=True)
    if p.suffix == ".json":
        return json.loads(p.read_text())
    raise AdapterError(f"path {p}: expected a .json or .pt suffix")


def load_sglang_location(path: str | Path, topo: Topology, experts: int, *,
                         moe_layer_ids: Sequence[int] | None = None, **kw: Any) -> RoutingTable:
    """Read an `--init-expert-location` file (.json or .pt) holding `physical_to_logical_map`."""
    p = Path(path)
    data = _load(p)
    if not isinstance(data, dict) or "physical_to_logical_map" not in data:
        raise AdapterError(f"{p} holds {sorted(data) if isinstance(data, dict) else type(data).__name__}: "
                           "expected physical_to_logical_map")
    return from_sglang({"physical_to_logical_map": data["physical_to_logical_map"]}, topo, experts,
                       moe_layer_ids=moe_layer_ids, **kw)


def to_sglang_dump(counts: Any, *, moe_layer_ids: Sequence[int] | None = None,
                   num_hidden_layers: int | None = None, as_torch: bool = False) -> dict[str, Any]:
    """An expert-distribution dump for counts `[L, E]` or `[steps, L, E]`: {'logical_count': ...}, MoE rows at
    `moe_layer_ids` of `num_hidden_layers` (dense rows zero)."""
    c = _np(counts, "counts")
    if c.ndim not in (2, 3) or (c < 0).any():
        raise AdapterError(f"counts shape {c.shape}: expected non-negative [layers, experts] or [steps, ...]")
    if moe_layer_ids is not None or num_hidden_layers is not None:
        layers = c.shape[-2]
        total = layers if num_hidden_layers is None else num_hidden_layers
        full = np.zeros(c.shape[:-2] + (total, c.shape[-1]), dtype=np.int64)
        full[..., _layer_ids(moe_layer_ids, layers, total), :] = c
        c = full
    return _out({"logical_count": c}, as_torch)


def from_sglang_dump(dump: Any, *, moe_layer_ids: Sequence[int] | None = None) -> npt.NDArray[np.uint32]:
    """uint32 [steps, L, E] from a dump dict (or a .pt/.json path) with `logical_count`; [L, E] -> [1, L, E];
    with `moe_layer_ids`, only those layers."""
    if isinstance(dump, (str, Path)):
        dump = _load(Path(dump))
    if not isinstance(dump, dict) or "logical_count" not in dump:
        raise AdapterError(f"dump holds {sorted(dump) if isinstance(dump, dict) else type(dump).__name__}: "
                           "expected logical_count")
    c = _np(dump["logical_count"], "logical_count")
    if c.ndim == 2:
        c = c[None]
    if c.ndim != 3 or (c < 0).any() or (c > np.iinfo(np.uint32).max).any():
        raise AdapterError(f"logical_count shape {c.shape}: expected counts [steps, layers, experts] in uint32")
    if moe_layer_ids is not None:
        c = c[:, _layer_ids(moe_layer_ids, len(moe_layer_ids), c.shape[1])]
    return c.astype(np.uint32)


# ---- DeepSeek EPLB ------------------------------------------------------------------------------
def to_eplb(table: RoutingTable, *, as_torch: bool = False) -> tuple[Any, Any, Any]:
    """(phy2log [L, P], log2phy [L, E, logcnt.max()], logcnt [L, E]) as `eplb.rebalance_experts` returns;
    refuses empty slots (EPLB fills every slot)."""
    _check_full(table, "DeepSeek EPLB")
    d = _out({"phy2log": np.array(table.phy2log), "log2phy": np.array(table.log2phy),
              "logcnt": np.array(table.logcnt)}, as_torch)
    return d["phy2log"], d["log2phy"], d["logcnt"]


def from_eplb(phy2log: Any, log2phy: Any, logcnt: Any, topo: Topology, *, version: int = 0, parent: int = 0,
              active_ranks: tuple[int, ...] = ()) -> RoutingTable:
    """A table from EPLB's output; log2phy rows may be in replica-rank order."""
    cnt = _np(logcnt, "logcnt")
    table = _table(_np(phy2log, "phy2log"), topo, int(cnt.shape[-1]), version, parent, active_ranks)
    _check_inverse(table, _np(log2phy, "log2phy"), cnt, "log2phy")
    return table
