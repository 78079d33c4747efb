"""The measured figures of README.md, docs/ and the model card are generated blocks: each one
matches what the committed records produce, an edited record makes its block stale, and a bad
marker stops `make docs` with one line."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from rbs_bench.errors import UserError
from rbs_bench.tables import docs
from rbs_bench.tables.blocks import Sources

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"


def test_every_generated_block_matches_the_committed_records():
    assert docs.stale(ROOT, RESULTS) == [], "run `make docs` and commit the rewritten files"


def test_every_registered_block_is_used_and_every_used_block_is_registered():
    used = {name for f in docs.doc_files(ROOT) for name in docs.names_in(f.read_text())}
    assert used == set(docs.registry())


def _copy_with(tmp_path: Path, page: str, edited: str) -> Path:
    """A repository of one docs page, the config its blocks read, and the results, every file
    linked to the committed one except `edited`, which is copied."""
    root = tmp_path / "repo"
    for rel in [page, "conf/experiment/ruler_budget.yaml"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, root / rel)
    for path in RESULTS.rglob("*"):
        if path.is_dir():
            continue
        rel = path.relative_to(ROOT)
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if str(rel) == edited:
            shutil.copy(path, dst)
        else:
            dst.symlink_to(path)
    return root


def test_an_edited_record_makes_its_block_stale(tmp_path):
    edited = "results/speed/cpu_samples_cpu.csv"
    root = _copy_with(tmp_path, "docs/quickstart.md", edited)
    assert docs.stale(root, root / "results") == []
    df = pd.read_csv(root / edited)
    df.loc[df["method"] == "dense", "request_s"] += 0.5  # a slower dense request
    df.to_csv(root / edited, index=False)
    found = docs.stale(root, root / "results")
    assert len(found) == 1 and "docs/quickstart.md: block 'cpu_samples' is stale" in found[0]
    # the command says so and rewrites nothing; without --check it rewrites the block
    check = [sys.executable, "-m", "rbs_bench.tables.docs", "--root", str(root), "--check"]
    out = subprocess.run(check, capture_output=True, text=True)
    assert out.returncode == 1 and "cpu_samples" in out.stderr
    assert docs.rewrite(root, root / "results") == [root / "docs" / "quickstart.md"]
    assert docs.stale(root, root / "results") == []


def test_a_bad_marker_stops_with_one_line(tmp_path):
    src = Sources(tmp_path, tmp_path / "results")
    unknown = "<!-- generated: nosuch (make docs; do not edit) -->\n"
    unknown += "<!-- end generated: nosuch -->\n"
    with pytest.raises(UserError, match="unknown generated block 'nosuch'"):
        docs.render(unknown, src, "README.md")
    with pytest.raises(UserError, match="no matching end marker"):
        docs.render("<!-- generated: cpu_samples -->\ntext\n", src, "README.md")
    # an indented marker (an example in a code block) is text, not a block
    example = "```\n  <!-- generated: nosuch -->\n  <!-- end generated: nosuch -->\n```\n"
    assert docs.render(example, src, "README.md") == example
    (tmp_path / "README.md").write_text(unknown)
    check = [sys.executable, "-m", "rbs_bench.tables.docs", "--root", str(tmp_path), "--check"]
    out = subprocess.run(check, capture_output=True, text=True)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
