"""The method registry: every selector by name, built from its config fields.

`build(name, **fields)` is the one way the runner, calibration and tools obtain a method. A name is
registered only once its rule is implemented; unknown names and fields fail with the valid choices.

Selectors come from this package (dense and the RBS family), from `rbs_bench.baselines`, and from
any installed distribution that declares an entry point in the group `rbs_bench.methods`, e.g. in
its pyproject.toml:

    [project.entry-points."rbs_bench.methods"]
    mymethod = "my_package.my_method:MyMethod"

The entry point names a selector class (a frozen dataclass with `name`, `knob`, `knob_direction`,
`knob_range`, `block_size`, `is_dense`, `select`, `with_knob`, `fields` and a `MethodInfo` as
`info`; see docs/design.md §3). `conformance.check_selector` checks it when it loads (the
attributes, the knob range against the knob's own check, one `select` on a small input); a plugin
that fails to load or to pass is skipped with one line on stderr naming it and what to fix. Every
selection a plugin returns later is checked before it is used (`conformance.guard_selections`).
Everything else the harness shows about a method is read from the class through `info(name)`.
"""

from __future__ import annotations

import dataclasses

from rbs_bench.methods.dense import Dense
from rbs_bench.methods.info import FastPath, MethodInfo
from rbs_bench.methods.info import line_style as _line_style
from rbs_bench.methods.oracle import Oracle
from rbs_bench.methods.rbs import RBS, Centroid, FullL2
from rbs_bench.methods.selection import BlockSelection, Selector

_CORE = (Dense, RBS, Centroid, FullL2, Oracle)
ENTRY_POINT_GROUP = "rbs_bench.methods"
DENSE = Dense.name  # the reference of every table

__all__ = [
    "DENSE",
    "BlockSelection",
    "FastPath",
    "MethodInfo",
    "Selector",
    "UnknownMethodError",
    "available",
    "build",
    "display",
    "info",
    "line_style",
    "order_key",
    "plugin_names",
    "refresh",
    "registry",
]

_REGISTRY: dict[str, type] | None = None


class UnknownMethodError(ValueError):
    pass


def _plugins(taken: set[str]) -> list[type]:
    """The selector classes that installed distributions register under ENTRY_POINT_GROUP and
    that pass `conformance.check_selector`; a broken one is reported in one line and skipped."""
    from rbs_bench import plugins
    from rbs_bench.methods.conformance import check_selector, guard_selections

    found = plugins.load(ENTRY_POINT_GROUP, "method", check_selector, taken)
    for name, cls in found.items():  # every selection checked before it is used (one line)
        guard_selections(cls, f"method plugin {name!r} ({cls.__module__}.{cls.__qualname__})")
    return list(found.values())


def registry() -> dict[str, type]:
    """Every registered selector class by name: this package's, rbs_bench.baselines' and the
    entry points'. A plugin that fails to import or to pass the checks of
    `rbs_bench.methods.conformance` (one that takes a registered name included) is skipped with
    one line on stderr (rbs_bench.plugins), and every other method works as before.

    Built on first use: baselines import this package's submodules, so whichever side is imported
    first, the registry is complete by the time anything asks. `refresh()` rebuilds it (after a
    distribution was installed or put on sys.path in the same process).
    """
    global _REGISTRY
    if _REGISTRY is None:
        from rbs_bench.baselines import SELECTORS

        reg = {cls.name: cls for cls in (*_CORE, *SELECTORS)}
        for cls in _plugins(set(reg)):
            reg[cls.name] = cls
        _REGISTRY = reg
    return dict(_REGISTRY)


def plugin_names() -> list[str]:
    """The registered methods that come from entry points (in table order)."""
    from rbs_bench.baselines import SELECTORS

    shipped = {cls.name for cls in (*_CORE, *SELECTORS)}
    return in_order(n for n in registry() if n not in shipped)


def refresh() -> None:
    """Forget the registry, so that the next look-up reads the entry points again."""
    global _REGISTRY
    _REGISTRY = None


def available() -> list[str]:
    return sorted(registry())


def method_class(name: str) -> type:
    try:
        return registry()[name]
    except KeyError:
        raise UnknownMethodError(
            f"unknown method {name!r}; valid methods: {', '.join(available())}"
        ) from None


def info(name: str) -> MethodInfo:
    """The metadata of method `name`; a name no installed selector has (e.g. in old records)
    gets its own name as display name and sorts after every known method."""
    cls = registry().get(name)
    got = getattr(cls, "info", None)
    return got if isinstance(got, MethodInfo) else MethodInfo(display=name)


def display(name: str) -> str:
    return info(name).display


def line_style(name: str) -> dict:
    """matplotlib keyword arguments of method `name`'s line in every figure: label (display name),
    colour (declared, else stable per name), marker, and the headline method emphasised."""
    return _line_style(name, info(name))


def order_key(name: str) -> tuple:
    """Sort key of a method in tables and figures: its `info.order`, then its name."""
    return (info(name).order, name)


def in_order(names) -> list[str]:
    return sorted(names, key=order_key)


def headline() -> str:
    """The method under study (the one whose `info.headline` is set): tool options' default."""
    return next(n for n in in_order(registry()) if info(n).headline)


def compared(with_dense: bool = False) -> list[str]:
    """The default method list of the comparison studies, in table order."""
    return [n for n in in_order(registry()) if info(n).compare and (with_dense or n != DENSE)]


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
