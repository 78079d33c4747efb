"""Hydra configuration tree of rbs_bench (groups mirror the code)."""
