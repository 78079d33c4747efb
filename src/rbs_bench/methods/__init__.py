"""The method registry: every selector by name, built from its config fields.

`build(name, **fields)` is the one way the runner, calibration and tools obtain a method. A name is
registered only once its rule is implemented; unknown names and fields fail with the valid choices.
"""

from __future__ import annotations

import dataclasses

from rbs_bench.methods.dense import Dense
from rbs_bench.methods.rbs import RBS, Centroid, FullL2
from rbs_bench.methods.selection import BlockSelection, Selector

_CORE = (Dense, RBS, Centroid, FullL2)

__all__ = ["BlockSelection", "Selector", "UnknownMethodError", "available", "build", "registry"]


class UnknownMethodError(ValueError):
    pass


def registry() -> dict[str, type]:
    """Every registered selector class by name: the RBS family, dense, and rbs_bench.baselines.

    Built on call: baselines import this package's submodules, so whichever side is imported
    first, the registry is complete by the time anything asks.
    """
    from rbs_bench.baselines import SELECTORS

    return {cls.name: cls for cls in (*_CORE, *SELECTORS)}


def available() -> list[str]:
    return sorted(registry())


def method_class(name: str) -> type:
    try:
        return registry()[name]
    except KeyError:
        raise UnknownMethodError(
            f"unknown method {name!r}; valid methods: {', '.join(available())}"
        ) from None


def field_names(name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(method_class(name))]


def build(name: str, **fields) -> Selector:
    """The selector registered as `name`, with its dataclass fields overridden by `fields`."""
    valid = field_names(name)
    unknown = sorted(set(fields) - set(valid))
    if unknown:
        raise ValueError(
            f"method {name!r} has no field {', '.join(map(repr, unknown))}; "
            f"valid fields: {', '.join(valid)}"
        )
    return method_class(name)(**fields)
