"""The paper's values file agrees with the paper, and tables are rebuilt from run records alone."""

import csv
import re
from collections import Counter
from pathlib import Path

import pytest

from rbs_bench import tables
from rbs_bench.records import RecordStore
from rbs_bench.report import load_records, summarize

ROOT = Path(__file__).resolve().parents[1]
VALUES = ROOT / "results" / "paper" / "paper_values.csv"
TEX = ROOT.parent / "shared" / "paper" / "rbs_attention.tex"
needs_tex = pytest.mark.skipif(not TEX.exists(), reason=f"{TEX} not beside the checkout")


def _values() -> list[dict]:
    with open(VALUES, newline="") as f:
        return list(csv.DictReader(f))


# --- the paper's values ---------------------------------------------------------------------


@needs_tex
def test_values_file_agrees_with_a_fresh_parse_of_the_paper():
    assert tables.check_paper_values(TEX, VALUES) == []


@needs_tex
def test_every_value_is_printed_on_its_line():
    """Independent of the parser: each number, with its thousands separators, is on tex_line,
    and bold ones are inside \\textbf there; the file has exactly the paper's bold numbers."""
    lines = TEX.read_text().splitlines()
    rows = _values()
    for r in rows:
        whole, dot, frac = r["value"].partition(".")
        printed = f"{int(whole):,}{dot}{frac}"
        line = lines[int(r["tex_line"]) - 1]
        assert re.search(rf"(?<![\d.,]){re.escape(printed)}(?!\d|[.,]\d)", line), r
        if r["bold"] == "1":
            assert f"\\textbf{{{printed}}}" in line, r
    bold_in_tex = len(re.findall(r"\\textbf\{[\d.,]+\}", TEX.read_text()))
    assert sum(r["bold"] == "1" for r in rows) == bold_in_tex


def test_values_file_spot_checks():
    rows = _values()
    assert list(rows[0]) == tables.PAPER_COLUMNS
    cells = {(r["table"], r["row"], r["column"]): r for r in rows}
    assert len(cells) == len(rows)  # (table, row, column) is a key

    def value(*key):
        return cells[key]["value"]

    assert value("tab:ruler_budget", "5%", "RBS-Attention:density") == "5.34"
    assert value("tab:ruler_budget", "5%", "RBS-Attention:accuracy") == "80.28"
    assert cells["tab:ruler_budget", "5%", "RBS-Attention:accuracy"]["bold"] == "1"
    assert value("tab:ruler_budget", "Dense", "Dense:accuracy") == "89.69"
    assert value("tab:ruler_budget", "1%", "XAttn:density") == "1.02"
    assert value("tab:ruler", "MInference", "4K:density") == "100.000"
    assert value("tab:longbench_dual", "Qwen3-32B:RBS-Attention", "Accuracy:Total") == "0.376"
    assert value("tab:selector_ablation", "Quest-style", "95% CI:high") == "80.47"
    assert value("tab:a100_sweep", "RBS-Attention:5", "TTFT gain") == "4.47"
    assert value("tab:a100_throughput", "128K:1", "Dense wall time (ms)") == "19709.12"
    assert value("tab:threshold_sensitivity", "Qwen3-30B-A3B FP8:Default", "alpha_base") == "0.22"
    assert value("tab:peak_memory", "RBS-Attention", "128K:reserved") == "64.016"
    assert ("tab:strict_density", "XAttn", "2.03% anchor:density") not in cells  # a dash
    assert ("tab:block_sensitivity", "RBS union:128", "Calibration parameter") not in cells
    per_table = Counter(r["table"] for r in rows)
    assert per_table["tab:ruler_budget"] == 4 * 5 * 2 + 2
    assert per_table["tab:a100_sweep"] == 5 + 18 * 6
    assert len(per_table) == 19


# --- tables from run records ------------------------------------------------------------------


def _put(root, model, method, budget, target, length, scores, densities):
    store = RecordStore(root / "runs" / "ruler_budget" / model / method / budget / "records.jsonl")
    for i, (score, density) in enumerate(zip(scores, densities)):
        for task in ("niah_single_1", "vt"):
            store.append(
                dict(experiment="ruler_budget", model=model, method=method, budget=budget)
                | dict(budget_target=target, task=task, context_length=length, index=i)
                | dict(score=score, density=density, ttft_s=0.5, meta={})
            )


@pytest.fixture
def results(tmp_path):
    for model, length in (("qwen3_30b_a3b_fp8", 131072), ("tiny", 4096)):
        _put(tmp_path, model, "dense", "default", None, length, [100, 80], [1, 1])
        _put(tmp_path, model, "rbs", "d5", 0.05, length, [100, 60], [0.05, 0.06])
        _put(tmp_path, model, "flashprefill", "d5", 0.05, length, [100, 40], [0.05, 0.04])
        _put(tmp_path, model, "rbs", "d1", 0.01, length, [0, 60], [0.01, 0.012])
        _put(tmp_path, model, "xattn", "d1", 0.01, length, [0, 60], [0.02, 0.02])
    return tmp_path


def _build(results):
    out = results / "tables"
    assert tables.main(["--results", str(results), "--paper-values", str(VALUES)]) == 0
    return {p.name: p.read_text() for p in out.iterdir()}


def _md_rows(md: str) -> dict[str, list[str]]:
    rows = [ln.strip("|").split(" | ") for ln in md.splitlines() if ln.startswith("| ")]
    return {r[0].strip(): [c.strip() for c in r[1:]] for r in rows}


def test_ruler_budget_paper_setting_shows_paper_beside_ours(results):
    files = _build(results)
    md = files["ruler_budget_qwen3_30b_a3b_fp8.md"]
    rows = _md_rows(md)
    assert rows["Target"] == ["FlashPrefill", "XAttn", "RBS-Attention"]
    assert list(rows) == ["Target", "1%", "5%"]
    # rbs d5: density (5+6)/2 = 5.50, accuracy (100+60)/2 = 80.00, best of the row.
    assert rows["5%"] == [
        "4.50 / 70.00 (4.69 / 75.36)",
        "– (3.81 / 60.47)",
        "5.50 / **80.00** (5.34 / 80.28)",
    ]
    # A tie on accuracy: both bold.
    assert rows["1%"][1] == "2.00 / **30.00** (1.02 / 44.51)"
    assert rows["1%"][2] == "1.10 / **30.00** (1.80 / 60.36)"
    assert "Dense (budget default, n=4): density / accuracy = 100.00 / 90.00 (100 / 89.69)." in md
    assert "table tab:ruler_budget" in md
    for method, budget in [("dense", "default"), ("rbs", "d5"), ("rbs", "d1"), ("xattn", "d1")]:
        path = results / "runs/ruler_budget/qwen3_30b_a3b_fp8" / method / budget / "records.jsonl"
        assert f"- `{path}` (4 records)" in md
    tex = files["ruler_budget_qwen3_30b_a3b_fp8.tex"]
    assert "5\\% & 4.50 / 70.00 (4.69 / 75.36) & -- (3.81 / 60.47) & " in tex
    assert "5.50 / \\textbf{80.00} (5.34 / 80.28) \\\\" in tex
    assert "\\texttt{" + str(results).replace("_", "\\_") in tex
    assert "records.jsonl} (4)" in tex and "\\label{tab:ours_ruler_budget_qwen3" in tex


def test_ruler_budget_other_setting_shows_ours_alone(results):
    md = _build(results)["ruler_budget_tiny.md"]
    rows = _md_rows(md)
    assert rows["5%"] == ["4.50 / 70.00", "–", "5.50 / **80.00**"]
    assert "(" not in "".join(rows["1%"])
    assert "= 100.00 / 90.00." in md
    assert "are for another setting (model qwen3_30b_a3b_fp8, context_length 131072)" in md
    assert "this table is model tiny, context_length 4096" in md
    assert str(results / "runs/ruler_budget/tiny/rbs/d5/records.jsonl") in md


def test_paper_model_at_another_length_gets_no_paper_values(tmp_path):
    _put(tmp_path, "qwen3_30b_a3b_fp8", "rbs", "d5", 0.05, 65536, [100], [0.05])
    _put(tmp_path, "qwen3_30b_a3b_fp8", "rbs", "d5", 0.05, 131072, [100], [0.05])
    md = _build(tmp_path)["ruler_budget_qwen3_30b_a3b_fp8.md"]
    first, second = md.split("## ")[1:]
    assert "context length 65536" in first and "(5.34 / 80.28)" not in first
    assert "context length 131072" in second and "(5.34 / 80.28)" in second


def test_unknown_experiment_gets_the_summary_table(results):
    (results / "runs" / "ruler_budget").rename(results / "runs" / "my_sweep")
    files = _build(results)
    assert sorted(files) == ["my_sweep_qwen3_30b_a3b_fp8.md", "my_sweep_qwen3_30b_a3b_fp8.tex"] + [
        "my_sweep_tiny.md",
        "my_sweep_tiny.tex",
    ]
    rows = _md_rows(files["my_sweep_tiny.md"])
    assert rows["rbs"] == ["d5", "4", "5.50", "80.00", "0.500"]
    assert "my_sweep/tiny/xattn/d1/records.jsonl" in files["my_sweep_tiny.md"]
    assert "rbs & d1 & 4 & 1.10 & 30.00 & 0.500 \\\\" in files["my_sweep_tiny.tex"]


def test_experiments_without_cell_records_are_skipped(results, capsys):
    obs = results / "runs" / "observations" / "tiny"
    obs.mkdir(parents=True)
    (obs / "records.jsonl").write_text('{"prompt": 0}\n')  # beside, not under, method/budget
    files = _build(results)
    assert "ruler_budget_tiny.md" in files and not any(f.startswith("observations") for f in files)
    assert "observations/tiny: no table" in capsys.readouterr().err


def test_cell_means_is_summarize_on_the_cell_keys(results):
    df = load_records(results / "runs" / "ruler_budget" / "tiny")
    _, overall = summarize(df)
    ours = tables.cell_means(df, ["method", "budget"]).set_index(["method", "budget"])
    for _, r in overall.iterrows():
        got = ours.loc[(r["method"], r["budget"])]
        assert got["score"] == pytest.approx(r["score"]) and got["n"] == r["n"]
        assert got["density"] == pytest.approx(r["density"])


def test_no_records_is_not_an_error(tmp_path, capsys):
    assert tables.main(["--results", str(tmp_path), "--paper-values", str(VALUES)]) == 0
    assert "no run records" in capsys.readouterr().err


def test_missing_values_file_is_one_line(tmp_path, capsys):
    assert tables.main(["--results", str(tmp_path)]) == 2
    assert "paper_values.csv is missing" in capsys.readouterr().err
