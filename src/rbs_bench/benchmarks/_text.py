"""What the fixed-data benchmarks share: the sample type, middle truncation on token ids, and how a
`benchmark.data.dataset` value is read (hub id or local path).

LongBench-v2 and InfiniteBench cut their prompts here; Video-MME reuses the sample type and the
data-source parsing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class Encoder(Protocol):
    def encode(self, text: str) -> Sequence: ...


@dataclass(frozen=True)
class Sample:
    """One prompt of a benchmark as `generate` returns it (public: rbs_bench.benchmarks.Sample)."""

    task: str
    index: int  # row position in the data, file order
    prompt: str  # wrap(filled template, middle-truncated)
    references: list[str]
    num_tokens: int  # len(tokenizer.encode(prompt))
    max_new_tokens: int
    meta: dict = field(default_factory=dict)  # categories the tables split by
    id: str = ""  # the row's id in the data set


# ---------------------------------------------------------------------------------------------
# Middle truncation on token ids


def _decoder(tokenizer) -> Callable | None:
    # The runner's encoder wraps the HF tokenizer as `.tokenizer`; a bare HF tokenizer has decode.
    for obj in (tokenizer, getattr(tokenizer, "tokenizer", None)):
        if callable(getattr(obj, "decode", None)):
            return obj.decode
    return None


def _last_fit(lo: int, hi: int, fits: Callable[[int], bool]) -> int:
    """The largest c in [lo, hi] with fits(c), fits being monotone decreasing and fits(lo)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def cut_middle(text: str, ids: Sequence, keep: int, tokenizer: Encoder) -> str:
    """`text` (encoded as `ids`) without its middle: the first keep//2 and the last
    keep - keep//2 tokens, decoded (special tokens skipped), as upstream does.

    A tokenizer without `decode` is cut on characters instead: the longest head and tail whose
    own encodings hold that many tokens.
    """
    if keep >= len(ids):
        return text
    head, tail = keep // 2, keep - keep // 2
    decode = _decoder(tokenizer)
    if decode is not None:
        return decode(list(ids[:head]) + list(ids[len(ids) - tail :]), skip_special_tokens=True)
    count = lambda s: len(tokenizer.encode(s))
    a = _last_fit(0, len(text), lambda c: count(text[:c]) <= head)
    b = len(text) - _last_fit(0, len(text) - a, lambda c: count(text[len(text) - c :]) <= tail)
    return text[:a] + text[b:]


def fit_middle(
    text: str, limit: int, tokenizer: Encoder, render: Callable[[str], str] | None = None
) -> tuple[str, int]:
    """(render(text cut in the middle), its token count), the count at most `limit`.

    `render` adds what must not be cut (the chat template, an answer prefix). Cutting at a token
    seam and re-encoding can merge tokens differently, so the result is re-counted and the cut
    deepened by the excess until it fits.
    """
    render = render or (lambda t: t)
    ids = tokenizer.encode(text)
    keep = min(len(ids), limit - len(tokenizer.encode(render(""))))
    while keep > 0 or keep == len(ids) == 0:  # an empty text needs no room
        prompt = render(cut_middle(text, ids, keep, tokenizer))
        n = len(tokenizer.encode(prompt))
        if n <= limit:
            return prompt, n
        keep -= n - limit
    raise ValueError(f"a limit of {limit} tokens leaves no room for the text around the cut")


# ---------------------------------------------------------------------------------------------
# Data sources and messages


def source(data: dict | None, default_hint: str) -> str:
    """`data["dataset"]`, or ValueError naming benchmark.data.dataset."""
    src = (data or {}).get("dataset")
    if not src or not isinstance(src, str):
        raise ValueError(f"benchmark.data.dataset is not set; give {default_hint}")
    return src


def is_local(src: str, suffixes: tuple[str, ...] = (".json", ".jsonl")) -> bool:
    """A path (existing, or written like one) rather than a hub id `owner/name`."""
    path_like = src.startswith(("/", ".", "~")) or src.endswith(suffixes)
    return path_like or src.count("/") != 1 or Path(src).expanduser().exists()


def stamped(src: str, path: Path) -> tuple[Path, int]:
    """(`path`, its modification time in ns): the cache key of a local copy's rows; a file that
    cannot be read is a ValueError naming benchmark.data.dataset and the file."""
    try:
        return path, path.stat().st_mtime_ns
    except OSError as e:
        raise ValueError(
            f"benchmark.data.dataset={src}: cannot read {path} ({e.strerror or e})"
        ) from None


def kind(value: Any) -> str:
    """The JSON-ish name of a value's type, for messages about bad rows."""
    return "null" if value is None else type(value).__name__


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
