"""The rows of a TTFT run: one per (model, layers, dtype, batch, N, method, target, feed-forward
chunk, compiled), in ttft_<device>.csv, rewritten after each row; a rerun skips finished rows.

Columns (times in ms; CUDA events on a GPU, perf_counter on a CPU):
- ttft_ms: request to first generated token on the host: prompt ids to the device, prefill
  forward filling the KV cache with the LM head at the last position, greedy pick, the token
  copied back: the prefill's own forward yields the first token, as vLLM's TTFT counts it.
  decode_ms: the decode step that follows (one token through the cache), reported beside it.
- attention_ms: sum over layers of the prefill attention calls (events around the attention
  function: selector and sparse attention for a method, SDPA for dense); selector_ms: the selector
  calls inside them; sparse_attention_ms = attention_ms - selector_ms.
- density: kept / causal block pairs, mean over layers, heads and sequences of the timed prefill
  (`PrefillRecorder`); calibration_density: the same on the captured dense activations.
- peak_allocated_mib / peak_reserved_mib: torch.cuda.max_memory_allocated / max_memory_reserved
  over this method's timed requests (cache emptied and peaks reset between methods); model_mib:
  the weights. On a CPU: parameters and buffers plus the peak of one request's own allocations
  (torch profiler memory events, on the first warm-up request); there is no reserved pool.
- block_stats_mib: one layer's per-key-block summaries that the method's rule reads (centroid,
  radius, beta, min/max box, mean-pooled keys), as its implementation builds them on this device;
  empty for methods whose estimate keeps none. selector_workspace_mib: the peak of one select()
  call on one layer beyond its inputs, less the selection it returns (selection_mib).
- sm_clock_mhz / power_w (GPU): the SM clock and power draw over the timed requests, means of
  `nvidia-smi` samples every 100 ms on the model's GPUs; power_capped_share: the share of samples
  with the software power cap lowering the clock (`rbs_bench.bench.gpu_clocks`). Absent where
  nvidia-smi is not there.
- prompts_per_s = batch / TTFT, tokens_per_s = batch x N / TTFT; ttft_speedup and
  attention_speedup: dense's time over the method's at the same N and batch.
- outside_ms_per_layer = (ttft_ms - attention_ms) / layers: the part of the prefill outside
  attention, per layer (it also holds the embedding, the final norm, the LM head at one position
  and the token's copy to the host, which are small beside a layer). gemm_ms_per_layer (CUDA):
  the GEMMs of one decoder layer alone on the request's batch x N tokens, timed in the same run
  on the layer's own weights (`rbs_bench.bench.roofline.gemm_reference_ms`: projections,
  router, the experts' grouped GEMMs with the rows spread evenly, or a dense MLP);
  outside_x_gemm = outside_ms_per_layer / gemm_ms_per_layer, the roofline ratio an inference
  engine brings near 1.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import torch

from rbs_bench import methods
from rbs_bench.bench.ttft_setup import Settings
from rbs_bench.records import write_atomic

KEY = ("model", "layers", "dtype", "batch", "n", "method", "target", "ffn_chunk_tokens", "compile")


def _chunk_key(value) -> int:
    """ffn_chunk_tokens as a key: 0 for unchunked (None, or a row written before the column)."""
    return 0 if value is None or pd.isna(value) else int(value)


def row_key(r: dict) -> tuple:
    """The row's identity (KEY), normalised so that rows written before a column still match."""
    return tuple(
        float(r[k])
        if k == "target"
        else _chunk_key(r.get(k))
        if k == "ffn_chunk_tokens"
        else as_bool(r.get(k))  # rows from before the column ran eager
        if k == "compile"
        else (int(r[k]) if k in ("layers", "batch", "n") else str(r[k]))
        for k in KEY
    )


def plan(s: Settings) -> list[tuple[int, int, str]]:
    """(batch, N, method) in run order: every batch-1 row first (largest N first, dense first in
    each N), then the larger batches."""
    order = lambda names: sorted(names, key=lambda m: (m != methods.DENSE, s.methods.index(m)))
    out = []
    for b in s.batches:
        ns, names = (s.contexts, s.methods) if b == 1 else (s.batch_contexts, s.batch_methods)
        out += [(b, n, m) for n in ns for m in order(names)]
    return out


def derive(df: pd.DataFrame) -> pd.DataFrame:
    """Add ttft_speedup and attention_speedup: dense's time over the row's, same model, batch, N."""
    derived = ["ttft_speedup", "attention_speedup", "outside_ms_per_layer", "outside_x_gemm"]
    df = df.drop(columns=derived, errors="ignore")
    if df.empty:
        return df
    # rows from before the column ran their feed-forward blocks unchunked: 0
    chunk = df["ffn_chunk_tokens"] if "ffn_chunk_tokens" in df else pd.Series(0, index=df.index)
    df["ffn_chunk_tokens"] = chunk.fillna(0).astype(int)
    # rows from before the column ran every layer eagerly
    df["compile"] = df["compile"].map(as_bool) if "compile" in df else False
    keys = ["model", "layers", "dtype", "batch", "n", "ffn_chunk_tokens", "compile"]
    ok = df["status"] == "ok"
    dense = df[ok & (df["method"] == methods.DENSE)].drop_duplicates(keys, keep="last")
    dense = dense[keys + ["ttft_ms", "attention_ms"]].rename(
        columns={"ttft_ms": "_dense_ttft", "attention_ms": "_dense_attn"}
    )
    df = df.merge(dense, on=keys, how="left")
    df["ttft_speedup"] = df["_dense_ttft"] / df["ttft_ms"]
    df["attention_speedup"] = df["_dense_attn"] / df["attention_ms"]
    df["outside_ms_per_layer"] = (df["ttft_ms"] - df["attention_ms"]) / df["layers"]
    gemm = df["gemm_ms_per_layer"] if "gemm_ms_per_layer" in df else math.nan
    df["outside_x_gemm"] = df["outside_ms_per_layer"] / gemm
    return df.drop(columns=["_dense_ttft", "_dense_attn"])


def load_rows(csv: Path) -> list[dict]:
    """The CSV's rows, less the derived columns (recomputed on every write)."""
    if not csv.exists():
        return []
    df = pd.read_csv(csv).drop(columns=["ttft_speedup", "attention_speedup"], errors="ignore")
    return df.to_dict("records")


def as_bool(value) -> bool:
    """A CSV cell written from a bool ('True'/'False', or a parsed bool)."""
    return str(value).strip().lower() == "true"


def write_rows(csv: Path, rows: list[dict]) -> pd.DataFrame:
    """Write every row with its derived columns in one atomic replace; returns the frame."""
    df = derive(pd.DataFrame(rows))
    write_atomic(csv, df.to_csv(index=False))
    return df


def versions() -> dict:
    """The versions of torch, Triton and transformers that every row records."""
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
    }


def target_of(s: Settings, name: str) -> float:
    """The row's target density: the run's, or 1 for dense."""
    return 1.0 if name == methods.DENSE else s.target


def experts_impl(config) -> str:
    """transformers' MoE experts implementation (grouped_mm, eager, ...); '' without experts."""
    if not hasattr(config, "num_experts"):
        return ""
    return str(getattr(config, "_experts_implementation", "") or "")


def device_name(device: torch.device) -> str:
    """The GPU's name, or 'cpu'."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def row_line(r) -> str:
    """One finished row as the line the run prints."""
    if r["status"] != "ok":
        return f"b={r['batch']} N={r['n']:>6} {r['method']:12s} {r['status']}"
    flag = "" if as_bool(r["target_reached"]) else " (target not reached)"
    speed = ""
    if not pd.isna(r.get("ttft_speedup")):
        speed = f"  x{r['attention_speedup']:.2f} attn  x{r['ttft_speedup']:.2f} TTFT"
    outside = f"  outside {r['outside_ms_per_layer']:.2f} ms/layer"
    if not pd.isna(r.get("outside_x_gemm")):
        outside += f" ({r['outside_x_gemm']:.2f}x GEMM)"
    return (
        f"b={r['batch']} N={r['n']:>6} {r['method']:12s} density {r['density']:.4f}{flag}  "
        f"TTFT {r['ttft_ms']:9.2f} ms  attn {r['attention_ms']:9.2f} ms  "
        f"sel {r['selector_ms']:7.2f} ms  peak {r['peak_allocated_mib']:9.1f} MiB{speed}{outside}"
    )


def summary_markdown(df: pd.DataFrame) -> str:
    """Batch-1 speedups over dense per method and context, as a Markdown table."""
    if df.empty:
        return ""
    one = df[(df["batch"] == 1) & (df["status"] == "ok") & (df["method"] != methods.DENSE)]
    ns = sorted(one["n"].unique())
    cells = {}
    for _, r in one.iterrows():
        flag = "" if as_bool(r["target_reached"]) else " *"
        cells[(r["method"], r["n"])] = (
            f"{r['attention_speedup']:.2f}x / {r['ttft_speedup']:.2f}x{flag}"
        )
    lines = ["| method | " + " | ".join(f"N={n}" for n in ns) + " |"]
    lines.append("|---|" + "---:|" * len(ns))
    for m in dict.fromkeys(one["method"]):
        lines.append(f"| {m} | " + " | ".join(cells.get((m, n), "–") for n in ns) + " |")
    note = "Prefill-attention / TTFT speedup over dense at batch 1; * target density not reached."
    return "\n".join(lines) + "\n\n" + note + "\n"
