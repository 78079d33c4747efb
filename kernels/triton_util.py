"""The Triton plumbing every kernel module shares: the optional import (the PyTorch references
need torch only), the interpreter flag (TRITON_INTERPRET=1 runs the kernels on CPU tensors), and
the one-line launch check."""

from __future__ import annotations

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
