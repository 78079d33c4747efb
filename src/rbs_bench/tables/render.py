"""A table as cells, and its Markdown and LaTeX text; the labels every table shares (method
display names and order from each selector's `MethodInfo`, context lengths as 32K/128K)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from rbs_bench import methods

# A method's name in tables and its position come from its selector class (`MethodInfo`).
display = methods.display
MISSING = "–"


method_order = methods.order_key


# ------------------------------------------------------------------------------------------------
# Tables and their Markdown / LaTeX.


@dataclass
class Cell:
    ours: tuple[str, ...]  # formatted numbers (MISSING where we have none), or a label
    bold: tuple[bool, ...] = ()
    paper: tuple[str, ...] | None = None  # the paper's numbers as printed
    template: str | None = None  # how the parts read, e.g. "[{}, {}]"; default "a / b"
    interval: str | None = None  # the accuracy's 95% interval, e.g. "[30.0, 90.3]"
    interval_at: int = -1  # the part it follows (-1: the last)
    resolved: bool = False  # its accuracy differs from the headline method's (tables.paired)

    def _join(self, parts: Iterable[str]) -> str:
        parts = list(parts)
        if self.template and all(p != MISSING for p in parts):
            return self.template.format(*parts)
        return " / ".join(parts)

    def render(
        self, bold: Callable[[str], str], esc: Callable[[str], str], dagger: str = "†"
    ) -> str:
        b = self.bold or (False,) * len(self.ours)
        parts = [bold(esc(v)) if f else esc(v) for v, f in zip(self.ours, b)]
        at = self.interval_at if 0 <= self.interval_at < len(parts) else len(parts) - 1
        if self.interval and parts:
            parts[at] += f" {esc(self.interval)}"
        if self.resolved and parts:
            parts[at] += dagger
        text = self._join(parts)
        return text + (f" ({self._join(esc(p) for p in self.paper)})" if self.paper else "")


@dataclass
class Table:
    title: str
    label: str  # LaTeX label
    header: list[str]
    rows: list[list[Cell]]
    lead: list[str] = field(default_factory=list)  # lines shown before the table (reference)
    notes: list[str] = field(default_factory=list)
    sources: list[tuple[str, int]] = field(default_factory=list)  # (records file, records used)
    keys: int = 1  # leading columns that name the row (left-aligned)


def _md(s: str) -> str:
    return s.replace("|", "\\|")


def to_markdown(t: Table) -> str:
    bold = lambda s: f"**{s}**"
    out = [f"## {t.title}", ""]
    out += [line + "\n" for line in t.lead]
    out.append("| " + " | ".join(_md(h) for h in t.header) + " |")
    keys = max(1, getattr(t, "keys", 1))
    out.append("|" + "|".join(["---"] * keys + ["---:"] * (len(t.header) - keys)) + "|")
    for row in t.rows:
        out.append("| " + " | ".join(c.render(bold, _md) for c in row) + " |")
    out.append("")
    out += [n + "\n" for n in t.notes]
    out.append("Run records:\n")
    out += [f"- `{s}` ({n} records)" for s, n in t.sources]
    return "\n".join(out) + "\n"


_TEX_ESC = {"\\": r"\textbackslash{}", "_": r"\_", "%": r"\%", "&": r"\&", "#": r"\#"}
_TEX_ESC |= {"$": r"\$", "{": r"\{", "}": r"\}", "–": "--", "~": r"\textasciitilde{}"}


def tex_escape(s: str) -> str:
    return "".join(_TEX_ESC.get(c, c) for c in s)


def to_latex(t: Table) -> str:
    bold = lambda s: f"\\textbf{{{s}}}"
    dagger = "$^{\\dagger}$"
    caption = " ".join([t.title + "."] + t.lead + t.notes)
    sources = "; ".join(f"\\texttt{{{tex_escape(s)}}} ({n})" for s, n in t.sources)
    keys = max(1, getattr(t, "keys", 1))
    out = [
        "\\begin{table}[htbp]",
        "\\centering",
        f"\\caption{{{tex_escape(caption).replace('†', dagger)}}}",
        f"\\label{{{t.label}}}",
        "\\small",
        "\\setlength{\\tabcolsep}{4pt}",
        f"\\begin{{tabular}}{{@{{}}{'l' * keys}{'c' * (len(t.header) - keys)}@{{}}}}",
        "\\toprule",
        " & ".join(tex_escape(h) for h in t.header) + " \\\\",
        "\\midrule",
    ]
    out += [" & ".join(c.render(bold, tex_escape, dagger) for c in row) + " \\\\" for row in t.rows]
    out += ["\\bottomrule", "\\end{tabular}", "\\par\\smallskip"]
    out += [f"{{\\footnotesize Run records (records used): {sources}.\\par}}", "\\end{table}"]
    return "\n".join(out) + "\n"


def context_label(n) -> str:
    """4096 -> "4K", 131072 -> "128K" (the paper's column names); other values as they are."""
    if isinstance(n, str):
        return n
    n = int(n)
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)
