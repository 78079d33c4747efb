"""Rewrite every generated block of the documentation from the committed records and CSVs.

    python -m rbs_bench.tables.docs [--root .] [--results results]    # make docs
    python -m rbs_bench.tables.docs --check                           # which blocks are stale

A measured figure in README.md, docs/ or the embedded model's card lives only inside a generated
block (blocks.py says how to add one); this command rewrites each block's text from results/, so
that no table can drift from the records it reports. `--check` rewrites nothing and exits 1 when a
committed block differs from what the records produce (tests/test_docs_blocks.py runs it).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
from pathlib import Path

from rbs_bench.errors import UserError, one_line
from rbs_bench.records import write_atomic
from rbs_bench.tables.blocks import BLOCKS, Sources, clear_memo

# The modules whose @block functions fill the registry (imported before any block is rendered).
MODULES = (
    "rbs_bench.tables.blocks_accuracy",
    "rbs_bench.tables.blocks_speed",
    "rbs_bench.tables.blocks_cluster",
    "rbs_bench.tables.blocks_kernels",
    "rbs_bench.tables.blocks_tinylm",
    "rbs_bench.tables.blocks_claims",
)
# The documentation files, relative to the repository root (docs/ is globbed).
FILES = ("README.md", "src/rbs_bench/tinylm/weights/README.md")
DOCS_DIR = "docs"

BEGIN = "<!-- generated: {name} (make docs; do not edit) -->"
END = "<!-- end generated: {name} -->"
# Markers start their line: an indented one (an example in a code block) is text.
BLOCK_RE = re.compile(
    r"^<!-- generated: (?P<name>[A-Za-z0-9_.-]+)[^>\n]*-->\n(?P<body>.*?)^<!-- end generated: "
    r"(?P<end>[A-Za-z0-9_.-]+) -->",
    re.DOTALL | re.MULTILINE,
)
OPEN_RE = re.compile(r"^<!-- generated: ", re.MULTILINE)


def registry() -> dict:
    """Every registered block (the block modules imported)."""
    for module in MODULES:
        importlib.import_module(module)
    return BLOCKS


def doc_files(root: Path) -> list[Path]:
    """The documentation files that may hold generated blocks."""
    files = [root / f for f in FILES] + sorted((root / DOCS_DIR).glob("**/*.md"))
    return [f for f in files if f.exists()]


def names_in(text: str) -> list[str]:
    """The block names of a file's text, in order."""
    return [m.group("name") for m in BLOCK_RE.finditer(text)]


def render(text: str, src: Sources, where: str = "") -> str:
    """`text` with every generated block's body rewritten from `src`."""
    blocks = registry()
    if len(OPEN_RE.findall(text)) != len(BLOCK_RE.findall(text)):
        raise UserError(f"{where}: a '<!-- generated: NAME -->' marker has no matching end marker")

    def fill(m: re.Match) -> str:
        name = m.group("name")
        if m.group("end") != name:
            raise UserError(f"{where}: block {name!r} ends with the marker of {m.group('end')!r}")
        if name not in blocks:
            known = ", ".join(sorted(blocks))
            raise UserError(f"{where}: unknown generated block {name!r}; registered: {known}")
        body = blocks[name](src).rstrip("\n") + "\n"
        return f"{BEGIN.format(name=name)}\n{body}{END.format(name=name)}"

    return BLOCK_RE.sub(fill, text)


def stale(root: Path, results: Path) -> list[str]:
    """One entry per block whose committed text differs from what the records produce, with the
    first differing lines."""
    src, out = Sources(Path(root), Path(results)), []
    clear_memo()
    for path in doc_files(Path(root)):
        old = path.read_text(encoding="utf-8")
        new = render(old, src, src.rel(path))
        if new == old:
            continue
        olds, news = dict(_bodies(old)), dict(_bodies(new))
        for name in [n for n in names_in(old) if olds.get(n) != news.get(n)]:
            diff = difflib.unified_diff(
                olds[name].splitlines(), news[name].splitlines(), "committed", "records", n=0
            )
            lines = [d for d in diff if d[:1] in "+-" and d[:3] not in ("+++", "---")]
            out.append(f"{src.rel(path)}: block {name!r} is stale:\n  " + "\n  ".join(lines[:6]))
    return out


def _bodies(text: str) -> list[tuple[str, str]]:
    return [(m.group("name"), m.group("body")) for m in BLOCK_RE.finditer(text)]


def rewrite(root: Path, results: Path) -> list[Path]:
    """Rewrite every documentation file whose generated blocks changed; returns those files."""
    src, changed = Sources(Path(root), Path(results)), []
    clear_memo()
    for path in doc_files(Path(root)):
        old = path.read_text(encoding="utf-8")
        new = render(old, src, src.rel(path))
        if new != old:
            write_atomic(path, new)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("."), help="the repository root")
    ap.add_argument("--results", type=Path, default=None, help="default: <root>/results")
    ap.add_argument("--check", action="store_true", help="report stale blocks, rewrite nothing")
    args = ap.parse_args(argv)
    return one_line(lambda: _run(args))


def _run(args) -> int:
    results = args.results or args.root / "results"
    if args.check:
        found = stale(args.root, results)
        if found:
            print("\n".join(found), file=sys.stderr)
            print(f"{len(found)} generated blocks are stale: run `make docs`", file=sys.stderr)
            return 1
        print("every generated block matches the records")
        return 0
    changed = rewrite(args.root, results)
    print("\n".join(str(p) for p in changed) or "every generated block was up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
