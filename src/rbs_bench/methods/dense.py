"""Dense causal attention: every causal block pair, executed with SDPA."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import Tensor

from rbs_bench.methods.info import MethodInfo
from rbs_bench.methods.selection import BlockSelection, check_inputs


@dataclass(frozen=True)
class Dense:
    """The reference point of every table: density 1, run by SDPA rather than a sparse executor."""

    block_size: int = 128

    name = "dense"
    knob = None  # nothing to calibrate
    knob_direction = 0
    is_dense = True
    info = MethodInfo(display="Dense", order=0, style=("#000000", "."), throughput=True)

    def fields(self) -> dict:
        return dataclasses.asdict(self)

    def select(self, q: Tensor, k: Tensor, scale: float | None = None) -> BlockSelection:
        check_inputs(q, k)
        b, h, n, _ = q.shape
        return BlockSelection.full(b, h, n, self.block_size, q.device)
