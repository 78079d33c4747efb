"""The RULER evaluation of a trained model: job commands, the table, bad input."""

import json
import sys

import pytest

from rbs_bench.tinylm import evaluate


def _record(task, length, index, score, pred="x"):
    return {
        "task": task,
        "context_length": length,
        "index": index,
        "score": score,
        "references": ["1234567"],
        "prediction": pred,
    }


def test_table_merges_the_records_under_out(tmp_path):
    for sub, recs in {
        "a/niah_single_1-4096/runs/adhoc/tiny/dense/default": [
            _record("niah_single_1", 4096, 0, 100.0),
            _record("niah_single_1", 4096, 1, 0.0, pred=" 7654321"),
        ],
        "b/vt-8192/runs/adhoc/tiny/dense/default": [_record("vt", 8192, 0, 40.0)],
        "b/niah_single_2-4096/runs/adhoc/tiny/dense/default": [
            _record("niah_single_2", 4096, 0, 100.0)
        ],
    }.items():
        (tmp_path / sub).mkdir(parents=True)
        lines = "".join(json.dumps(r) + "\n" for r in recs) + '{"torn'  # a torn last line
        (tmp_path / sub / "records.jsonl").write_text(lines)
    table = evaluate.table(tmp_path).splitlines()
    assert table[0] == "| task | 4096 | 8192 |"
    rows = [line for line in table if line.startswith("| ") and "task" not in line]
    # offline tasks first, then the essay ones; mean score (samples) per length
    assert rows == [
        "| niah_single_1 | 50.0 (2) | - |",
        "| vt | - | 40.0 (1) |",
        "| niah_single_2 | 100.0 (1) | - |",
    ]
    assert "- niah_single_1 @ 4096: refs ['1234567'] -> ' 7654321'" in table


def test_job_command_runs_dense_on_the_model(tmp_path):
    cmd = evaluate.job_command("/m", ["vt"], 8192, 20, tmp_path, "cuda", "/e.txt", None)
    assert cmd[:3] == [sys.executable, "-m", "rbs_bench"]
    for part in (
        "method=dense",
        "model.hf_id=/m",
        "benchmark.tasks=[vt]",
        "benchmark.context_lengths=[8192]",
        "benchmark.num_samples=20",
        "device=cuda",
        "model.dtype=auto",
        "+benchmark.data.essays=/e.txt",
    ):
        assert part in cmd


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--tasks", "niah_single_2"], "need an essay haystack: give --essays PATH"),
        (["--model", "/nonexistent"], "holds no config.json"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, extra, message):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", str(tmp_path / "m"), "--out", str(tmp_path / "o"), *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.slow
def test_evaluates_a_model_through_the_runner(tmp_path, monkeypatch):
    from rbs_bench.models import tiny

    model = tiny.materialize(tmp_path / "cache")  # the random model: checks the plumbing
    evaluate.main(
        [
            "--model",
            str(model),
            "--out",
            str(tmp_path / "o"),
            "--tasks",
            "niah_single_1",
            "--lengths",
            "1024",
            "--samples",
            "1",
            "--device",
            "cpu",
            "--max-new-tokens",
            "4",
            "--jobs",
            "1",
        ]
    )
    table = (tmp_path / "o" / "table.md").read_text()
    assert "| niah_single_1 | 0.0 (1) |" in table
