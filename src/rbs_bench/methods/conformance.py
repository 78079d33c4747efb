"""What a selector class must have before the registry takes it (docs/design.md §3).

`check_selector(name, cls)` runs when a plugin's class loads (rbs_bench.methods reads the entry
points through rbs_bench.plugins) and, in the tests, on every shipped selector: the required class
attributes, the knob range against the knob field's own check (`with_knob` at both ends), and one
`select` on a small input whose result must have one row per query head and pass
`selection_problem`. Each failure is one `PluginError` line that says what to change.

A plugin's selections are checked at every call too (`guard_selections`, applied by the registry
to each plugin class): `selection_problem` on what `select` returns, before it is used or
recorded. A bad selection, or an exception from the plugin's `select`, stops the command with one
line naming the plugin and what it returned (a UserError), so nothing is recorded.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch import Tensor

from rbs_bench.errors import UserError, first_line, stopping
from rbs_bench.methods.info import MethodInfo
from rbs_bench.methods.selection import BlockSelection
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
    problem = selection_problem(out, q)
    if problem is not None:
        raise PluginError(f"select({shapes}) returns {problem}; see docs/design.md §3")


# ------------------------------------------------------------------------------------------------
# Every selection of a plugin, checked before it is used.


def guard_selections(cls, who: str) -> None:
    """Check every selection `cls.select` returns (`selection_problem`) before any caller uses
    it, in place on the class, so copies made by `with_knob` are checked too. A bad selection, or
    any exception from the plugin's code (but a GPU out of memory, and a stop by SIGINT or
    SIGTERM), becomes one UserError line naming `who` (the plugin) and what it returned."""
    inner = cls.__dict__.get("select")
    if inner is None or getattr(inner, "_checked_of", None) is not None:
        return

    @functools.wraps(inner)
    def select(self, q, k, scale=None):
        try:
            out = inner(self, q, k, scale=scale)
        except torch.OutOfMemoryError:
            raise
        except BaseException as e:  # SystemExit, KeyboardInterrupt of its own included
            if stopping() is not None or isinstance(e, UserError):
                raise
            raise UserError(
                f"{who} raised {first_line(e, typed=True)} in select; fix it or run another method"
            ) from None
        problem = selection_problem(out, q)
        if problem is not None:
            raise UserError(f"{who} returned {problem}; fix its select (docs/design.md §3)")
        return out

    select._checked_of = inner
    cls.select = select


def selection_problem(out, q: Tensor) -> str | None:
    """What is wrong with `out` as the selection of query `q` [B, Hq, N, D], or None: a
    BlockSelection must have int32 kv_count [B, Hq, Mq] and kv_indices [B, Hq, Mq, <= Mk] on q's
    device for seq_len N, every count within its query block's causal key blocks, and the
    counted indices within the causal range, strictly ascending; any other pattern needs
    head_density() (float [B, Hq], each in [0, 1]) and attend()."""
    b, h, n = q.shape[:3]
    if out is None:
        return "None"
    if isinstance(out, BlockSelection):
        return _block_problem(out, b, h, n, q.device)
    density = getattr(out, "head_density", None)
    if not (callable(density) and callable(getattr(out, "attend", None))):
        return (
            f"a {type(out).__name__}, which is neither a BlockSelection nor a pattern with "
            "head_density() and attend()"
        )
    d = density()
    if not (isinstance(d, Tensor) and d.is_floating_point() and tuple(d.shape) == (b, h)):
        what = list(d.shape) if isinstance(d, Tensor) else type(d).__name__
        return f"a {type(out).__name__} whose head_density() is {what}, not float [{b}, {h}]"
    if not bool(((d >= 0) & (d <= 1)).all()):
        return f"a {type(out).__name__} with a head density outside [0, 1] (or NaN)"
    return None


def _block_problem(sel: BlockSelection, b: int, h: int, n: int, device) -> str | None:
    bq, bk = sel.block_q, sel.block_k
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (bq, bk)):
        return f"block sizes {bq!r} x {bk!r} (positive integers expected)"
    if sel.seq_len != n:
        return f"a selection for seq_len={sel.seq_len!r}, not the prompt's {n} tokens"
    mq, mk = math.ceil(n / bq), math.ceil(n / bk)
    for name, t, want in (
        ("kv_count", sel.kv_count, [b, h, mq]),
        ("kv_indices", sel.kv_indices, [b, h, mq, mk]),
    ):
        if not isinstance(t, Tensor):
            return f"{name} of type {type(t).__name__}, not a tensor"
        if t.dtype != torch.int32:
            return f"{name} of dtype {t.dtype}, not torch.int32"
        got = list(t.shape)
        if got[:3] != want[:3] or len(got) != len(want) or got[-1] > want[-1]:
            return f"{name} of shape {got}, not {want}"
        if t.device != device:
            return f"{name} on {t.device}, not on the query's {device}"
    return _index_problem(sel.kv_count.long(), sel.kv_indices.long(), bq, bk, n)


def _index_problem(count: Tensor, idx: Tensor, bq: int, bk: int, n: int) -> str | None:
    """Counts and indices against the causal range of each query block: block i may keep key
    blocks 0 .. (min((i + 1) bq, N) - 1) // bk."""
    mq, width = count.shape[-1], idx.shape[-1]
    i = torch.arange(mq, device=count.device)
    last = (torch.clamp((i + 1) * bq, max=n) - 1) // bk  # [Mq] last causal key block
    room = torch.clamp(last + 1, max=width)
    bad = (count < 0) | (count > room)
    if bool(bad.any()):
        at = bad.nonzero()[0].tolist()
        c, qi = int(count[tuple(at)]), at[-1]
        return (
            f"kv_count {c} for query block {qi} of head {at[1]}, more than its "
            f"{int(last[qi]) + 1} causal key blocks (or below 0)"
        )
    kept = torch.arange(width, device=idx.device) < count[..., None]  # [B, H, Mq, W]
    out = kept & ((idx < 0) | (idx > last[:, None]))
    if bool(out.any()):
        at = out.nonzero()[0].tolist()
        qi = at[2]
        return (
            f"kv_indices holding block {int(idx[tuple(at)])} for query block {qi} of head "
            f"{at[1]}, outside the causal range 0..{int(last[qi])}"
        )
    order = kept[..., 1:] & (idx[..., 1:] <= idx[..., :-1])
    if bool(order.any()):
        at = order.nonzero()[0].tolist()
        return (
            f"kv_indices not strictly ascending in query block {at[2]} of head {at[1]} (a block "
            "kept twice or out of order)"
        )
    return None
