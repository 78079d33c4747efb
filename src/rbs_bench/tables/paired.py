"""Which accuracy differences a table resolves: paired tests on the same samples.

Two cells of a table that ran the same prompts (the same task, context length and sample index;
the same prompt hash where the records hold one) are compared sample by sample. For each pair the
one cell scores higher, lower or the same; the exact two-sided sign test asks whether the higher
and lower counts could come from a fair coin. For 0/100 scores this is McNemar's exact test on the
discordant pairs; for fractional scores (F1, ROUGE) it is the sign test of the paired differences.
It needs no normal approximation, so it is exact at any n, and pairing removes the variation
between prompts that two separate intervals carry (two overlapping 95% intervals can still be a
resolved difference, and a small n resolves nothing).

The tables compare the method under study (`methods.headline()`) with every other method of the
same row or column and mark a resolved difference with a dagger; the p-values of one table are
corrected together (Holm), so the table's marks hold at 5% family-wise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

ALPHA = 0.05  # family-wise level of one table's marks


def sign_test(higher: int, lower: int) -> float:
    """Exact two-sided p-value of `higher` against `lower` discordant pairs under p = 1/2."""
    n = higher + lower
    if n == 0:
        return 1.0
    k = min(higher, lower)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def _key(df: pd.DataFrame) -> pd.Series:
    cols = ["task", "context_length", "index"]
    if "prompt_sha1" in df and df["prompt_sha1"].notna().all():
        cols = ["task", "context_length", "prompt_sha1"]
    return df[cols].astype(str).agg("|".join, axis=1)


@dataclass(frozen=True)
class Paired:
    n: int  # samples both cells ran
    higher: int  # samples where the first cell scores higher
    lower: int  # ... lower
    p: float  # exact two-sided sign test

    @property
    def diff(self) -> int:
        return self.higher - self.lower


def paired(a: pd.DataFrame, b: pd.DataFrame) -> Paired:
    """The sign test of cell `a` against cell `b` over the samples both ran (records of one
    cell each: score on 0-100, a sample's task, context length and index)."""
    sa = pd.Series(a["score"].to_numpy(float), index=_key(a)).groupby(level=0).mean()
    sb = pd.Series(b["score"].to_numpy(float), index=_key(b)).groupby(level=0).mean()
    both = sa.index.intersection(sb.index)
    d = sa[both] - sb[both]
    higher, lower = int((d > 0).sum()), int((d < 0).sum())
    return Paired(len(both), higher, lower, sign_test(higher, lower))


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error over the list)."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    out, running = [1.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        out[i] = running
    return out


def mark_resolved(pairs: list[tuple[object, Paired]]) -> int:
    """Set `resolved` on each cell whose comparison holds after Holm's correction over `pairs`
    ((cell, Paired) with a `resolved` attribute); returns how many are resolved."""
    adjusted = holm([pr.p for _, pr in pairs])
    count = 0
    for (cell, _), p in zip(pairs, adjusted):
        cell.resolved = p < ALPHA
        count += cell.resolved
    return count


def note(against: str, resolved: int, total: int, n_pairs: list[int]) -> str:
    """The table note that explains the daggers."""
    ns = sorted(set(n_pairs))
    n_text = f"{ns[0]}" if len(ns) == 1 else f"{ns[0]}-{ns[-1]}"
    return (
        f"†: the accuracy differs from {against}'s on the same samples, resolved by an exact "
        f"two-sided sign test of the paired per-sample scores (McNemar's exact test for 0/100 "
        f"scores; {n_text} paired samples per comparison), p < {ALPHA:g} after Holm's correction "
        f"over the table's {total} comparison{'s' if total != 1 else ''} ({resolved} resolved); "
        "an unmarked cell's "
        f"difference from {against} is not resolved at this n (rbs_bench.tables.paired)."
    )
