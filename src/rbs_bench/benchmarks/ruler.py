"""RULER (Hsieh et al., 2024), generated offline: the 13 tasks, the length fitting and the scorer.

Follows the NVIDIA/RULER generator at commit c3f5e3b (binary-search length fitting), written
anew, not from upstream code; docs/benchmarks.md §1 describes both. Samples follow
upstream's templates and distribution but are not byte-identical to upstream's (RNG call order:
one `random.Random(seed)` per `generate` call drives every draw, where upstream also uses numpy).

Tasks and what they read:
- niah_single_1, niah_multikey_2/3, vt, cwe, fwe: nothing (noise sentences, wonderwords lists,
  random numbers, uuids and letters).
- niah_single_2/3, niah_multikey_1, niah_multivalue, niah_multiquery: an essay haystack,
  `data["essays"]`: a directory of .txt files (concatenated in sorted filename order), a .txt
  file, a JSON file {"text": ...}, or a hub dataset with a "text" column (split "train").
- qa_1: SQuAD v2 dev, `data["squad"]`: dev-v2.0.json or a hub id (rajpurkar/squad_v2).
- qa_2: HotpotQA dev-distractor, `data["hotpotqa"]`: hotpot_dev_distractor_v1.json or a hub id
  (hotpotqa/hotpot_qa, config "distractor"). Hub rows are mapped to the official JSON first.

Length fitting counts `wrap(task text) + answer prefix` + max new tokens <= context_length, by
upstream's binary search over haystack units: essay words (step 500), noise or needle lines (25;
vt 10), cwe words (10), qa documents (10); 5 lines below 4096 tokens. fwe keeps upstream's own
linear search (from budget // 6 words in steps of budget // 32). A sample that comes out longer
than the searched size loses one step, as upstream.

Deliberate differences from upstream:
- When the whole search range fits, the range doubles (upstream stops at its top). Our vt probe
  includes the in-context example (upstream's leaves it out), which inflates the tokens-per-unit
  estimate; without the doubling vt prompts at 4K would end about 10% short.
- `wrap` (the chat template) is applied to the rendered task text, so upstream's singular rewrite
  ("are" -> "is", ...) never touches the chat template's own words.
- cwe's few-shot example sits inside the user turn, as vt's does: `wrap(example + answer + "\\n" +
  task) + prefix`. Upstream renders the example with the full model template, so a chat model
  sees two wrapped turns; with no chat template (identity `wrap`) the two prompts are identical.
- cwe above the 8,166 wonderwords: upstream switches to its `english_words.json` (not shipped
  here); we cap the word count at the vocabulary, so cwe prompts at about 128K tokens fill only
  part of the context. The under-fill is in each sample's `num_tokens` (and the run records'
  `input_tokens`); `generate` warns when it caps.
- Sentences of the essay haystack are split by `split_sentences`, a regex splitter, not NLTK
  punkt (which needs a download): needle depths land on slightly different sentence boundaries.
- vt draws distinct variable names (never "VAR") and re-randomises its example in one pass.
- qa always includes every gold document, also when the context holds fewer documents than that
  (upstream fails there); it raises when num_samples exceeds the answerable questions.
- A context too small for the smallest haystack raises ValueError (upstream loops forever); the
  vt example alone may exceed its 500-token target when even 5 noise lines do not fit in it.
"""

from __future__ import annotations

import bisect
import json
import math
import random
import re
import string
import uuid
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from importlib.resources import files
from pathlib import Path
from typing import Any, Protocol

# Bump the suffix whenever prompts, fitting or RNG call order change: it goes into every result row.
VERSION = "ruler-c3f5e3b.rbs2"
# The most prompts `generate` makes for one task and length. Every prompt of a cell is built and
# held before the first sample runs (a 128K-token prompt is ~0.5 MB of text), and the draws come
# from one RNG in order, so a count is only as cheap as its prompts: 100,000 at 4K tokens already
# take minutes and gigabytes. Upstream RULER generates 500 per task.
MAX_SAMPLES = 100_000


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
# Constants (data, quoted from upstream scripts/data/synthetic/constants.py and the generators)

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
# Needle depths in percent of the essay's sentences: numpy round(linspace(0, 100, 40)).
DEPTHS = [round(100 * i / 39) for i in range(40)]

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
    "variables are assigned the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common "
    "words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three "
    "most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. "
    "Please ignore the dots '....'. What are the three most frequently appeared words in the "
    "above coded text?"
)
FWE_ANSWER_PREFIX = (
    " Answer: According to the coded text above, the three most frequently appeared words are:"
)
QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output "
    "any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question "
    "based on the given documents. Only give me the answer and do not output any other words."
    "\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"
QA_DOCUMENT = "Document {i}:\n{document}"


# ---------------------------------------------------------------------------------------------
# Word lists: every wonderwords adjective-noun pair (niah keys); nouns + adjectives + verbs (cwe)


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


@cache
def cwe_words(seed: int) -> tuple[str, ...]:
    """cwe's vocabulary: wonderwords nouns, adjectives and verbs, deduplicated, sorted, then
    shuffled with `Random(seed)` (8,166 words in wonderwords 3.0)."""
    lists = ("nounlist.txt", "adjectivelist.txt", "verblist.txt")
    words = sorted({w for name in lists for w in _wonderwords_list(name)})
    random.Random(seed).shuffle(words)
    return tuple(words)


_DRAW: dict[str, Callable[[random.Random], str]] = {
    "words": lambda rng: rng.choice(word_keys()),
    "numbers": lambda rng: str(rng.randint(10**6, 10**7 - 1)),  # 7 digits
    "uuids": lambda rng: str(uuid.UUID(int=rng.getrandbits(128), version=4)),
}


# ---------------------------------------------------------------------------------------------
# Sentence splitting (the essay haystack)

_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof rev sr jr st mt vs etc cf al approx no vol fig ed eds inc ltd co corp "
    "dept est jan feb mar apr jun jul aug sep sept oct nov dec".split()
)
_CLOSERS = "\"')]\u201d\u2019"
_OPENERS = "\"'([\u201c\u2018"


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`; `" ".join(split_sentences(t)) == " ".join(t.split())`.

    A sentence ends at a word ending in . ! or ? (closing quotes or brackets may follow) unless
    the word is a listed abbreviation ("Mr.", "e.g.", "etc."), a single-letter initial ("J.") or
    a dotted acronym ("U.S."). NLTK punkt, which upstream uses, learns its abbreviations and
    uses the next word's capitalisation to decide after abbreviations, initials and ellipses;
    here those never end a sentence and everything else always does.
    """
    sentences, current = [], []
    for word in text.split():
        current.append(word)
        core = word.rstrip(_CLOSERS)
        if core[-1:] in (".", "!", "?") and not (core[-1] == "." and _abbreviation(core)):
            sentences.append(" ".join(current))
            current = []
    if current:
        sentences.append(" ".join(current))
    return sentences


def _abbreviation(word: str) -> bool:
    core = word.lstrip(_OPENERS)[:-1].lower()
    return (
        core in _ABBREVIATIONS
        or (len(core) == 1 and core.isalpha())
        or re.fullmatch(r"(?:[a-z]\.)+[a-z]", core) is not None
    )


# ---------------------------------------------------------------------------------------------
# Data sources (benchmark.data): essays, SQuAD v2 dev, HotpotQA dev-distractor

_SOURCES = {  # key: (what, example path, accepted forms)
    "essays": (
        "an essay haystack",
        "/path/to/essays",
        "a directory of .txt files, a JSON file with a 'text' field, or a hub dataset",
    ),
    "squad": (
        "SQuAD v2 dev",
        "/path/to/dev-v2.0.json",
        "the official JSON, or a hub dataset such as rajpurkar/squad_v2",
    ),
    "hotpotqa": (
        "HotpotQA dev-distractor",
        "/path/to/hotpot_dev_distractor_v1.json",
        "the official JSON, or a hub dataset such as hotpotqa/hotpot_qa",
    ),
}


def check_data(task: str, data: dict | None) -> None:
    """Raise the one-line ValueError `generate` raises when `task`'s source is not set.

    The runner can call this for every task before it loads a model or generates anything.
    """
    key = _spec(task).source
    if key is not None and (data or {}).get(key) in (None, ""):
        what, example, forms = _SOURCES[key]
        raise ValueError(
            f"RULER task {task} needs {what}: set benchmark.data.{key}={example} ({forms})"
        )


def _local(source: str) -> Path | None:
    """The local path `source` names, None for a hub dataset id."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    if source.startswith(("/", ".", "~")) or path.suffix in (".json", ".txt"):
        raise ValueError(f"{source}: no such file or directory")
    return None


def _stamp(path: Path | None) -> tuple:
    """Modification times, so that a cached source is reloaded when its files change."""
    if path is None:
        return ()
    paths = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    return tuple((p.name, p.stat().st_mtime_ns) for p in paths)


def _hub_rows(name: str, config: str | None, split: str, key: str) -> Iterable[dict]:
    """Rows of a hub dataset (patched in tests: no hub there)."""
    try:
        import datasets

        return datasets.load_dataset(name, config, split=split)
    except Exception as e:  # no network, unknown id, missing config: all one message
        lines = str(e).strip().splitlines()
        reason = lines[0] if lines else type(e).__name__
        raise ValueError(
            f"cannot load hub dataset {name!r} for benchmark.data.{key} ({reason}); "
            f"download it and set benchmark.data.{key}=/local/path"
        ) from e


def _load_source(key: str, source: str):
    path = _local(str(source))
    return _load_cached(key, str(source), path, _stamp(path))


@lru_cache(maxsize=8)
def _load_cached(key: str, source: str, path: Path | None, stamp: tuple):
    if key == "essays":
        return _essay_words(source, path)
    config, from_hub, read = {
        "squad": (None, _squad_from_hub, read_squad),
        "hotpotqa": ("distractor", _hotpot_from_hub, read_hotpotqa),
    }[key]
    obj = (
        _read_json(path) if path else from_hub(_hub_rows(source, config, "validation", key), source)
    )
    return read(obj, source)


def _read_json(path: Path):
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON ({e})") from e


def _essay_words(source: str, path: Path | None) -> list[str]:
    """The essay corpus as whitespace-separated words (upstream: re.sub(r"\\s+", " ").split)."""
    if path is None:
        texts = []
        for i, row in enumerate(_hub_rows(source, None, "train", "essays")):
            if not isinstance(row.get("text"), str):
                raise ValueError(f"{source}: row {i} has no 'text' string")
            texts.append(row["text"])
        text = "\n\n".join(texts)
    elif path.is_dir():
        paths = sorted(path.glob("*.txt"))
        if not paths:
            raise ValueError(f"{path}: no .txt files in this directory")
        text = "\n\n".join(p.read_text(encoding="utf-8") for p in paths)
    elif path.suffix == ".json":
        obj = _read_json(path)
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ValueError(f"{path}: expected a JSON object with a 'text' string")
        text = obj["text"]
    else:
        text = path.read_text(encoding="utf-8")
    words = text.split()
    if not words:
        raise ValueError(f"{source}: the essay text is empty")
    return words


@dataclass(frozen=True)
class QaItem:
    question: str
    answers: tuple[str, ...]
    gold: tuple[int, ...]  # indices into QaSet.docs
    more: tuple[int, ...] = ()  # SQuAD: the other paragraphs of the same article


@dataclass(frozen=True)
class QaSet:
    docs: list[str]  # unique documents, sorted
    items: list[QaItem]  # answerable questions, in file order
    source: str


def _bad(where: str, kind: str, row_id, problem: str) -> ValueError:
    return ValueError(f"{where}: {kind} row {row_id}: {problem}")


def read_squad(obj, where: str = "squad") -> QaSet:
    """SQuAD v2 in the official JSON schema (dev-v2.0.json) as documents and answerable items."""
    if not isinstance(obj, dict) or not isinstance(obj.get("data"), list):
        raise ValueError(f"{where}: expected the SQuAD JSON schema, an object with a 'data' list")
    articles = []  # [(paragraph contexts, [(context, qa, row id)])]
    n = 0
    for a, article in enumerate(obj["data"]):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            raise _bad(where, "SQuAD", f"article {a}", "no 'paragraphs' list")
        contexts, qas = [], []
        for p, par in enumerate(paragraphs):
            if not isinstance(par, dict) or not isinstance(par.get("context"), str):
                raise _bad(where, "SQuAD", f"article {a} paragraph {p}", "no 'context' string")
            if not isinstance(par.get("qas"), list):
                raise _bad(where, "SQuAD", f"article {a} paragraph {p}", "no 'qas' list")
            contexts.append(par["context"])
            for qa in par["qas"]:
                row_id = repr(qa.get("id", f"#{n}")) if isinstance(qa, dict) else f"#{n}"
                n += 1
                qas.append((par["context"], qa, row_id))
        articles.append((contexts, qas))

    docs = sorted({c for contexts, _ in articles for c in contexts})
    index = {d: i for i, d in enumerate(docs)}
    items = []
    for contexts, qas in articles:
        article_docs = list(dict.fromkeys(index[c] for c in contexts))
        for context, qa, row_id in qas:
            if not isinstance(qa, dict) or not isinstance(qa.get("question"), str):
                raise _bad(where, "SQuAD", row_id, "no 'question' string")
            answers = qa.get("answers")
            if not isinstance(answers, list) or not all(
                isinstance(x, dict) and isinstance(x.get("text"), str) for x in answers
            ):
                raise _bad(where, "SQuAD", row_id, "'answers' is not a list of {'text': str}")
            if qa.get("is_impossible", False):
                continue
            if not answers:
                raise _bad(where, "SQuAD", row_id, "answerable but has no answers")
            gold = index[context]
            more = tuple(i for i in article_docs if i != gold)
            items.append(QaItem(qa["question"], tuple(x["text"] for x in answers), (gold,), more))
    if not items:
        raise ValueError(f"{where}: no answerable SQuAD questions")
    return QaSet(docs, items, where)


def read_hotpotqa(obj, where: str = "hotpotqa") -> QaSet:
    """HotpotQA in the official JSON schema (hotpot_dev_distractor_v1.json).

    A document is "title\\nsentences joined with no separator"; all of a question's paragraphs
    (2 gold + 8 distractors in the dev-distractor set) are its context.
    """
    if not isinstance(obj, list):
        raise ValueError(f"{where}: expected the HotpotQA JSON schema, a list of questions")
    rows = []
    for n, row in enumerate(obj):
        row_id = repr(row.get("_id", f"#{n}")) if isinstance(row, dict) else f"#{n}"
        if not isinstance(row, dict) or not isinstance(row.get("question"), str):
            raise _bad(where, "HotpotQA", row_id, "no 'question' string")
        if not isinstance(row.get("answer"), str):
            raise _bad(where, "HotpotQA", row_id, "no 'answer' string")
        ctx = row.get("context")
        if (
            not isinstance(ctx, list)
            or not ctx
            or not all(
                isinstance(p, list | tuple)
                and len(p) == 2
                and isinstance(p[0], str)
                and isinstance(p[1], list)
                and all(isinstance(s, str) for s in p[1])
                for p in ctx
            )
        ):
            raise _bad(where, "HotpotQA", row_id, "'context' is not a list of [title, sentences]")
        rows.append((row, [f"{title}\n{''.join(sents)}" for title, sents in ctx]))
    docs = sorted({d for _, paragraphs in rows for d in paragraphs})
    index = {d: i for i, d in enumerate(docs)}
    items = [
        QaItem(row["question"], (row["answer"],), tuple(dict.fromkeys(index[d] for d in ps)))
        for row, ps in rows
    ]
    if not items:
        raise ValueError(f"{where}: no HotpotQA questions")
    return QaSet(docs, items, where)


def _squad_from_hub(rows: Iterable[dict], where: str) -> dict:
    """rajpurkar/squad_v2 rows (id, title, context, question, answers{text, answer_start}) in
    the official schema: articles by title, paragraphs by context, file order kept."""
    articles: dict[str, dict[str, list]] = {}
    for n, r in enumerate(rows):
        answers = r.get("answers") or {}
        if not isinstance(answers, dict) or not isinstance(answers.get("text"), list):
            raise _bad(where, "SQuAD", repr(r.get("id", f"#{n}")), "no 'answers.text' list")
        qa = {
            "id": r.get("id"),
            "question": r.get("question"),
            "answers": [{"text": t} for t in answers["text"]],
            "is_impossible": not answers["text"],
        }
        articles.setdefault(r.get("title"), {}).setdefault(r.get("context"), []).append(qa)
    return {
        "data": [
            {"title": t, "paragraphs": [{"context": c, "qas": q} for c, q in ps.items()]}
            for t, ps in articles.items()
        ]
    }


def _hotpot_from_hub(rows: Iterable[dict], where: str) -> list[dict]:
    """hotpotqa/hotpot_qa rows (context {title: [...], sentences: [[...]]}) in the official
    schema (context [[title, sentences], ...])."""
    out = []
    for n, r in enumerate(rows):
        ctx = r.get("context")
        titles, sents = (
            (ctx.get("title"), ctx.get("sentences")) if isinstance(ctx, dict) else (0, 0)
        )
        if not isinstance(titles, list) or not isinstance(sents, list) or len(titles) != len(sents):
            raise _bad(
                where, "HotpotQA", repr(r.get("id", f"#{n}")), "no 'context' title/sentences"
            )
        pairs = [[t, s] for t, s in zip(titles, sents)]
        out.append(
            {
                "_id": r.get("id"),
                "question": r.get("question"),
                "answer": r.get("answer"),
                "context": pairs,
            }
        )
    return out


# ---------------------------------------------------------------------------------------------
# Tasks


@dataclass(frozen=True)
class NiahConfig:
    haystack: str  # "noise" | "needle" (distractor needles) | "essay"
    type_k: str  # key type, a _DRAW entry
    type_v: str  # value type, a _DRAW entry; plural, as it reads in the needle
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1


@dataclass(frozen=True)
class VtConfig:
    num_chains: int = 1
    num_hops: int = 4
    example_tokens: int = 500  # the in-context example is fitted to this many tokens


@dataclass(frozen=True)
class CweConfig:
    freq_cw: int = 30  # repeats of each common word (6 below 4096 tokens)
    freq_ucw: int = 3  # repeats of each uncommon word (1 below 4096 tokens)
    num_cw: int = 10


@dataclass(frozen=True)
class FweConfig:
    alpha: float = 2.0  # word k appears int(n * k**-alpha / zeta(alpha)) times
    coded_wordlen: int = 6
    tokens_per_vocab_word: int = 50  # vocabulary size = prompt budget // this


@dataclass(frozen=True)
class QaConfig:
    dataset: str  # "squad" | "hotpotqa"


@dataclass
class _Job:
    """State of one `generate` call that the generators share."""

    task: str
    context_length: int
    budget: int  # tokens the prompt may use
    seed: int
    rng: random.Random
    source: Any = None  # essay words or a QaSet
    example: tuple[str, list[str]] | None = None  # vt: the in-context example and its names
    limit: int | None = None  # most haystack units the task can use (cwe: its vocabulary)
    capped: int = 0  # cwe: samples that use the whole vocabulary
    cache: dict = field(default_factory=dict)


# generator(spec, job, units, index) -> (task text, answer prefix, references)
Generator = Callable[["TaskSpec", _Job, int, int], tuple[str, str, list[str]]]


@dataclass(frozen=True)
class TaskSpec:
    generator: Generator
    template: str
    answer_prefix: str
    max_new_tokens: int
    metric: str  # a METRICS key
    config: Any  # the generator's config
    incremental: int = 25  # haystack units per fitting step, context >= 4096 tokens
    incremental_small: int = 5  # the same below 4096 tokens
    source: str | None = None  # the benchmark.data key the task reads
    probe_units: int | None = None  # units of the tokens-per-unit probe (default: one step)
    search_factor: int = 3  # binary search upper bound: factor * context_length / tokens-per-unit
    linear_search: bool = False  # fwe: upstream's own linear search
    prepare: Callable[[TaskSpec, _Job, Encoder], None] | None = None  # once per generate call


def _niah_context(spec: TaskSpec, job: _Job, units: int, needles: list[str]) -> str:
    c, rng = spec.config, job.rng
    if c.haystack == "essay":
        if units not in job.cache:  # every sample at a length splits the same text
            words = job.source
            text = " ".join(words[i % len(words)] for i in range(units))  # repeats the corpus
            job.cache = {units: split_sentences(text)}
        sentences = list(job.cache[units])
        depths = rng.sample(DEPTHS, len(needles))
        positions = sorted(int(len(sentences) * (d / 100)) for d in depths)
        for pos, needle in reversed(list(zip(positions, needles))):  # needle i at position i
            sentences.insert(pos, needle)
        return " ".join(sentences)
    if c.haystack == "noise":
        items = [NOISE] * units
    elif c.haystack == "needle":
        items = [
            NIAH_NEEDLE.format(
                type_needle_v=c.type_v, key=_DRAW[c.type_k](rng), value=_DRAW[c.type_v](rng)
            )
            for _ in range(units)
        ]
    else:
        raise ValueError(f"unknown haystack {c.haystack!r}; valid: noise, needle, essay")
    positions = sorted(rng.sample(range(units), len(needles)), reverse=True)
    for pos, needle in zip(positions, needles, strict=True):
        items.insert(pos, needle)
    return "\n".join(items)


def _niah(spec: TaskSpec, job: _Job, units: int, index: int) -> tuple[str, str, list[str]]:
    c, rng = spec.config, job.rng
    keys, values, needles = [], [], []
    for _ in range(max(c.num_k, c.num_q)):
        keys.append(_DRAW[c.type_k](rng))
        values.append([_DRAW[c.type_v](rng) for _ in range(c.num_v)])
        needles += [
            NIAH_NEEDLE.format(type_needle_v=c.type_v, key=keys[-1], value=v) for v in values[-1]
        ]
    random.Random(job.seed).shuffle(needles)  # upstream: a fresh RNG with the fixed seed
    context = _niah_context(spec, job, units, needles)

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


def _var_names(rng: random.Random, count: int, length: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=length))
        if name not in names and name != "VAR":
            names.append(name)
    return names


def _vt_text(spec: TaskSpec, job: _Job, units: int, icl: bool) -> tuple[str, str, list[str]]:
    """vt's task text without the example: `num_chains` chains of `num_hops` assignments among
    `units` noise lines. The example (icl) uses 3-letter names and the value 12345."""
    c, rng = spec.config, job.rng
    size = c.num_hops + 1
    names = _var_names(rng, c.num_chains * size, 3 if icl else 5)
    chains = []
    for k in range(c.num_chains):
        v = names[k * size : (k + 1) * size]
        value = "12345" if icl else str(rng.randrange(10000, 99999))
        chains.append(
            [f"VAR {v[0]} = {value}"] + [f"VAR {v[j + 1]} = VAR {v[j]} " for j in range(c.num_hops)]
        )
    lines = [NOISE] * units
    for chain in chains:  # each chain's lines in order, at sorted random positions
        for j, pos in enumerate(sorted(rng.sample(range(len(lines)), len(chain)))):
            lines.insert(pos + j, chain[j])
    context = "\n".join(lines).replace(". \n", ".\n")
    query = chains[0][0].rsplit("= ", 1)[1]
    text = spec.template.format(context=context, query=query)
    prefix = spec.answer_prefix.format(num_v=size, query=query)
    return text, prefix, names[:size]


def _vt_prepare(spec: TaskSpec, job: _Job, tokenizer: Encoder) -> None:
    """vt's in-context example, fitted once per call to `example_tokens` raw tokens (task text +
    answer prefix, no chat template), with its answer: "<text><prefix> N1 N2 ... N5\\n"."""

    def render(units: int, index: int = 0):
        text, prefix, names = _vt_text(spec, job, units, icl=True)
        return text + prefix, names, len(tokenizer.encode(text + prefix))

    target = spec.config.example_tokens
    units = _binary_search(render, target, target, 5, 5, 3) or 5
    prompt, names, count = render(units)
    while count > target and units > 5:
        units -= 5
        prompt, names, count = render(units)
    job.example = (prompt + " " + " ".join(names) + "\n", names)


def _cwe_prepare(spec: TaskSpec, job: _Job, tokenizer: Encoder) -> None:
    job.limit = len(cwe_words(job.seed))


def _vt(spec: TaskSpec, job: _Job, units: int, index: int) -> tuple[str, str, list[str]]:
    text, prefix, names = _vt_text(spec, job, units, icl=False)
    example, old = job.example
    # Upstream's randomize_icl: fresh names and a fresh value in the example, every sample.
    new = dict(zip(old, _var_names(job.rng, len(old), 3), strict=True))
    new["12345"] = str(job.rng.randrange(10000, 99999))
    example = re.sub(r"\b(?:" + "|".join(new) + r")\b", lambda m: new[m[0]], example)
    return example + "\n" + text, prefix, names


def _cwe_list(job: _Job, num: int, common_rep: int, uncommon_rep: int, num_cw: int):
    vocab = cwe_words(job.seed)
    words = job.rng.sample(vocab, min(num, len(vocab)))  # capped: no english_words.json here
    common = words[:num_cw]
    items = common * common_rep + words[num_cw:] * uncommon_rep
    random.Random(job.seed).shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), common


def _cwe(spec: TaskSpec, job: _Job, units: int, index: int) -> tuple[str, str, list[str]]:
    c = spec.config
    if job.context_length < 4096:
        example, example_answer = _cwe_list(job, 20, 3, 1, c.num_cw)
        reps = (6, 1)
    else:
        example, example_answer = _cwe_list(job, 40, 10, 3, c.num_cw)
        reps = (c.freq_cw, c.freq_ucw)
    context, answer = _cwe_list(job, units, *reps, c.num_cw)
    job.capped += units >= len(cwe_words(job.seed))
    shot = spec.template.format(context=example) + spec.answer_prefix + " "
    shot += " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_answer))
    return shot + "\n" + spec.template.format(context=context), spec.answer_prefix, answer


def _fwe(spec: TaskSpec, job: _Job, units: int, index: int) -> tuple[str, str, list[str]]:
    c, rng = spec.config, job.rng
    size = job.budget // c.tokens_per_vocab_word
    vocab: set[str] = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=c.coded_wordlen)))
    ranked = sorted(vocab)
    random.Random(job.seed).shuffle(ranked)
    ranked[0] = "..."  # the most frequent word is noise
    zeta = {2.0: math.pi**2 / 6}[c.alpha]
    words = [w for k, w in enumerate(ranked, 1) for _ in range(int(units * k**-c.alpha / zeta))]
    random.Random(job.seed).shuffle(words)
    return spec.template.format(context=" ".join(words)), spec.answer_prefix, ranked[1:4]


def _qa(spec: TaskSpec, job: _Job, units: int, index: int) -> tuple[str, str, list[str]]:
    qas: QaSet = job.source
    item, docs = qas.items[index], qas.docs
    gold, more = list(item.gold), list(item.more)
    if units < len(docs):
        if units - len(gold) > len(more):
            taken = set(gold + more)
            others = [i for i in range(len(docs)) if i not in taken]
            chosen = gold + more + job.rng.sample(others, units - len(gold) - len(more))
        else:
            chosen = gold + job.rng.sample(more, max(0, units - len(gold)))
        picked = [docs[i] for i in chosen]
    else:
        picked = [docs[i % len(docs)] for i in range(units)]  # every document, repeated
    random.Random(job.seed).shuffle(picked)
    context = "\n\n".join(QA_DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(picked))
    return (
        spec.template.format(context=context, query=item.question),
        spec.answer_prefix,
        list(item.answers),
    )


def _niah_task(haystack: str, type_k: str, type_v: str, **counts) -> TaskSpec:
    essay = haystack == "essay"
    return TaskSpec(
        generator=_niah,
        template=NIAH_TEMPLATE,
        answer_prefix=NIAH_ANSWER_PREFIX,
        max_new_tokens=128,
        metric="string_match_all",
        config=NiahConfig(haystack, type_k, type_v, **counts),
        incremental=500 if essay else 25,  # essay words, or noise/needle lines
        incremental_small=500 if essay else 5,
        source="essays" if essay else None,
    )


def _qa_task(dataset: str) -> TaskSpec:
    return TaskSpec(
        generator=_qa,
        template=QA_TEMPLATE,
        answer_prefix=QA_ANSWER_PREFIX,
        max_new_tokens=32,
        metric="string_match_part",
        config=QaConfig(dataset),
        incremental=10,  # documents
        incremental_small=10,
        source=dataset,
    )


# In upstream's order (scripts/config_tasks.sh); parameters from scripts/synthetic.yaml.
TASKS: dict[str, TaskSpec] = {
    "niah_single_1": _niah_task("noise", "words", "numbers"),
    "niah_single_2": _niah_task("essay", "words", "numbers"),
    "niah_single_3": _niah_task("essay", "words", "uuids"),
    "niah_multikey_1": _niah_task("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": _niah_task("needle", "words", "numbers"),
    "niah_multikey_3": _niah_task("needle", "uuids", "uuids"),
    "niah_multivalue": _niah_task("essay", "words", "numbers", num_v=4),
    "niah_multiquery": _niah_task("essay", "words", "numbers", num_q=4),
    "vt": TaskSpec(
        generator=_vt,
        template=VT_TEMPLATE,
        answer_prefix=VT_ANSWER_PREFIX,
        max_new_tokens=30,
        metric="string_match_all",
        config=VtConfig(),
        prepare=_vt_prepare,
        incremental=10,  # noise lines
        incremental_small=5,
    ),
    "cwe": TaskSpec(
        generator=_cwe,
        template=CWE_TEMPLATE,
        answer_prefix=CWE_ANSWER_PREFIX,
        max_new_tokens=120,
        metric="string_match_all",
        config=CweConfig(),
        incremental=10,  # words
        incremental_small=10,
        probe_units=4096,
        search_factor=2,
        prepare=_cwe_prepare,
    ),
    "fwe": TaskSpec(
        generator=_fwe,
        template=FWE_TEMPLATE,
        answer_prefix=FWE_ANSWER_PREFIX,
        max_new_tokens=50,
        metric="string_match_all",
        config=FweConfig(),
        linear_search=True,  # words, in steps of budget // 32
    ),
    "qa_1": _qa_task("squad"),
    "qa_2": _qa_task("hotpotqa"),
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

Render = Callable[..., tuple[str, list[str], int]]  # (units, index=0) -> (prompt, refs, tokens)


def _binary_search(
    render: Render,
    budget: int,
    length: int,
    step: int,
    probe: int,
    factor: int,
    limit: int | None = None,
) -> int | None:
    """Upstream's search: tokens per unit from one `probe`-unit sample, then a binary search for
    the most units (at most `limit`) whose prompt fits `budget`; None if even `step` units do
    not. Every probe draws a fresh sample from the same RNG.

    Unlike upstream, the range doubles when its top fits: a large fixed part (vt's example)
    inflates the tokens-per-unit estimate, and the range would end short of the budget.
    """
    limit = limit or max(4 * length, 2 * step)  # a unit is at least a token: ends the doubling
    per_unit = render(probe)[2] / probe
    top = min(max(int(factor * length / per_unit), 2 * step), limit)
    lo, hi, units = step, top, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if render(mid)[2] <= budget:
            units, lo = mid, mid + 1
        else:
            hi = mid - 1
        if lo > top < limit:  # the top of the range fits
            top = hi = min(2 * top, limit)
    return units


def _linear_search(render: Render, budget: int, step: int) -> int:
    """fwe's own search: from budget // 6 words up in `step`s until the prompt reaches the
    budget, then one step back."""
    units = budget // 6
    while render(units)[2] < budget and units < 4 * budget:
        units += step
    return units - step


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
    `data` names the sources of the tasks that read text: `essays`, `squad`, `hotpotqa` (local
    paths or hub dataset ids; see the module docstring); the other tasks need none.

    The prompt is `wrap(task_text) + answer_prefix`; `wrap` puts the task text in the model's chat
    format (user turn and the opening of the assistant turn) and defaults to identity. vt and cwe
    put their one in-context example inside the task text. Tokens are
    `len(tokenizer.encode(prompt))`, so pass an encoder that adds no special tokens.
    """
    spec = _spec(task)
    if context_length <= 0 or num_samples < 0:
        raise ValueError(
            f"need context_length > 0 and num_samples >= 0, got {context_length}, {num_samples}"
        )
    check_data(task, data)
    wrap = wrap or (lambda s: s)
    new_tokens = spec.max_new_tokens if max_new_tokens is None else max_new_tokens
    budget = context_length - new_tokens
    job = _Job(task, context_length, budget, seed, random.Random(seed))
    if spec.source is not None:
        job.source = _load_source(spec.source, data[spec.source])
        if isinstance(job.source, QaSet) and num_samples > len(job.source.items):
            raise ValueError(
                f"{task}: {job.source.source} has {len(job.source.items)} answerable questions, "
                f"fewer than num_samples={num_samples}; lower benchmark.num_samples"
            )
    if spec.prepare is not None:
        spec.prepare(spec, job, tokenizer)

    def render(units: int, index: int = 0) -> tuple[str, list[str], int]:
        text, prefix, refs = spec.generator(spec, job, units, index)
        prompt = wrap(text) + prefix
        return prompt, refs, len(tokenizer.encode(prompt))

    def too_small(units: int, count: int) -> ValueError:
        return ValueError(
            f"context_length {context_length} is too small for {task}: its smallest haystack "
            f"({units} units) needs {count + new_tokens} tokens ({count} prompt + "
            f"{new_tokens} new)"
        )

    if spec.linear_search:
        step = budget // 32
        if step < 1 or budget // spec.config.tokens_per_vocab_word < 4:
            raise ValueError(f"context_length {context_length} is too small for {task}")
        units = _linear_search(render, budget, step)
        if units < step:
            raise too_small(step, render(step)[2])
    else:
        step = spec.incremental if context_length >= 4096 else spec.incremental_small
        units = _binary_search(
            render,
            budget,
            context_length,
            step,
            spec.probe_units or step,
            spec.search_factor,
            job.limit,
        )
        if units is None:
            raise too_small(step, render(step)[2])

    samples, job.capped = [], 0
    for index in range(num_samples):
        n = units
        prompt, refs, count = render(n, index)
        while count > budget:  # this draw came out longer (e.g. a longer key): one step less
            if n <= step:
                raise too_small(n, count)
            n -= step
            prompt, refs, count = render(n, index)
        samples.append(Sample(task, index, prompt, refs, count, new_tokens))
    if job.capped and num_samples:
        fill = sum(s.num_tokens + new_tokens for s in samples) / (num_samples * context_length)
        warnings.warn(
            f"{task} at {context_length} tokens: the word list is capped at the "
            f"{len(cwe_words(seed))} wonderwords, so prompts fill {100 * fill:.0f}% of the context",
            stacklevel=2,
        )
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


def aggregate(records):
    """The paper's Table 4 layout: a DataFrame with context lengths as rows, tasks as columns
    (in TASKS order) plus "avg", the plain mean of the task scores at that length; a last row
    "avg" holds each column's mean over the lengths, so ("avg", "avg") is the overall score.

    `records`: a list of dicts or a DataFrame with columns task, context_length and score (one
    sample's 0-100 score). Each cell is the mean over its samples, rounded to 2 decimals like
    upstream's per-task score; a task missing at some length leaves that length's avg NaN.
    """
    import pandas as pd

    df = records if isinstance(records, pd.DataFrame) else pd.DataFrame(list(records))
    missing = {"task", "context_length", "score"} - set(df.columns)
    if missing or df.empty:
        raise ValueError(
            f"need records with task, context_length and score; missing {sorted(missing)}"
            if missing
            else "no records to aggregate"
        )
    for task in df["task"].unique():
        _spec(task)
    table = df.groupby(["context_length", "task"])["score"].mean().unstack("task")
    table = table[[t for t in TASKS if t in table.columns]].round(2)
    table["avg"] = table.mean(axis=1, skipna=False).round(2)
    table.loc["avg"] = table.mean(axis=0, skipna=False).round(2)
    table.columns.name = None
    return table


def main() -> None:
    """Print one prompt of each task that needs no data, at 4096 whitespace-separated 'tokens'."""

    class Words:
        def encode(self, text: str) -> list[str]:
            return text.split()

    for task, spec in TASKS.items():
        if spec.source is None:
            (s,) = generate(task, 4096, 1, Words())
            print(f"== {VERSION} {task}: {s.num_tokens} + {s.max_new_tokens} tokens")
            print(s.prompt[:200] + "\n...\n" + s.prompt[-300:] + f"\n-> {s.references}\n")


if __name__ == "__main__":
    main()
