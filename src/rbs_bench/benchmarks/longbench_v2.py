"""LongBench-v2 (Bai et al., 2024): 503 multiple-choice questions over 8K-2M-word contexts.

Follows THUDM/LongBench at commit 2e00731 (`pred.py`, `result.py`, `prompts/`), written anew,
not from upstream code; docs/benchmarks.md §2 describes both. The data is not
generated: `data["dataset"]` names the hub copy (THUDM/LongBench-v2, split train) or a local
json/jsonl file in the hub's schema.

Tasks: "all" (the 0-shot prompt, 128 new tokens) and "cot" (the 0-shot chain-of-thought prompt,
1024 new tokens). Each sample scores 100 if the answer extracted from the response is the right
letter, else 0.

Deliberate differences from upstream:
- The filled prompt is cut to `context_length - max_new_tokens` tokens less the chat template's
  own (upstream: a fixed 120000 for every 128K model), so the whole prompt plus the answer fits
  the context. Our encoder adds no BOS; upstream's count includes one.
- Decoding is greedy (upstream samples at temperature 0.1).
- An empty response scores 0 (upstream retries 5 times, then drops the sample from the mean).
- "cot" makes one call and extracts the answer from the reasoning itself; upstream makes a second
  call (`COT_ANSWER_TEMPLATE`, the reasoning pasted in, 128 tokens). `fill` builds that prompt.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

# The sample type, middle truncation and data-source parsing are shared (benchmarks._text).
from rbs_bench.benchmarks._text import Encoder, Sample, fit_middle, is_local, source, stamped
from rbs_bench.errors import first_line

# Bump the suffix whenever prompts, truncation or row order change: it goes into every result row.
VERSION = "longbench_v2-2e00731.rbs1"

HUB_ID = "THUDM/LongBench-v2"


# ---------------------------------------------------------------------------------------------
# Prompts (upstream prompts/*.txt, quoted exactly: no trailing newline, U+2019 in "Let’s")

_QUESTION = (
    "What is the correct answer to this question: $Q$\n"
    "Choices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n(D) $C_D$\n\n"
)
_FORMAT = 'Format your response as follows: "The correct answer is (insert answer here)".'
TEMPLATE_0SHOT = (
    "Please read the following text and answer the question below.\n\n<text>\n$DOC$\n</text>\n\n"
    + _QUESTION
    + _FORMAT
)
TEMPLATE_COT = (
    "Please read the following text and answer the questions below.\n\n<text>\n$DOC$\n</text>\n\n"
    + _QUESTION
    + "Let\u2019s think step by step:"
)
COT_ANSWER_TEMPLATE = (
    "Please read the following text and answer the questions below.\n\n"
    "The text is too long and omitted here.\n\n"
    + _QUESTION
    + "Let\u2019s think step by step: $COT$\n\n"
    + "Based on the above, what is the single, most likely answer choice? "
    + _FORMAT
)


@dataclass(frozen=True)
class TaskSpec:
    template: str
    max_new_tokens: int  # upstream max_tokens for this call


TASKS: dict[str, TaskSpec] = {
    "all": TaskSpec(TEMPLATE_0SHOT, 128),
    "cot": TaskSpec(TEMPLATE_COT, 1024),
}


def _spec(task: str) -> TaskSpec:
    if task not in TASKS:
        raise ValueError(f"unknown LongBench-v2 task {task!r}; valid: {', '.join(TASKS)}")
    return TASKS[task]


def max_new_tokens(task: str) -> int:
    """Tokens to generate for `task` (upstream max_tokens; upstream samples at temperature 0.1)."""
    return _spec(task).max_new_tokens


def fill(template: str, row: dict, cot: str | None = None) -> str:
    """The template with the row's stripped fields, replaced one after another as upstream does."""
    text = template.replace("$DOC$", row["context"].strip()).replace("$Q$", row["question"].strip())
    for letter in "ABCD":
        text = text.replace(f"$C_{letter}$", row[f"choice_{letter}"].strip())
    return text if cot is None else text.replace("$COT$", cot)


# ---------------------------------------------------------------------------------------------
# Data


_FIELDS = ("_id", "domain", "sub_domain", "question", "context") + tuple(
    f"choice_{c}" for c in "ABCD"
)
_CHOICES = {"difficulty": ("easy", "hard"), "length": ("short", "medium", "long")}
_CHOICES["answer"] = ("A", "B", "C", "D")


def check_row(row: Any, where: str) -> dict:
    """The row if it has every hub field with the right type; else ValueError naming its `_id`."""
    if not isinstance(row, dict):
        raise ValueError(f"LongBench-v2 {where}: a row must be a JSON object, got {_kind(row)}")
    name = f"row _id={row['_id']!r}" if "_id" in row else "row without _id"
    for key in _FIELDS + tuple(_CHOICES):
        if key not in row:
            raise ValueError(f"LongBench-v2 {name} ({where}): missing field {key!r}")
        if not isinstance(row[key], str):
            raise ValueError(
                f"LongBench-v2 {name} ({where}): field {key!r} must be a string, got "
                f"{_kind(row[key])}"
            )
    for key, valid in _CHOICES.items():
        if row[key] not in valid:
            raise ValueError(
                f"LongBench-v2 {name} ({where}): field {key!r} is {row[key]!r}; valid: "
                f"{', '.join(valid)}"
            )
    return row


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def load_rows(data: dict | None) -> list[dict]:
    """Every row of the data set named by `data["dataset"]` (hub id or local file), validated.

    `data["revision"]` pins a hub revision. A local file is JSON (a list of rows, like the hub's
    data.json) or JSONL; a directory is read as its data.json.
    """
    src = source(data, SOURCE_HINT)
    revision = (data or {}).get("revision")
    if is_local(src):
        path, stamp = _local_file(src)
        return _local_rows(str(path), stamp)
    return _hub_rows(src, revision)


SOURCE_HINT = f"the hub id {HUB_ID} or a local data.json/.jsonl copy"


def _local_file(src: str) -> tuple[Path, int]:
    """The local copy named by `src` (a directory: its data.json) and its modification time."""
    path = Path(src).expanduser()
    return stamped(src, path / "data.json" if path.is_dir() else path)


def check_data(task: str, data: dict | None) -> None:
    """Fail before any model loads if a local copy cannot be read or holds a malformed row (the
    error names the file and the row); a hub id is checked when it is loaded."""
    _spec(task)
    src = source(data, SOURCE_HINT)
    if is_local(src):
        load_rows(data)


@lru_cache(maxsize=1)
def _local_rows(path: str, stamp: int) -> list[dict]:
    src = f"benchmark.data.dataset={path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
        if path.endswith(".jsonl"):
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            rows = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{src}: cannot read it as JSON/JSONL ({first_line(e)})") from None
    if not isinstance(rows, list):
        raise ValueError(f"{src}: expected a list of rows, got {_kind(rows)}")
    return [check_row(r, f"row {i} of {path}") for i, r in enumerate(rows)]


@lru_cache(maxsize=1)
def _hub_rows(hub_id: str, revision: str | None) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(hub_id, split="train", revision=revision)
    except Exception as e:  # offline, unknown id, gated: all the user's to fix
        raise ValueError(
            f"benchmark.data.dataset={hub_id}: cannot load it from the hub ({first_line(e)}); "
            f"download data.json and set benchmark.data.dataset=/path/to/data.json"
        ) from None
    return [check_row(dict(r), f"row {i} of {hub_id}") for i, r in enumerate(ds)]


# ---------------------------------------------------------------------------------------------
# Generation


def generate(
    task: str,
    context_length: int,
    num_samples: int,
    tokenizer: Encoder,
    seed: int = 42,
    wrap: Callable[[str], str] | None = None,
    max_new_tokens: int | None = None,
    data: dict | None = None,
) -> list[Sample]:
    """The first `num_samples` rows in file order (0: all), each prompt cut to fit.

    The prompt is `wrap(filled template)`: one user turn, as upstream sends it. A filled template
    whose wrapped prompt plus `max_new_tokens` exceeds `context_length` loses its middle tokens
    (the whole filled template is cut, as upstream's pred.py does, before the chat template).
    `seed` is unused: the data is fixed and read in order.
    """
    spec = _spec(task)
    if context_length <= 0 or num_samples < 0:
        raise ValueError(
            f"need context_length > 0 and num_samples >= 0, got {context_length}, {num_samples}"
        )
    new_tokens = spec.max_new_tokens if max_new_tokens is None else max_new_tokens
    rows = load_rows(data)
    rows = rows[:num_samples] if num_samples else rows
    samples = []
    for index, row in enumerate(rows):
        try:
            prompt, n = fit_middle(
                fill(spec.template, row), context_length - new_tokens, tokenizer, wrap
            )
        except ValueError:
            raise ValueError(
                f"context_length {context_length} is too small for LongBench-v2 {task}: the "
                f"chat template and {new_tokens} new tokens leave no room for the prompt"
            ) from None
        meta = {k: row[k] for k in ("difficulty", "length", "domain")}
        samples.append(
            Sample(task, index, prompt, [row["answer"]], n, new_tokens, meta, row["_id"])
        )
    return samples


# ---------------------------------------------------------------------------------------------
# Scoring (upstream pred.py extract_answer, result.py)

_ANSWER_PAREN = re.compile(r"The correct answer is \(([A-D])\)")
_ANSWER_BARE = re.compile(r"The correct answer is ([A-D])")


def extract_answer(response: str) -> str | None:
    """The letter after "The correct answer is", in parentheses or bare; asterisks removed first.

    Case-sensitive, first match of the parenthesised form, then of the bare form; else None.
    """
    response = response.replace("*", "")
    m = _ANSWER_PAREN.search(response) or _ANSWER_BARE.search(response)
    return m.group(1) if m else None


def score_one(task: str, prediction: str, references: Sequence[str]) -> float:
    """100 if the extracted answer is the reference letter, else 0 (None scores 0)."""
    _spec(task)
    if not references:
        raise ValueError("every sample needs its answer letter as reference")
    return 100.0 if extract_answer(prediction) == references[0] else 0.0


def score(task: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Accuracy, 0-100 rounded to 1 decimal as result.py prints it."""
    if not predictions or len(predictions) != len(references):
        raise ValueError(
            f"need as many predictions as references, at least one; got "
            f"{len(predictions)} and {len(references)}"
        )
    scores = [score_one(task, p, r) for p, r in zip(predictions, references, strict=True)]
    return round(sum(scores) / len(scores), 1)


_CELL = ("method", "budget", "task", "context_length")
_CLASSES = {c: "difficulty" for c in ("easy", "hard")} | {
    c: "length" for c in ("short", "medium", "long")
}
COLUMNS = ("overall", *_CLASSES)


def aggregate(df, compensated: bool = False):
    """Accuracy (0-100, unrounded) overall, by difficulty and by length class, per cell.

    `df` holds run records: `score` plus the categories, either in a `meta` dict column or as
    `difficulty`/`length` columns. Rows are grouped by whichever of method, budget, task and
    context_length it has. `compensated` scores an answer that cannot be extracted 25 (chance), as
    result.py's option does; it needs a `prediction` column. Returns a DataFrame with `n` and the
    columns overall, easy, hard, short, medium, long (NaN where a group has none).
    """
    import pandas as pd

    df = df.reset_index(drop=True)

    def category(key: str):
        if key in df:
            return df[key]
        return df["meta"].map(lambda m: m.get(key) if isinstance(m, dict) else None)

    acc = df["score"].astype(float)
    if compensated:
        acc = acc.where(df["prediction"].map(extract_answer).notna(), 25.0)
    keys = [k for k in _CELL if k in df]
    table = pd.DataFrame(
        {k: df[k] for k in keys} | {k: category(k) for k in ("difficulty", "length")} | {"acc": acc}
    )

    def summary(g) -> pd.Series:
        out = {"n": len(g), "overall": g["acc"].mean()}
        out |= {c: g.loc[g[key] == c, "acc"].mean() for c, key in _CLASSES.items()}
        return pd.Series(out)

    if not keys:
        return summary(table).to_frame().T
    return (
        table.groupby(keys, sort=False)[["difficulty", "length", "acc"]]
        .apply(summary)
        .reset_index()
    )


def main() -> None:
    """Print the 0-shot prompt of a made-up row, cut to 200 whitespace 'tokens'."""

    class Words:
        def encode(self, text: str) -> list[str]:
            return text.split()

    row = {"context": " ".join(f"w{i}" for i in range(400)), "question": "Which word is first?"}
    row |= {f"choice_{c}": f"w{i}" for i, c in enumerate("ABCD")}
    prompt, n = fit_middle(fill(TEMPLATE_0SHOT, row), 200, Words())
    print(f"{VERSION}: {n} tokens\n{prompt}")
    print(extract_answer("**The correct answer is (A)**"))


if __name__ == "__main__":
    main()
