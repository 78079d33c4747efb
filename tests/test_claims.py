"""The claims table decides each claim from fixture records: supported, contradicted, not
resolved, and the speed rows against a timing CSV."""

from pathlib import Path

import pandas as pd

from rbs_bench import methods
from rbs_bench.records import RecordStore
from rbs_bench.tables import claims, paper

ROOT = Path(__file__).resolve().parents[1]
VALUES = ROOT / "results" / "paper" / "paper_values.csv"
N = 40


def _cell(root, method, budget, target, scores):
    path = root / "runs" / "ruler_budget_16k" / "tiny" / method / budget / "records.jsonl"
    store = RecordStore(path)
    for i, score in enumerate(scores):
        store.append(
            dict(experiment="ruler_budget_16k", model="tiny", method=method, budget=budget)
            | dict(budget_target=target, task="niah_multikey_2", context_length=16384, index=i)
            | dict(score=score, density=target or 1.0, ttft_s=0.1, meta={})
        )


def _fixture(root: Path) -> None:
    head = methods.headline()
    contenders = [m for m in methods.compared() if m != head and not methods.info(m).reference]
    better, worse, same = contenders[:3]
    _cell(root, "dense", "default", None, [100] * N)
    _cell(root, head, "d5", 0.05, [100] * (N // 2) + [0] * (N // 2))
    _cell(root, better, "d5", 0.05, [100] * N)  # every sample above RBS's half
    _cell(root, worse, "d5", 0.05, [0] * N)  # every sample below
    _cell(root, same, "d5", 0.05, [0] * (N // 2) + [100] * (N // 2))  # 20 up, 20 down: a tie
    speed = root / "speed"
    speed.mkdir()
    rows = [("sdpa_cudnn", 1.0, 250.0), ("sdpa_fa2", 1.0, 400.0), (head, 0.05, 10.0)]
    pd.DataFrame(
        dict(gpu="GPU X", inputs="synthetic", n=131072, method=m, target=t, density=t)
        | dict(executor="triton", total_ms=ms)
        for m, t, ms in rows
    ).to_csv(speed / "attention_gpu_x.csv", index=False)
    return better, worse, same


def _rows(md: str) -> dict[str, list[str]]:
    rows = [ln.strip("|").split(" | ") for ln in md.splitlines() if ln.startswith("| ")]
    return {r[0].strip(): [c.strip() for c in r[1:]] for r in rows[1:]}


def test_claims_table_gives_each_verdict_from_the_records(tmp_path):
    better, worse, same = _fixture(tmp_path)
    pv = paper.PaperValues.load(VALUES)
    written = claims.build(tmp_path, tmp_path / "tables", pv)
    assert sorted(p.name for p in written) == ["claims_tiny.md", "claims_tiny.tex"]
    md = (tmp_path / "tables" / "claims_tiny.md").read_text()
    rows = _rows(md)
    head = methods.display(methods.headline())
    verdict = lambda other: rows[
        f"{head} at least as accurate as {methods.display(other)} at 5% density"
    ]
    # the headline scores 50 against 100 / 0 / 50 (20 samples each way)
    assert verdict(better)[-1] == "contradicted"
    assert verdict(better)[2].startswith("-50.0 [") and verdict(better)[2].endswith("n=40")
    assert verdict(worse)[-1] == "supported"
    assert verdict(same)[-1] == "not resolved at this n"
    assert verdict(same)[4] == "1"  # p after Holm
    a, b = (
        pv.get("tab:ruler_budget", "5%", f"{m}:accuracy") for m in (head, methods.display(better))
    )
    assert verdict(better)[1] == (f"{a} vs {b}" if a and b else "–")  # the paper's, as printed
    (speed,) = [r for name, r in rows.items() if "standalone" in name]
    assert speed[2] == "25.00x" and speed[-1] == "supported"  # 250 ms (cuDNN) / 10 ms
    assert "1 supported" not in md and "2 supported" in md and "1 contradicted" in md
    assert "ruler_budget_16k/tiny/dense/default/records.jsonl` (40 records)" in md
    assert "\\label{tab:claims_tiny}" in (tmp_path / "tables" / "claims_tiny.tex").read_text()


def test_no_claims_table_without_records_of_a_claim(tmp_path):
    (tmp_path / "runs" / "speed_only" / "tiny").mkdir(parents=True)
    assert claims.build(tmp_path, tmp_path / "tables", paper.PaperValues.load(VALUES)) == []


def test_decide_marks_the_sign_only_where_holm_resolves_it():
    ev = lambda diff, p: claims.Evidence(100, diff, diff - 1, diff + 1, p, "", "")
    rows = [claims.Claim("a", "", "", ev(5.0, 0.001)), claims.Claim("b", "", "", ev(-5.0, 0.001))]
    rows += [claims.Claim("c", "", "", ev(5.0, 0.03)), claims.Claim("d", "", "", ev(1.0, 0.2))]
    rows += [claims.Claim("e", "", "")]
    claims.decide(rows)
    resolved, unresolved = ["supported", "contradicted"], ["not resolved at this n"] * 2
    assert [c.verdict for c in rows] == resolved + unresolved + ["no records"]
    # Holm over four: 0.001 x 4, 0.001 x 3 (kept monotone), 0.03 x 2, 0.2 x 1
    assert [round(c.p_holm, 6) for c in rows[:4]] == [0.004, 0.004, 0.06, 0.2]
