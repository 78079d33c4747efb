"""Baseline selectors, one file per method."""
