"""The paper's values: one row per table cell, parsed from the paper's LaTeX source into
results/paper/paper_values.csv (`paper_values_from_tex`) and read back by the tables
(`PaperValues`); `check_paper_values` lists the cells where the file and a fresh parse differ."""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rbs_bench.errors import UserError

PAPER_COLUMNS = ["table", "caption_short", "row", "column", "value", "unit", "tex_line", "bold"]


# ------------------------------------------------------------------------------------------------
# The paper's values: one row per cell, read from the paper's LaTeX source.


@dataclass(frozen=True)
class TexTableSpec:
    """How to name the cells of one paper table (the parser does the rest)."""

    keys: int = 1  # leading cells that name the row (an empty one repeats the row above)
    unit: str = "percent"
    units: dict[str, str] = field(default_factory=dict)  # column substring -> unit
    split: tuple[str, ...] = ()  # suffixes of the parts of an "a / b" cell
    metric_rows: tuple[str, ...] = ()  # (plain rows' metric, italic rows' metric, ...)
    rename_rows: dict[str, str] = field(default_factory=dict)
    caption_values: tuple[tuple[str, str, str], ...] = ()  # (row, column, number as printed)


TEX_SPECS: dict[str, TexTableSpec] = {
    "tab:ruler_budget": TexTableSpec(
        split=("density", "accuracy"),
        caption_values=(("Dense", "Dense:accuracy", "89.69"), ("Dense", "Dense:density", "100")),
    ),
    "tab:longbench_dual": TexTableSpec(units={"Accuracy": "score0-1"}),
    "tab:ruler": TexTableSpec(metric_rows=("accuracy", "density")),
    "tab:InfiniteBench": TexTableSpec(unit="score0-1"),
    "tab:videomme": TexTableSpec(),
    "tab:selector_ablation": TexTableSpec(),
    "tab:strict_density": TexTableSpec(split=("density", "accuracy")),
    "tab:selector_breakdown": TexTableSpec(),
    "tab:a100_sweep": TexTableSpec(keys=2, split=("sys", "acc")),
    "tab:a100_throughput": TexTableSpec(
        keys=2,
        units={"wall time (ms)": "ms", "prompt tokens": "tokens", "tokens/s": "tokens/s"},
    ),
    "tab:block_sensitivity": TexTableSpec(keys=2, units={"Calibration parameter": "knob"}),
    "tab:threshold_sensitivity": TexTableSpec(
        keys=2,
        units={"alpha_": "threshold"},
        # "Qwen3-30B-A3B FP8" is one model name wrapped over two lines of the first column.
        rename_rows={
            "Qwen3-30B-A3B:Conservative": "Qwen3-30B-A3B FP8:Conservative",
            "FP8:Default": "Qwen3-30B-A3B FP8:Default",
            "FP8:Aggressive": "Qwen3-30B-A3B FP8:Aggressive",
        },
    ),
    "tab:calibration": TexTableSpec(
        units={
            "Configurations": "count",
            "Wall hours": "hours",
            "GPU-hours": "GPU-hours",
            "error (pp)": "pp",
        }
    ),
    "tab:dynamic_cost": TexTableSpec(unit="ms"),
    "tab:metadata": TexTableSpec(unit="MiB"),
    "tab:peak_memory": TexTableSpec(unit="GiB", split=("allocated", "reserved")),
}

# Numbers that figures carry only in their captions or in the text that reports them:
# (label, row, column, number as printed, unit, a string that occurs once, on that line).
FIGURE_VALUES = [
    (
        "fig:observations_b",
        "Q5",
        "RBS vs mean-only underestimation",
        "25",
        "pp",
        "25-percentage-point difference in Q5.",
    ),
    ("fig:observations_c", "Q5", "share of top-5% blocks", "39.5", "percent", "39.5\\% fall"),
    ("fig:observations_c", "uniform", "share of top-5% blocks", "20", "percent", "reference of 20"),
]
_SPEED = [
    ("standalone:128K", "RBS-Attention", "20.65"),
    ("standalone:128K", "FlashPrefill", "11.98"),
    ("standalone:128K", "FlexPrefill", "4.78"),
    ("standalone:128K", "MInference", "2.25"),
    ("standalone:128K", "XAttn", "2.97"),
    ("vllm_attention:128K", "RBS-Attention", "11.92"),
    ("vllm_ttft:128K", "RBS-Attention", "5.97"),
]
FIGURE_VALUES += [
    ("fig:speed_3panel", row, col, v, "x", "fig:speed_3panel} reports the H100")
    for row, col, v in _SPEED
]

_NUM = re.compile(r"^-?\d{1,3}(,\d{3})*(\.\d+)?$|^-?\d+(\.\d+)?$")


def _brace_arg(text: str, start: int) -> tuple[str, int]:
    """The balanced {...} argument starting at text[start] == '{', and the index after it."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i], i + 1
    raise ValueError(f"unbalanced braces at {text[start : start + 40]!r}")


def _clean(s: str) -> str:
    """LaTeX cell or caption text as plain text."""
    s = re.sub(r"\\(?:textbf|textit|emph|text)\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\$\\alpha_\{\\rm (\w+)\}\$", r"alpha_\1", s)
    s = (
        s.replace("$\\times$", "x")
        .replace("$\\beta$", "beta")
        .replace("\\method{}", "RBS-Attention")
    )
    s = re.sub(r"\\ref\{([^{}]*)\}", r"\1", s).replace("~", " ").replace("\\%", "%")
    s = re.sub(r"\$([^$]*)\$", r"\1", s)
    return s.strip()


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)&", line.strip().removesuffix("\\\\"))]


def _multicolumn(cell: str) -> tuple[int, str] | None:
    m = re.match(r"\\multicolumn\{(\d+)\}\{[^{}]*\}", cell)
    if not m:
        return None
    return int(m.group(1)), _brace_arg(cell, m.end())[0]


def _values(raw: str, spec: TexTableSpec, where: str) -> list[tuple[str, str, bool]]:
    """(column suffix, number without thousands separators, bold) for each number in a cell."""
    raw = raw.replace("\\%", "").replace("$\\times$", "").strip()
    ci = re.fullmatch(r"\[([\d.,]+), ([\d.,]+)\]", raw)
    if ci:
        parts = [(":low", ci.group(1)), (":high", ci.group(2))]
    elif " / " in raw:
        pieces = raw.split(" / ")
        if len(pieces) != len(spec.split):
            raise ValueError(f"{where}: {raw!r} has {len(pieces)} parts, spec names {spec.split}")
        parts = [(f":{s}", p) for s, p in zip(spec.split, pieces)]
    elif "/" in raw:
        parts = [(f":{i + 1}", p) for i, p in enumerate(raw.split("/"))]
    else:
        parts = [("", raw)]
    out = []
    for suffix, p in parts:
        bold = p.startswith("\\textbf{")
        text = _clean(p)
        if _NUM.match(text):
            out.append((suffix, text.replace(",", ""), bold))
        elif len(parts) > 1 and text not in ("---", ""):
            raise ValueError(f"{where}: part {text!r} of {raw!r} is not a number")
    return out


def _short(caption: str) -> str:
    text = _clean(caption)
    m = re.search(r"\.(\s|$)", text)
    return text[: m.start()] if m else text


def _unit(spec: TexTableSpec, column: str, raw: str) -> str:
    if "$\\times$" in raw:
        return "x"
    for key, unit in spec.units.items():
        if key in column:
            return unit
    return spec.unit


def _parse_table(label: str, lines: list[tuple[int, str]], spec: TexTableSpec) -> list[dict]:
    caption = ""
    for n, text in lines:
        if "\\caption{" in text:
            caption, cap_line = _brace_arg(text, text.index("\\caption{") + 8)[0], n
    short = _short(caption)
    rows = []
    for row, column, literal in spec.caption_values:
        if literal not in caption:
            raise ValueError(f"{label}: {literal} is not in the caption")
        unit = _unit(spec, column, "")
        rows.append(dict(row=row, column=column, value=literal, unit=unit, bold=False))
        rows[-1]["tex_line"] = cap_line
    in_tabular = False
    for n, text in lines:
        s = text.strip()
        if s.startswith("\\begin{tabular}"):  # a table may hold several (panels)
            in_tabular, body, header_rows, keys, panel, prev = True, False, [], [], "", ""
            continue
        if not in_tabular or s.startswith(("\\toprule", "\\cmidrule", "\\bottomrule")):
            continue
        if s.startswith("\\end{tabular}"):
            in_tabular = False
            continue
        if s.startswith("\\midrule"):
            body = True
            continue
        if not s.endswith("\\\\"):
            continue
        cells = _cells(s)
        if not body:
            expanded = []
            for c in cells:
                mc = _multicolumn(c)
                expanded += [_clean(mc[1])] * mc[0] if mc else [_clean(c)]
            header_rows.append(expanded)
            header = [":".join(h for h in col if h) for col in zip(*header_rows)]
            continue
        mc = _multicolumn(cells[0])
        if len(cells) == 1 and mc:
            panel, keys = _clean(mc[1]), []
            continue
        key_cells = [_clean(c) for c in cells[: spec.keys]]
        metric = spec.metric_rows[0] if spec.metric_rows else ""
        if spec.metric_rows and cells[0].startswith("\\textit{"):
            metric, name = key_cells[0], prev
        else:
            keys = [k or (keys[i] if i < len(keys) else "") for i, k in enumerate(key_cells)]
            name = ":".join(([panel] if panel else []) + keys)
            name = spec.rename_rows.get(name, name)
            prev = name
        for j in range(spec.keys, len(cells)):
            column = header[j] + (f":{metric}" if metric else "")
            for suffix, value, bold in _values(cells[j], spec, f"{label} line {n}"):
                unit = _unit(spec, column, cells[j])
                rows.append(dict(row=name, column=column + suffix, value=value, unit=unit))
                rows[-1].update(tex_line=n, bold=bold)
    return [dict(table=label, caption_short=short, **r) for r in rows]


def paper_values_from_tex(path: Path) -> list[dict]:
    """Every number of every table of the paper (and the figures' FIGURE_VALUES), one row per
    cell, in PAPER_COLUMNS; an "a / b" cell gives one row per part (column suffix ":<part>")."""
    lines = Path(path).read_text().splitlines()
    out, block = [], None
    for n, text in enumerate(lines, start=1):
        if text.strip().startswith("\\begin{table}"):
            block = []
        if block is not None:
            block.append((n, text))
        if text.strip().startswith("\\end{table}") and block is not None:
            label = next(m.group(1) for _, t in block if (m := re.search(r"\\label\{(.*?)\}", t)))
            if label not in TEX_SPECS:
                raise ValueError(f"{path}: no TEX_SPECS entry for table {label}")
            out += _parse_table(label, block, TEX_SPECS[label])
            block = None
    captions = {}
    for n, text in enumerate(lines, start=1):
        m = re.search(r"\\label\{(fig:[^}]*)\}", text)
        if m:  # a figure's caption is the \caption just above its \label
            cap = next(t for t in reversed(lines[: n - 1]) if "\\caption{" in t)
            captions[m.group(1)] = _short(_brace_arg(cap, cap.index("\\caption{") + 8)[0])
    for label, row, column, literal, unit, anchor in FIGURE_VALUES:
        hits = [n for n, t in enumerate(lines, start=1) if anchor in t]
        if len(hits) != 1 or literal not in lines[hits[0] - 1]:
            raise ValueError(f"{path}: {label} {literal!r} not found once near {anchor!r}")
        out.append(
            dict(table=label, caption_short=captions[label], row=row, column=column)
            | dict(value=literal, unit=unit, tex_line=hits[0], bold=False)
        )
    return [{k: r[k] for k in PAPER_COLUMNS} for r in out]


def paper_values_csv(rows: Iterable[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=PAPER_COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow(r | {"bold": int(bool(r["bold"]))})
    return buf.getvalue()


@dataclass
class PaperValues:
    """The paper's numbers as printed, by (table, row, column)."""

    path: Path
    cells: dict[tuple[str, str, str], dict]

    @classmethod
    def load(cls, path: Path) -> PaperValues:
        path = Path(path)
        if not path.exists():
            raise UserError(f"{path} is missing; pass --paper-values with the paper's values file")
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        return cls(path, {(r["table"], r["row"], r["column"]): r for r in rows})

    def get(self, table: str, row: str, column: str) -> str | None:
        r = self.cells.get((table, row, column))
        return None if r is None else r["value"]

    def lines(self, table: str) -> tuple[int, int]:
        ns = [int(r["tex_line"]) for k, r in self.cells.items() if k[0] == table]
        return min(ns), max(ns)

    def parts(self, table: str, row: str, column: str) -> str | None:
        """The value of a cell, or its numbered parts ("2/5/10" from column:1, :2, :3)."""
        whole = self.get(table, row, column)
        if whole is not None:
            return whole
        got, i = [], 1
        while (v := self.get(table, row, f"{column}:{i}")) is not None:
            got.append(v)
            i += 1
        return "/".join(got) if got else None


def check_paper_values(tex: Path, csv_path: Path) -> list[str]:
    """Differences between the values file and a fresh parse of the paper's source ([] if none)."""
    with open(csv_path, newline="") as f:
        have = list(csv.DictReader(f))
    want = list(csv.DictReader(io.StringIO(paper_values_csv(paper_values_from_tex(tex)))))
    key = lambda r: (r["table"], r["row"], r["column"])
    h, w = {key(r): r for r in have}, {key(r): r for r in want}
    diffs = [f"only in {csv_path}: {k}" for k in h.keys() - w.keys()]
    diffs += [f"missing from {csv_path}: {k} = {w[k]['value']}" for k in w.keys() - h.keys()]
    diffs += [f"{k}: file {h[k]} != tex {w[k]}" for k in h.keys() & w.keys() if h[k] != w[k]]
    if len(have) != len(h):
        diffs.append(f"{csv_path} has duplicate (table, row, column) keys")
    return sorted(diffs)
