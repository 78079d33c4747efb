"""One call for a GPU machine: the `gpu`-marked tests, the fast-path check, then the attention
benchmark.

    python -m rbs_bench.bench.gpu_check [--out results/speed] [benchmark arguments ...]

The fast-path check (`rbs_bench.bench.fast_paths`, defaults, same --out) validates and times the
Triton selectors / executor of flexprefill and minference against their PyTorch / Flex paths.
Exits non-zero if the tests or the check fail; the rest still runs so one lease yields all.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rbs_bench.bench import attention, fast_paths

ROOT = Path(__file__).resolve().parents[3]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    tests = ROOT / "tests"
    if tests.is_dir():
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "gpu", str(tests)])
    else:  # an installed copy without the source tree
        print(f"no tests/ beside {ROOT}; skipping the gpu tests", file=sys.stderr)
        rc = 0
    out = argv[argv.index("--out") + 1 : argv.index("--out") + 2] if "--out" in argv else []
    try:
        fast_rc = fast_paths.main(["--out", *out] if out else [])
    except Exception as e:  # the benchmark still runs
        print(f"fast-path check failed: {type(e).__name__}: {e}", file=sys.stderr)
        fast_rc = 1
    bench_rc = attention.main(argv)
    return rc or fast_rc or bench_rc


if __name__ == "__main__":
    sys.exit(main())
