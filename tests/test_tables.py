"""The paper's values file is well formed, and tables are rebuilt from run records alone."""

import csv
import json
from collections import Counter
from pathlib import Path

import pytest

from rbs_bench.records import RecordStore, seal
from rbs_bench.report import load_records, summarize
from rbs_bench.tables import build, layout, paper

ROOT = Path(__file__).resolve().parents[1]
VALUES = ROOT / "results" / "paper" / "paper_values.csv"


def _values() -> list[dict]:
    with open(VALUES, newline="") as f:
        return list(csv.DictReader(f))


# --- the paper's values ---------------------------------------------------------------------


def test_values_file_spot_checks():
    rows = _values()
    assert list(rows[0]) == paper.PAPER_COLUMNS
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
    assert build.main(["--results", str(results), "--paper-values", str(VALUES)]) == 0
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
        "4.50 / 70.00 [26.7, 93.7] (4.69 / 75.36)",
        "– (3.81 / 60.47)",
        "5.50 / **80.00** [33.7, 96.9] (5.34 / 80.28)",
    ]
    # A tie on accuracy: both bold.
    assert rows["1%"][1] == "2.00 / **30.00** [6.3, 73.3] (1.02 / 44.51)"
    assert rows["1%"][2] == "1.10 / **30.00** [6.3, 73.3] (1.80 / 60.36)"
    assert (
        "Dense (budget default, n=4): density / accuracy = 100.00 / 90.00 [41.7, 99.1] "
        "(100 / 89.69)." in md
    )
    assert "table tab:ruler_budget" in md
    for method, budget in [("dense", "default"), ("rbs", "d5"), ("rbs", "d1"), ("xattn", "d1")]:
        path = results / "runs/ruler_budget/qwen3_30b_a3b_fp8" / method / budget / "records.jsonl"
        assert f"- `{path}` (4 records)" in md
    tex = files["ruler_budget_qwen3_30b_a3b_fp8.tex"]
    assert "5\\% & 4.50 / 70.00 [26.7, 93.7] (4.69 / 75.36) & -- (3.81 / 60.47) & " in tex
    assert "5.50 / \\textbf{80.00} [33.7, 96.9] (5.34 / 80.28) \\\\" in tex
    assert "\\texttt{" + str(results).replace("_", "\\_") in tex
    assert "records.jsonl} (4)" in tex and "\\label{tab:ours_ruler_budget_qwen3" in tex


def test_ruler_budget_other_setting_shows_ours_alone(results):
    md = _build(results)["ruler_budget_tiny.md"]
    rows = _md_rows(md)
    assert rows["5%"] == ["4.50 / 70.00 [26.7, 93.7]", "–", "5.50 / **80.00** [33.7, 96.9]"]
    assert "(" not in "".join(rows["1%"])  # no paper values: another setting
    assert "= 100.00 / 90.00 [41.7, 99.1]." in md
    assert "Accuracy in brackets: its 95% Wilson interval" in md
    assert "Within noise: at n=4 samples the intervals reach +-34 points" in md
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


def _as_experiment(results, old: str, new: str) -> None:
    """The records of experiment `old` as a run of experiment `new` writes them (a record
    carries its experiment, and is read only in that experiment's folder)."""
    for path in (results / "runs" / old).rglob("records.jsonl"):
        lines = path.read_text().splitlines()
        recs = [seal(json.loads(line) | {"experiment": new}) for line in lines]
        path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in recs))
    (results / "runs" / old).rename(results / "runs" / new)


def test_unknown_experiment_gets_the_summary_table(results):
    _as_experiment(results, "ruler_budget", "my_sweep")
    files = _build(results)
    assert sorted(files) == ["my_sweep_qwen3_30b_a3b_fp8.md", "my_sweep_qwen3_30b_a3b_fp8.tex"] + [
        "my_sweep_tiny.md",
        "my_sweep_tiny.tex",
    ]
    rows = _md_rows(files["my_sweep_tiny.md"])
    assert rows["RBS-Attention"] == ["d5", "4", "5.50", "80.00 [33.7, 96.9]", "0.500"]
    assert "my_sweep/tiny/xattn/d1/records.jsonl" in files["my_sweep_tiny.md"]
    tex = files["my_sweep_tiny.tex"]
    assert "RBS-Attention & d1 & 4 & 1.10 & 30.00 [6.3, 73.3] & 0.500 \\\\" in tex


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
    ours = layout.cell_means(df, ["method", "budget"]).set_index(["method", "budget"])
    for _, r in overall.iterrows():
        got = ours.loc[(r["method"], r["budget"])]
        assert got["score"] == pytest.approx(r["score"]) and got["n"] == r["n"]
        assert got["density"] == pytest.approx(r["density"])


def test_no_records_is_not_an_error(tmp_path, capsys):
    assert build.main(["--results", str(tmp_path), "--paper-values", str(VALUES)]) == 0
    assert "no run records" in capsys.readouterr().err


def test_missing_values_file_is_one_line(tmp_path, capsys):
    assert build.main(["--results", str(tmp_path)]) == 2
    assert "paper_values.csv is missing" in capsys.readouterr().err


# --- the other experiments' layouts -----------------------------------------------------------


def _rec(root, experiment, model, method, budget, **fields):
    """Append one run record (defaults for every field a table needs)."""
    path = root / "runs" / experiment / model / method / budget / "records.jsonl"
    rec = dict(experiment=experiment, model=model, method=method, budget=budget)
    rec |= dict(budget_target=None, task="niah_single_1", context_length=131072, index=0)
    rec |= dict(score=0.0, density=1.0, ttft_s=0.1, meta={}, method_fields={}, prediction="")
    RecordStore(path).append(rec | fields)


def _tables(root) -> dict[str, str]:
    assert build.main(["--results", str(root), "--paper-values", str(VALUES)]) == 0
    return {p.name: p.read_text() for p in (root / "tables").iterdir()}


def test_strict_density_anchors_are_columns_with_the_paper_beside(tmp_path):
    m = "qwen3_30b_a3b_fp8"
    for method, dens, scores in (("flashprefill", 0.053, [80, 60]), ("rbs", 0.0534, [100, 80])):
        for i, score in enumerate(scores):
            _rec(
                tmp_path,
                "strict_density",
                m,
                method,
                "anchor0.0534",
                budget_target=0.0534,
                index=i,
                score=score,
                density=dens,
            )
    rows = _md_rows(_tables(tmp_path)[f"strict_density_{m}.md"])
    assert rows["Method"] == ["5.34% anchor"]
    assert rows["FlashPrefill"] == ["5.300 / 70.00 [17.4, 96.3] (5.300 / 74.73)"]
    assert rows["RBS-Attention"] == [
        "5.340 / **90.00** [27.9, 99.5] (5.340 / 80.28)"
    ]  # best in the column


def test_ruler_main_puts_density_under_each_method_with_overall(tmp_path):
    for method, acc, dens in (("dense", (90, 70), 1.0), ("rbs", (80, 60), 0.3)):
        for n, a in zip((4096, 8192), acc):
            for task in ("niah_single_1", "vt"):
                _rec(
                    tmp_path,
                    "ruler_main",
                    "qwen3_32b",
                    method,
                    "default",
                    task=task,
                    context_length=n,
                    score=a,
                    density=dens if n == 4096 else dens / 2,
                )
    md = _tables(tmp_path)["ruler_main_qwen3_32b.md"]
    table = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert table[0] == "| Method | 4K | 8K | Overall |"
    # Overall is the mean over lengths; the density row follows the accuracy row.
    assert table[1:3] == [
        "| Dense | 90.00 [27.9, 99.5] (93.30) | 70.00 [17.4, 96.3] (91.90) "
        "| 80.00 [33.7, 96.9] (89.52) |",
        "| density | 100.000 (100) | 50.000 (100) | 75.000 (100) |",
    ]
    assert table[3] == (
        "| RBS-Attention | **80.00** [22.3, 98.2] (91.10) | **60.00** [13.2, 93.7] (89.90) "
        "| 70.00 [26.7, 93.7] (88.65) |"
    )
    assert table[4] == "| density | 30.000 (73.030) | 15.000 (48.465) | 22.500 (31.109) |"


def test_longbench_splits_by_length_class_on_the_unit_scale(tmp_path):
    m = "qwen3_32b"
    classes = [("short", 100, 0.05), ("short", 0, 0.15), ("medium", 100, 0.1), ("long", 0, 0.3)]
    for method in ("dense", "rbs"):
        for i, (length, score, dens) in enumerate(classes):
            _rec(
                tmp_path,
                "longbench_v2",
                m,
                method,
                "default",
                task="all",
                index=i,
                score=score,
                density=1.0 if method == "dense" else dens,
                meta={"length": length},
            )
    rows = _md_rows(_tables(tmp_path)[f"longbench_v2_{m}.md"])
    assert rows["Method"] == ["Short", "Medium", "Long", "Total", "Density mean (%)", "p50", "p90"]
    rbs = rows["RBS-Attention"]
    assert rbs[:4] == [
        "**0.500** (0.411)",
        "**1.000** (0.353)",
        "**0.000** (0.361)",
        "**0.500** (0.376)",
    ]
    # density over the samples 5, 10, 15, 30: mean 15, median 12.5, p90 (linear) 15 + 0.7 x 15
    assert rbs[4:] == ["15.000 (9.719)", "12.500 (5.515)", "25.500 (20.172)"]
    assert rows["Dense"][0] == "0.500 (0.450)"  # the reference is never bold


def test_infinitebench_tasks_by_methods_with_macro_average(tmp_path):
    m = "qwen3_32b"
    for method, scores in (("dense", (100, 50)), ("xattn", (50, 50)), ("rbs", (0, 100))):
        for task, s in zip(("kv_retrieval", "passkey"), scores):
            _rec(tmp_path, "infinitebench", m, method, "default", task=task, score=s)
    rows = _md_rows(_tables(tmp_path)[f"infinitebench_{m}.md"])
    assert rows["Task"] == ["Dense", "XAttn", "RBS-Attention"]
    assert rows["Ret.KV"] == ["1.000 (0.244)", "**0.500** (0.194)", "0.000 (0.204)"]
    assert rows["Ret.PassKey"] == ["0.500 (1.000)", "0.500 (1.000)", "**1.000** (1.000)"]
    assert rows["Macro average"] == ["0.750 (0.372)", "0.500 (0.352)", "0.500 (0.362)"]


def test_videomme_splits_by_duration(tmp_path):
    for i, (dur, s) in enumerate((("short", 100), ("medium", 0), ("long", 100), ("long", 0))):
        _rec(
            tmp_path,
            "videomme",
            "tiny_vl",
            "rbs",
            "default",
            task="all",
            index=i,
            score=s,
            density=0.5,
            meta={"duration": dur},
        )
    rows = _md_rows(_tables(tmp_path)["videomme_tiny_vl.md"])
    assert rows["Method"] == ["Short", "Medium", "Long", "Total", "Density (%)"]
    assert rows["RBS-Attention"] == ["**100.0**", "**0.0**", "**50.0**", "**50.00**", "50.000"]


def test_bootstrap_ci_follows_its_rule():
    import pandas as pd

    one = lambda scores, task="t": pd.DataFrame(
        {"score": scores, "task": task, "context_length": 1}
    )
    assert layout.bootstrap_ci(one([70.0] * 5)) == (70.0, 70.0)  # no spread, no interval
    # two samples: resampled means are 0, 50 or 100 with probability 1/4, 1/2, 1/4
    assert layout.bootstrap_ci(one([0.0, 100.0])) == (0.0, 100.0)
    df = pd.concat([one([0.0, 100.0, 100.0, 0.0, 100.0], "a"), one([100.0] * 4, "b")])
    lo, hi = layout.bootstrap_ci(df)
    assert lo < layout.score_mean(df) == 80.0 < hi <= 100.0
    assert layout.bootstrap_ci(df) == (lo, hi)  # seeded: the same interval every build


def test_selector_ablation_has_ci_and_task_groups_with_the_paper_beside(tmp_path):
    m = "qwen3_30b_a3b_fp8"
    tasks = ("niah_single_1", "niah_multikey_2", "vt")
    for method in ("rbs", "centroid", "full_l2", "quest"):
        for task, s in zip(tasks, (100, 50, 0) if method == "rbs" else (0, 0, 0)):
            for i in range(2):
                _rec(
                    tmp_path,
                    "selector_ablation",
                    m,
                    method,
                    "anchor0.0534",
                    task=task,
                    index=i,
                    score=s,
                    density=0.0534,
                    budget_target=0.0534,
                )
    md = _tables(tmp_path)[f"selector_ablation_{m}.md"]
    first, second = md.split("\n## ")[1:]
    rows = _md_rows(first)
    assert list(rows)[1:] == ["Centroid-only", "Full-L2 bound", "Quest-style", "RBS adaptive union"]
    assert rows["RBS adaptive union"] == [
        "5.340 (5.350)",
        "**50.00** (76.67)",
        "[50.00, 50.00] ([69.01, 82.15])",  # each task's scores are equal: no spread
    ]
    assert rows["Centroid-only"][2] == "[0.00, 0.00] ([68.00, 81.21])"
    rows = _md_rows(second)
    # retrieval: niah tasks (100, 50) -> 75; multi-key: niah_multikey_2 only -> 50
    assert rows["RBS adaptive union"] == ["**75.00** (90.00)", "**50.00** (93.33)"]


def test_block_size_rows_show_the_calibrated_threshold(tmp_path):
    m = "qwen3_30b_a3b_fp8"
    for method, b, fields in (
        ("centroid", 64, {"alpha": 0.1, "block_size": 64}),
        ("rbs", 128, {"alpha_base": 0.2, "alpha_rescue": 0.16, "block_size": 128}),
    ):
        _rec(
            tmp_path,
            "block_size",
            m,
            method,
            f"anchor0.0534_B{b}",
            budget_target=0.0534,
            density=0.0534,
            score=80,
            method_fields=fields,
        )
    rows = _md_rows(_tables(tmp_path)[f"block_size_{m}.md"])
    assert rows["Selector"][0] == "Block size"
    assert rows["Centroid-only"] == ["64", "0.100 (0.100)", "5.340 (5.302)", "80.00 (74.17)"]
    assert rows["RBS union"] == ["128", "0.200", "5.340 (5.340)", "80.00 (80.28)"]  # "Reference"


def test_thresholds_rows_are_the_three_pairs(tmp_path):
    for model in ("qwen3_32b", "tiny"):
        for name, pair, dens in (
            ("aggressive", (0.24, 0.16), (0.05, 0.07)),
            ("conservative", (0.16, 0.24), (0.1, 0.1)),
        ):
            for i, d in enumerate(dens):
                fields = {"alpha_base": pair[0], "alpha_rescue": pair[1]}
                _rec(
                    tmp_path,
                    "thresholds",
                    model,
                    "rbs",
                    name,
                    index=i,
                    density=d,
                    score=50,
                    method_fields=fields,
                    context_length=131072 if model != "tiny" else 4096,
                )
    files = _tables(tmp_path)
    rows = _md_rows(files["thresholds_qwen3_32b.md"])
    assert list(rows) == ["Setting", "Conservative", "Aggressive"]
    # p90 of (5, 7) by linear interpolation: 6.8
    assert rows["Aggressive"] == [
        "0.24 (0.24)",
        "0.16 (0.16)",
        "6.000 (5.600)",
        "6.800 (6.078)",
        "50.00 (61.74)",
    ]
    assert "(" not in "".join(_md_rows(files["thresholds_tiny.md"])["Aggressive"])


def test_calibration_cost_from_calibration_records(tmp_path):
    import yaml

    def entry(target, error, seconds, gpus):
        return dict(
            target=target,
            knob=1.0,
            abs_error=error,
            seconds=seconds,
            gpus=gpus,
            prompts=50,
            forwards=150,
            context_length=131072,
            steps=3,
        )

    for model, gpus in (("qwen3_30b_a3b_fp8", 1), ("tiny", 0)):
        d = tmp_path / "runs" / "calibration_cost" / model
        d.mkdir(parents=True)
        data = {
            "model": model,
            "method": "rbs",
            "entries": [entry(0.02, 1e-5, 1800, gpus), entry(0.05, 4e-5, 1800, gpus)],
        }
        (d / "rbs.yaml").write_text(yaml.safe_dump(data))
    files = _tables(tmp_path)
    rows = _md_rows(files["calibration_cost_qwen3_30b_a3b_fp8.md"])
    assert rows["Method"][:5] == [
        "Configurations",
        "Wall hours",
        "GPU-hours",
        "Target density (%)",
        "Max. error (pp)",
    ]
    assert rows["RBS-Attention"] == [
        "2 (3)",
        "1.000 (0.443)",
        "1.000 (0.885)",
        "2/5 (5)",
        "0.0040 (0.0078)",
        "50",
        "300",
    ]
    tiny = _md_rows(files["calibration_cost_tiny.md"])["RBS-Attention"]
    assert tiny[2] == "–"  # no GPU: no GPU-hours
    assert (
        str(tmp_path / "runs/calibration_cost/tiny/rbs.yaml") in files["calibration_cost_tiny.md"]
    )


def test_paper_values_parts_join_numbered_columns():
    pv = paper.PaperValues.load(VALUES)
    assert pv.parts("tab:calibration", "MInference", "Target density") == "2/5/10"
    assert pv.parts("tab:calibration", "RBS-Attention", "Target density") == "5"
    assert pv.parts("tab:calibration", "RBS-Attention", "nosuch") is None


def test_recall_column_and_oracle_row_appear_when_runs_recorded_them(tmp_path):
    _put(tmp_path, "tiny", "dense", "default", None, 4096, [100, 80], [1, 1])
    _put(tmp_path, "tiny", "rbs", "d5", 0.05, 4096, [100, 60], [0.05, 0.06])
    _put(tmp_path, "tiny", "oracle", "d5", 0.05, 4096, [100, 100], [0.05, 0.05])
    for method, budget, recall in (("rbs", "d5", 0.5), ("oracle", "d5", 0.9)):
        path = tmp_path / "runs" / "ruler_budget" / "tiny" / method / budget / "records.jsonl"
        recs = [seal(json.loads(ln) | {"recall": recall}) for ln in path.read_text().splitlines()]
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))  # as if recorded so
    out = tmp_path / "tables"
    assert (
        build.main(["--results", str(tmp_path), "--out", str(out), "--paper-values", str(VALUES)])
        == 0
    )
    md = (out / "ruler_budget_tiny.md").read_text()
    rows = _md_rows(md)
    assert rows["Target"] == ["RBS-Attention", "Oracle"]
    # the oracle is a reference: never the bold best of a row
    # accuracy carries its 95% Wilson interval at n=4 (report.wilson)
    assert rows["5%"] == [
        "5.50 / **80.00** [33.7, 96.9] / 50.00",
        "5.00 / 100.00 [51.0, 100.0] / 90.00",
    ]
    assert "density / accuracy / recall" in md and "Recall: the share" in md
    dense = "Dense (budget default, n=4): density / accuracy / recall = 100.00 / 90.00 [41.7, 99.1]"
    assert f"{dense} / –." in md


@pytest.mark.parametrize(
    "benchmark, experiment, task",
    [
        ("ruler", "ruler_main", "niah_single_1"),
        ("longbench_v2", "longbench_v2", "all"),
        ("infinitebench", "infinitebench", "passkey"),
        ("videomme", "videomme", "all"),
    ],
)
def test_tables_score_with_the_benchmarks_own_aggregate(
    tmp_path, monkeypatch, benchmark, experiment, task
):
    import importlib

    module = importlib.import_module(f"rbs_bench.benchmarks.{benchmark}")
    calls = []
    real = module.aggregate

    def spy(df, *args, **kwargs):
        calls.append(len(df))
        return real(df, *args, **kwargs)

    monkeypatch.setattr(module, "aggregate", spy)
    for method in ("dense", "rbs"):
        for i, s in enumerate((100, 0)):
            meta = {"length": "short", "duration": "short"}
            _rec(tmp_path, experiment, "m", method, "default", task=task, index=i, score=s)
            _rec(tmp_path, experiment, "m", method, "default", task=task, index=i + 2, meta=meta)
    _tables(tmp_path)
    assert calls and set(calls) <= {2, 4}  # one cell's or one row's records at a time


def test_a_longbench_row_of_two_tasks_is_refused(tmp_path, capsys):
    for i, task in enumerate(("all", "cot")):
        _rec(tmp_path, "longbench_v2", "m", "rbs", "default", task=task, index=i, meta={})
    assert build.main(["--results", str(tmp_path), "--paper-values", str(VALUES)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tasks all, cot" in err[0] and "results_dir" in err[0]


def test_row_tables_gain_a_recall_column_and_grid_cells_a_recall_part(tmp_path):
    for method, recall in (("dense", 1.0), ("rbs", 0.8), ("oracle", None)):
        extra = {} if recall is None else {"recall": recall}
        meta = {"length": "short"}
        _rec(tmp_path, "longbench_v2", "m", method, "default", task="all", meta=meta, **extra)
        _rec(tmp_path, "infinitebench", "m", method, "default", task="passkey", **extra)
    tables = _tables(tmp_path)
    rows = _md_rows(tables["longbench_v2_m.md"])
    assert rows["Method"][-1] == "Recall (%)"
    assert [rows[m][-1] for m in ("Dense", "RBS-Attention", "Oracle")] == ["100.0", "80.0", "–"]
    ib = tables["infinitebench_m.md"]
    assert "attention recall (%) after the slash" in ib
    assert _md_rows(ib)["Ret.PassKey"][:2] == ["0.000 / 100.00", "**0.000** / 80.00"]


# --- paired comparisons ---------------------------------------------------------------------------


def test_sign_test_is_exact():
    from rbs_bench.tables.paired import holm, sign_test

    assert sign_test(5, 0) == pytest.approx(2 / 2**5)  # 0.0625: five of five does not resolve
    assert sign_test(0, 6) == pytest.approx(2 / 2**6)  # 0.03125: six of six does
    assert sign_test(3, 3) == 1.0 and sign_test(0, 0) == 1.0
    assert sign_test(8, 2) == pytest.approx(2 * (1 + 10 + 45) / 2**10)
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])


def test_tables_dagger_the_differences_the_paired_test_resolves(tmp_path):
    n = 12
    _put(tmp_path, "tiny", "dense", "default", None, 4096, [100] * n, [1] * n)
    _put(tmp_path, "tiny", "rbs", "d25", 0.25, 4096, [100] * n, [0.25] * n)
    # all 0 where rbs scores 100: 24 discordant pairs, resolved
    _put(tmp_path, "tiny", "xattn", "d25", 0.25, 4096, [0] * n, [0.25] * n)
    # two samples differ: within noise of rbs
    _put(tmp_path, "tiny", "flashprefill", "d25", 0.25, 4096, [0, 0] + [100] * (n - 2), [0.25] * n)
    files = _build(tmp_path)
    rows = _md_rows(files["ruler_budget_tiny.md"])
    assert rows["Target"] == ["FlashPrefill", "XAttn", "RBS-Attention"]
    flash, xattn, rbs = rows["25%"]
    assert xattn.endswith("†") and not flash.endswith("†") and not rbs.endswith("†")
    md = files["ruler_budget_tiny.md"]
    assert "differs from RBS-Attention's on the same samples" in md
    assert "Holm's correction over the table's 2 comparisons (1 resolved)" in md
    assert "24 paired samples per comparison" in md
    assert "$^{\\dagger}$" in files["ruler_budget_tiny.tex"]


# --- settings of an experiment, and whether a table can rank its methods -----------------------


def test_a_setting_of_an_experiment_gets_its_table_spec():
    from rbs_bench.tables import specs

    assert specs.spec_for("ruler_budget_16k") is specs.SPECS["ruler_budget"]
    assert specs.spec_for("selector_ablation_16k") is specs.SPECS["selector_ablation"]
    assert specs.spec_for("ruler_budget") is specs.SPECS["ruler_budget"]
    assert specs.spec_for("adhoc") is specs.SUMMARY


def test_discrimination_note_names_dense_and_the_largest_drop(results):
    md = _build(results)["ruler_budget_tiny.md"]
    # dense 90 on both tasks; at 1% rbs and xattn score (0 + 60) / 2 = 30 on each task
    assert (
        "Discrimination: dense scores 90.00% (n=4; niah_single_1 90.00%; vt 90.00%); at the "
        "lowest target, 1%, the largest drop below it is RBS-Attention's, 60.0 points (30.00%), "
        "so the table can rank methods." in md
    )


def _records(method, budget, target, scores, **fields):
    import pandas as pd

    return pd.DataFrame(
        dict(method=method, budget=budget, budget_target=target, task="niah_single_1")
        | dict(context_length=16384, index=i, score=s, density=0.05 if target else 1.0)
        | dict(method_fields=dict(fields), source=f"{method}/{budget}/records.jsonl")
        for i, s in enumerate(scores)
    )


def test_a_table_whose_methods_stay_near_dense_says_it_cannot_rank_them():
    import pandas as pd

    df = pd.concat(
        [
            _records("dense", "default", None, [100] * 9 + [0]),
            _records("rbs", "d5", 0.05, [100] * 8 + [0, 0]),
            _records("rbs", "d10", 0.1, [0] * 10),  # far below, but not at the lowest target
        ]
    )
    (note,) = layout.discrimination_note(df, layout.score_mean)
    assert "dense scores 90.00% (n=10); at the lowest target, 5%" in note
    assert "RBS-Attention's, 10.0 points (80.00%), so the table can rank" in note
    df.loc[(df["budget"] == "d5") & (df["index"] == 8), "score"] = 100
    (note,) = layout.discrimination_note(df, layout.score_mean)
    assert "0.0 points (90.00%), less than 10: no method falls clearly below dense" in note
    assert layout.discrimination_note(df[df["method"] != "dense"], layout.score_mean) == []


def test_block_size_table_holds_every_block_size_and_dense_once():
    import pandas as pd

    from rbs_bench.tables import specs

    df = pd.concat(
        [_records("dense", "default", None, [100, 100], block_size=64)]
        + [
            _records(m, f"anchor0.1103_B{b}", 0.1103, [100, 0], block_size=b, alpha=0.1)
            for m in ("centroid", "rbs")
            for b in (64, 128, 256)
        ]
    )
    df["model"] = "tiny"
    pv = paper.PaperValues.load(VALUES)
    (table,) = specs.BLOCK_SIZE.build(df, "block_size_16k", "tiny", pv)
    labels = [tuple(c.ours[0] for c in row[:2]) for row in table.rows]
    assert labels == [("Dense", "–")] + [
        (name, str(b)) for name in ("Centroid-only", "RBS union") for b in (64, 128, 256)
    ]
    assert "target 11.03%" in table.title
    assert any(n.startswith("Discrimination: dense scores 100.00% (n=2)") for n in table.notes)


def test_rows_that_are_not_methods_show_the_reference_as_a_line():
    import pandas as pd

    from rbs_bench.tables import specs

    df = pd.concat(
        [_records("dense", "default", None, [100, 100, 100, 0])]
        + [
            _records("rbs", name, None, [100, 100, 0, 0], alpha_base=a, alpha_rescue=r)
            for name, a, r in (("default", 0.22, 0.18), ("aggressive", 0.24, 0.16))
        ]
    )
    df["model"] = "tiny"
    (table,) = specs.THRESHOLDS.build(df, "thresholds_16k", "tiny", paper.PaperValues.load(VALUES))
    assert [row[0].ours[0] for row in table.rows] == ["Default", "Aggressive"]
    assert table.lead == ["Dense (n=4): density 100.00%, accuracy 75.00 [30.1, 95.4]."]
    assert [row[-1].ours[0] for row in table.rows] == ["50.00", "50.00"]  # dense not mixed in


def test_a_ttft_note_names_each_process_whose_rows_it_shows():
    import pandas as pd

    from rbs_bench.tables.blocks_speed import _runs

    one = pd.DataFrame(
        {"run": ["2026-11-28T03:19:40"] * 2, "method": ["dense", "rbs"], "gemm_ms_per_layer": 22.9}
    )
    assert _runs(one) == "run 2026-11-28. One layer's GEMMs alone: 22.9 ms."
    two = pd.concat([one, one.assign(run="2026-11-28T07:26:32", method="flashprefill")])
    two = two.reset_index(drop=True).assign(gemm_ms_per_layer=[22.9, 22.9, 25.6, 25.6])
    note = _runs(two)
    assert note.startswith("measured in 2 processes: 2026-11-28 03:19 (dense, RBS-Attention;")
    assert "2026-11-28 07:26 (FlashPrefill; one layer's GEMMs alone: 25.6 ms)" in note
