"""Run a kernel test file again under Triton's CPU interpreter, in a fresh Python.

TRITON_INTERPRET is read when triton decorates a kernel (at import), so a pytest process that
already imported triton cannot switch to the interpreter; a subprocess started with it set can.
"""

import os
import re
import subprocess
import sys
from pathlib import Path


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
