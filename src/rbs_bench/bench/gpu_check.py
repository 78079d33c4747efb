"""One call for a GPU machine: the `gpu`-marked tests, then the attention benchmark.

    python -m rbs_bench.bench.gpu_check [--out results/speed] [benchmark arguments ...]

Exits non-zero if the tests fail; the benchmark still runs so one lease yields both.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rbs_bench.bench import attention

ROOT = Path(__file__).resolve().parents[3]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    tests = ROOT / "tests"
    if tests.is_dir():
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "gpu", str(tests)])
    else:  # an installed copy without the source tree
        print(f"no tests/ beside {ROOT}; skipping the gpu tests", file=sys.stderr)
        rc = 0
    bench_rc = attention.main(argv)
    return rc or bench_rc


if __name__ == "__main__":
    sys.exit(main())
