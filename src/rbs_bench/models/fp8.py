"""Block-FP8 checkpoints through transformers' FP8 integration, without the hub kernel.

transformers 5.x loads a checkpoint whose config says `quant_method: fp8` into FP8Linear and
FP8Experts layers, and runs every one of them through the three entry points of the hub kernel
`kernels-community/finegrained-fp8` (`matmul`, `batched_matmul`, `grouped_matmul`), which
`load_finegrained_fp8_kernel` fetches on first use into the module global
`transformers.integrations.finegrained_fp8._FINEGRAINED_FP8`. On a node without network access or
without the `kernels` package that fetch fails and the first FP8 layer raises. `install` puts this
harness's Triton kernels (`rbs_bench.kernels.fp8_gemm`) into that global instead, with the hub
kernel's call signatures, where the hub kernel cannot be loaded; it is idempotent, and a no-op on
a CPU and on GPUs older than capability 8.9, where transformers dequantises FP8 weights to bf16
at load time. transformers' DeepGEMM path is then switched off for linear layers
(TRANSFORMERS_DISABLE_DEEPGEMM_LINEAR=1, unless set): it needs the hub too; its experts path runs
only when asked for (`experts_implementation="deepgemm"`).

`rbs_bench.models.load` calls `prepare(config, device)` before `from_pretrained`.

`fuse_linears` makes FP8 layers that read the same input (an attention module's q, k and v) one
product, as serving engines do: the input is quantised once instead of once per layer, and one
GEMM of N = N_q + N_k + N_v replaces three (the k and v products alone are too small to fill an
H100). The compiled layers (`rbs_bench.models.fastpath`) take it.
"""

from __future__ import annotations

import dataclasses
import os
import sys

__all__ = [
    "FusedLinears",
    "QuantisedRows",
    "entry_points",
    "fuse_linears",
    "install",
    "is_fp8",
    "prepare",
    "producers_enabled",
    "quantised_linear",
]

ENTRY_POINTS = ("matmul", "batched_matmul", "grouped_matmul")
_REQUIRED = ("_FINEGRAINED_FP8", "FineGrainedFP8", "load_finegrained_fp8_kernel")


def is_fp8(config) -> bool:
    """True when a model config carries a block-FP8 quantisation config (quant_method fp8), on
    itself or on its text config."""
    for cfg in (config, getattr(config, "text_config", None)):
        qc = getattr(cfg, "quantization_config", None)
        if qc is None:
            continue
        method = (
            qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        )
        if str(getattr(method, "value", method)).lower() == "fp8":
            return True
    return False


def _weights(weight_scale_inv, weight):
    import torch

    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"rbs_bench's FP8 kernels take float8_e4m3fn weights; got {weight.dtype} (FP4-packed "
            "weights need transformers' hub kernel)"
        )
    if weight_scale_inv.dtype != torch.float32:  # ue8m0 scales: powers of two, exact in fp32
        weight_scale_inv = weight_scale_inv.float()
    return weight_scale_inv


def _blocks(block_size):
    return None if block_size is None else (int(block_size[0]), int(block_size[1]))


def entry_points(backend: str = "triton") -> dict:
    """{matmul, batched_matmul, grouped_matmul} with the hub kernel's signatures, computed by the
    Triton kernels ("triton") or their PyTorch references ("reference", for tests on a CPU)."""
    from rbs_bench.kernels import fp8_gemm as k

    if backend not in ("triton", "reference"):
        raise ValueError(f"backend must be triton or reference; got {backend!r}")
    ref = backend == "reference"
    linear = k.fp8_linear_ref if ref else k.fp8_linear
    grouped = k.fp8_grouped_linear_ref if ref else k.fp8_grouped_linear
    batched = k.fp8_batched_linear_ref if ref else k.fp8_batched_linear

    def matmul(
        input, weight, weight_scale_inv, block_size=None, output_dtype=None, activation_scale=None
    ):
        """input [..., K] @ the FP8 weight [N, K] -> [..., N] in output_dtype (input's)."""
        scales = _weights(weight_scale_inv, weight)
        return linear(input, weight, scales, _blocks(block_size), activation_scale, output_dtype)

    def batched_matmul(input, weight, weight_scale_inv, block_size=None, expert_ids=None):
        """input [S, K], one expert id per row -> [S, N]; rows of no local expert are zeros."""
        scales = _weights(weight_scale_inv, weight)
        return batched(input, weight, scales, expert_ids, _blocks(block_size))

    def grouped_matmul(
        input, weight, weight_scale_inv, offsets=None, tokens_per_expert=None, block_size=None
    ):
        """input [S, K] sorted by expert, offsets [E] cumulative row ends -> [S, N] (the counts
        are read from offsets; tokens_per_expert is accepted and not needed)."""
        scales = _weights(weight_scale_inv, weight)
        return grouped(input, weight, scales, offsets, _blocks(block_size))

    matmul.rbs_backend = backend  # what `FusedLinears` runs its quantised products on
    return {"matmul": matmul, "batched_matmul": batched_matmul, "grouped_matmul": grouped_matmul}


def _fp8_gpus(device) -> bool:
    """True when `device` (or, for None or device_map=auto, every visible GPU) has fp8 tensor
    cores (capability 8.9 or newer)."""
    import torch

    if device is not None and torch.device(device).type != "cuda":
        return False
    if not torch.cuda.is_available():
        return False
    dev = torch.device(device) if device is not None else None
    indices = [dev.index] if dev is not None and dev.index is not None else None
    indices = indices or range(torch.cuda.device_count())
    return all(torch.cuda.get_device_capability(i) >= (8, 9) for i in indices)


def _hub_loadable(fg) -> bool:
    """Try transformers' own loader once; False (and nothing installed) when it fails."""
    try:
        from transformers.utils.import_utils import is_kernels_available

        if not is_kernels_available():
            return False
        fg.load_finegrained_fp8_kernel()
    except Exception:  # no network, no build for this torch/CUDA, missing symbols
        return False
    return fg._FINEGRAINED_FP8 is not None


# What `install`'s one line says each backend's entry points run
_RUNS = {
    "triton": "kernels (rbs_bench.kernels.fp8_gemm: cuBLAS's block-scaled products where the GPU "
    "and the shape take them, Triton otherwise)",
    "reference": "PyTorch references (rbs_bench.kernels.fp8_gemm's *_ref)",
}


def install(device=None, force: bool = False, backend: str = "triton") -> str:
    """Make transformers' FP8 layers runnable here; returns what they will run:

    "hub"        transformers' own hub kernel loads (nothing installed);
    "rbs_bench"  this harness's kernels are installed (now or by an earlier call);
    "none"       a CPU or a GPU older than capability 8.9: transformers dequantises at load;
    "unknown"    the installed transformers has no FP8 integration of the shape known here
                 (one line on stderr says so; its FP8 layers run as that version decides).

    force: install even on a CPU and without trying the hub (tests; `backend` "reference" runs
    the PyTorch references there).
    """
    if not force and not _fp8_gpus(device):
        return "none"
    try:
        from transformers import __version__
        from transformers.integrations import finegrained_fp8 as fg
    except ImportError:
        fg, __version__ = None, "?"
    fields = {f.name for f in dataclasses.fields(fg.FineGrainedFP8)} if _known(fg) else set()
    if not set(ENTRY_POINTS) <= fields:
        print(
            f"rbs-bench: transformers {__version__} has no FP8 integration of the shape rbs_bench "
            f"knows (transformers.integrations.finegrained_fp8 with {', '.join(_REQUIRED)} and "
            f"entry points {', '.join(ENTRY_POINTS)}); its FP8 layers run as it decides",
            file=sys.stderr,
        )
        return "unknown"
    current = fg._FINEGRAINED_FP8
    if current is not None:
        return "rbs_bench" if getattr(current.matmul, "__module__", "") == __name__ else "hub"
    if not force and _hub_loadable(fg):
        return "hub"
    fg._FINEGRAINED_FP8 = fg.FineGrainedFP8(**entry_points(backend))
    os.environ.setdefault("TRANSFORMERS_DISABLE_DEEPGEMM_LINEAR", "1")
    print(
        f"rbs-bench: FP8 layers run rbs_bench's {_RUNS[backend]}: transformers' hub kernel "
        "kernels-community/finegrained-fp8 is not loadable here",
        file=sys.stderr,
    )
    return "rbs_bench"


@dataclasses.dataclass(frozen=True)
class QuantisedRows:
    """Activations quantised by their producer for a block-FP8 product: `values` e4m3 [M, K],
    `scales` fp32 [K / 128, M] group-major (`kernels.fp8_gemm.fp8_act_quant`'s layout)."""

    values: object
    scales: object


@dataclasses.dataclass(frozen=True)
class FusedLinears:
    """FP8 layers of one input as one product: `weight` [sum N_i, K] e4m3 holds the layers'
    weights as row blocks (each layer's own weight and scales are now views of it and of `scale`),
    `sizes` their N_i. Called on x [..., K], it returns [..., sum N_i] through the installed
    entry point's `matmul`, the function each layer would call on its own rows of the weight.
    `backend` ("triton" or "reference", the installed entry points'; None for other entry points
    of this module, as tests install) computes `quantised` and `normalised`, the products whose
    input its producer quantised."""

    weight: object
    scale: object
    block_size: tuple[int, int]
    sizes: tuple[int, ...]
    backend: str | None = "triton"

    def __call__(self, x):
        from transformers.integrations import finegrained_fp8 as fg

        return fg._FINEGRAINED_FP8.matmul(x, self.weight, self.scale, self.block_size)

    def quantised(self, rows: QuantisedRows, dtype):
        """The product of rows quantised already -> [M, sum N_i] in `dtype`."""
        from rbs_bench.kernels import fp8_gemm as k

        fn = k.fp8_linear_quantised_ref if self.backend == "reference" else k.fp8_linear_quantised
        return fn(rows.values, rows.scales, self.weight, self.scale, self.block_size, dtype)

    def normalised(self, x, norm_weight, eps: float):
        """The product of RMSNorm(x) (`kernels.fp8_norm.rmsnorm_ref`), the norm writing its rows
        quantised (`rmsnorm_quant`): x [..., K] -> [..., sum N_i] in x's dtype."""
        from rbs_bench.kernels import fp8_norm

        x2 = x.reshape(-1, x.shape[-1])
        fn = fp8_norm.rmsnorm_quant_ref if self.backend == "reference" else fp8_norm.rmsnorm_quant
        y = self.quantised(QuantisedRows(*fn(x2, norm_weight, eps)), x.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def _fusable(layers) -> bool:
    import torch

    first = layers[0]
    block = getattr(first, "block_size", None)
    if block is None:
        return False
    block = _blocks(block)
    return all(
        type(m) is type(first)
        and getattr(m, "weight", None) is not None
        and m.weight.dtype == torch.float8_e4m3fn
        and m.weight.dim() == 2
        and getattr(m, "weight_scale_inv", None) is not None
        and m.weight_scale_inv.dtype == first.weight_scale_inv.dtype
        and getattr(m, "bias", None) is None
        and getattr(m, "activation_scale", None) is None
        and getattr(m, "_hf_hook", None) is None  # an offloading hook loads the weight per call
        and _blocks(getattr(m, "block_size", None)) == block
        and m.weight.shape[1] == first.weight.shape[1]
        and m.weight.shape[0] % block[0] == 0
        and m.weight.device == first.weight.device
        for m in layers
    )


def fuse_linears(layers) -> FusedLinears | None:
    """One `FusedLinears` for FP8Linear `layers` that read the same input, or None where they
    cannot be one product: this harness's entry points are not the installed ones (the hub
    kernel keeps its own dispatch), the layers differ in type, block size, K, device or scale
    dtype, have a bias or a static activation scale, or an N that is not a multiple of the weight
    block. Block-wise numerics are unchanged: each output column sums the same quantised
    products. RBS_BENCH_FP8_QKV=0 keeps the layers apart."""
    import torch

    try:
        from transformers.integrations import finegrained_fp8 as fg
    except ImportError:
        return None
    if os.environ.get("RBS_BENCH_FP8_QKV", "1") == "0" or len(layers) < 2:
        return None
    current = getattr(fg, "_FINEGRAINED_FP8", None)
    if current is None or getattr(current.matmul, "__module__", "") != __name__:
        return None  # the hub kernel keeps its own dispatch
    if not _fusable(layers):
        return None
    backend = getattr(current.matmul, "rbs_backend", None)
    block = _blocks(layers[0].block_size)
    with torch.no_grad():
        weight = torch.cat([m.weight for m in layers])
        scale = torch.cat([m.weight_scale_inv for m in layers])
        row = 0
        for m in layers:  # the layers' own tensors become views: no second copy of the weights
            n = m.weight.shape[0]
            m.weight.data = weight[row : row + n]
            m.weight_scale_inv.data = scale[row // block[0] : (row + n) // block[0]]
            row += n
    sizes = tuple(m.weight.shape[0] for m in layers)
    return FusedLinears(weight, scale, block, sizes, backend)


def producers_enabled() -> bool:
    """Whether FP8 layers take inputs their producers quantised (the input norm, the sparse
    attention; `models.fastpath`); RBS_BENCH_FP8_PRODUCERS=0 keeps each layer quantising its
    own input."""
    return os.environ.get("RBS_BENCH_FP8_PRODUCERS", "1") != "0"


def quantised_linear(layer) -> FusedLinears | None:
    """One FP8Linear layer as a `FusedLinears` of itself (its own weight and scales, nothing
    copied), for a producer that quantises its input (the attention kernel's epilogue for the
    output projection); None where `fuse_linears` would refuse it. RBS_BENCH_FP8_PRODUCERS=0
    keeps every FP8 layer quantising its own input."""
    try:
        from transformers.integrations import finegrained_fp8 as fg
    except ImportError:
        return None
    if not producers_enabled():
        return None
    current = getattr(fg, "_FINEGRAINED_FP8", None)
    backend = getattr(getattr(current, "matmul", None), "rbs_backend", None)
    if backend is None or not _fusable([layer]):
        return None
    block = _blocks(layer.block_size)
    n = layer.weight.shape[0]
    return FusedLinears(layer.weight, layer.weight_scale_inv, block, (n,), backend)


def _known(fg) -> bool:
    return fg is not None and all(hasattr(fg, name) for name in _REQUIRED)


def prepare(config, device=None) -> str | None:
    """The call `rbs_bench.models.load` makes before `from_pretrained`: `install` for a block-FP8
    config, None for any other."""
    return install(device) if is_fp8(config) else None
