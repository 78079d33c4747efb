"""RULER (Hsieh et al., 2024), generated offline: the prompts, the length fitting and the scorer.

Follows the NVIDIA/RULER generator at commit c3f5e3b (binary-search length fitting); written from
the description in shared/research/benchmarks.md section 1, not from upstream code. Samples follow
upstream's templates and distribution but are not byte-identical to upstream's (RNG call order).

Deliberate differences from upstream:
- `wrap` (the chat template) is applied to the rendered task text, so upstream's singular rewrite
  ("are" -> "is", ...) never touches the chat template's own words.
- A context too small for the smallest haystack raises ValueError (upstream loops forever).

Task registered so far: niah_single_1 (noise haystack, word keys, 7-digit number values).
"""

from __future__ import annotations

import bisect
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import Protocol

# Bump the suffix whenever prompts, fitting or RNG call order change: it goes into every result row.
VERSION = "ruler-c3f5e3b.rbs1"


class Encoder(Protocol):
    def encode(self, text: str) -> Sequence: ...


@dataclass(frozen=True)
class Sample:
    task: str
    index: int
    prompt: str  # wrap(task text) + answer prefix: the model continues right after it
    references: list[str]
    num_tokens: int  # len(tokenizer.encode(prompt))
    max_new_tokens: int


# ---------------------------------------------------------------------------------------------
# Constants (data, quoted from upstream scripts/data/synthetic/constants.py and niah.py)

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all "
    "the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = (
    " The special magic {type_needle_v} for {query} mentioned in the provided text are"
)
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# Upstream's singular rewrite, plain str.replace on the template, in this order.
_SINGULAR = (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer"))


# ---------------------------------------------------------------------------------------------
# Word keys: every wonderwords adjective-noun pair, deduplicated and sorted


class _SortedPairs(Sequence):
    """`sorted(set(a + "-" + n for a in adjs for n in nouns))` without building it.

    The full list is about 6M strings (0.8 GB, 9 s). All pairs sharing the prefix `a + "-"` are
    contiguous and ordered like the sorted nouns, unless another prefix extends it ("high-" and
    "high-pitched-"): only such groups can interleave or collide, so only they are materialised.
    """

    def __init__(self, adjs: Sequence[str], nouns: Sequence[str]):
        self._nouns = sorted(set(nouns))
        self._blocks: list[str | list[str]] = []  # a lone prefix, or a materialised group
        self._starts: list[int] = []
        groups: list[list[str]] = []
        for p in sorted({a + "-" for a in adjs}):  # a prefix sorts right before its extensions
            if groups and p.startswith(groups[-1][0]):
                groups[-1].append(p)
            else:
                groups.append([p])
        size = 0
        for g in groups:
            block = g[0] if len(g) == 1 else sorted({p + n for p in g for n in self._nouns})
            self._blocks.append(block)
            self._starts.append(size)
            size += len(self._nouns) if len(g) == 1 else len(block)
        self._len = size

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(i)
        b = bisect.bisect_right(self._starts, i) - 1
        block, off = self._blocks[b], i - self._starts[b]
        return block + self._nouns[off] if isinstance(block, str) else block[off]

    def __contains__(self, word) -> bool:  # sorted: bisect instead of Sequence's linear scan
        i = bisect.bisect_left(self, word)
        return i < self._len and self[i] == word


def _wonderwords_list(name: str) -> list[str]:
    # Read like wonderwords' own loader: one word per line, trailing whitespace stripped.
    with files("wonderwords").joinpath("assets", name).open("r", encoding="utf-8") as f:
        return [line.rstrip() for line in f]


@cache
def word_keys() -> Sequence[str]:
    """All "adjective-noun" keys from the installed wonderwords lists, deduplicated and sorted."""
    return _SortedPairs(_wonderwords_list("adjectivelist.txt"), _wonderwords_list("nounlist.txt"))


_DRAW: dict[str, Callable[[random.Random], str]] = {
    "words": lambda rng: rng.choice(word_keys()),
    "numbers": lambda rng: str(rng.randint(10**6, 10**7 - 1)),  # 7 digits
}


# ---------------------------------------------------------------------------------------------
# Tasks


@dataclass(frozen=True)
class NiahConfig:
    haystack: str  # "noise": NOISE repeated as "\n"-joined list items
    type_k: str  # key type, a _DRAW entry
    type_v: str  # value type, a _DRAW entry; plural, as it reads in the needle
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1


# generator(spec, rng, units, seed) -> (task text, answer prefix, references)
Generator = Callable[["TaskSpec", random.Random, int, int], tuple[str, str, list[str]]]


@dataclass(frozen=True)
class TaskSpec:
    generator: Generator
    template: str
    answer_prefix: str
    max_new_tokens: int
    metric: str  # a METRICS key
    config: NiahConfig
    incremental: int = 25  # haystack units per fitting step, context >= 4096 tokens
    incremental_small: int = 5  # the same below 4096 tokens


def _niah(spec: TaskSpec, rng: random.Random, units: int, seed: int) -> tuple[str, str, list[str]]:
    c = spec.config
    if c.haystack != "noise":
        raise ValueError(f"unknown haystack {c.haystack!r}; valid: noise")
    keys, values, needles = [], [], []
    for _ in range(max(c.num_k, c.num_q)):
        keys.append(_DRAW[c.type_k](rng))
        values.append([_DRAW[c.type_v](rng) for _ in range(c.num_v)])
        needles += [
            NIAH_NEEDLE.format(type_needle_v=c.type_v, key=keys[-1], value=v) for v in values[-1]
        ]
    random.Random(seed).shuffle(needles)  # upstream: a fresh RNG with the fixed seed, every sample

    items = [NOISE] * units
    positions = sorted(rng.sample(range(units), len(needles)), reverse=True)
    for pos, needle in zip(positions, needles, strict=True):
        items.insert(pos, needle)
    context = "\n".join(items)

    asked = rng.sample(range(len(keys)), c.num_q)
    query = (
        keys[asked[0]]
        if len(asked) == 1
        else (", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]])
    )
    refs = [v for i in asked for v in values[i]]

    template, prefix, type_v = spec.template, spec.answer_prefix, c.type_v
    if c.num_q * c.num_v == 1:
        for old, new in _SINGULAR:
            template, prefix = template.replace(old, new), prefix.replace(old, new)
        type_v = type_v[:-1]
    text = template.format(type_needle_v=type_v, context=context, query=query)
    return text, prefix.format(type_needle_v=type_v, query=query), refs


TASKS: dict[str, TaskSpec] = {
    "niah_single_1": TaskSpec(
        generator=_niah,
        template=NIAH_TEMPLATE,
        answer_prefix=NIAH_ANSWER_PREFIX,
        max_new_tokens=128,
        metric="string_match_all",
        config=NiahConfig(haystack="noise", type_k="words", type_v="numbers"),
    ),
}


def _spec(task: str) -> TaskSpec:
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; valid: {', '.join(TASKS)}")
    return TASKS[task]


def max_new_tokens(task: str) -> int:
    """Tokens to generate for `task` (upstream tokens_to_generate; greedy, no stop words)."""
    return _spec(task).max_new_tokens


# ---------------------------------------------------------------------------------------------
# Generation with length fitting


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
    """`num_samples` prompts of `task`, each fitted so that its tokens + max new tokens fit.

    `max_new_tokens` replaces the task's official generation budget when given (smoke runs).
    `data` names the sources of the tasks that read text (essays, QA sets); the offline tasks
    need none.

    The prompt is `wrap(task_text) + answer_prefix`; `wrap` puts the task text in the model's chat
    format (user turn and the opening of the assistant turn) and defaults to identity. Tokens are
    `len(tokenizer.encode(prompt))`, so pass an encoder that adds no special tokens.
    """
    spec = _spec(task)
    if context_length <= 0 or num_samples < 0:
        raise ValueError(
            f"need context_length > 0 and num_samples >= 0, got {context_length}, {num_samples}"
        )
    wrap = wrap or (lambda s: s)
    new_tokens = spec.max_new_tokens if max_new_tokens is None else max_new_tokens
    rng = random.Random(seed)
    budget = context_length - new_tokens
    step = spec.incremental if context_length >= 4096 else spec.incremental_small

    def render(units: int) -> tuple[str, list[str], int]:
        text, prefix, refs = spec.generator(spec, rng, units, seed)
        prompt = wrap(text) + prefix
        return prompt, refs, len(tokenizer.encode(prompt))

    def too_small(units: int, count: int) -> ValueError:
        return ValueError(
            f"context_length {context_length} is too small for {task}: its smallest haystack "
            f"({units} units) needs {count + new_tokens} tokens ({count} prompt + "
            f"{new_tokens} new)"
        )

    # Upstream's search: tokens per unit from one sample, then a binary search over the unit
    # count. Every probe draws a fresh sample from the same RNG.
    per_unit = render(step)[2] / step
    lo, hi = step, max(int(3 * context_length / per_unit), 2 * step)
    units, count = None, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        count = render(mid)[2]
        if count <= budget:
            units, lo = mid, mid + 1
        else:
            hi = mid - 1
    if units is None:  # the last probe was at `step`
        raise too_small(step, count)

    samples = []
    for index in range(num_samples):
        n = units
        prompt, refs, count = render(n)
        while count > budget:  # this draw came out longer (e.g. a longer key): one step less
            if n <= step:
                raise too_small(n, count)
            n -= step
            prompt, refs, count = render(n)
        samples.append(Sample(task, index, prompt, refs, count, new_tokens))
    return samples


# ---------------------------------------------------------------------------------------------
# Scoring (upstream scripts/eval/synthetic/constants.py and evaluate.py)


def postprocess(pred: str) -> str:
    """Upstream's prediction clean-up: strip, control characters to newlines, strip again."""
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


def _match_all(pred: str, refs: Sequence[str]) -> float:
    return sum(r.lower() in pred.lower() for r in refs) / len(refs)


def _match_part(pred: str, refs: Sequence[str]) -> float:
    return max(float(r.lower() in pred.lower()) for r in refs)


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": _match_all,  # fraction of the references found in the prediction
    "string_match_part": _match_part,  # 1 if any reference is found (QA: references paraphrase)
}


def _mean_percent(metric, preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    if not preds or len(preds) != len(refs):
        raise ValueError(
            f"need as many predictions as references, at least one; got "
            f"{len(preds)} and {len(refs)}"
        )
    if any(not r for r in refs):
        raise ValueError("every sample needs at least one reference")
    return round(sum(metric(p, r) for p, r in zip(preds, refs, strict=True)) / len(preds) * 100, 2)


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean fraction of each sample's references contained in its prediction, 0-100, 2 decimals.

    Case-insensitive substring match on the predictions as given (no post-processing).
    """
    return _mean_percent(_match_all, preds, refs)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Share of samples whose prediction contains any of their references, 0-100, 2 decimals."""
    return _mean_percent(_match_part, preds, refs)


def score(task: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """The task's official score, 0-100 rounded to 2 decimals, on post-processed predictions."""
    metric = METRICS[_spec(task).metric]
    return _mean_percent(metric, [postprocess(p) for p in predictions], references)


def score_one(task: str, prediction: str, refs: Sequence[str]) -> float:
    """One sample's score, 0-100 and unrounded: `score` is the rounded mean of these."""
    if not refs:
        raise ValueError("every sample needs at least one reference")
    return 100 * METRICS[_spec(task).metric](postprocess(prediction), refs)


def main() -> None:
    """Print one niah_single_1 prompt of 4096 whitespace-separated 'tokens'."""

    class Words:
        def encode(self, text: str) -> list[str]:
            return text.split()

    (s,) = generate("niah_single_1", 4096, 1, Words())
    print(f"{VERSION} {s.task}: {s.num_tokens} + {s.max_new_tokens} tokens, refs {s.references}")
    print(s.prompt[:300] + "\n...\n" + s.prompt[-300:])


if __name__ == "__main__":
    main()
