"""Benchmarks that time attention, TTFT and memory on a GPU."""
