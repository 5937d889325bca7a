"""Adapters between our routing tables and the engines' expert-placement formats, both directions.

All three engines use our convention (slot p on EP rank p // slots_per_rank; phy2log is authoritative):
- vLLM `EplbState`: `physical_to_logical_map [L, P]`, `logical_to_physical_map [L, E, P - E + 1]` (slots in
  ascending order, -1 padded; the width is num_redundant_experts + 1), `logical_replica_count [L, E]`.
- SGLang `ExpertLocationMetadata`: `physical_to_logical_map [L, P]`, `logical_to_all_physical_map
  [L, E, P]` (ascending, -1 padded to P), `logical_to_all_physical_map_num_valid [L, E]`; the file given to
  `--init-expert-location` is JSON or a `torch.save`d dict holding `physical_to_logical_map`. Its
  expert-distribution dumps hold `logical_count` `[L, E]` or `[steps, L, E]`.
- DeepSeek EPLB `rebalance_experts` -> `(phy2log [L, P], log2phy [L, E, P - E + 1], logcnt [L, E])`.
  EPLB orders a log2phy row by replica rank, not by slot: import compares rows as sets.

Engines fill every slot; our tables may hold empty slots (-1), which export as -1 (`strict=True` refuses
them instead). Arrays come in as numpy or torch (CPU or device); exports are numpy int64 unless
`as_torch=True`. torch is imported only when needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from controlplane.errors import ControlPlaneError
from controlplane.table import RoutingTable
from controlplane.topology import Topology
from dataplane_shim.errors import ShimError

I64 = npt.NDArray[np.int64]


class AdapterError(ShimError):
    code = "ADAPTER"


def _np(x: Any, name: str) -> I64:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise AdapterError(f"{name} has dtype {arr.dtype}: expected integers")
    return arr.astype(np.int64)


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


def _check_full(table: RoutingTable, strict: bool) -> None:
    if strict and (table.phy2log < 0).any():
        layer, slot = (int(v) for v in np.argwhere(table.phy2log < 0)[0])
        raise AdapterError(f"layer {layer} slot {slot} is empty: the engine format needs every slot filled")


def _table(phy2log: I64, topo: Topology, experts: int, version: int, parent: int,
           active_ranks: tuple[int, ...]) -> RoutingTable:
    if phy2log.ndim != 2 or phy2log.shape[1] != topo.slots:
        raise AdapterError(f"physical_to_logical_map shape {phy2log.shape}: expected [layers, {topo.slots}]")
    try:
        return RoutingTable(topo, experts, phy2log, version, parent, active_ranks)
    except ControlPlaneError as exc:
        raise AdapterError(exc.message) from exc


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
def to_vllm(table: RoutingTable, *, as_torch: bool = False, strict: bool = False) -> dict[str, Any]:
    """EplbState's three maps for `table`."""
    _check_full(table, strict)
    width = max(1, table.slots - table.experts + 1)
    return _out({
        "physical_to_logical_map": np.array(table.phy2log),
        "logical_to_physical_map": _padded_log2phy(table, width),
        "logical_replica_count": np.array(table.logcnt),
    }, as_torch)


def from_vllm(state: Any, topo: Topology, *, version: int = 0, parent: int = 0,
              active_ranks: tuple[int, ...] = ()) -> RoutingTable:
    """A table from an EplbState (or a dict with its field names); the three maps must agree."""
    get = state.get if isinstance(state, dict) else lambda k: getattr(state, k)
    phy = _np(get("physical_to_logical_map"), "physical_to_logical_map")
    cnt = _np(get("logical_replica_count"), "logical_replica_count")
    table = _table(phy, topo, int(cnt.shape[-1]), version, parent, active_ranks)
    _check_inverse(table, _np(get("logical_to_physical_map"), "logical_to_physical_map"), cnt,
                   "logical_to_physical_map")
    return table


# ---- SGLang ---------------------------------------------------------------------------------------
def to_sglang(table: RoutingTable, *, as_torch: bool = False, strict: bool = False) -> dict[str, Any]:
    """ExpertLocationMetadata's tensor fields (the dispatch map is per-rank SGLang state and omitted)."""
    _check_full(table, strict)
    return _out({
        "physical_to_logical_map": np.array(table.phy2log),
        "logical_to_all_physical_map": _padded_log2phy(table, table.slots),
        "logical_to_all_physical_map_num_valid": np.array(table.logcnt),
    }, as_torch)


def from_sglang(meta: Any, topo: Topology, experts: int | None = None, *, version: int = 0, parent: int = 0,
                active_ranks: tuple[int, ...] = ()) -> RoutingTable:
    """A table from ExpertLocationMetadata, or a dict with at least `physical_to_logical_map`.

    `experts` defaults to the width of `logical_to_all_physical_map` if given, else max id + 1."""
    get = meta.get if isinstance(meta, dict) else lambda k: getattr(meta, k, None)
    if get("physical_to_logical_map") is None:
        raise AdapterError("no physical_to_logical_map in the SGLang metadata")
    phy = _np(get("physical_to_logical_map"), "physical_to_logical_map")
    l2p = get("logical_to_all_physical_map")
    num = get("logical_to_all_physical_map_num_valid")
    if experts is None:
        experts = int(_np(l2p, "logical_to_all_physical_map").shape[1]) if l2p is not None else int(phy.max()) + 1
    table = _table(phy, topo, experts, version, parent, active_ranks)
    if l2p is not None:
        _check_inverse(table, _np(l2p, "logical_to_all_physical_map"),
                       None if num is None else _np(num, "logical_to_all_physical_map_num_valid"),
                       "logical_to_all_physical_map")
    return table


def save_sglang_location(table: RoutingTable, path: str | Path) -> Path:
    """Write the `--init-expert-location` file: `.json` (lists) or `.pt` (torch.save of int64 tensors)."""
    p = Path(path)
    if p.suffix == ".json":
        p.write_text(json.dumps({"physical_to_logical_map": table.phy2log.tolist()}))
    elif p.suffix == ".pt":
        import torch

        torch.save({"physical_to_logical_map": torch.from_numpy(np.array(table.phy2log))}, p)
    else:
        raise AdapterError(f"path {p}: expected a .json or .pt suffix (as SGLang's --init-expert-location)")
    return p


def load_sglang_location(path: str | Path, topo: Topology, experts: int, **kw: Any) -> RoutingTable:
    """Read an `--init-expert-location` file (.json or .pt) holding `physical_to_logical_map`."""
    p = Path(path)
    if p.suffix == ".pt":
        import torch

        data = torch.load(p, weights_only=True)
    elif p.suffix == ".json":
        data = json.loads(p.read_text())
    else:
        raise AdapterError(f"path {p}: expected a .json or .pt suffix")
    if "physical_to_logical_map" not in data:
        raise AdapterError(f"{p} holds {sorted(data)}: expected physical_to_logical_map")
    return from_sglang({"physical_to_logical_map": data["physical_to_logical_map"]}, topo, experts, **kw)


def to_sglang_dump(counts: Any, *, as_torch: bool = False) -> dict[str, Any]:
    """An expert-distribution dump for counts uint32/int `[L, E]` or `[steps, L, E]`: {'logical_count': ...}."""
    c = _np(counts, "counts")
    if c.ndim not in (2, 3) or (c < 0).any():
        raise AdapterError(f"counts shape {c.shape}: expected non-negative [layers, experts] or [steps, ...]")
    return _out({"logical_count": c}, as_torch)


def from_sglang_dump(dump: Any) -> npt.NDArray[np.uint32]:
    """uint32 [steps, L, E] from a dump dict (or a .pt/.json path) with `logical_count`; [L, E] -> [1, L, E]."""
    if isinstance(dump, (str, Path)):
        p = Path(dump)
        if p.suffix == ".json":
            dump = json.loads(p.read_text())
        else:
            import torch

            dump = torch.load(p, weights_only=True)
    if "logical_count" not in dump:
        raise AdapterError(f"dump holds {sorted(dump)}: expected logical_count")
    c = _np(dump["logical_count"], "logical_count")
    if c.ndim == 2:
        c = c[None]
    if c.ndim != 3 or (c < 0).any() or (c > np.iinfo(np.uint32).max).any():
        raise AdapterError(f"logical_count shape {c.shape}: expected counts [steps, layers, experts] in uint32")
    return c.astype(np.uint32)


# ---- DeepSeek EPLB ------------------------------------------------------------------------------
def to_eplb(table: RoutingTable, *, as_torch: bool = False, strict: bool = False) -> tuple[Any, Any, Any]:
    """(phy2log [L, P], log2phy [L, E, P - E + 1], logcnt [L, E]) as `eplb.rebalance_experts` returns."""
    d = to_vllm(table, as_torch=as_torch, strict=strict)
    return d["physical_to_logical_map"], d["logical_to_physical_map"], d["logical_replica_count"]


def from_eplb(phy2log: Any, log2phy: Any, logcnt: Any, topo: Topology, *, version: int = 0, parent: int = 0,
              active_ranks: tuple[int, ...] = ()) -> RoutingTable:
    """A table from EPLB's output; log2phy rows may be in replica-rank order."""
    cnt = _np(logcnt, "logcnt")
    table = _table(_np(phy2log, "phy2log"), topo, int(cnt.shape[-1]), version, parent, active_ranks)
    _check_inverse(table, _np(log2phy, "log2phy"), cnt, "log2phy")
    return table
