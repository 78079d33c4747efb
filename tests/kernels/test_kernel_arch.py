"""Which architecture's tuned configurations the kernels launch with (`kernel_arch`,
RBS_KERNEL_ARCH), checked without a GPU by standing in for torch's device queries."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from rbs_bench.kernels import block_sparse_attn as bsa
from rbs_bench.kernels import fp8_gemm, triton_util
from rbs_bench.kernels.triton_util import ARCH_ENV, kernel_arch


@pytest.fixture
def gpu(monkeypatch):
    """A fake CUDA device of the capability the test sets (`gpu(9, 0)`)."""
    monkeypatch.delenv(ARCH_ENV, raising=False)

    def set_capability(major, minor):
        triton_util._capability.cache_clear()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (major, minor))

    yield set_capability
    triton_util._capability.cache_clear()


def test_cpu_tensors_have_no_gpu_architecture():
    assert kernel_arch("cpu") == 0
    assert kernel_arch(torch.device("cpu")) == 0


@pytest.mark.parametrize("cap, want", [((9, 0), 90), ((8, 0), 80), ((8, 9), 89), ((10, 0), 100)])
def test_the_gpus_own_architecture(gpu, cap, want):
    gpu(*cap)
    assert kernel_arch() == want == kernel_arch("cuda") == kernel_arch(torch.device("cuda", 0))


def test_an_older_architecture_can_be_forced(gpu, monkeypatch):
    gpu(9, 0)
    monkeypatch.setenv(ARCH_ENV, "sm80")
    assert kernel_arch("cuda") == 80
    monkeypatch.setenv(ARCH_ENV, "auto")
    assert kernel_arch("cuda") == 90


@pytest.mark.parametrize("value, message", [("sm90", "newer architecture"), ("a100", "not one")])
def test_bad_forcing_is_one_line(gpu, monkeypatch, value, message):
    gpu(8, 0)
    monkeypatch.setenv(ARCH_ENV, value)
    with pytest.raises(ValueError, match=message) as err:
        kernel_arch("cuda")
    assert "\n" not in str(err.value)


def test_tuning_spaces_follow_the_architecture(gpu, monkeypatch):
    gpu(9, 0)
    assert bsa.tuning_space("cuda") is bsa.HOPPER_SPACE
    assert fp8_gemm.tuning_space("cuda") is fp8_gemm.HOPPER_SPACE
    monkeypatch.setenv(ARCH_ENV, "sm80")
    assert bsa.tuning_space("cuda") is bsa.SM80_SPACE
    assert fp8_gemm.tuning_space("cuda") is fp8_gemm.ADA_SPACE
    gpu(8, 0)
    monkeypatch.delenv(ARCH_ENV)
    assert bsa.tuning_space("cuda") is bsa.SM80_SPACE


def test_the_autotune_setting_times_the_whole_space_or_its_first_entry(monkeypatch):
    AUTOTUNE_ENV, autotune_space = triton_util.AUTOTUNE_ENV, triton_util.autotune_space
    space = bsa.HOPPER_SPACE
    for value, want in (("full", space), ("", space), ("first", space[:1]), (" First ", space[:1])):
        monkeypatch.setenv(AUTOTUNE_ENV, value)
        assert autotune_space(space) == want
    monkeypatch.delenv(AUTOTUNE_ENV)
    assert autotune_space(space) == space
    monkeypatch.setenv(AUTOTUNE_ENV, "fast")
    with pytest.raises(ValueError, match="not one of full, first") as err:
        autotune_space(space)
    assert "\n" not in str(err.value)


class _Tuner:
    """The part of triton's Autotuner that ChoiceStore uses: arg_names, cache, fn, run; run
    prunes a key it has not tuned and takes the last pruned entry as the fastest."""

    arg_names = ["x", "N"]

    def __init__(self, configs, store):
        self.configs, self.cache, self.timed = configs, {}, []
        self.fn = SimpleNamespace(cache_key="source-digest", __name__="kernel")
        self.store = store
        store.attach(self)

    def run(self, *args, **kwargs):
        nargs = dict(zip(self.arg_names, args))
        key = (nargs["N"], str(nargs["x"].dtype))
        if key not in self.cache:
            pruned = self.store.prune(self.configs, nargs, **kwargs)
            self.timed.append(len(pruned))
            self.cache[key] = pruned[-1]


def test_the_tuned_configuration_persists_for_the_next_process(monkeypatch, tmp_path):
    """A new process (a new store and tuner) times only the stored choice of a key tuned before;
    a new key, or a damaged file, times the whole space again."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    configs = [triton_util.triton.Config({"BLOCK": b}) for b in (16, 32, 64)]
    x = torch.zeros(2, dtype=torch.float16)
    first = _Tuner(configs, triton_util.ChoiceStore(configs, ["N"]))
    first.run(x, 1024)
    first.run(x, 1024)  # tuned in this process: not pruned again
    (stored,) = (tmp_path / "rbs_bench_autotune").glob("kernel-*.json")
    second = _Tuner(configs, triton_util.ChoiceStore(configs, ["N"]))
    second.run(x, 1024)
    second.run(x.double(), 1024)  # another dtype is another key
    assert first.timed == [3] and second.timed == [1, 3]
    assert second.cache[(1024, "torch.float16")] is configs[2]
    stored.write_text("{not json")
    third = _Tuner(configs, triton_util.ChoiceStore(configs, ["N"]))
    third.run(x, 1024)
    assert third.timed == [3]


def test_tuning_choices_are_kept_only_where_asked(monkeypatch):
    """RBS_BENCH_AUTOTUNE_CACHE=1 (parallel's cells) prunes through a ChoiceStore; unset (the
    speed benches) the tuner times its space in each process."""
    seen = []
    monkeypatch.setattr(
        triton_util.triton, "autotune", lambda **kw: seen.append(kw) or (lambda fn: fn)
    )
    monkeypatch.setattr(triton_util, "INTERPRET", False)
    configs = [triton_util.triton.Config({"BLOCK": b}) for b in (16, 32)]
    monkeypatch.delenv(triton_util.AUTOTUNE_CACHE_ENV, raising=False)
    triton_util.autotune(configs, ["N"])
    monkeypatch.setenv(triton_util.AUTOTUNE_CACHE_ENV, "1")
    triton_util.autotune(configs, ["N"])
    assert "prune_configs_by" not in seen[0] and "prune_configs_by" in seen[1]


def test_the_ampere_space_is_pointer_only_and_uncapped():
    """No TMA descriptors and no register caps (which spill on sm_80), and tiles within an
    A100's 164 KB of shared memory: (K + V tiles) x stages + the query tile, bf16, D = 128."""
    assert bsa.SM80_SPACE and len(set(bsa.SM80_SPACE)) == len(bsa.SM80_SPACE)
    for bn, _warps, stages, maxnreg, _merge, tma, order, bm in bsa.SM80_SPACE:
        assert not tma and maxnreg is None and order in (0, 1, 2)
        assert (2 * bn * 128 * 2) * stages + bm * 128 * 2 <= 164 * 1024
    assert any(c[5] for c in bsa.HOPPER_SPACE)  # TMA only in the Hopper space


def test_a_choice_that_cannot_be_stored_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "choice.json"
    target.mkdir()  # a folder in the way: the rename fails
    triton_util._write_json(target, {"index": 0})
    assert [p.name for p in tmp_path.iterdir()] == ["choice.json"]
