"""logger=wandb in offline mode with no network: what the offline run directory holds."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from rbs_bench import config, report
from rbs_bench.config import UserError
from rbs_bench.loggers import NullLogger, make_logger
from rbs_bench.records import RecordStore, read_records

wandb = pytest.importorskip("wandb")
config.register_schemas()
DEAD = "http://127.0.0.1:9"  # nothing listens here: any network use fails


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """WANDB_MODE=offline, no API key, every route to the network closed."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_BASE_URL": DEAD,
        "HTTP_PROXY": DEAD,
        "HTTPS_PROXY": DEAD,
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
    }.items():
        monkeypatch.setenv(key, value)
    return tmp_path


def _cfg(*overrides):
    with initialize_config_module(config_module=config.CONFIG_MODULE, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def wandb_log(path: Path) -> list:
    """The protobuf records of a `run-*.wandb` file (LevelDB log framing, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, out, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]  # 1 full, 2 first, 3 middle, 4 last
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def _records(method: str, n: int) -> list[dict]:
    """Run records in the runner's schema (one per sample)."""
    return [
        {
            "experiment": "demo",
            "model": "tiny",
            "method": method,
            "method_fields": {"alpha": 0.1} if method != "dense" else {},
            "budget": "default",
            "task": "niah_single_1",
            "context_length": 1024,
            "index": i,
            "density": 1.0 if method == "dense" else 0.5 + 0.1 * i,
            "density_layers_heads": [[1.0, 0.5], [0.5, 0.25]],
            "prediction": f"answer {i}",
            "references": [f"answer {i}"],
            "meta": {},
            "score": 100.0 * (i % 2),
            "ttft_s": 0.01 * (i + 1),
            "selector_s": 0.001,
            "attention_s": 0.002,
        }
        for i in range(n)
    ]


def _offline_run(exp: Path) -> Path:
    (run,) = (exp / "wandb").glob("offline-run-*")
    return run


def _table(run: Path, key: str) -> dict:
    pattern = re.compile(rf"{key}_\d+_[0-9a-f]+\.table\.json")  # <key>_<step>_<hash>
    (path,) = [
        p for p in (run / "files" / "media" / "table").iterdir() if pattern.fullmatch(p.name)
    ]
    return json.loads(path.read_text())


def test_offline_run_holds_config_samples_tables_and_figures(offline):
    # logger.mode=online in the config: WANDB_MODE=offline in the environment wins
    cfg = _cfg("logger=wandb", "logger.mode=online", f"results_dir={offline / 'results'}")
    exp = offline / "results" / "runs" / "demo" / "tiny"
    recs = _records("dense", 3) + _records("rbs", 3)
    for method in ("dense", "rbs"):
        store = RecordStore(exp / method / "default" / "records.jsonl")
        for rec in recs:
            if rec["method"] == method:
                store.append(rec)
    report.write_summary(exp)

    logger = make_logger(cfg, exp, "demo")
    for rec in recs:
        logger.log_sample(rec)
    logger.log_summary(exp)
    logger.finish()
    wandb.teardown()  # the run file is written by wandb's service process: wait for it to close

    run = _offline_run(exp)
    log = wandb_log(next(run.glob("run-*.wandb")))
    (meta,) = [r.run for r in log if r.WhichOneof("record_type") == "run"]
    assert (meta.run_group, meta.display_name) == ("demo/tiny", "demo/tiny")
    logged_cfg = {item.key: json.loads(item.value_json) for item in meta.config.update}
    assert logged_cfg["experiment"] == "demo"
    assert logged_cfg["logger"]["name"] == "wandb"
    assert logged_cfg["results_dir"] == str(offline / "results")
    assert logged_cfg["method"]["name"] == cfg.method.name

    history = [
        {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in r.history.item
        }
        for r in log
        if r.WhichOneof("record_type") == "history"
    ]
    per_sample = [h for h in history if not any(k.startswith("records") for k in h)]
    assert len(per_sample) == len(recs)  # one step per recorded sample, in order
    for row, rec in zip(per_sample, recs):
        prefix = f"{rec['method']}/{rec['budget']}"
        for key in ("score", "density", "ttft_s", "selector_s", "attention_s"):
            assert row[f"{prefix}/{key}"] == pytest.approx(rec[key])

    table = _table(run, "records")
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert [(r["method"], r["index"]) for r in rows] == [(r["method"], r["index"]) for r in recs]
    for row, rec in zip(rows, recs):
        assert row["score"] == rec["score"] and row["density"] == pytest.approx(rec["density"])
        assert json.loads(row["density_layers_heads"]) == rec["density_layers_heads"]

    summary = _table(run, "summary")
    disk = (exp / "summary.csv").read_text().splitlines()
    assert summary["columns"] == disk[0].split(",")
    assert [r[0] for r in summary["data"]] == [line.split(",")[0] for line in disk[1:]]
    assert len(_table(run, "summary_by_task")["data"]) == 2
    (image,) = (run / "files" / "media" / "images").glob("score_vs_density_*.png")
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_mode_is_one_line(offline, monkeypatch):
    monkeypatch.delenv("WANDB_MODE")
    cfg = _cfg("logger=wandb", "logger.mode=sometimes")
    with pytest.raises(
        UserError, match=r"wandb mode 'sometimes' \(logger.mode, .*\) is not one of online, offline"
    ):
        make_logger(cfg, offline, "demo")


def test_logger_none_logs_nothing(offline):
    assert type(make_logger(_cfg(), offline, "demo")) is NullLogger


@pytest.mark.slow
def test_run_with_logger_wandb_offline(offline):
    """The runner with logger=wandb: one offline run holding every sample it recorded."""
    results = offline / "results"
    cmd = [
        sys.executable,
        "-m",
        "rbs_bench",
        "+experiment=ruler_budget",
        "method=dense",
        "budget=default",
        "benchmark.tasks=[niah_single_1]",
        "benchmark.context_lengths=[1024]",
        "benchmark.num_samples=2",
        "benchmark.max_new_tokens=4",
        "progress=false",
        "logger=wandb",
        f"results_dir={results}",
        f"hydra.run.dir={offline / 'outputs'}",
    ]
    env = dict(os.environ, RBS_BENCH_CACHE=str(offline / "cache"))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=offline)
    assert res.returncode == 0, res.stderr[-3000:]
    exp = results / "runs" / "ruler_budget" / "tiny"
    recs = read_records(exp / "dense" / "default" / "records.jsonl")
    table = _table(_offline_run(exp), "records")
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert [r["prompt_sha1"] for r in rows] == [r["prompt_sha1"] for r in recs]
    assert [r["density"] for r in rows] == [r["density"] for r in recs]
