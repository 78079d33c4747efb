"""The GPU clock sampler of the TTFT rows (`rbs_bench.bench.gpu_clocks`) on the CPU: parsing
nvidia-smi's samples, the summary, and a run against a stand-in nvidia-smi on PATH."""

from __future__ import annotations

import os
import stat
import time
import types

import pytest
import torch

from rbs_bench.bench import gpu_clocks


def test_samples_parse_and_summarise():
    text = "1980, 150.5, 0x0000000000000000\n1500, 690.0, 0x0000000000000004\n"
    text += "[N/A], 10.0, 0x0\nFailed to read\n1520, 689.0, 0x0000000000000005\n"
    samples = gpu_clocks.parse_samples(text)
    assert samples == [(1980.0, 150.5, 0), (1500.0, 690.0, 4), (1520.0, 689.0, 5)]
    got = gpu_clocks.summarise(samples)
    assert got["sm_clock_mhz"] == pytest.approx(5000 / 3)
    assert got["power_w"] == pytest.approx(1529.5 / 3)
    assert got["power_capped_share"] == pytest.approx(2 / 3)
    assert gpu_clocks.summarise([]) == {}


def test_the_sampler_reads_a_stand_in_nvidia_smi(tmp_path, monkeypatch):
    """The sampler passes the devices' UUIDs and the interval, and its summary is the samples
    the tool printed while the block ran; without CUDA devices or without the tool: nothing."""
    args_file = tmp_path / "args"
    tool = tmp_path / "nvidia-smi"
    tool.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > {args_file}\n'
        'echo "1600, 680.0, 0x0000000000000004"\n'
        'echo "1980, 200.0, 0x0000000000000000"\n'
        "exec sleep 30\n"
    )
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    props = types.SimpleNamespace(uuid="1234-abcd")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    with gpu_clocks.ClockSampler([0], interval_ms=50) as clocks:
        deadline = time.time() + 10
        while not args_file.exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the two samples written
    assert clocks.summary() == {"sm_clock_mhz": 1790.0, "power_w": 440.0, "power_capped_share": 0.5}
    args = args_file.read_text().split()
    assert args[args.index("-i") + 1] == "GPU-1234-abcd" and args[args.index("-lms") + 1] == "50"
    with gpu_clocks.ClockSampler([torch.device("cpu")]) as clocks:
        pass
    assert clocks.summary() == {}
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    with gpu_clocks.ClockSampler([0]) as clocks:
        pass
    assert clocks.summary() == {}
