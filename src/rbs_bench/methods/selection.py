"""The selection API: what every method returns, and the block-geometry helpers they share.

A selector never runs attention. It returns a `BlockSelection`, whose `kv_count`/`kv_indices`
are exactly the layout of PyTorch's `BlockMask.from_kv_blocks`, so the same selection can be
executed by the PyTorch reference, FlexAttention, or a Triton kernel.

`BlockSelector` holds the fields every block selector shares (block size, forced blocks);
`check_impl` and `use_triton` read the `impl` field most selectors have (docs/design.md §3).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

# The block-level mask rule lives beside the fused kernel that implements it, and is shared here.
from rbs_bench.kernels.block_masks import candidate_mask, forced_mask, relative_threshold
from rbs_bench.kernels.block_sparse_attn import (
    block_geometry,
    block_lists_from_mask,
    block_mask_from_lists,
)
from rbs_bench.kernels.quest_select import top_fraction
from rbs_bench.kernels.shapes import check_qk
from rbs_bench.kernels.triton_util import INTERPRET, triton_available

__all__ = [
    "IMPLS",
    "BlockSelection",
    "BlockSelector",
    "Selector",
    "candidate_mask",
    "causal_block_mask",
    "check_impl",
    "check_inputs",
    "forced_mask",
    "num_blocks",
    "relative_threshold",
    "use_triton",
]

IMPLS = ("auto", "torch", "triton")


_FINITE_CHECKED = contextvars.ContextVar("rbs_bench_finite_checked", default=False)


@contextlib.contextmanager
def finite_checked():
    """Inside this block `check_inputs` skips its finiteness test: the caller has already
    checked q and k (the attention hook does, without a host sync: models/hf_attention.py)."""
    token = _FINITE_CHECKED.set(True)
    try:
        yield
    finally:
        _FINITE_CHECKED.reset(token)


# The largest |q_t . k_s| (and ||q_t||^2, ||k_s||^2) a selection may meet: every selector scores
# in float32, whose range ends at 3.4e38, and sums, bounds and softmaxes of such scores must stay
# inside it, so the inputs' norms must leave that many orders of magnitude of headroom.
SCORE_LIMIT = 1e30


def check_inputs(q: Tensor, k: Tensor) -> None:
    """The checks every `select` runs first: q [B, Hq, N, D] and k [B, Hkv, N, D], Hq a multiple
    of Hkv (`check_qk`), floating point, no empty dimension (N = 0 has no blocks), finite values,
    and values whose scores fit float32.

    A NaN or Inf would not fail later: it silently changes which blocks a threshold keeps, and so
    do finite inputs whose scores overflow (q and k scaled by 1e30). Both tests read one
    fp32-accumulated Frobenius norm of q and one of k (NaN and Inf survive it; no copy of the
    inputs is made) with one host sync: by Cauchy-Schwarz every score |q_t . k_s| and every
    squared row norm is at most the product of the two norms (or a norm squared), which must stay
    below SCORE_LIMIT; an exact `isfinite` pass runs only when a norm is not finite, to tell a
    NaN or Inf from an overflow. Inside `finite_checked()` both are skipped.
    Raises ValueError.
    """
    check_qk(q, k)
    if not (q.dtype.is_floating_point and k.dtype.is_floating_point):
        raise ValueError(
            f"q and k must be floating point (float16, bfloat16, float32), got {q.dtype}, "
            f"{k.dtype}; convert them first (an integer tensor is not a query)"
        )
    if q.numel() == 0 or k.numel() == 0:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} are empty (N = 0 tokens, or no batch, "
            "heads or head dim): there is nothing to select"
        )
    if _FINITE_CHECKED.get():
        return
    norms = torch.stack(
        [torch.linalg.vector_norm(t, dtype=torch.float32).to(q.device) for t in (q, k)]
    )
    qn, kn = norms.tolist()
    if not (math.isfinite(qn) and math.isfinite(kn)):  # exact test only now
        for name, t in (("q", q), ("k", k)):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(
                    f"{name} holds NaN or Inf values; the selection of non-finite scores "
                    "would be meaningless (check the model's dtype and activations)"
                )
    if max(qn * kn, qn * qn, kn * kn) > SCORE_LIMIT:
        size = (
            f"norms {qn:.3g} and {kn:.3g}: a score q.k may reach {qn * kn:.3g}"
            if math.isfinite(qn * kn)
            else "their norms overflow float32"
        )
        raise ValueError(
            f"q and k are too large for float32 scores ({size}, past {SCORE_LIMIT:g}); the "
            "selection of overflowing scores would be meaningless (check the model's dtype and "
            "activations)"
        )


def num_blocks(n: int, block: int) -> int:
    return math.ceil(n / block)


def causal_block_mask(seq_len: int, block_q: int, block_k: int, device=None) -> Tensor:
    """bool [Mq, Mk]: key block j holds a key <= some query of block i (a causal pair)."""
    return block_geometry(seq_len, block_q, block_k, device)[0]


@dataclass(frozen=True)
class BlockSelection:
    """Kept key blocks per (batch, head, query block).

    kv_count:   int32 [B, H, Mq]      number of kept key blocks of each query block
    kv_indices: int32 [B, H, Mq, Mk]  kept key-block ids in ascending order, padded past the count
    """

    kv_count: Tensor
    kv_indices: Tensor
    block_q: int
    block_k: int
    seq_len: int

    @classmethod
    def from_mask(cls, mask: Tensor, block_q: int, block_k: int, seq_len: int) -> BlockSelection:
        """Compact a bool [B, H, Mq, Mk] mask; blocks outside the causal region are dropped."""
        mask = mask & causal_block_mask(seq_len, block_q, block_k, mask.device)
        return cls(*block_lists_from_mask(mask), block_q, block_k, seq_len)

    @classmethod
    def full(cls, batch: int, heads: int, seq_len: int, block: int, device=None) -> BlockSelection:
        """Every causal block pair (what dense attention computes)."""
        mq = num_blocks(seq_len, block)
        mask = torch.ones(batch, heads, mq, mq, dtype=torch.bool, device=device)
        return cls.from_mask(mask, block, block, seq_len)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, h, mq, mk = self.kv_indices.shape
        return b, h, mq, mk

    def mask(self) -> Tensor:
        """bool [B, H, Mq, Mk]; for tests and small inputs."""
        return block_mask_from_lists(self.kv_count, self.kv_indices)

    def causal_pairs(self) -> int:
        """Causally valid block pairs of one (batch, head)."""
        return int(causal_block_mask(self.seq_len, self.block_q, self.block_k).sum())

    def head_density(self) -> Tensor:
        """float [B, H]: kept / causally valid block pairs of each (batch, head)."""
        return self.kv_count.sum(-1).double() / self.causal_pairs()

    def density(self) -> float:
        """Kept / causally valid block pairs over the whole selection (forced blocks included)."""
        return float(self.head_density().mean())


@runtime_checkable
class Selector(Protocol):
    """A method: a small dataclass with a registered name and one calibration knob.

    `select(q, k)` takes q [B, Hq, N, D] and k [B, Hkv, N, D] (Hq a multiple of Hkv) and returns
    the kept key blocks per query head. `knob` names the field calibration moves; `knob_direction`
    is -1 when a larger knob keeps fewer blocks, +1 when it keeps more.
    """

    name: str
    knob: str
    knob_direction: int
    block_size: int
    is_dense: bool

    def select(self, q: Tensor, k: Tensor, scale: float | None = None) -> BlockSelection: ...


@dataclass(frozen=True)
class BlockSelector:
    """Fields every block selector shares: block size and the forced blocks (FlashPrefill's)."""

    block_size: int = 128
    sink_blocks: int = 2
    window_blocks: int = 4
    last_q_blocks: int = 2

    is_dense = False

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        for f in ("sink_blocks", "window_blocks", "last_q_blocks"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{f} must be an integer >= 0, got {v!r}")

    def fields(self) -> dict:
        return dataclasses.asdict(self)

    def with_knob(self, value: float) -> BlockSelector:
        return dataclasses.replace(self, **{self.knob: value})

    def _check(self, q: Tensor, k: Tensor) -> None:
        check_inputs(q, k)

    def _finish(self, keep: Tensor, n: int) -> BlockSelection:
        """keep bool [B, Hq, M, M] from the rule; add forced blocks and compact."""
        m = keep.shape[-1]
        forced = forced_mask(
            m, self.sink_blocks, self.window_blocks, self.last_q_blocks, keep.device
        )
        return BlockSelection.from_mask(keep | forced, self.block_size, self.block_size, n)


@dataclass(frozen=True)
class TopRatio(BlockSelector):
    """A block selector that keeps, per query block, the top `ratio` of its candidates by a block
    score (Quest's box bound, the oracle's true mass), plus the forced blocks; `impl` picks the
    PyTorch or the Triton code (`use_triton`). Knob: ratio, a fraction searched linearly."""

    ratio: float = 0.1
    impl: str = "auto"

    knob = "ratio"
    knob_direction = 1  # a larger ratio keeps more blocks
    knob_range = (0.0, 1.0)  # a fraction: calibration searches it linearly

    def __post_init__(self) -> None:
        super().__post_init__()
        r = self.ratio
        if not (isinstance(r, (int, float)) and math.isfinite(r) and 0 <= r <= 1):
            raise ValueError(f"ratio must be a number in [0, 1], got {r!r}")
        check_impl(self.impl)

    def _keep_top(self, scores: Tensor, n: int) -> BlockSelection:
        """The PyTorch path's end: the top `ratio` of each row's candidates by `scores`
        [B, Hq, M, M] (ties to the lower block id), then the forced blocks."""
        cand = candidate_mask(scores.shape[-1], scores.device)
        return self._finish(top_fraction(scores, cand, self.ratio), n)


def check_impl(impl: str) -> None:
    """Raise ValueError unless `impl` is one of IMPLS."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}; got {impl!r}")


def use_triton(impl: str, device: torch.device) -> bool:
    """Resolve impl for tensors on `device`: True for the Triton kernels, False for torch."""
    if impl == "torch":
        return False
    if impl == "auto":
        return device.type == "cuda" and triton_available()
    if device.type != "cuda" and not INTERPRET:
        raise ValueError(
            f"impl='triton' needs CUDA tensors (got {device.type}), or TRITON_INTERPRET=1 set "
            "before Python starts for Triton's CPU interpreter; use impl='auto' or 'torch'"
        )
    return True
