"""rbs-bench: a benchmark harness for sparse long-context prefill attention."""

__version__ = "0.1.0"
