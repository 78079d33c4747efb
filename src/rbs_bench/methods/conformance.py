"""What a selector class must have before the registry takes it (docs/design.md §3).

`check_selector(name, cls)` runs when a plugin's class loads (rbs_bench.methods reads the entry
points through rbs_bench.plugins) and, in the tests, on every shipped selector: the required class
attributes, the knob range against the knob field's own check (`with_knob` at both ends), and one
`select` on a small input whose result must have one row per query head. Each failure is one
`PluginError` line that says what to change.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from rbs_bench.errors import first_line
from rbs_bench.methods.info import MethodInfo
from rbs_bench.plugins import PluginError

# The small input of the check: 4 query heads reading 2 KV heads, three blocks and a partial one.
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
REQUIRED = ("name", "knob", "knob_direction", "is_dense", "info")
HOW = {
    "name": "name = '<the entry point's name>'",
    "knob": "knob = '<the name with_knob sets>' (None for a dense method)",
    "knob_direction": "knob_direction = 1 (a larger knob keeps more blocks) or -1",
    "knob_range": "knob_range = (lo, hi), where calibration searches the knob (lo = 0: linearly)",
    "is_dense": "is_dense = False",
    "info": "info = MethodInfo(display=...) (rbs_bench.methods.MethodInfo)",
}


def _need(cls, attr: str) -> None:
    if not hasattr(cls, attr):
        raise PluginError(f"lacks {attr}; add the class attribute {HOW[attr]}")


def check_selector(name: str, cls) -> None:
    """Raise PluginError (one line: what to change) unless `cls` is a usable selector `name`."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise PluginError(
            f"{getattr(cls, '__name__', cls)!r} is not a dataclass; make the selector a "
            "@dataclasses.dataclass(frozen=True) whose fields are its config"
        )
    for attr in REQUIRED:
        _need(cls, attr)
    if cls.name != name:
        raise PluginError(
            f"its class attribute name is {cls.name!r}; set name = {name!r} (the entry point's)"
        )
    if not isinstance(cls.info, MethodInfo):
        raise PluginError(f"info is a {type(cls.info).__name__}; set {HOW['info']}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    missing = [f for f, spec in fields.items() if _no_default(spec)]
    if missing:
        raise PluginError(
            f"field {missing[0]!r} has no default; give every field a default (the method's "
            "config is built from them)"
        )
    for meth in ("select", "fields") + (() if cls.knob is None else ("with_knob",)):
        if not callable(getattr(cls, meth, None)):
            raise PluginError(f"lacks the method {meth}(); see rbs_bench.methods.Selector")
    try:
        sel = cls()
    except Exception as e:
        why = first_line(e, typed=True)
        raise PluginError(f"{cls.__name__}() fails with its defaults: {why}") from None
    if cls.knob is not None:
        _check_knob(cls, sel)
    _check_select(sel)


def _no_default(spec) -> bool:
    return spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING


def _check_knob(cls, sel) -> None:
    if not isinstance(cls.knob, str):
        raise PluginError(f"knob is {cls.knob!r}; set {HOW['knob']}")
    if cls.knob_direction not in (1, -1):
        raise PluginError(f"knob_direction is {cls.knob_direction!r}; set {HOW['knob_direction']}")
    _need(cls, "knob_range")
    rng = cls.knob_range
    ok = (
        isinstance(rng, tuple)
        and len(rng) == 2
        and all(isinstance(v, (int, float)) and math.isfinite(v) for v in rng)
        and 0 <= rng[0] < rng[1]
    )
    if not ok:
        raise PluginError(f"knob_range is {rng!r}; set {HOW['knob_range']} with 0 <= lo < hi")
    for end in rng:
        try:
            sel.with_knob(end)
        except Exception as e:
            raise PluginError(
                f"knob_range {tuple(rng)} reaches {cls.knob}={end!r}, which the field's check "
                f"refuses ({first_line(e, typed=True)}); narrow knob_range to the values "
                f"{cls.knob} accepts"
            ) from None


def _check_select(sel) -> None:
    block = getattr(sel, "block_size", 16)
    n = 3 * block + block // 2  # three whole blocks and a partial one
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, n, HEAD_DIM, generator=gen)
    k = torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=gen)
    shapes = f"q [1, {HEADS}, {n}, {HEAD_DIM}], k [1, {KV_HEADS}, {n}, {HEAD_DIM}]"
    try:
        out = sel.select(q, k)
    except Exception as e:
        raise PluginError(f"select({shapes}) fails: {first_line(e, typed=True)}") from None
    rows = getattr(out, "kv_count", None)
    got = tuple(rows.shape) if rows is not None else None
    if rows is not None and (len(got) != 3 or got[:2] != (1, HEADS)):
        per = "KV head" if got[:2] == (1, KV_HEADS) else "something else"
        m = math.ceil(n / block)
        raise PluginError(
            f"select({shapes}) returns kv_count {list(got)}, one row per {per}; return one "
            f"per query head, [1, {HEADS}, {m}] (query head h reads KV head h // (Hq // Hkv))"
        )
    density = getattr(out, "head_density", None)
    if not callable(density):
        raise PluginError(
            f"select returns a {type(out).__name__}; return a BlockSelection "
            "(rbs_bench.methods.BlockSelection.from_mask), or a pattern with head_density() and "
            "attend()"
        )
    got = tuple(density().shape)
    if got != (1, HEADS):
        raise PluginError(
            f"select({shapes}) returns densities {list(got)}; return one per query head, "
            f"[1, {HEADS}] (query head h reads KV head h // (Hq // Hkv))"
        )
