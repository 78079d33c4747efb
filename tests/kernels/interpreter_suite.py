"""What the kernel test files share: `check` (with its skip mark `fresh`), which runs a test
file again under Triton's CPU interpreter in a fresh Python; the device their kernel tests run
on; the kv-list checks; the mass kernels' random q and k (`qk`).

TRITON_INTERPRET is read when triton decorates a kernel (at import), so a pytest process that
already imported triton cannot switch to the interpreter; a subprocess started with it set can.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rbs_bench.kernels.triton_util import INTERPRET, triton_available

CUDA = torch.cuda.is_available()
# where kernel tests run: CUDA, or the CPU under TRITON_INTERPRET=1 (set before import), else skip
DEVICE = "cuda" if CUDA and not INTERPRET else ("cpu" if INTERPRET else None)
kernel_test = pytest.mark.skipif(
    DEVICE is None or not triton_available(),
    reason="needs CUDA, or TRITON_INTERPRET=1 before import (test_interpreter_suite runs these)",
)


def qk(hq, hkv, n, d, seed=0, device="cpu", dtype=torch.float32, b=1):
    """Random q [b, hq, n, d] and k [b, hkv, n, d] where a few keys draw most of the mass (the
    inputs of the mass kernels' tests)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g) * 1.5
    k = torch.randn(b, hkv, n, d, generator=g)
    k[:, :, :: max(1, n // 5)] *= 4
    return q.to(device, dtype), k.to(device, dtype)


def lists_to_mask(count, idx):
    m = idx.shape[-1]
    live = torch.arange(m, device=idx.device) < count[..., None].long()
    out = torch.zeros(*idx.shape[:-1], m + 1, dtype=torch.bool, device=idx.device)
    return out.scatter_(-1, torch.where(live, idx.long(), m), True)[..., :m]


def check_layout(count, idx):
    """int32 lists; ids ascending and causal (<= i) up to the count, zeros past it."""
    assert count.dtype == idx.dtype == torch.int32
    m = idx.shape[-1]
    slots = torch.arange(m, device=idx.device)
    live = slots < count[..., None]
    assert bool((idx[~live] == 0).all()), "padding past the count must be 0"
    assert bool(((idx[..., 1:] > idx[..., :-1]) | ~live[..., 1:]).all()), "ids not ascending"
    assert bool(((idx <= slots[:, None]) | ~live).all()), "a kept block lies above the diagonal"


# the test that runs a file's kernel tests under the interpreter: only where they did not run here
fresh = pytest.mark.skipif(
    INTERPRET or CUDA or not triton_available(), reason="kernel tests already run in this process"
)


def check(test_file: str, *select: str, at_least: int, timeout: int = 900) -> None:
    """`run` the selected tests of `test_file` under the interpreter: all pass, and at least
    `at_least` of them (a selection that stopped matching fails rather than passes empty)."""
    rc, tail, passed = run(test_file, *select, timeout=timeout)
    assert rc == 0, tail
    assert passed >= at_least, tail


def run(test_file: str, *select: str, timeout: int = 900) -> tuple[int, str, int]:
    """(exit code, last 30 lines of output, tests passed) of `pytest test_file *select`."""
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *select]
    res = subprocess.run(
        [*cmd, str(Path(test_file).resolve())],
        cwd=root,
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    tail = "\n".join(res.stdout.strip().splitlines()[-30:])
    passed = re.search(r"(\d+) passed", tail)
    return res.returncode, tail, int(passed.group(1)) if passed else 0
