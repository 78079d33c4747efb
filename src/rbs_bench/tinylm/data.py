"""The training mixture of the tiny retrieval LM: synthetic long-context tasks in raw text.

Every example is `prompt + answer + <|endoftext|>`, where the prompt is an instruction, a long
context, a question and an answer prefix; the loss is taken mostly on the answer. The tasks teach
the skills RULER measures, in phrasing of their own (RULER stays held out: none of its templates,
needle sentences or noise sentences are used, and none of its code is imported here):

- `kv_single`: one key-value fact (or a key-less pass code) hidden in filler text.
- `kv_lookup`: a haystack made of distractor facts of the same form; one or a few keys are asked.
- `kv_multi`: several facts in filler: one of many keys, all values of one key, or several keys.
- `var_chain`: chains of variable assignments in filler; which variables hold a given value.
- `common_words`: a word list where a few words repeat often; which are they.
- `frequent_words`: Zipf-distributed coded words; the most frequent ones.
- `word_count`: how often one word occurs in a list.

Keys are adjective-noun pairs, nouns, tags or UUIDs; values are numbers (mostly 7 digits), UUIDs or
words; the words come from wonderwords' lists. Filler (`FILLER_KINDS`) is generated prose, prose
lines, a short block of prose repeated, or a repeated block of "The <noun> is <adjective>."
statements. Most haystacks also carry a few extra facts that are stated again later: the restated
values are recall targets, a dense training signal for key-based lookup. The tokenizer is
byte-level, so a text's token count is its UTF-8 byte count; every text here is ASCII, so lengths
are counted in characters.

`batch(seed, step, rows, length, mixture, fillers)` builds one training batch from its arguments
alone: rows are packed with examples of mixed lengths and padded with end-of-text, so a run is
reproducible and resumable from any step.
"""

from __future__ import annotations

import random
import string
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib.resources import files

import numpy as np

EOS_ID = 256  # <|endoftext|> of the byte-level tokenizer (rbs_bench.models.tiny)

# Sampling weights of the tasks in a training row.
MIXTURE: dict[str, float] = {
    "kv_single": 0.22,
    "kv_lookup": 0.30,
    "kv_multi": 0.18,
    "var_chain": 0.14,
    "common_words": 0.06,
    "frequent_words": 0.06,
    "word_count": 0.04,
}
TASKS = tuple(MIXTURE)
# Filler kinds of the haystacks and their relative weights (integers).
FILLERS: dict[str, int] = {"prose": 2, "repeat": 2, "lines": 1}
FILLER_KINDS = ("prose", "repeat", "lines", "copula")
# Token labels: a task index for answer tokens, RECALL for restated values inside a context.
LABELS = (*TASKS, "recall")
RECALL = len(TASKS)


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str  # instruction, context, question and answer prefix
    answer: str  # what the model must write next (end-of-text follows)
    context: str  # the haystack part of the prompt
    references: tuple[str, ...]  # strings a correct answer contains
    recall: tuple[tuple[int, int], ...] = ()  # spans of restated values in the prompt

    def __len__(self) -> int:  # tokens, end-of-text included
        return len(self.prompt) + len(self.answer) + 1


# ---------------------------------------------------------------------------------------------
# Words


@dataclass(frozen=True)
class Words:
    nouns: tuple[str, ...]
    adjectives: tuple[str, ...]
    vocabulary: tuple[str, ...]  # nouns, adjectives and verbs: word-list tasks


def _wordlist(name: str) -> list[str]:
    text = files("wonderwords").joinpath("assets", name).read_text(encoding="utf-8")
    return [w.strip() for w in text.splitlines()]


def _plain(word: str) -> bool:
    return word.isascii() and word.replace("-", "").isalpha() and word.islower() and len(word) > 2


@cache
def words() -> Words:
    nouns = sorted({w for w in _wordlist("nounlist.txt") if _plain(w)})
    adjectives = sorted({w for w in _wordlist("adjectivelist.txt") if _plain(w)})
    verbs = {w for w in _wordlist("verblist.txt") if _plain(w)}
    vocabulary = sorted(set(nouns) | set(adjectives) | verbs)
    return Words(tuple(nouns), tuple(adjectives), tuple(vocabulary))


# A few verbs in fixed forms, so that generated sentences read as English.
_PAST = (
    "found carried watched painted followed opened described moved studied repaired counted "
    "noticed borrowed cleaned built measured visited answered ignored admired collected "
    "sold ordered packed lifted checked marked tested shared covered chose"
).split()
_BASE = (
    "find carry watch paint follow open describe move study repair count notice borrow "
    "clean build measure visit answer ignore admire collect"
).split()
_PLACES = (
    "near the river|in the old town|by the window|after the storm|before dawn|at the market|"
    "on the hill|in the garden|under the bridge|behind the station|during the festival|"
    "in the library|along the coast|at the workshop|in the quiet valley"
).split("|")


def _an(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _sentence(rng: random.Random) -> str:
    """One sentence of generated prose: plausible grammar, random content."""
    w = words()
    n = lambda: rng.choice(w.nouns)
    a = lambda: rng.choice(w.adjectives)
    form = rng.randrange(16)
    if form == 0:
        s = f"The {a()} {n()} {rng.choice(_PAST)} the {n()} {rng.choice(_PLACES)}."
    elif form == 1:
        s = f"Nobody expected the {n()} to be so {a()}."
    elif form == 2:
        s = f"Every {n()} in the {n()} seemed {a()} that year."
    elif form == 3:
        s = f"She {rng.choice(_PAST)} {_an(a())} {n()} before the {n()} arrived."
    elif form == 4:
        s = f"After the {n()}, the {n()} {rng.choice(_PAST)} it again."
    elif form == 5:
        s = f"It was {_an(a())} {n()}, and the {n()} knew it."
    elif form == 6:
        s = f"They {rng.choice(_PAST)} the {n()} with {_an(a())} {n()}."
    elif form == 7:
        s = f"Beyond the {n()} lay {_an(a())} {n()}."
    elif form == 8:
        s = f"The {n()} of the {n()} is {a()}, or so people say."
    elif form == 9:
        s = f"Why would anyone {rng.choice(_BASE)} {_an(n())} {rng.choice(_PLACES)}?"
    elif form == 10:
        s = f"He said the {n()} was {a()} and {a()}."
    elif form == 11:
        year, who, did, what = rng.randint(1700, 2024), n(), rng.choice(_PAST), n()
        s = f"In {year} the {who} {did} the {what} {rng.randint(2, 90)} times."
    elif form == 12:
        s = f"We {rng.choice(_PAST)} the {a()} {n()} {rng.choice(_PLACES)}."
    elif form == 13:
        s = f"{_an(a())} {n()} is rarely {a()}."
    elif form == 14:
        s = f"Most of the {n()} was {a()}, but the {n()} was not."
    else:
        s = f"There were {rng.randint(3, 400)} kinds of {n()} {rng.choice(_PLACES)}."
    return s[0].upper() + s[1:]


# ---------------------------------------------------------------------------------------------
# Keys, values and their names


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randint(10 ** (n - 1), 10**n - 1))


def _draw_key(rng: random.Random, kind: str) -> str:
    w = words()
    if kind == "pair":
        return f"{rng.choice(w.adjectives)}-{rng.choice(w.nouns)}"
    if kind == "noun":
        return rng.choice(w.nouns)
    if kind == "tag":
        return f"{rng.choice(w.nouns)}-{rng.randint(10, 9999)}"
    if kind == "uuid":
        return _uuid(rng)
    raise ValueError(kind)


def _draw_value(rng: random.Random, kind: str) -> str:
    w = words()
    if kind == "num7":
        return _digits(rng, 7)
    if kind == "num":
        return _digits(rng, rng.randint(3, 10))
    if kind == "uuid":
        return _uuid(rng)
    if kind == "pair":
        return f"{rng.choice(w.adjectives)}-{rng.choice(w.nouns)}"
    if kind == "word":
        return rng.choice(w.nouns)
    raise ValueError(kind)


_KEY_KINDS = (("pair", 0.55), ("noun", 0.12), ("tag", 0.13), ("uuid", 0.20))
_VALUE_KINDS = (("num7", 0.55), ("num", 0.13), ("uuid", 0.20), ("pair", 0.07), ("word", 0.05))

# (singular, plural) names of a value, by value kind.
_NUMBER_NAMES = (
    ("number", "numbers"),
    ("code", "codes"),
    ("pass code", "pass codes"),
    ("access code", "access codes"),
    ("pin", "pins"),
    ("serial number", "serial numbers"),
    ("ticket number", "ticket numbers"),
    ("figure", "figures"),
    ("value", "values"),
    ("combination", "combinations"),
)
_UUID_NAMES = (
    ("uuid", "uuids"),
    ("identifier", "identifiers"),
    ("id", "ids"),
    ("token", "tokens"),
    ("hash", "hashes"),
    ("reference", "references"),
    ("key", "keys"),
)
_WORD_NAMES = (
    ("word", "words"),
    ("password", "passwords"),
    ("codeword", "codewords"),
    ("label", "labels"),
    ("tag", "tags"),
)
_NAME_ADJECTIVES = ("", "", "", "", "secret ", "hidden ", "special ", "private ", "assigned ")


def _value_names(rng: random.Random, value_kind: str) -> tuple[str, str]:
    pool = {"uuid": _UUID_NAMES, "pair": _WORD_NAMES, "word": _WORD_NAMES}.get(
        value_kind, _NUMBER_NAMES
    )
    one, many = rng.choice(pool)
    adj = rng.choice(_NAME_ADJECTIVES)
    return adj + one, adj + many


def _weighted(rng: random.Random, pairs) -> str:
    names, weights = zip(*pairs)
    return rng.choices(names, weights)[0]


# ---------------------------------------------------------------------------------------------
# Templates ({k} key, {v} value, {n} value name, {ns} its plural, {q} a qualifier)

_FACTS = (
    "The {n} for {k} is {v}.",
    "The {n} of {k} is {v}.",
    "For {k}, the {n} is {v}.",
    "Note: the {n} assigned to {k} is {v}.",
    "Remember that {k} has the {n} {v}.",
    "{k}: {v}",
    "{k} = {v}",
    "{k} -> {v}",
    "Entry {k} has {n} {v}.",
    "Write down the {n} for {k}: {v}.",
    "One {n} that belongs to {k} is {v}.",
    "The {n} linked to {k} reads {v}.",
    "Under {k} the records list the {n} {v}.",
    "A {n} for {k}: {v}.",
    "{k} was given the {n} {v}.",
    "If anyone asks about {k}, the {n} is {v}.",
    "Record for {k} -- {n}: {v}.",
    "The {n} {v} belongs to {k}.",
    "{v} is the {n} for {k}.",
    "For {k} the {n} was: {v}.",
    "Item {k}, {n}: {v}.",
)
_KEYLESS_FACTS = (
    "The {n} is {v}. Remember it. {v} is the {n}.",
    "Keep this in mind: the {n} is {v}.",
    "The {n} you will need is {v}.",
    "Here is the {n}: {v}.",
)
_QUALIFIERS = (
    "",
    "",
    "",
    " given above",
    " in the document",
    " from the passage above",
    " stated in the text",
    " listed in the notes",
    " found in the context",
    " mentioned above",
)
_INSTRUCTIONS_ONE = (
    "Read the following text. It contains {an_n} that you will be asked about later.",
    "Somewhere in the notes below there is {an_n}. Remember it for the question at the end.",
    "Study this document carefully; a question about {an_n} follows it.",
    "Here is some text. Answer the question at the end.",
    "The passage below contains records. Keep them in mind; you will be asked to look one up.",
    "",
    "",
)
_INSTRUCTIONS_MANY = (
    "Below is a long document with some {ns} scattered through it. Keep them in mind.",
    "Read the records below. You will be asked about several of the {ns} they contain.",
    "Some {ns} are written somewhere in the following text. Remember all of them.",
    "Here is some text. Answer the question at the end.",
    "",
)
_QUESTIONS_ONE = (
    "What is the {n} for {k}{q}?",
    "Which {n} was given for {k}{q}?",
    "What {n} belongs to {k}{q}?",
    "Find the {n} of {k}{q}.",
    "Question: what is the {n} of {k}{q}?",
    "Look up {k}. What is its {n}{q}?",
    "Recall the {n} listed for {k}{q}.",
    "Which {n} does {k} have{q}?",
)
_PREFIXES_ONE = (
    "The {n} for {k}{q} is",
    "The {n} of {k}{q} is",
    "Answer: the {n} for {k} is",
    "{k} has the {n}",
    "Answer:",
    "The {n} listed for {k} is",
    "The {n} is",
    "According to the text, the {n} for {k} is",
    "{k}:",
    "Answer: ",
    "The {n} for {k}{q} is: ",
)
_KEYLESS_QUESTIONS = ("What is the {n}{q}?", "Which {n} was given{q}?", "Recall the {n}{q}.")
_KEYLESS_PREFIXES = ("The {n} is", "Answer:", "The {n}{q} is", "Answer: ")
_QUESTIONS_MANY_VALUES = (
    "What are all the {ns} for {k}{q}?",
    "List every {n} given for {k}{q}.",
    "Which {ns} belong to {k}{q}?",
    "Question: name all {ns} of {k}{q}.",
)
_PREFIXES_MANY_VALUES = (
    "The {ns} for {k}{q} are",
    "Answer: the {ns} of {k} are",
    "All {ns} for {k}:",
    "The {ns} are: ",
)
_QUESTIONS_MANY_KEYS = (
    "What are the {ns} for {k}{q}?",
    "Give the {ns} of {k}{q}.",
    "Which {ns} belong to {k}{q}?",
)
_PREFIXES_MANY_KEYS = (
    "The {ns} for {k}{q} are",
    "Answer: the {ns} of {k} are",
    "In order, the {ns} are",
    "Answer: ",
)
_SEPARATORS = ("\n", "\n", "\n\n", " ")


def _fmt(template: str, **kw) -> str:
    n = kw.get("n", "")
    return template.format(an_n=_an(n) if n else "", **kw)


def _join_list(rng: random.Random, items: list[str], style: int | None = None) -> str:
    style = rng.randrange(3) if style is None else style
    if len(items) == 1:
        return items[0]
    if style == 0:
        return ", ".join(items[:-1]) + ", and " + items[-1]
    if style == 1:
        return ", ".join(items)
    return " and ".join([", ".join(items[:-1]), items[-1]])


def _answer(prefix: str, text: str) -> str:
    return text if prefix.endswith((" ", "\n")) else " " + text


def _render(instruction: str, context: str, question: str, prefix: str, seps) -> str:
    head = instruction + seps[0] if instruction else ""
    return head + context + seps[1] + question + seps[2] + prefix


# ---------------------------------------------------------------------------------------------
# Haystacks


def _pool(weights: dict[str, int]) -> tuple[str, ...]:
    return tuple(k for k, n in weights.items() for _ in range(n))


_filler_pool = _pool(FILLERS)


def set_fillers(weights: dict[str, int] | None) -> None:
    """Use these filler weights in this process (None: the default FILLERS)."""
    global _filler_pool
    weights = FILLERS if weights is None else weights
    unknown = set(weights) - set(FILLER_KINDS)
    if unknown or not any(weights.values()):
        raise ValueError(f"filler weights {weights}: kinds are {', '.join(FILLER_KINDS)}")
    _filler_pool = _pool(weights)


_RULER_LIKE = {("grass", "green"), ("sky", "blue"), ("sun", "yellow")}  # held-out noise


def _copula(rng: random.Random) -> str:
    w = words()
    while True:
        noun, adj = rng.choice(w.nouns), rng.choice(w.adjectives)
        if (noun, adj) not in _RULER_LIKE:
            return f"The {noun} is {adj}."


def _filler(rng: random.Random, kind: str | None = None) -> tuple[Callable[[], str], str]:
    """(unit generator, joiner) of a natural-looking filler.

    prose: generated sentences; lines: one per line; repeat: a block of 1-5 sentences repeated;
    copula: a block of 2-5 short "The <noun> is <adjective>." statements repeated, so that "is"
    is followed by many words other than the answer.
    """
    kind = kind or rng.choice(_filler_pool)
    if kind == "copula":
        block = " ".join(_copula(rng) for _ in range(rng.randint(2, 5)))
        return (lambda: block), rng.choice(("\n", "\n", " "))
    if kind == "prose":
        return (lambda: _sentence(rng)), " "
    if kind == "lines":
        return (lambda: _sentence(rng)), "\n"
    block = " ".join(_sentence(rng) for _ in range(rng.randint(1, 5)))
    return (lambda: block), rng.choice(("\n", "\n", " "))


def _haystack(
    rng: random.Random,
    budget: int,
    unit: Callable[[], str | tuple[str, tuple[int, int]]],
    sep: str,
    needles: list[str],
    keep_order: bool = False,
) -> tuple[str, list[int], list[tuple[int, int]]]:
    """Filler units up to `budget` characters with the needles inserted at random places.

    Returns the text, the needles' indices in the order they appear (with `keep_order` the given
    order: assignment chains) and the character spans of recall targets. A unit is a string or
    (string, span of a recall target in it); a unit generator with an `accepted()` method is told
    which units were used.
    """
    size = sum(len(x) + len(sep) for x in needles)
    units: list[tuple[str, tuple[int, int] | None]] = []
    misses = 0
    accepted = getattr(unit, "accepted", None)
    while misses < 3:
        u = unit()
        text, span = (u, None) if isinstance(u, str) else u
        if size + len(text) + len(sep) > budget:
            misses += 1  # units vary in length: a shorter one may still fit
            continue
        if accepted is not None:
            accepted()
        units.append((text, span))
        size += len(text) + len(sep)
    slots = sorted(rng.randint(0, len(units)) for _ in needles)
    order = list(range(len(needles)))
    if not keep_order:
        rng.shuffle(order)
    items: list[tuple[str, tuple[int, int] | None]] = []
    k = 0
    for i in range(len(units) + 1):
        while k < len(slots) and slots[k] == i:
            items.append((needles[order[k]], None))
            k += 1
        if i < len(units):
            items.append(units[i])
    spans, pos = [], 0
    for text, span in items:
        if span is not None:
            spans.append((pos + span[0], pos + span[1]))
        pos += len(text) + len(sep)
    return sep.join(t for t, _ in items), order, spans


# Facts stated again later must name the key before the value: the value is then predictable.
_RECALL_FACTS = tuple(f for f in _FACTS if f.index("{k}") < f.index("{v}"))


class _FactStream:
    """Filler units mixed with key-value facts, some of which are stated again later.

    The value of a restated fact is a recall target: the model can only predict it by finding the
    key's earlier statement. `base` makes the filler units (None: every unit is a fact); `draw`
    returns a fresh (key, value, value name); `fact_of(key, value, name)` states a new fact.
    """

    def __init__(self, rng, base, p_fact, p_again, draw, fact_of):
        self.rng, self.base, self.p_fact, self.p_again = rng, base, p_fact, p_again
        self.draw, self.fact_of = draw, fact_of
        self.stored: list[tuple[str, str, str]] = []
        self._pending = None

    def __call__(self):
        r = self.rng.random()
        if self.stored and r < self.p_again:
            i = self.rng.randrange(len(self.stored))
            key, value, n = self.stored[i]
            t = self.rng.choice(_RECALL_FACTS)
            start = len(t[: t.index("{v}")].format(k=key, n=n))
            self._pending = ("again", i)
            return t.format(k=key, v=value, n=n), (start, start + len(value))
        if self.base is None or r < self.p_again + self.p_fact:
            fact = self.draw()
            self._pending = ("new", fact)
            return self.fact_of(*fact)
        self._pending = None
        return self.base()

    def accepted(self) -> None:
        if self._pending is None:
            return
        kind, x = self._pending
        if kind == "new":
            self.stored.append(x)
        else:
            self.stored.pop(x)
        self._pending = None


def _with_recall(rng, base, taken_k: set, taken_v: set):
    """`base` with, in most examples, a few random facts mixed in and restated later."""
    if rng.random() < 0.35:
        return base
    rate = rng.uniform(0.02, 0.12)

    def draw():
        vkind = _weighted(rng, _VALUE_KINDS)
        (k,) = _distinct(rng, lambda: _draw_key(rng, _weighted(rng, _KEY_KINDS)), 1, taken_k)
        (v,) = _distinct(rng, lambda: _draw_value(rng, vkind), 1, taken_v)
        return k, v, _value_names(rng, vkind)[0]

    fact_of = lambda k, v, n: rng.choice(_FACTS).format(k=k, v=v, n=n)
    return _FactStream(rng, base, rate, rate, draw, fact_of)


def _offset(spans, shift: int) -> tuple[tuple[int, int], ...]:
    return tuple((a + shift, b + shift) for a, b in spans)


def _context_start(shots: str, instruction: str, seps) -> int:
    return len(shots) + (len(instruction) + len(seps[0]) if instruction else 0)


# ---------------------------------------------------------------------------------------------
# Tasks: each takes (rng, budget) and returns an Example of at most `budget` tokens, or None
# when the budget is too small for it.


@dataclass
class _KvStyle:
    key_kind: str
    value_kind: str
    n: str
    ns: str
    fact: str
    q: str
    instruction: str
    seps: tuple[str, str, str]

    @classmethod
    def draw(cls, rng: random.Random, many: bool = False) -> _KvStyle:
        key_kind = _weighted(rng, _KEY_KINDS)
        value_kind = _weighted(rng, _VALUE_KINDS)
        n, ns = _value_names(rng, value_kind)
        return cls(
            key_kind,
            value_kind,
            n,
            ns,
            rng.choice(_FACTS),
            rng.choice(_QUALIFIERS),
            rng.choice(_INSTRUCTIONS_MANY if many else _INSTRUCTIONS_ONE),
            (rng.choice(_SEPARATORS), rng.choice(_SEPARATORS), rng.choice((" ", " ", "\n"))),
        )

    def fact_of(self, key: str, value: str) -> str:
        return self.fact.format(k=key, v=value, n=self.n)


def _distinct(rng: random.Random, draw: Callable[[], str], count: int, taken: set) -> list[str]:
    out = []
    while len(out) < count:
        x = draw()
        if x not in taken:
            taken.add(x)
            out.append(x)
    return out


def kv_single(rng: random.Random, budget: int) -> Example | None:
    """One fact (or a key-less pass code) hidden in filler."""
    st = _KvStyle.draw(rng)
    value = _draw_value(rng, st.value_kind)
    keyless = rng.random() < 0.15
    key = None
    if keyless:
        fact = rng.choice(_KEYLESS_FACTS).format(n=st.n, v=value)
        question = _fmt(rng.choice(_KEYLESS_QUESTIONS), n=st.n, q=st.q)
        prefix = _fmt(rng.choice(_KEYLESS_PREFIXES), n=st.n, q=st.q)
        instruction = _fmt(st.instruction, n=st.n, ns=st.ns)
    else:
        key = _draw_key(rng, st.key_kind)
        fact = st.fact_of(key, value)
        question = _fmt(rng.choice(_QUESTIONS_ONE), n=st.n, k=key, q=st.q)
        prefix = _fmt(rng.choice(_PREFIXES_ONE), n=st.n, k=key, q=st.q)
        instruction = _fmt(st.instruction, n=st.n, ns=st.ns)
    answer = _answer(prefix, value)
    room = budget - len(_render(instruction, "", question, prefix, st.seps)) - len(answer) - 1
    if room < len(fact):
        return None
    unit, sep = _filler(rng)
    if not keyless:  # more facts would make a key-less question ambiguous
        unit = _with_recall(rng, unit, {key}, {value})
    context, _, spans = _haystack(rng, room, unit, sep, [fact])
    prompt = _render(instruction, context, question, prefix, st.seps)
    recall = _offset(spans, _context_start("", instruction, st.seps))
    return Example("kv_single", prompt, answer, context, (value,), recall)


def kv_lookup(rng: random.Random, budget: int) -> Example | None:
    """A haystack of facts of one form with distinct keys; one or a few keys are asked."""
    asked = 1 if rng.random() < 0.75 else rng.randint(2, 4)
    st = _KvStyle.draw(rng, many=asked > 1)
    keys_taken: set = set()
    values_taken: set = set()
    keys = _distinct(rng, lambda: _draw_key(rng, st.key_kind), asked, keys_taken)
    values = _distinct(rng, lambda: _draw_value(rng, st.value_kind), asked, values_taken)
    facts = [st.fact_of(k, v) for k, v in zip(keys, values)]
    if asked == 1:
        question = _fmt(rng.choice(_QUESTIONS_ONE), n=st.n, k=keys[0], q=st.q)
        prefix = _fmt(rng.choice(_PREFIXES_ONE), n=st.n, k=keys[0], q=st.q)
        answer = _answer(prefix, values[0])
    else:
        style = rng.randrange(3)
        klist = _join_list(rng, keys, style)
        question = _fmt(rng.choice(_QUESTIONS_MANY_KEYS), ns=st.ns, k=klist, q=st.q)
        prefix = _fmt(rng.choice(_PREFIXES_MANY_KEYS), ns=st.ns, k=klist, q=st.q)
        answer = _answer(prefix, _join_list(rng, values, style))
    instruction = _fmt(st.instruction, n=st.n, ns=st.ns)
    room = budget - len(_render(instruction, "", question, prefix, st.seps)) - len(answer) - 1
    if room < sum(len(f) + 1 for f in facts):
        return None
    prose = rng.random() < 0.3  # some prose between the facts

    def draw():
        (k,) = _distinct(rng, lambda: _draw_key(rng, st.key_kind), 1, keys_taken)
        (v,) = _distinct(rng, lambda: _draw_value(rng, st.value_kind), 1, values_taken)
        return k, v, st.n

    again = rng.uniform(0.1, 0.35) if rng.random() < 0.6 else 0.0
    unit = _FactStream(
        rng,
        (lambda: _sentence(rng)) if prose else None,
        0.6,
        again,
        draw,
        lambda k, v, n: st.fact_of(k, v),
    )
    context, _, spans = _haystack(rng, room, unit, rng.choice(("\n", "\n", " ")), facts)
    prompt = _render(instruction, context, question, prefix, st.seps)
    recall = _offset(spans, _context_start("", instruction, st.seps))
    return Example("kv_lookup", prompt, answer, context, tuple(values), recall)


def kv_multi(rng: random.Random, budget: int) -> Example | None:
    """Several facts in filler: one key of many, every value of one key, or several keys."""
    mode = rng.choice(("keys", "values", "queries"))
    st = _KvStyle.draw(rng, many=mode != "keys")
    taken_k: set = set()
    taken_v: set = set()
    if mode == "values":
        (key,) = _distinct(rng, lambda: _draw_key(rng, st.key_kind), 1, taken_k)
        count = rng.randint(2, 5)
        values = _distinct(rng, lambda: _draw_value(rng, st.value_kind), count, taken_v)
        facts = [st.fact_of(key, v) for v in values]
    else:
        count = rng.randint(2, 6)
        keys = _distinct(rng, lambda: _draw_key(rng, st.key_kind), count, taken_k)
        values = _distinct(rng, lambda: _draw_value(rng, st.value_kind), count, taken_v)
        facts = [st.fact_of(k, v) for k, v in zip(keys, values)]
    instruction = _fmt(st.instruction, n=st.n, ns=st.ns)
    # The question depends on where the facts land (values are answered in order of
    # appearance), so place them in a provisional haystack size first.
    unit, sep = _filler(rng)
    if mode == "keys":
        i = rng.randrange(count)
        question = _fmt(rng.choice(_QUESTIONS_ONE), n=st.n, k=keys[i], q=st.q)
        prefix = _fmt(rng.choice(_PREFIXES_ONE), n=st.n, k=keys[i], q=st.q)
        answer = _answer(prefix, values[i])
        refs = (values[i],)
    elif mode == "queries":
        asked = sorted(rng.sample(range(count), rng.randint(2, count)))
        rng.shuffle(asked)
        style = rng.randrange(3)
        klist = _join_list(rng, [keys[i] for i in asked], style)
        question = _fmt(rng.choice(_QUESTIONS_MANY_KEYS), ns=st.ns, k=klist, q=st.q)
        prefix = _fmt(rng.choice(_PREFIXES_MANY_KEYS), ns=st.ns, k=klist, q=st.q)
        answer = _answer(prefix, _join_list(rng, [values[i] for i in asked], style))
        refs = tuple(values[i] for i in asked)
    else:
        question = _fmt(rng.choice(_QUESTIONS_MANY_VALUES), n=st.n, ns=st.ns, k=key, q=st.q)
        prefix = _fmt(rng.choice(_PREFIXES_MANY_VALUES), ns=st.ns, k=key, q=st.q)
        # the longest answer: every value, the widest join
        answer = _answer(prefix, ", ".join(values[:-1]) + ", and " + values[-1])
        refs = tuple(values)
    room = budget - len(_render(instruction, "", question, prefix, st.seps)) - len(answer) - 1
    if room < sum(len(f) + 1 for f in facts):
        return None
    context, order, spans = _haystack(
        rng, room, _with_recall(rng, unit, taken_k, taken_v), sep, facts
    )
    if mode == "values":  # answered in order of appearance; never longer than reserved
        answer = _answer(prefix, _join_list(rng, [values[i] for i in order]))
    prompt = _render(instruction, context, question, prefix, st.seps)
    recall = _offset(spans, _context_start("", instruction, st.seps))
    return Example("kv_multi", prompt, answer, context, refs, recall)


_ASSIGN = (  # (first line, link line) of a chain
    ("{kw} {a} = {v}", "{kw} {b} = {kw} {a}"),
    ("{a} = {v}", "{b} = {a}"),
    ("{a} := {v}", "{b} := {a}"),
    ("let {a} be {v}.", "let {b} be {a}."),
    ("{a} <- {v}", "{b} <- {a}"),
    ("set {a} to {v};", "set {b} to {a};"),
    ("{kw} {a} = {v};", "{kw} {b} = {a};"),
)
_KEYWORDS = ("LET", "SET", "DEF", "VAL", "REG", "let", "var", "val", "def", "NODE")
_VT_INSTRUCTIONS = (
    "Follow the variable assignments hidden in the text below.",
    "The text below contains assignments between variables. Keep track of them.",
    "Track which variable gets which value in the following notes.",
    "",
)
_VT_QUESTIONS = (
    "Which variables end up with the value {v}?",
    "Question: list all variables that hold {v} after the assignments above.",
    "Find every variable equal to {v} in the text.",
    "Which variables are assigned {v}, directly or through other variables?",
)
_VT_PREFIXES = (
    "Answer: the variables equal to {v} are:",
    "Variables holding {v}:",
    "Answer: {m} variables hold {v}, namely: ",
    "They are: ",
    "The variables with the value {v} are",
)


def _var_names(rng: random.Random, count: int, style: int) -> list[str]:
    letters = string.ascii_lowercase if style == 2 else string.ascii_uppercase
    size = 5 if style == 0 else rng.randint(3, 6)
    taken: set = set()
    return _distinct(rng, lambda: "".join(rng.choices(letters, k=size)), count, taken)


def var_chain(rng: random.Random, budget: int) -> Example | None:
    """Chains of assignments (a = value, b = a, ...) in filler; which variables hold a value."""
    first, link = rng.choice(_ASSIGN)
    kw = rng.choice(_KEYWORDS)
    instruction = rng.choice(_VT_INSTRUCTIONS)
    question_t, prefix_t = rng.choice(_VT_QUESTIONS), rng.choice(_VT_PREFIXES)
    seps = (rng.choice(_SEPARATORS), rng.choice(_SEPARATORS), rng.choice((" ", " ", "\n")))
    name_style = rng.choices((0, 1, 2), (0.7, 0.2, 0.1))[0]
    digits = 5 if rng.random() < 0.6 else rng.randint(2, 7)
    joiner = rng.choice((" ", " ", ", "))
    kind = rng.choice(("prose", "repeat", "repeat", "lines"))

    def render(room_budget: int, shots: str) -> Example | None:
        hops = rng.randint(1, 6)
        chains = rng.choices((1, 2, 3), (0.5, 0.3, 0.2))[0]
        names = _var_names(rng, chains * (hops + 1), name_style)
        values = _distinct(rng, lambda: _digits(rng, digits), chains, set())
        lines, chain_of = [], []
        for c in range(chains):
            chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
            lines.append(first.format(kw=kw, a=chain[0], v=values[c]))
            lines += [link.format(kw=kw, a=a, b=b) for a, b in zip(chain, chain[1:])]
            chain_of += [c] * (hops + 1)
        # interleave the chains at random, each kept in order
        order = sorted(range(len(lines)), key=lambda i: (rng.random(), chain_of[i]))
        order = _keep_chain_order(order, chain_of)
        ordered = [lines[i] for i in order]
        target = names[: hops + 1]
        question = question_t.format(v=values[0])
        prefix = prefix_t.format(v=values[0], m=hops + 1)
        answer = _answer(prefix, joiner.join(target))
        fixed = shots + _render(instruction, "", question, prefix, seps)
        room = room_budget - len(fixed) - len(answer) - 1
        if room < sum(len(x) + 1 for x in ordered):
            return None
        unit, sep = _filler(rng, kind)
        if sep == " ":
            sep = "\n"  # one assignment per line
        unit = _with_recall(rng, unit, set(names), set(values))
        context, _, spans = _haystack(rng, room, unit, sep, ordered, keep_order=True)
        prompt = shots + _render(instruction, context, question, prefix, seps)
        recall = _offset(spans, _context_start(shots, instruction, seps))
        return Example("var_chain", prompt, answer, context, tuple(target), recall)

    shots = ""
    if rng.random() < 0.5 and budget >= 1200:
        shot = render(rng.randint(300, 600), "")
        if shot is not None:
            shots = shot.prompt + shot.answer + "\n" + rng.choice(("", "\n"))
    return render(budget, shots)


def _keep_chain_order(order: list[int], chain_of: list[int]) -> list[int]:
    """Reassign positions so that each chain's lines keep their original order."""
    per_chain: dict[int, list[int]] = {}
    for i in sorted(order):
        per_chain.setdefault(chain_of[i], []).append(i)
    out, used = [], Counter()
    for i in order:
        c = chain_of[i]
        out.append(per_chain[c][used[c]])
        used[c] += 1
    return out


_LIST_STYLES = ("numbered", "numbered", "comma", "lines", "dashes")
_CW_INSTRUCTIONS = (
    "Here is a list of words. Some of them occur many times, most only a few times.",
    "The following list repeats a handful of words much more often than the rest.",
    "Read the word list below and notice which words come up again and again.",
    "",
)
_CW_QUESTIONS = (
    "Which {c} words occur most often in the list above?",
    "Name the {c} most frequent words of the list.",
    "Question: what are the {c} words repeated most in the list?",
)
_CW_PREFIXES = (
    "The {c} most frequent words are:",
    "Answer: the most common words are:",
    "Most frequent: ",
    "The words repeated most often are",
)


def _word_list(items: list[str], style: str) -> str:
    if style == "numbered":
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
    if style == "comma":
        return ", ".join(items)
    if style == "lines":
        return "\n".join(f"{i + 1}) {w}" for i, w in enumerate(items))
    return "\n".join(f"- {w}" for w in items)


def common_words(rng: random.Random, budget: int) -> Example | None:
    """A list in which `c` words repeat often and the rest rarely; name the frequent ones."""
    vocab = words().vocabulary
    style = rng.choice(_LIST_STYLES)
    instruction = rng.choice(_CW_INSTRUCTIONS)
    question_t, prefix_t = rng.choice(_CW_QUESTIONS), rng.choice(_CW_PREFIXES)
    seps = (rng.choice(_SEPARATORS), "\n", rng.choice((" ", " ", "\n")))
    answer_style = rng.choice(("numbered", "comma", "space"))

    def render(room_budget: int, shots: str, c: int, fc: int, fu: int) -> Example | None:
        pad = {"numbered": 5, "lines": 5}.get(style, 2)
        wanted = c + max(10, int(room_budget / (7 + pad) / fu))
        chosen = rng.sample(vocab, min(wanted, len(vocab)))
        common, rare = chosen[:c], chosen[c:]
        question, prefix = question_t.format(c=c), prefix_t.format(c=c)
        # answered in order of first appearance; reserve the longest form
        longest = " ".join(f"{i + 1}. {w}" for i, w in enumerate(common))
        fixed = shots + _render(instruction, "", question, prefix, seps)
        room = room_budget - len(fixed) - len(_answer(prefix, longest)) - 1
        avg = sum(len(w) for w in rare[:200]) / len(rare[:200]) + pad
        n_rare = int((room / avg - c * fc) / fu)
        while True:
            if n_rare < 0:
                return None
            items = [w for w in common for _ in range(fc)]
            items += [w for w in rare[:n_rare] for _ in range(fu)]
            rng.shuffle(items)
            context = _word_list(items, style)
            if len(context) <= room:
                break
            n_rare -= max(1, n_rare // 50)
        common_set = set(common)
        seen = list(dict.fromkeys(w for w in items if w in common_set))
        if answer_style == "numbered":
            text = " ".join(f"{i + 1}. {w}" for i, w in enumerate(seen))
        else:
            text = (", " if answer_style == "comma" else " ").join(seen)
        answer = _answer(prefix, text)
        prompt = shots + _render(instruction, context, question, prefix, seps)
        return Example("common_words", prompt, answer, context, tuple(seen))

    c = rng.choice((10, 10, 10, rng.randint(3, 9)))
    fc = rng.randint(4, 30)
    fu = rng.randint(1, max(1, min(3, fc // 3)))
    shots = ""
    if rng.random() < 0.5 and budget >= 3000:
        shot = render(rng.randint(600, 1200), "", c, rng.randint(3, 6), 1)
        if shot is not None:
            shots = shot.prompt + shot.answer + "\n" + rng.choice(("", "\n"))
    return render(budget, shots, c, fc, fu)


_NOISE_MARKS = ("...", "--", "~~", "**", "::", "..")
_FW_INSTRUCTIONS = (
    "The text below is written in made-up code words. Some code words are used far more often "
    "than others.",
    "Count how often each code word occurs in the following text.",
    "Below is a sequence of coded words with very uneven frequencies.",
    "",
)
_FW_QUESTIONS = (
    "Which {c} code words occur most often?",
    "Question: what are the {c} most frequent code words above{ignore}?",
    "Name the {c} most common coded words{ignore}.",
)
_FW_PREFIXES = (
    "The {c} most frequent code words are:",
    "Answer: the most common code words are:",
    "Most frequent: ",
    "In order of frequency:",
)


def frequent_words(rng: random.Random, budget: int) -> Example | None:
    """Coded words with Zipf frequencies (an optional noise mark most frequent); the top few."""
    alpha = rng.uniform(1.5, 2.5)
    c = rng.choice((3, 3, 3, 2, 4, 5))
    noise = rng.choice(_NOISE_MARKS) if rng.random() < 0.6 else None
    ignore = f" (ignore the {noise} marks)" if noise else ""
    question = rng.choice(_FW_QUESTIONS).format(c=c, ignore=ignore)
    prefix = rng.choice(_FW_PREFIXES).format(c=c)
    instruction = rng.choice(_FW_INSTRUCTIONS)
    seps = (rng.choice((" ", "\n")), "\n", rng.choice((" ", " ", "\n")))
    wordlen = rng.randint(4, 7)
    size = max(c + 2, (budget - 300) // rng.randint(35, 70))
    vocab = _distinct(
        rng, lambda: "".join(rng.choices(string.ascii_lowercase, k=wordlen)), size, set()
    )
    ranked = ([noise] if noise else []) + vocab
    answer_words = ranked[1 : c + 1] if noise else ranked[:c]
    reserve = _answer(prefix, ", ".join(answer_words))
    room = budget - len(_render(instruction, "", question, prefix, seps)) - len(reserve) - 1
    zeta = sum(k**-alpha for k in range(1, len(ranked) + 1))
    per_item = 1 + sum(len(w) * (k + 1) ** -alpha / zeta for k, w in enumerate(ranked))
    total = int(room / per_item)
    while total > 0:
        counts = [int(total * (k + 1) ** -alpha / zeta) for k in range(len(ranked))]
        top = counts[: len(answer_words) + (2 if noise else 1)]
        if any(a <= b for a, b in zip(top, top[1:])):  # ties make the answer ambiguous
            return None
        items = [w for w, n in zip(ranked, counts) for _ in range(n)]
        rng.shuffle(items)
        context = " ".join(items)
        if len(context) <= room:
            break
        total -= max(1, total // 40)
    else:
        return None
    answer = _answer(prefix, rng.choice((", ", " ")).join(answer_words))
    prompt = _render(instruction, context, question, prefix, seps)
    return Example("frequent_words", prompt, answer, context, tuple(answer_words))


_COUNT_QUESTIONS = (
    'How many times does the word "{w}" appear in the list above?',
    "Question: how often is {w} listed above?",
    "Count the occurrences of {w} in the list.",
)
_COUNT_PREFIXES = ("The word appears", "Answer:", "{w} occurs this many times:", "Count: ")


def word_count(rng: random.Random, budget: int) -> Example | None:
    """A word list with one word repeated 1-30 times; how often it occurs."""
    vocab = words().vocabulary
    target = rng.choice(vocab)
    count = rng.randint(1, 30)
    style = rng.choice(_LIST_STYLES)
    question = rng.choice(_COUNT_QUESTIONS).format(w=target)
    prefix = rng.choice(_COUNT_PREFIXES).format(w=target)
    instruction = rng.choice(("Here is a list of words.", "Read the following word list.", ""))
    seps = (rng.choice(_SEPARATORS), "\n", rng.choice((" ", " ", "\n")))
    answer = _answer(prefix, str(count))
    room = budget - len(_render(instruction, "", question, prefix, seps)) - len(answer) - 1
    others = [w for w in rng.sample(vocab, 400) if w != target]
    per_item = sum(len(w) for w in others) / len(others) + {"numbered": 5, "lines": 5}.get(style, 2)
    n_other = max(0, int(room / per_item) - count)
    while True:
        items = [target] * count + [rng.choice(others) for _ in range(n_other)]
        rng.shuffle(items)
        context = _word_list(items, style)
        if len(context) <= room:
            break
        if n_other == 0:
            return None
        n_other -= max(1, n_other // 40)
    prompt = _render(instruction, context, question, prefix, seps)
    return Example("word_count", prompt, answer, context, (str(count),))


GENERATORS: dict[str, Callable[[random.Random, int], Example | None]] = {
    "kv_single": kv_single,
    "kv_lookup": kv_lookup,
    "kv_multi": kv_multi,
    "var_chain": var_chain,
    "common_words": common_words,
    "frequent_words": frequent_words,
    "word_count": word_count,
}
assert tuple(GENERATORS) == TASKS


def example(task: str, rng: random.Random, budget: int) -> Example | None:
    """One example of `task` of at most `budget` tokens (None if the budget is too small)."""
    if task not in GENERATORS:
        raise ValueError(f"unknown task {task!r}; valid: {', '.join(TASKS)}")
    return GENERATORS[task](rng, budget)


# ---------------------------------------------------------------------------------------------
# Packed rows and batches


def encode(text: str) -> list[int]:
    """Token ids of ASCII/UTF-8 text under the byte-level tokenizer: its bytes."""
    return list(text.encode("utf-8"))


MIN_EXAMPLE = 192  # shortest example budget tried when filling the end of a row


def row(
    rng: random.Random, length: int, mixture: dict[str, float] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """One packed row of `length` tokens: (ids int16 [length], task int8 [length]).

    `task[t]` is the task index of an answer token (the answer and its end-of-text), RECALL for
    a restated value inside a context, -1 for other context and -2 for padding. Half the rows
    hold one example that fills the row; the others hold examples of random lengths.
    """
    mixture = mixture or MIXTURE
    names, weights = list(mixture), list(mixture.values())
    ids = np.full(length, EOS_ID, dtype=np.int16)
    task = np.full(length, -2, dtype=np.int8)
    pos = 0
    whole = rng.random() < 0.5
    while length - pos >= MIN_EXAMPLE:
        left = length - pos
        budget = left if whole or left < 2 * MIN_EXAMPLE else rng.randint(MIN_EXAMPLE, left)
        ex = None
        for _ in range(8):
            name = rng.choices(names, weights)[0]
            ex = example(name, rng, budget)
            if ex is not None:
                break
        if ex is None:
            break
        prompt, answer = encode(ex.prompt), encode(ex.answer) + [EOS_ID]
        n = len(prompt) + len(answer)
        ids[pos : pos + n] = prompt + answer
        task[pos : pos + len(prompt)] = -1
        for a, b in ex.recall:
            task[pos + a : pos + b] = RECALL
        task[pos + len(prompt) : pos + n] = TASKS.index(ex.task)
        pos += n
    return ids, task


def batch(
    seed: int,
    step: int,
    rows: int,
    length: int,
    mixture: dict[str, float] | None = None,
    fillers: dict[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """The batch of training step `step`: a pure function of its arguments.

    Returns `ids` int64 [rows, length + 1] (inputs are ids[:, :-1], targets ids[:, 1:]) and
    `task` int8 [rows, length + 1], aligned with ids.
    """
    set_fillers(fillers)
    ids = np.empty((rows, length + 1), dtype=np.int64)
    task = np.empty((rows, length + 1), dtype=np.int8)
    for r in range(rows):
        rng = random.Random(f"rbs-tinylm:{seed}:{step}:{r}")
        ids[r], task[r] = row(rng, length + 1, mixture)
    return {"ids": ids, "task": task}
