"""The trainer on a micro model: a few CPU steps, reproducible, resumable, with its outputs."""

import json
import math

import pytest
import torch

from rbs_bench.tinylm import data, train

MICRO = dict(
    preset="micro",
    stages="256:2,320:2",
    tokens_per_step=640,
    workers=0,
    log_every=1,
    warmup=2,
    device="cpu",
)


def _run(out, stop_at=None, **overrides):
    s = train.resolve(train.Settings(out=str(out), **{**MICRO, **overrides}))
    return train.train(s, stop_at=stop_at, progress=False)


def test_training_is_reproducible_and_resumable(tmp_path):
    a = _run(tmp_path / "a")
    _run(tmp_path / "b", stop_at=2)
    assert not (tmp_path / "b" / "model").exists()
    _run(tmp_path / "b")  # the same command again continues from the checkpoint
    weights = [(p / "model" / "model.safetensors").read_bytes() for p in (a, tmp_path / "b")]
    assert weights[0] == weights[1]

    log = [json.loads(x) for x in (a / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert [r["length"] for r in log] == [256, 256, 320, 320]
    assert all(math.isfinite(r["loss_answer"]) and 0 <= r["acc_tokens"] <= 1 for r in log)
    assert (a / "loss_curve.png").stat().st_size > 0
    run = json.loads((a / "run.json").read_text())
    assert run["steps"] == 4 and run["determinism"] == "strict"
    assert "--stages 256:2,320:2" in run["command"]
    summary = json.loads((a / "summary.json").read_text())
    assert summary["steps"] == 4 and len(summary["model_sha256"]) == 64

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(a / "model")
    tok = AutoTokenizer.from_pretrained(a / "model")
    assert model.config.num_hidden_layers == 2 and model.dtype == torch.bfloat16
    assert tok.decode(tok.encode("key: 123", add_special_tokens=False)) == "key: 123"


def test_init_starts_from_a_trained_model(tmp_path):
    first = _run(tmp_path / "first")
    s = train.resolve(
        train.Settings(out=str(tmp_path / "second"), init=str(first / "model"), **MICRO)
    )
    model = train.build_model(s.model, seed=123, init=s.init)
    saved = train.build_model(s.model, seed=0, init=str(first / "model")).state_dict()
    assert all(torch.equal(p, saved[n]) for n, p in model.state_dict().items())
    with pytest.raises(train.UsageError, match="config differs in num_hidden_layers"):
        train.build_model({**s.model, "num_hidden_layers": 3}, 0, str(first / "model"))


def test_resume_refuses_other_settings(tmp_path):
    _run(tmp_path / "r", stop_at=1)
    with pytest.raises(train.UsageError, match="other settings .*lr"):
        _run(tmp_path / "r", lr=1e-3)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--stages", "1024"], "is not length:steps"),
        (["--stages", "100:5"], "length >= "),
        (["--mixture", "kv_single=1,riddles=2"], "unknown 'riddles'"),
        (["--fillers", "copula=x"], "is not name=number"),
        (["--preset", "micro", "--tokens-per-step", "128"], "is below stage length"),
        (["--init", "/nonexistent"], "no config.json there"),
    ],
)
def test_bad_arguments_fail_with_one_line(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        train.main(["--out", str(tmp_path / "x"), "--stages", "512:1", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_lr_warms_up_then_decays_to_its_floor():
    s = train.Settings(out="x", lr=1e-3, warmup=10, min_lr_ratio=0.1)
    assert train.lr_at(0, 100, s) == pytest.approx(1e-4)
    assert train.lr_at(9, 100, s) == pytest.approx(1e-3)
    assert train.lr_at(100, 100, s) == pytest.approx(1e-4)
    lrs = [train.lr_at(i, 100, s) for i in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_answer_accuracy_scores_whole_answers():
    # two answers (kv_single, then a recall target); the second has one wrong token
    tgt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    task = torch.full((1, 9), -1, dtype=torch.int8)
    task[0, 2:4] = data.TASKS.index("kv_single")  # targets 1..2
    task[0, 6:9] = data.RECALL  # targets 5..7
    ids = torch.cat([torch.tensor([[4]]), tgt], dim=1)
    logits = torch.nn.functional.one_hot(tgt, 16).float()
    logits[0, 6] = torch.nn.functional.one_hot(torch.tensor(0), 16).float()  # one miss
    acc = train.answer_accuracy(logits, ids, task)
    assert acc["exact_by_task"] == {"kv_single": 1.0, "recall": 0.0}
    assert acc["exact"] == 1.0 and acc["answers"] == 1 and acc["acc_tokens"] == 1.0
