"""rbs-bench: a benchmark harness for sparse long-context prefill attention.

Imports point one way: each layer below imports only from the layers above it, and the modules of
one layer import each other without a cycle (the pipelines not at all). tests/test_import_cycles.py
checks both on every module, function-level imports included.

    errors, paths                the one error type for bad input and its one-line report; the
                                 layout of a results directory: the standard library only
    plugins                      entry points of installed distributions: loaded, checked, a
                                   broken one skipped with one line
    kernels                      Triton kernels and their PyTorch references: torch and Triton only
    methods, baselines           the selection API, the selectors, the registry (methods.build),
                                 which finds the baselines and entry-point plugins
    budget, execution            the one knob search; running a selection with an executor
    synthetic, benchmarks        synthetic Q/K; benchmark prompts and scorers (their registry)
    config                       config schemas, composed-config explanations, grid expansion
    records, report, loggers     run records on disk, their summaries, wandb
    models                       model loading, the attention hook, memory estimates
    tinylm                       the embedded model's training mixture, trainer and weights
    calibrations                 the calibration store: knobs per model, method, target, setting
    session                      device, method with its budget, model and samples, cell paths
    checks                       every check that runs before a model loads; preflight
    tables, scale                tables and reports from records and CSVs, never a model
    runner, calibrate,           the pipelines; none imports another
      observations, bench, serving
    figures                      the paper's figures, from records (observations' panels too)
    __main__, slurm, parallel    the command line: a grid of cells, SLURM arrays, cells as
                                   concurrent processes
"""

import sys as _sys

__version__ = "0.1.0"

# `python -m rbs_bench...` imports this package while it locates the command, with sys.argv[0]
# set to "-m" (the interpreter's documented behaviour): every command then ends on SIGINT or
# SIGTERM with one line and exit status 130 / 143 (errors.stop_on_signals), its own main or not.
if _sys.argv[:1] == ["-m"]:
    from rbs_bench.errors import stop_on_signals as _stop_on_signals

    _stop_on_signals()
