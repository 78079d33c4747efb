"""Generated block of the paper's claims decided by the embedded model's records: the README's
"What the harness finds" (the full table: results/tables/claims_tiny.md, tables.claims)."""

from __future__ import annotations

from rbs_bench import paths
from rbs_bench.tables.blocks import Sources, block, md_table, memo
from rbs_bench.tables.claims import CONTRADICTED, SUPPORTED, UNRESOLVED, claims_of
from rbs_bench.tables.paper import PaperValues

TINY = "tiny"  # the embedded model's folder under results/runs
VERDICTS = (SUPPORTED, CONTRADICTED, UNRESOLVED)


def _group(source: str) -> str:
    """A claim's paper table or figure: its source up to the first comma."""
    return source.split(",")[0]


def _resolved(c) -> str:
    """A decided claim in brief: its verdict, the claim, and our figure."""
    if c.speed is not None:
        ours, _, where = c.speed
        return f"{c.verdict}: {c.text} ({ours:.2f}x: {where.split(' (')[0]})"
    e = c.evidence
    return f"{c.verdict}: {c.text} ({e.diff:+.1f} [{e.lo:+.1f}, {e.hi:+.1f}])"


@block("claims_tiny")
def claims_tiny(src: Sources) -> str:
    """Per paper table or figure: how many of its claims the embedded model's records (and the
    GPU timings) support, contradict or leave unresolved, and each resolved claim in brief."""
    pv = PaperValues.load(src.need(paths.paper_values_file(src.results)))
    claims, sources = memo(("claims", TINY), lambda: claims_of(src.results, TINY, pv))
    groups: dict[str, list] = {}
    for c in claims:
        groups.setdefault(_group(c.source), []).append(c)
    rows = []
    for name, group in groups.items():
        counts = [sum(c.verdict == v for c in group) for v in VERDICTS]
        decided = [_resolved(c) for c in group if c.verdict in (SUPPORTED, CONTRADICTED)]
        rows.append([name, str(len(group)), *map(str, counts), "; ".join(decided) or "–"])
    head = ["paper", "claims", *VERDICTS, "each resolved claim (ours: difference [95% CI])"]
    table = paths.tables_dir(src.results) / f"claims_{TINY}.md"
    return (
        md_table(head, rows, keys=1)
        + f"\nFrom {len(sources)} records files and the GPU timing CSVs; every claim with the "
        f"paper's values, our paired difference, n and p: `{src.rel(table)}`.\n"
    )
