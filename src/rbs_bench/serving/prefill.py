"""Sparse prefill over a packed batch: the part of the vLLM backend that needs no vLLM.

vLLM hands attention one step's tokens packed: query [T, Hq, D], key/value [T, Hkv, D], with each
sequence's rows given by offsets. `sparse_prefill` runs the selector on every sequence separately
(never on the batch as one sequence) and executes the selections in one varlen launch of the block
kernel (Triton on CUDA, its PyTorch reference elsewhere), so no sequence attends to another's keys.

`PrefillSpec` is what the engine's worker processes run (method, fields, knob, executor); it travels
to them as JSON in the environment variable `ENV_VAR`. `StepStats` keeps the per-layer densities
and selector / attention times of the prefill steps a worker ran until the runner collects them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rbs_bench import methods
from rbs_bench.execution import execute, resolve_executor
from rbs_bench.kernels.block_sparse_attn import (
    block_sparse_attention,
    block_sparse_attention_varlen_ref,
)
from rbs_bench.methods.selection import BlockSelection

ENV_VAR = "RBS_VLLM_PREFILL"  # JSON of a PrefillSpec; unset = the plugin registers nothing


@dataclass(frozen=True)
class PrefillSpec:
    """The prefill method a worker runs: registry name, dataclass fields, the knob (budget) value
    and the executor. `dense` runs the engine's own attention kernel, timed like a sparse method."""

    method: str
    fields: dict = field(default_factory=dict)
    knob: float | None = None
    executor: str = "auto"

    def selector(self):
        """The configured selector; raises ValueError with the valid choices on bad input."""
        sel = methods.build(self.method, **self.fields)
        if self.knob is None:
            return sel
        if sel.knob is None:
            raise ValueError(f"method {self.method!r} has no knob; give no budget for it")
        if not (isinstance(self.knob, (int, float)) and math.isfinite(self.knob)):
            raise ValueError(f"the budget (knob {sel.knob}) must be a finite number")
        return sel.with_knob(self.knob)

    def check(self, device) -> None:
        """Fail early, in the caller's process, for anything a worker would reject."""
        self.selector()
        resolve_executor(self.executor, device)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PrefillSpec:
        try:
            data = json.loads(text)
            return cls(**data)
        except (json.JSONDecodeError, TypeError) as e:
            names = ", ".join(f.name for f in dataclasses.fields(cls))
            raise ValueError(
                f"{ENV_VAR} must be a JSON object with the keys {names}; got {text!r} ({e})"
            ) from None

    @classmethod
    def from_env(cls) -> PrefillSpec | None:
        text = os.environ.get(ENV_VAR)
        return cls.from_json(text) if text else None


def pack_selections(selections: list[BlockSelection]) -> tuple[Tensor, Tensor]:
    """Stack per-sequence lists into the varlen layout: kv_count int32 [S, Hq, Mq_max] and
    kv_indices int32 [S, Hq, Mq_max, Mk_max]; query blocks past a sequence's end keep nothing."""
    mq = max(s.kv_count.shape[-1] for s in selections)
    mk = max(s.kv_indices.shape[-1] for s in selections)
    first = selections[0].kv_count
    s_n, hq = len(selections), first.shape[1]
    count = torch.zeros(s_n, hq, mq, dtype=torch.int32, device=first.device)
    indices = torch.zeros(s_n, hq, mq, mk, dtype=torch.int32, device=first.device)
    for i, sel in enumerate(selections):
        if sel.kv_count.shape[0] != 1:
            raise ValueError(f"expected one sequence per selection; got batch {sel.shape[0]}")
        m_q, m_k = sel.kv_indices.shape[-2:]
        count[i, :, :m_q] = sel.kv_count[0]
        indices[i, :, :m_q, :m_k] = sel.kv_indices[0]
    return count, indices


def _heads_first(x: Tensor) -> Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [T, H, D] -> [1, H, T, D], a view


def sparse_prefill(
    query: Tensor,  # [T, Hq, D]
    key: Tensor,  # [T, Hkv, D]
    value: Tensor,  # [T, Hkv, D]
    bounds: list[tuple[int, int]],
    selector,
    executor: str,
    scale: float,
    out: Tensor,  # [T, Hq, D], written at the rows of `bounds` only
    clock=None,
) -> tuple[list[Tensor], tuple]:
    """Causal sparse attention of the whole-prompt sequences at `bounds` (start, end) rows.

    Each sequence gets its own selection from its own q/k; block selections then run in one
    varlen launch (cu_seqlens), other patterns (e.g. MInference's) one sequence at a time through
    their own executors. Returns each sequence's head density (float [Hq]) and the three clock
    marks (start, selections done, attention done) that `clock(query)` returned.
    """
    clock = clock or (lambda _: time.perf_counter())
    q, k, v = _heads_first(query), _heads_first(key), _heads_first(value)
    marks = [clock(query)]
    sels = [selector.select(q[:, :, a:b], k[:, :, a:b], scale=scale) for a, b in bounds]
    marks.append(clock(query))

    name = resolve_executor(executor, query.device)
    blocks = all(isinstance(s, BlockSelection) for s in sels)
    if (
        blocks
        and name in ("triton", "reference")
        and len({(s.block_q, s.block_k) for s in sels}) == 1
    ):
        _run_varlen(q, k, v, bounds, sels, name, scale, out)
    else:
        for (a, b), sel in zip(bounds, sels):
            o = execute(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], sel, executor, scale=scale)
            out[a:b] = o[0].transpose(0, 1)
    marks.append(clock(query))
    return [s.head_density()[0].float() for s in sels], tuple(marks)


def _run_varlen(q, k, v, bounds, sels, name: str, scale: float, out: Tensor) -> None:
    """One packed launch over the sequences; rows between them (other requests) are skipped."""
    lo, hi = bounds[0][0], bounds[-1][1]
    contiguous = all(b0 == a1 for (_, b0), (a1, _) in zip(bounds[:-1], bounds[1:]))
    if contiguous:
        qp, kp, vp = q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi]
    else:
        qp, kp, vp = (torch.cat([x[:, :, a:b] for a, b in bounds], dim=2) for x in (q, k, v))
    lengths = [b - a for a, b in bounds]
    cu = torch.tensor([0, *lengths], device=q.device).cumsum(0).to(torch.int32)
    count, indices = pack_selections(sels)
    block_q, block_k = sels[0].block_q, sels[0].block_k
    kernel = block_sparse_attention if name == "triton" else block_sparse_attention_varlen_ref
    o = kernel(qp, kp, vp, count, indices, block_q, block_k, cu_seqlens=cu, scale=scale)[0]
    o = o.transpose(0, 1)  # [T', Hq, D]
    if contiguous:
        out[lo:hi] = o
        return
    start = 0
    for (a, b), n in zip(bounds, lengths):
        out[a:b] = o[start : start + n]
        start += n


@dataclass
class StepStats:
    """Per-layer records of the prefill steps a worker ran since the last `drain()`.

    Times are taken with CUDA events on a GPU (resolved at drain, no per-layer synchronisation)
    and `perf_counter` on the CPU. A layer seen a second time starts a new step. Only the latest
    `MAX_ENTRIES` are kept, so an engine that nobody drains (a plain `vllm serve`) stays bounded.
    """

    MAX_ENTRIES = 1 << 16
    entries: deque = field(default_factory=lambda: deque(maxlen=StepStats.MAX_ENTRIES))
    step: int = 0
    _layers: set = field(default_factory=set)

    @staticmethod
    def clock(like: Tensor):
        if like.is_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def add(self, layer: str, path: str, seq_lens: list[int], densities, marks) -> None:
        """path: "sparse" (our selector + executor), "stock" (the engine's kernel), or "mixed"
        (the engine's kernel on every row, then ours over the whole-prompt rows)."""
        if layer in self._layers:
            self.step += 1
            self._layers.clear()
        self._layers.add(layer)
        self.entries.append(
            {
                "step": self.step,
                "layer": layer,
                "path": path,
                "seq_lens": list(seq_lens),
                "density": densities,
                "marks": marks,
            }
        )

    def drain(self) -> list[dict]:
        """The records so far with times in ms and densities as lists; clears them."""
        entries, self.entries = list(self.entries), deque(maxlen=self.MAX_ENTRIES)
        self._layers.clear()
        self.step = 0
        out = []
        for e in entries:
            m0, m1, m2 = e.pop("marks")
            if isinstance(m0, float):
                sel_ms, attn_ms = (m1 - m0) * 1e3, (m2 - m1) * 1e3
            else:
                m2.synchronize()
                sel_ms, attn_ms = m0.elapsed_time(m1), m1.elapsed_time(m2)
            e["selector_ms"], e["attention_ms"] = sel_ms, attn_ms
            e["density"] = [[round(float(x), 6) for x in d.tolist()] for d in e["density"]]
            out.append(e)
        return out


def summarize(entries: list[dict]) -> dict:
    """Mean density over layers, heads and sequences; summed selector / attention ms; the paths."""
    dens = [x for e in entries for seq in e["density"] for x in seq]
    return {
        "density": sum(dens) / len(dens) if dens else None,
        "selector_ms": sum(e["selector_ms"] for e in entries),
        "attention_ms": sum(e["attention_ms"] for e in entries),
        "prefill_attention_ms": sum(e["selector_ms"] + e["attention_ms"] for e in entries),
        "layer_calls": len(entries),
        "paths": sorted({e["path"] for e in entries}),
    }
