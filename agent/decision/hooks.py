"""What a harness may observe of a node (the chaos simulator records its history through these)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from agent.consensus.core import Outcome
from controlplane.controller import Explain
from controlplane.table import RoutingTable


@dataclass
class Hooks:
    """What a harness may observe (the chaos simulator records its history through these; it never replaces a
    method): `window_closed(seq, total, samples)` before a closed cluster window is acted on; `proposing(table)` as a
    table goes to the commit backend, returning the callback that gets the proposal's outcome (before the
    node acts on it); `explained(explain)` for every account the controller gives of a decision it made or did
    not make (controlplane.controller.Explain)."""

    window_closed: list[Callable[[int, npt.NDArray[np.uint64], npt.NDArray[np.uint32] | None], None]] = field(
        default_factory=list)
    proposing: list[Callable[[RoutingTable], Callable[[Outcome], None]]] = field(default_factory=list)
    explained: list[Callable[[Explain], None]] = field(default_factory=list)
