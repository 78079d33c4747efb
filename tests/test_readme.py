"""The README is a front page a newcomer reads in minutes, and every link of it and of the docs
resolves: to a file of the repository, and to a heading of that file where it names one."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CARD = ROOT / "src" / "rbs_bench" / "tinylm" / "weights" / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), CARD]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), not an image
MAX_LINES = 250


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces
    to hyphens), outside code blocks."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    out = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def _broken(page: Path, root: Path = ROOT) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_file() or root.resolve() not in dest.parents:
            bad.append(f"{page.relative_to(root)}: {target} (no such file in the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return bad


def test_the_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; keep it to {MAX_LINES}"


def test_every_link_of_the_readme_and_the_docs_resolves():
    assert LINK.findall(README.read_text()), "the README links its docs"
    bad = [b for page in PAGES for b in _broken(page)]
    assert bad == []


def test_the_link_check_catches_a_missing_file_and_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "results.md").write_text((ROOT / "docs" / "results.md").read_text())
    page = tmp_path / "docs" / "probe.md"
    page.write_text("[a](nosuch.md) [b](results.md#nosuch) [c](results.md#tables-and-figures)\n")
    assert [b.split(": ", 1)[1] for b in _broken(page, tmp_path)] == [
        "nosuch.md (no such file in the repository)",
        "results.md#nosuch (no such heading)",
    ]
