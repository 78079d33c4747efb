"""Run records survive a kill mid-write, and the summary is built from them alone."""

import json
import math

import pytest

from rbs_bench import report
from rbs_bench.config import UserError
from rbs_bench.records import RecordStore, check_fingerprint, read_records


def _rec(i, method="rbs", score=100.0, density=0.5):
    return {
        "task": "niah_single_1",
        "context_length": 4096,
        "index": i,
        "method": method,
        "budget": "default",
        "score": score,
        "density": density,
        "ttft_s": 0.1,
    }


def test_torn_line_is_dropped_and_resume_appends(tmp_path):
    path = tmp_path / "records.jsonl"
    store = RecordStore(path)
    store.append(_rec(0))
    store.append(_rec(1))
    with open(path, "a") as f:
        f.write(json.dumps(_rec(2))[:25])  # killed mid-write
    assert len(read_records(path)) == 2
    store = RecordStore(path)
    assert store.done(("niah_single_1", 4096, 1)) and not store.done(("niah_single_1", 4096, 2))
    store.append(_rec(2))
    assert [r["index"] for r in read_records(path)] == [0, 1, 2]
    assert path.read_text().count("\n") == 3


def test_store_refuses_nan(tmp_path):
    with pytest.raises(ValueError):
        RecordStore(tmp_path / "r.jsonl").append(_rec(0, score=float("nan")))


def test_fingerprint_mismatch_names_the_key(tmp_path):
    check_fingerprint(tmp_path / "cell.json", {"method.alpha": 0.2, "model.name": "tiny"})
    check_fingerprint(tmp_path / "cell.json", {"method.alpha": 0.2, "model.name": "tiny"})
    with pytest.raises(UserError, match=r"method.alpha=0.2, not 0.3"):
        check_fingerprint(tmp_path / "cell.json", {"method.alpha": 0.3, "model.name": "tiny"})


def test_summary_tables_and_plot(tmp_path):
    exp = tmp_path / "runs" / "exp" / "tiny"
    for method, scores, dens in (("dense", [100, 100], 1.0), ("rbs", [100, 0], 0.25)):
        store = RecordStore(exp / method / "default" / "records.jsonl")
        for i, s in enumerate(scores):
            store.append(_rec(i, method, s, dens))
    overall = report.write_summary(exp)
    assert overall["method"].tolist() == ["dense", "rbs"]
    assert overall["score"].tolist() == [100.0, 50.0]
    assert overall["density"].tolist() == [1.0, 0.25]
    md = (exp / "summary.md").read_text()
    assert "| Dense | default | 2 | 100.00 | [34.2, 100.0] | 1.0000 |" in md
    assert "| RBS-Attention | default | 2 | 50.00 | [9.5, 90.5] | 0.2500 |" in md
    assert "Within noise: with n=2 samples per cell the 95% intervals are up to +-41" in md
    assert "rbs/default/records.jsonl" in md  # names the records it used
    assert (exp / "score_vs_density.png").stat().st_size > 1000


def test_summary_splits_by_meta_categories(tmp_path):
    exp = tmp_path / "runs" / "exp" / "tiny"
    store = RecordStore(exp / "rbs" / "default" / "records.jsonl")
    for i, (diff, score) in enumerate([("easy", 100.0), ("easy", 0.0), ("hard", 0.0)]):
        store.append(_rec(i) | {"score": score, "meta": {"difficulty": diff, "domain": "qa"}})
    report.write_summary(exp)
    table = (exp / "summary_by_difficulty.csv").read_text().splitlines()
    assert table[0] == "method,display,budget,difficulty,n,score,density,ci95_low,ci95_high"
    assert table[1].startswith("rbs,RBS-Attention,default,easy,2,50.0,0.5,9.45312")
    assert table[2].startswith("rbs,RBS-Attention,default,hard,1,0.0,0.5,0.0,79.345")
    assert not (exp / "summary_by_domain.csv").exists()  # one value: nothing to split
    assert "## By difficulty" in (exp / "summary.md").read_text()


def test_wilson_interval_matches_the_textbook():
    lo, hi = report.wilson(50.0, 10)  # 5 of 10: (0.2366, 0.7634)
    assert (round(lo, 2), round(hi, 2)) == (23.66, 76.34)
    lo, hi = report.wilson(100.0, 6)  # all right: the interval still has width
    assert hi == 100.0 and round(lo, 1) == 61.0
    assert report.wilson(0.0, 6)[0] == pytest.approx(0.0, abs=1e-9)
    assert all(map(math.isnan, report.wilson(50.0, 0)))
