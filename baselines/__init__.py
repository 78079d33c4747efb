"""Baseline selectors, one file per method; each class here is registered by its `name`."""

SELECTORS: list[type] = []
