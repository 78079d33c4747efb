"""The Triton plumbing every kernel module shares: the optional import (the PyTorch references
need torch only), the interpreter flag (TRITON_INTERPRET=1 runs the kernels on CPU tensors), the
one-line launch check, and the architecture whose tuned configurations a launch uses
(`kernel_arch`, RBS_KERNEL_ARCH)."""

from __future__ import annotations

import contextlib
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
    """`triton.autotune`, whose choices persist on disk (`ChoiceStore`) where
    RBS_BENCH_AUTOTUNE_CACHE=1 (when the tuned kernel is first launched): a new process then
    launches the configuration tuned before for the same kernel, key and GPU instead of timing
    every configuration again. `rbs_bench.parallel` sets it for its cells, which would otherwise
    each time the space while the other cells load the GPU; the speed benches leave it unset, so
    each tunes in its own process on the GPU it times. Triton's own `cache_results` cannot keep
    configurations with a pre-hook (the TMA entries set their descriptors' block shapes in one)."""
    if os.environ.get(AUTOTUNE_CACHE_ENV, "0").strip() != "1" or INTERPRET or len(configs) < 2:
        return triton.autotune(configs=configs, key=key)
    store = ChoiceStore(configs, key)
    decorate = triton.autotune(
        configs=configs, key=key, prune_configs_by={"early_config_prune": store.prune}
    )

    def wrap(fn):
        tuner = decorate(fn)
        store.attach(tuner)
        return tuner

    return wrap


class ChoiceStore:
    """The autotuner's best configuration per key, one small JSON file each under Triton's cache
    directory (`rbs_bench_autotune/`), named by a digest of the Triton version, the kernel's
    source key, the GPU's name, the key's values and the configurations. `prune` (the tuner's
    early pruning, called only for a key this process has not tuned) narrows the space to the
    stored choice; after a launch that tuned, `_run` stores the tuner's choice (written whole by
    a rename, so concurrent processes never read half a file)."""

    def __init__(self, configs: list, key: list):
        self.configs, self.key = list(configs), list(key)
        self.tuner = None
        self.pending: tuple | None = None  # (the tuner's key, file) of a key being timed

    def attach(self, tuner) -> None:
        self.tuner = tuner
        run = tuner.run

        def _run(*args, **kwargs):
            out = run(*args, **kwargs)
            if self.pending is not None:
                tuned, path = self.pending
                self.pending = None
                best = tuner.cache.get(tuned)
                if best is not None and best in self.configs:
                    _write_json(path, {"index": self.configs.index(best), "config": str(best)})
            return out

        tuner.run = _run

    def _tuner_key(self, named_args: dict, kwargs: dict) -> tuple:
        """The tuner's own cache key: the key arguments' values, then every tensor's dtype."""
        args = {k: v for k, v in {**named_args, **kwargs}.items() if k in self.tuner.arg_names}
        values = [args[k] for k in self.key if k in args]
        return tuple(values + [str(v.dtype) for v in args.values() if hasattr(v, "dtype")])

    def _path(self, tuned: tuple, named_args: dict):
        import hashlib
        from pathlib import Path

        import torch

        fn = self.tuner.fn
        while not hasattr(fn, "cache_key") and hasattr(fn, "fn"):
            fn = fn.fn
        on = [v.device for v in named_args.values() if isinstance(v, torch.Tensor)]
        gpu = torch.cuda.get_device_name(on[0]) if on and on[0].type == "cuda" else ""
        parts = [triton.__version__, str(getattr(fn, "cache_key", fn)), gpu, str(tuned)]
        digest = hashlib.sha256("|".join(parts + [str(c) for c in self.configs]).encode())
        knobs = getattr(triton, "knobs", None)
        root = (
            knobs.cache.dir
            if knobs is not None
            else os.environ.get(
                "TRITON_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".triton", "cache")
            )
        )
        name = getattr(fn, "__name__", "kernel")[:80]
        return Path(root) / "rbs_bench_autotune" / f"{name}-{digest.hexdigest()[:32]}.json"

    def prune(self, configs: list, named_args: dict, **kwargs) -> list:
        tuned = self._tuner_key(named_args, kwargs)
        path = self._path(tuned, named_args)
        stored = _read_json(path)
        if stored is not None:
            index = stored.get("index")
            if isinstance(index, int) and 0 <= index < len(self.configs):
                choice = self.configs[index]
                if str(choice) == stored.get("config") and choice in configs:
                    return [choice]
        self.pending = (tuned, path)
        return configs


def _read_json(path) -> dict | None:
    import json

    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path, data: dict) -> None:
    """Write `data` whole (a temporary file renamed over the target); a failure to write (a
    read-only cache, a full disk) only loses the stored choice, and leaves no temporary file."""
    import json
    import tempfile

    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            tmp = f.name
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)


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
