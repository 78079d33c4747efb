"""Generated blocks of measured accuracy and calibration: the README's headline results, what the
embedded model's accuracy tables hold and resolve (docs/results.md), its accuracy against density
(the model card), and its committed calibrations at 5% (docs/calibration.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import yaml

from rbs_bench import methods, paths
from rbs_bench.methods import DENSE
from rbs_bench.methods.rbs import RBS
from rbs_bench.report import load_records
from rbs_bench.tables.blocks import (
    MISSING,
    Sources,
    block,
    md_table,
    memo,
    num,
    sources_line,
    times,
)
from rbs_bench.tables.blocks_speed import H100, H200, speed_table, standalone_at, ttft_rows
from rbs_bench.tables.paper import PaperValues
from rbs_bench.tables.render import Table, context_label
from rbs_bench.tables.specs import spec_for

TINY = "tiny"  # the embedded model's folder under results/runs
# The embedded model's accuracy experiments, in the order docs/results.md lists them.
ACCURACY = (
    "ruler_budget", "strict_density", "block_size", "thresholds", "ruler_main",
    "selector_ablation", "infinitebench", "longbench_v2",
    "ruler_budget_16k", "strict_density_16k", "selector_ablation_16k", "block_size_16k",
    "thresholds_16k",
)  # fmt: skip
DROP_RE = re.compile(
    r"largest drop below it is (.+?)'s, ([\d.]+) points \(([\d.]+)%\), (so the table can)?"
)
NOTE_RE = re.compile(r"over the table's (\d+) comparisons? \((\d+) resolved\)")
INTERVAL_RE = re.compile(r"\[(-?[\d.]+), (-?[\d.]+)\]")


def records(src: Sources, folder: Path) -> pd.DataFrame:
    """The run records under an experiment's folder (read once per pass)."""
    return memo(("records", str(folder)), lambda: load_records(src.need(folder)))


def tables_of(src: Sources, experiment: str, model: str = TINY) -> tuple[list[Table], Path]:
    """The paper-layout tables of one experiment's records (as `make tables` builds them)."""
    folder = paths.runs_dir(src.results) / experiment / model

    def build() -> list[Table]:
        pv = PaperValues.load(paths.paper_values_file(src.results))
        return spec_for(experiment).build(records(src, folder), experiment, model, pv)

    return memo(("tables", str(folder)), build), folder


def compact(t: Table) -> str:
    """A table's header and rows as Markdown, without its title, notes and sources."""
    bold = lambda s: f"**{s}**"
    esc = lambda s: s.replace("|", "\\|")
    rows = [[c.render(bold, esc) for c in row] for row in t.rows]
    return md_table(t.header, rows, keys=max(1, t.keys))


def table_file(src: Sources, experiment: str, model: str = TINY) -> str:
    """The full table's file, as the docs link it."""
    return src.rel(paths.tables_dir(src.results) / f"{experiment}_{model}.md")


# ------------------------------------------------------------------------------------------------
# The embedded model's accuracy tables: what they hold and what they resolve.


def _intervals(t: Table) -> list[tuple[float, str]]:
    """(half-width, 'row / column: cell') of every accuracy with a 95% interval."""
    out = []
    for row in t.rows:
        label = row[0].render(str, str)
        for head, cell in zip(t.header[1:], row[1:]):
            m = INTERVAL_RE.fullmatch(cell.interval or "")
            if m:
                width = (float(m.group(2)) - float(m.group(1))) / 2
                out.append((width, f"{label} / {head}: {cell.render(str, str)}"))
    return out


def _resolved(t: Table) -> list[str]:
    """'row / column' of every daggered cell."""
    return [
        f"{row[0].render(str, str)} / {head}"
        for row in t.rows
        for head, cell in zip(t.header[1:], row[1:])
        if cell.resolved
    ]


def _devices(src: Sources, folder: Path) -> str:
    df = records(src, folder)
    gpu = df["gpu"].fillna("CPU") if "gpu" in df else pd.Series("CPU", index=df.index)
    return ", ".join(sorted(set(gpu.replace("", "CPU"))))


def _ranks(tables: list[Table]) -> str:
    """The tables' discrimination notes in brief: the largest drop below dense, and whether it
    lets the table rank methods (at least 10 points); – without a dense cell."""
    found = [m for t in tables for n in t.notes if (m := DROP_RE.search(n))]
    if not found:
        return MISSING
    method, drop, _, ranks = max(found, key=lambda m: float(m.group(2))).groups()
    return f"{float(drop):.1f} points ({method}): {'ranks' if ranks else 'cannot rank'}"


@block("accuracy_tables")
def accuracy_tables(src: Sources) -> str:
    """Per accuracy experiment of the embedded model: its records, its narrowest n, its widest
    interval, and the paired comparisons its table resolves."""
    rows, resolved, files = [], [], []
    for exp in ACCURACY:
        tables, folder = tables_of(src, exp)
        files.append(table_file(src, exp))
        df = records(src, folder)
        cells = df.groupby(["method", "budget"]).size()
        widths = [w for t in tables for w in _intervals(t)]
        notes = [m for t in tables for n in t.notes for m in NOTE_RE.finditer(n)]
        made = sum(int(m.group(1)) for m in notes)
        got = sum(int(m.group(2)) for m in notes)
        widest = max(widths) if widths else None
        rows.append([
            f"`{exp}`", _devices(src, folder), str(len(cells)), f"{len(df):,}",
            f"{cells.min()}-{cells.max()}" if cells.min() != cells.max() else str(cells.min()),
            MISSING if widest is None else f"{widest[0]:.1f} ({widest[1]})",
            f"{got} of {made}" if notes else MISSING, _ranks(tables),
        ])  # fmt: skip
        marks = [r for t in tables for r in _resolved(t)]
        if marks:
            resolved.append(f"- `{exp}`: " + "; ".join(marks) + ".")
    head = ["experiment", "ran on", "cells", "samples", "samples per cell"]
    head += ["widest 95% half-width (cell)", "comparisons resolved"]
    head += ["largest drop below dense at the sparsest setting"]
    text = md_table(head, rows, keys=2) + "\n"
    headline = methods.display(methods.headline())
    text += f"Resolved differences from {headline} (row / column of each table):\n\n"
    text += "\n".join(resolved or ["- none"]) + "\n\n"
    return text + "Full tables: " + ", ".join(f"`{f}`" for f in files) + ".\n"


@block("ruler_budget_tiny")
def ruler_budget_tiny(src: Sources) -> str:
    """Table 2 on the embedded model: measured density / accuracy / recall per target."""
    (t, *_), _ = tables_of(src, "ruler_budget")
    lead = " ".join(line for line in t.lead)
    file = table_file(src, "ruler_budget")
    notes = f"{t.title}. {lead} Full table with its notes: `{file}`."
    return compact(t) + "\n" + notes.replace("  ", " ") + "\n"


# ------------------------------------------------------------------------------------------------
# The README's headline results.


def _accuracy_row(src: Sources) -> list[str]:
    """RULER at the lowest target of the embedded model's budget table: each method's accuracy."""
    (t, *_), folder = tables_of(src, "ruler_budget")
    first = t.rows[0]
    parts = []
    for head, cell in zip(t.header[1:], first[1:]):
        acc = cell.ours[1] if len(cell.ours) > 1 else cell.ours[0]
        parts.append(f"{head} {acc}{'†' if cell.resolved else ''}")
    df = records(src, folder)
    dense = df[df["method"] == DENSE]
    task = ", ".join(sorted(df["task"].unique()))
    n = context_label(int(df["context_length"].max()))
    what = f"RULER {task} at {n}, {first[0].ours[0]} target density, n={len(dense)} per cell"
    value = "; ".join(parts) + f"; dense {dense['score'].mean():.2f}"
    table = paths.tables_dir(src.results) / "ruler_budget_tiny.md"
    return [what, f"embedded tiny model, {_devices(src, folder)}", value, _link(src, table)]


def _link(src: Sources, path: Path) -> str:
    """A link to a file, relative to the repository root (the README's folder)."""
    rel = src.rel(path)
    return f"[{Path(rel).name}]({rel})"


@block("headline")
def headline(src: Sources) -> str:
    """The README's short table of what the harness measured, each with its hardware and file."""
    rows = []
    for family in ("synthetic", "needles"):
        r, path = standalone_at(src, family, 131072)
        rows.append([
            f"prefill attention, 128K, 5% ({family} inputs)", "H100, standalone kernels",
            f"RBS {r['total_ms']:.1f} ms: {times(r['speedup_vs_sdpa_fa2'], '.1f')} SDPA-FA2, "
            f"{times(r['speedup_vs_sdpa_cudnn'], '.1f')} SDPA-cuDNN",
            _link(src, path),
        ])  # fmt: skip
    for gpu, model, layers, chunk, label in (
        (H200, "qwen3_30b_a3b", 48, 0, "H200, Qwen3-30B-A3B shape, bf16, unchunked"),
        (H100, "qwen3_30b_a3b_fp8", 48, 131072, "H100, FP8 checkpoint layout, unchunked"),
        (H200, "qwen3_30b_a3b_fp8", 48, 131072, "H200, FP8 checkpoint layout, unchunked"),
        (H200, "qwen3_32b", 64, 32768, "H200, Qwen3-32B shape, bf16"),
    ):
        sub, path = ttft_rows(src, gpu, model, layers, True, chunk)
        one = sub[sub["batch"] == 1].set_index("method")
        d, r = one.loc[DENSE], one.loc[RBS.name]
        table = speed_table(src, path, sub)
        rows.append([
            f"TTFT, {layers} layers, 128K, batch 1, 5%", label,
            f"dense {num(d['ttft_ms'] / 1e3)} s, RBS {num(r['ttft_ms'] / 1e3)} s: "
            f"{times(r['ttft_speedup'])}",
            _link(src, table or path),
        ])  # fmt: skip
    rows.append(_accuracy_row(src))
    head = ["result", "hardware, model", "measured", "full table"]
    note = "Random weights for the timing rows (time does not depend on them); †: the accuracy "
    note += f"differs from {methods.display(methods.headline())}'s on the same samples (paired "
    note += "sign test, Holm-corrected)."
    return md_table(head, rows, keys=len(head)) + "\n" + note + "\n"


# ------------------------------------------------------------------------------------------------
# The embedded model's committed calibrations at 5%.


@block("calibration_tiny_5pct")
def calibration_tiny_5pct(src: Sources) -> str:
    """Every committed calibration of the embedded model at a 5% target: where it landed."""
    rows, files = [], []
    for path in sorted((paths.calibration_dir(src.results) / TINY).glob("*.yaml")):
        doc = yaml.safe_load(path.read_text()) or {}
        for e in doc.get("entries") or []:
            if abs(float(e.get("target", 0)) - 0.05) > 1e-9:
                continue
            files.append(path)
            near = e.get("neighbours") or {}
            step = " / ".join(
                f"{100 * float(near[side]['density_mean']):.2f}%"
                for side in ("below", "above")
                if side in near
            )
            rows.append([
                methods.display(doc.get("method", path.stem)),
                context_label(int(e["context_length"])), f"{100 * float(e['density_mean']):.3f}%",
                f"{100 * float(e['abs_error']):.3f}", step or MISSING,
            ])  # fmt: skip
    rows.sort(key=lambda r: r[0])
    head = ["method", "prompt length", "measured density", "error (pp)"]
    head += ["nearest densities below / above (a step)"]
    return md_table(head, rows) + "\n" + sources_line(src, files) + "\n"


# ------------------------------------------------------------------------------------------------
# The forced blocks' share at the quick start's length (a count, from the configs).


@block("forced_share_4k")
def forced_share_4k(src: Sources) -> str:
    """What the forced blocks alone keep at 4K: the paper's and ruler_budget's shrunk ones."""
    from rbs_bench.config import ForcedCfg
    from rbs_bench.kernels.block_masks import candidate_mask, forced_mask

    conf = src.need(src.root / "conf" / "experiment" / "ruler_budget.yaml")
    shrunk = yaml.safe_load(conf.read_text())["forced"]
    paper = ForcedCfg()
    m, rows = 4096 // 128, []
    causal = int((candidate_mask(m) | forced_mask(m, 0, 1, 0)).sum())
    for what, f in (("the paper's (`forced.*` defaults)", vars(paper)),
                    ("`ruler_budget`'s, shrunk", shrunk)):  # fmt: skip
        kept = int(forced_mask(m, f["sink_blocks"], f["window_blocks"], f["last_q_blocks"]).sum())
        rows.append([
            what, str(f["sink_blocks"]), str(f["window_blocks"]), str(f["last_q_blocks"]),
            f"{100 * kept / causal:.1f}%",
        ])  # fmt: skip
    head = ["forced blocks", "sink blocks", "window blocks", "last query blocks"]
    head += ["share of the causal block pairs at 4K (B=128)"]
    return md_table(head, rows) + "\n" + sources_line(src, [conf]) + "\n"


def _span(g: pd.DataFrame, col: str) -> str:
    """min-max of a column in seconds, or – where the run predates it."""
    vals = g[col] if col in g else pd.Series(dtype=float)
    return f"{vals.min():.0f}-{vals.max():.0f} s" if vals.notna().any() else "–"


def _first(g: pd.DataFrame, col: str) -> str:
    vals = g[col].dropna() if col in g else pd.Series(dtype=object)
    return str(vals.iloc[0]) if len(vals) else "–"


def _startup(g: pd.DataFrame) -> str:
    if "import_s" not in g or g["import_s"].isna().all():
        return "–"
    return f"{g['compose_s'].iloc[0]:.1f} + {g['import_s'].iloc[0]:.1f} s"


@block("seven_cells_16k")
def seven_cells_16k(src: Sources) -> str:
    """The seven 16K cells at d10 (dense and six methods, 60 samples each) timed on one GPU
    (`bench.cells_timing`): per run the wall time, the samples a second, the medians of a sample's
    first token and decoding, how it decoded, when the cells' first and last records came (their
    start-up, then their sampling), parallel's own start-up (composing the cells + importing the
    harness) and whether Python kept its bytecode; runs before a column existed show –
    (results/speed/seven_cells_16k_<gpu>.csv)."""
    files = sorted(paths.speed_dir(src.results).glob("seven_cells_16k_*.csv"))
    rows = []
    for path in files:
        df = pd.read_csv(path)
        for run, g in df.groupby("run", sort=False):
            wall = float(g["wall_s"].iloc[0])
            samples = int(g["samples"].iloc[0])
            tokens = g["new_tokens_median"].median()
            decoded = ", ".join(sorted(set(g["decode"].dropna()))) if "decode" in g else "–"
            rows.append([
                str(g["gpu"].iloc[0]), run.replace("_", " "), str(int(g["processes"].iloc[0])),
                f"{samples}", f"{wall:.1f} s", f"{samples / wall:.1f}",
                f"{1000 * g['ttft_s_median'].median():.0f} ms",
                f"{1000 * g['decode_s_median'].median():.0f} ms ({tokens:.0f} tokens)",
                decoded.replace("_", " "), _span(g, "first_record_s"), _span(g, "last_record_s"),
                _startup(g), _first(g, "bytecode"),
            ])  # fmt: skip
    head = ["GPU", "run", "processes", "samples", "wall", "samples/s", "first token (median)"]
    head += ["decoding (median)", "decoded", "cells' first records", "cells' last records"]
    head += ["start-up: compose + import", "bytecode"]
    return md_table(head, rows, keys=2) + "\n" + sources_line(src, files) + "\n"
