"""The GPUs' SM clock and power draw while timed work runs, sampled by `nvidia-smi`.

A GPU held at its power limit lowers its SM clock (the software power cap), and everything it
runs then, the GEMMs included, takes longer. A long dense prefill at 128K keeps an H200 there
for seconds; a sparse one much less. The TTFT rows therefore record the clock and power over
their timed requests, so that a difference in the time outside attention can be read against
the clock it ran at.

`ClockSampler` runs `nvidia-smi --query-gpu=... -lms INTERVAL` beside the work and summarises
its samples (mean SM clock in MHz, mean power draw in W, the share of samples with the software
power cap among the clock event reasons). Where there is no CUDA device or no `nvidia-smi`, it
records nothing and the row has no such columns.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess

import torch

FIELDS = "clocks.sm,power.draw,clocks_event_reasons.active"
SW_POWER_CAP = 0x4  # nvidia-smi's clock event reason bit: software power scaling


def parse_samples(text: str) -> list[tuple[float, float, int]]:
    """(SM clock MHz, power W, event reasons) of each sample line of `FIELDS` (csv, noheader,
    nounits); lines that do not parse (an "[N/A]" field, a message) are skipped."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            samples.append((float(parts[0]), float(parts[1]), int(parts[2], 16)))
        except ValueError:
            continue
    return samples


def summarise(samples: list[tuple[float, float, int]]) -> dict:
    """The row's columns from the samples: sm_clock_mhz and power_w (means), power_capped_share
    (samples with `SW_POWER_CAP` set); {} without samples."""
    if not samples:
        return {}
    return {
        "sm_clock_mhz": statistics.fmean(s[0] for s in samples),
        "power_w": statistics.fmean(s[1] for s in samples),
        "power_capped_share": sum(bool(s[2] & SW_POWER_CAP) for s in samples) / len(samples),
    }


def _gpu_ids(devices: list) -> list[str]:
    """nvidia-smi's names of these CUDA devices: their UUIDs, which do not depend on
    CUDA_VISIBLE_DEVICES' renumbering."""
    ids = []
    for d in devices:
        uuid = str(torch.cuda.get_device_properties(d).uuid)
        ids.append(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    return ids


class ClockSampler:
    """`with ClockSampler(devices) as clocks: ...` samples the CUDA devices (indices or
    `torch.device`s; others are left out) every `interval_ms` while
    the block runs; `clocks.summary()` gives the row's columns afterwards ({} where nothing
    could be sampled)."""

    def __init__(self, devices: list, interval_ms: int = 100):
        self.devices = [d for d in devices if isinstance(d, int) or torch.device(d).type == "cuda"]
        self.interval_ms = interval_ms
        self._proc: subprocess.Popen | None = None
        self._text = ""

    def __enter__(self) -> ClockSampler:
        exe = shutil.which("nvidia-smi")
        if exe and self.devices:
            cmd = [exe, f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits"]
            cmd += ["-i", ",".join(_gpu_ids(self.devices)), "-lms", str(self.interval_ms)]
            try:
                self._proc = subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
                )
            except OSError:
                self._proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._text, _ = self._proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._text, _ = self._proc.communicate()
        self._proc = None

    def summary(self) -> dict:
        return summarise(parse_samples(self._text))
