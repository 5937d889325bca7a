"""The agents' first table (version 1, parent 0): the placement the engine boots with.

    genesis_table("vllm", topo, layers, experts)      # vLLM: [0..E-1] then (p - E) % E, every MoE layer
    genesis_table("sglang", topo, layers, experts)    # SGLang's trivial placement: arange(P) % E (the
                                                      # same placement: (p - E) % E == p % E for p >= E)
    genesis_table("static", topo, layers, experts)    # the project's static EP blocks with empty spare slots
    genesis_table("/etc/emoe/placement.json", ...)    # a placement file: SGLang --init-expert-location
                                                      # (.json / .pt) or DeepSeek EPLB output (.npz)

Pure and numpy-only (a `.pt` file needs torch): the agent builds its genesis with it, and the engine plugin
compares the engine's own boot placement with the same table, refusing to run on a mismatch.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import numpy.typing as npt

from controlplane.errors import ControlPlaneError
from controlplane.table import RoutingTable, initial_table
from controlplane.topology import Topology
from dataplane_shim import adapters as ad
from dataplane_shim.errors import BadInput

I64 = npt.NDArray[np.int64]
KINDS = ("static", "vllm", "sglang")


def vllm_boot_phy2log(layers: int, experts: int, slots: int) -> I64:
    """[L, P] vLLM's `EplbState.build_initial_global_physical_to_logical_map` ([0..E-1] then (p - E) % E)
    and SGLang's `ExpertLocationMetadata.init_trivial` (`arange(P) % E`), repeated for every layer."""
    _check(experts, slots)
    return np.broadcast_to(np.arange(slots, dtype=np.int64) % experts, (layers, slots)).copy()


sglang_boot_phy2log = vllm_boot_phy2log  # both engines boot with arange(P) % E


def _check(experts: int, slots: int) -> None:
    if experts < 1 or slots < experts:
        raise BadInput(f"experts={experts}, slots={slots}: expected 1 <= experts <= slots")


def genesis_table(spec: str, topo: Topology, layers: int, experts: int) -> RoutingTable:
    """Version 1 for `spec`: one of KINDS, or the path of a placement file holding [layers, P] (MoE layers
    only: the agents' layer count). Raises BadInput naming the spec and what was wrong. Built once per
    (spec, shape, file state) in a process: the config check and the agent's start ask for the same table
    (tables are immutable)."""
    stamp: tuple[int, int] | None = None
    if spec not in KINDS:
        try:
            st = Path(spec).stat()
            stamp = (st.st_mtime_ns, st.st_size)
        except OSError:
            pass  # _from_file says what is wrong with the path
    return _genesis(spec, topo, layers, experts, stamp)


@lru_cache(maxsize=8)
def _genesis(spec: str, topo: Topology, layers: int, experts: int, stamp: tuple[int, int] | None) -> RoutingTable:
    if spec == "static":
        return initial_table(topo, layers, experts)
    if spec in ("vllm", "sglang"):
        phy = vllm_boot_phy2log(layers, experts, topo.slots)
    else:
        phy = _from_file(Path(spec), topo, layers, experts)
    table = RoutingTable(topo, experts, phy, version=1, parent=0)
    try:
        table.validate()
    except ControlPlaneError as exc:
        raise BadInput(f"genesis {spec!r}: {exc.message}") from None
    return table


def _from_file(path: Path, topo: Topology, layers: int, experts: int) -> I64:
    if not path.is_file():
        raise BadInput(f"genesis {str(path)!r}: expected one of {KINDS} or an existing placement file")
    if path.suffix == ".npz":  # DeepSeek EPLB output saved with np.savez(phy2log=..., log2phy=..., logcnt=...)
        with np.load(path) as z:
            missing = {"phy2log", "log2phy", "logcnt"} - set(z.files)
            if missing:
                raise BadInput(f"genesis {str(path)!r} lacks {sorted(missing)}: expected EPLB's three arrays")
            t = ad.from_eplb(z["phy2log"], z["log2phy"], z["logcnt"], topo)
    elif path.suffix in (".json", ".pt"):
        t = ad.load_sglang_location(path, topo, experts)
    else:
        raise BadInput(f"genesis {str(path)!r}: expected a .json or .pt (SGLang) or .npz (EPLB) file")
    if t.layers != layers or t.experts != experts:
        raise BadInput(f"genesis {str(path)!r} holds [{t.layers} layers, {t.experts} experts]: the cluster "
                       f"has [{layers}, {experts}]")
    return np.array(t.phy2log)


def content_hex(table: RoutingTable) -> str:
    """A short printable name of a placement (its content digest), for mismatch messages."""
    return table.content_digest.hex()[:16]
