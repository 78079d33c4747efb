"""The Triton plumbing every kernel module shares: the optional import (the PyTorch references
need torch only), the interpreter flag (TRITON_INTERPRET=1 runs the kernels on CPU tensors), the
one-line launch check, and the architecture whose tuned configurations a launch uses
(`kernel_arch`, RBS_KERNEL_ARCH)."""

from __future__ import annotations

import functools
import os

from torch import Tensor

try:  # Triton is optional: the references need torch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised in a subprocess by the tests
    triton = tl = None


# Triton picks compiled or interpreted code when it decorates a function, its own library
# (tl.sum, tl.cumsum) included, so TRITON_INTERPRET=1 counts only if set before triton is imported.
def _interpret_flag() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


INTERPRET = triton is not None and _interpret_flag()
jit = triton.jit if triton is not None else (lambda fn: fn)


def triton_available() -> bool:
    return triton is not None


def check_triton_launch(what: str, *tensors: Tensor | None) -> None:
    """Raise a one-line error unless the Triton kernel `what` can run on these tensors."""
    if triton is None:
        raise RuntimeError(f"{what} needs Triton, which is not installed; use {what}_ref")
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        names = sorted(map(str, devices))
        raise ValueError(f"{what}: all inputs must be on one device; got {names}")
    device = devices.pop()
    if device.type != "cuda" and not INTERPRET:
        raise ValueError(
            f"{what} needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported "
            f"for CPU tensors; got {device.type} tensors"
        )


# The kernels' tuned configurations per GPU architecture; see `kernel_arch`.
ARCH_ENV = "RBS_KERNEL_ARCH"
_ARCHS = {"sm80": 80, "sm86": 86, "sm89": 89, "sm90": 90}


@functools.cache
def _capability(index: int) -> int:
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def kernel_arch(device=None) -> int:
    """The architecture whose tuned configurations a kernel launches with, as 10 * major + minor
    of the compute capability: 90 on an H100 or H200 (TMA descriptors, Hopper-tuned tiles), 80 on
    an A100 (pointer loads, Ampere-tuned tiles), 0 for CPU tensors (the interpreter).

    RBS_KERNEL_ARCH=sm80 (or sm86, sm89) makes a newer GPU use that older architecture's
    configurations, so that they can be checked and timed on an H100; it cannot ask for a newer
    architecture than the GPU's. Unset or `auto`: the GPU's own.
    """
    import torch

    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        return 0
    if device is None and not torch.cuda.is_available():
        return 0
    index = device.index if device is not None and device.index is not None else None
    own = _capability(torch.cuda.current_device() if index is None else index)
    wanted = os.environ.get(ARCH_ENV, "auto").strip().lower()
    if wanted in ("", "auto"):
        return own
    if wanted not in _ARCHS:
        raise ValueError(
            f"{ARCH_ENV}={wanted!r} is not one of auto, {', '.join(_ARCHS)}; unset it to use the "
            f"GPU's own configurations"
        )
    if _ARCHS[wanted] > own:
        raise ValueError(
            f"{ARCH_ENV}={wanted} asks for a newer architecture than this GPU's (capability "
            f"{own // 10}.{own % 10}); it can only choose an older one (e.g. sm80), or unset it"
        )
    return _ARCHS[wanted]


AUTOTUNE_ENV = "RBS_BENCH_AUTOTUNE"
AUTOTUNE_CACHE_ENV = "RBS_BENCH_AUTOTUNE_CACHE"


def autotune(configs: list, key: list):
    """`triton.autotune` that keeps its choices on disk (Triton's cache directory) where this
    Triton can, so a new process (each cell of `rbs_bench.parallel`) reads the tuned configuration
    of a kernel and key instead of timing every configuration again, while other GPU processes
    disturb the timings. Triton keys the file on the kernel's source, the device's backend, the
    key's values and the configurations. RBS_BENCH_AUTOTUNE_CACHE=0 times them in every process."""
    import inspect

    kwargs = {}
    wanted = os.environ.get(AUTOTUNE_CACHE_ENV, "1").strip()
    if wanted != "0" and "cache_results" in inspect.signature(triton.autotune).parameters:
        kwargs["cache_results"] = True
    return triton.autotune(configs=configs, key=key, **kwargs)


def autotune_space(space: tuple) -> tuple:
    """The configurations an autotuner times: the whole `space`, or its first entry alone when
    RBS_BENCH_AUTOTUNE=first. With one entry the autotuner launches without timing, so every new
    shape costs one compilation instead of one per entry (the GPU tests set it; they check the
    kernels' values, and the tuning benches time the whole space). Unset or `full`: the space."""
    wanted = os.environ.get(AUTOTUNE_ENV, "full").strip().lower()
    if wanted in ("", "full"):
        return space
    if wanted == "first":
        return space[:1]
    raise ValueError(f"{AUTOTUNE_ENV}={wanted!r} is not one of full, first; unset it to autotune")
