"""The fast-path check: which methods it covers, its command line, and the rows a method's
`FastPath` asks for (on the CPU, with a toy selector and the timers replaced)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import torch

from rbs_bench import methods
from rbs_bench.bench import fast_paths
from rbs_bench.methods.info import FastPath, MethodInfo

COMMITTED = Path(__file__).parents[2] / "results/speed/fast_paths_nvidia_h100_80gb_hbm3.csv"


def test_the_methods_with_a_triton_fast_path_are_covered_in_table_order():
    names = fast_paths.fast_path_methods()
    assert names == ["flexprefill", "minference"]
    for name in names:
        assert methods.build(name, impl="triton").impl == "triton"  # both paths are fields


def test_methods_without_a_fast_path_are_refused_in_one_line(capsys):
    assert fast_paths.main(["--methods", "rbs", "minference", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "(flexprefill, minference); got rbs, nosuch" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_without_cuda_the_check_stops(capsys):
    assert fast_paths.main(["--methods", "minference"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@dataclass(frozen=True)
class ToySelection:
    """A selection of kept block pairs with its own `attend` (output: q plus a per-executor
    offset, so each executor's error is known)."""

    keep: torch.Tensor
    offsets = {"ref": 0.0, "close": 1e-4, "far": 1.0}

    def mask(self) -> torch.Tensor:
        return self.keep

    def density(self) -> float:
        return float(self.keep.float().mean())

    def attend(self, q, k, v, executor="ref"):
        return q + self.offsets[executor]


def toy_class(name: str, fast_path: FastPath) -> type:
    @dataclass(frozen=True)
    class Toy:
        """Keeps the first `ratio` of 10 pairs; its Triton path drops `lost` of them."""

        ratio: float = 0.5
        tau: float = 0.1  # read by nothing: a field an `also` setting can vary
        lost: int = 0
        impl: str = "auto"

        knob = "ratio"
        knob_direction = 1
        knob_range = (0.0, 1.0)
        block_size = 64
        is_dense = False
        info = MethodInfo(display=name, fast_path=fast_path)

        def select(self, q, k, scale=None) -> ToySelection:
            keep = torch.arange(10) < round(10 * self.ratio)
            if self.impl == "triton" and self.lost:
                keep[: self.lost] = False
            return ToySelection(keep)

    Toy.name = name
    return Toy


@pytest.fixture
def toy(monkeypatch):
    """Register toy methods, each from a FastPath; the timers and calibration replaced."""
    calibrated = {}
    monkeypatch.setattr(methods, "_REGISTRY", methods.registry())
    monkeypatch.setattr(fast_paths, "calibrate", lambda name, q, k, t: (calibrated[name], None))
    monkeypatch.setattr(fast_paths, "do_bench", lambda fn, rep_ms: (fn(), 1.5)[1])
    monkeypatch.setattr(fast_paths, "peak_workspace_mib", lambda fn: (2.0, fn()))

    def register(fast_path: FastPath, name: str = "toy", **fields) -> None:
        cls = toy_class(name, fast_path)
        methods._REGISTRY[name] = cls
        calibrated[name] = cls(**fields)

    return register


def rows_of(name: str, **common) -> list[dict]:
    q = torch.zeros(1, 2, 8, 4)
    return fast_paths.method_rows(name, q, q, q, 0.05, dict(common), rep_ms=1)


def test_each_also_setting_is_checked_and_recorded(toy):
    toy(FastPath(also=({"ratio": 1.0},)), lost=1)
    assert fast_paths.fast_path_methods()[-1] == "toy"
    rows = rows_of("toy")
    assert [(r["path"], r["ratio"], r["density"]) for r in rows] == [
        ("torch", 0.5, 0.5),
        ("triton", 0.5, 0.4),
        ("torch", 1.0, 1.0),
        ("triton", 1.0, 0.9),
    ]
    assert [(r["differ"], r["differ_share"], r["check"]) for r in rows] == [
        (1, 1 / 5, "MISMATCH"),
        (1, 1 / 5, "MISMATCH"),
        (1, 1 / 10, "MISMATCH"),
        (1, 1 / 10, "MISMATCH"),
    ]
    assert {r["stage"] for r in rows} == {"selector"}
    assert fast_paths.varied_fields(["toy"]) == ["ratio"]


def test_executors_are_timed_on_the_calibrated_triton_selection(toy):
    toy(FastPath(compare=lambda got, want: (0, 7), executors=("ref", "close")))
    rows = rows_of("toy")
    assert [(r["stage"], r["path"]) for r in rows] == [
        ("selector", "torch"),
        ("selector", "triton"),
        ("executor", "ref"),
        ("executor", "close"),
    ]
    assert [r["differ"] for r in rows[:2]] == [0, 0] and "ratio" not in rows[0]
    assert [r["max_err_vs_fp32"] for r in rows[2:]] == [0.0, pytest.approx(1e-4)]
    assert {r["check"] for r in rows} == {"ok"}


def test_an_executor_past_twice_the_references_error_is_a_mismatch(toy):
    toy(FastPath(executors=("ref", "far")))
    assert [r["check"] for r in rows_of("toy")[2:]] == ["MISMATCH", "MISMATCH"]


def test_rows_keep_the_committed_csv_columns(toy):
    """A method with an `also` setting of tau, then one with executors, under main's common
    columns: the columns of the committed H100 table, in its order."""
    toy(FastPath(also=({"tau": 1.0},)), name="a")
    toy(FastPath(executors=("ref", "close")), name="b")
    common = {"gpu": "g", "n": 8, "target": 0.05, "heads": 2, "kv_heads": 2, "head_dim": 4}
    rows = rows_of("a", **common) + rows_of("b", **common)
    assert list(pd.DataFrame(rows).columns) == list(pd.read_csv(COMMITTED, nrows=0).columns)
