"""RULER generation, length fitting, data sources and scoring (all 13 tasks)."""

from __future__ import annotations

import hashlib
import json
import random
import re
import statistics
import sys
import types
import warnings
from collections import Counter
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path

import pytest

from rbs_bench import benchmarks
from rbs_bench.benchmarks import ruler

TASK = "niah_single_1"
ALL_TASKS = [
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
]
FIXTURES = Path(__file__).parents[1] / "fixtures" / "ruler"
DATA = {
    "essays": str(FIXTURES / "essays"),
    "squad": str(FIXTURES / "squad_dev_v2_tiny.json"),
    "hotpotqa": str(FIXTURES / "hotpot_dev_distractor_tiny.json"),
}
PROMPT_RE = re.compile(
    r"A special magic number is hidden within the following text\. Make sure to memorize it\. "
    r"I will quiz you about the number afterwards\.\n(?P<context>.*)\nWhat is the special magic "
    r"number for (?P<key>\S+) mentioned in the provided text\? The special magic number for "
    r"(?P=key) mentioned in the provided text is",
    re.DOTALL,
)


class Words:
    def encode(self, text: str) -> list[str]:
        return text.split()


class Chars:
    def encode(self, text: str) -> list[str]:
        return list(text)


class ByteLevel:
    """An HF `tokenizers` byte-level BPE with no merges: one token per UTF-8 byte."""

    def __init__(self):
        tokenizers = pytest.importorskip("tokenizers")
        alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
        tok = tokenizers.Tokenizer(
            tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[])
        )
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids


def check_niah_prompt(s: ruler.Sample) -> str:
    m = PROMPT_RE.fullmatch(s.prompt)
    assert m, s.prompt[-300:]
    key, (ref,) = m["key"], s.references
    assert re.fullmatch(r"[1-9]\d{6}", ref)
    assert s.prompt.endswith(
        f" The special magic number for {key} mentioned in the provided text is"
    )
    needle = f"One of the special magic numbers for {key} is: {ref}."
    assert s.prompt.count(ref) == 1 and s.prompt.count(needle) == 1
    items = m["context"].split("\n")
    assert items.count(needle) == 1
    assert all(item == ruler.NOISE for item in items if item != needle)
    return key


# --- registry -----------------------------------------------------------------------------------


def test_benchmark_registry():
    assert benchmarks.get("ruler") is ruler
    assert ruler.VERSION.startswith("ruler-")
    with pytest.raises(ValueError, match=r"^unknown benchmark 'x'; valid: .*\bruler\b"):
        benchmarks.get("x")


def test_unknown_task_lists_valid_tasks():
    for call in (
        lambda: ruler.generate("niah_single_9", 4096, 1, Words()),
        lambda: ruler.max_new_tokens("niah_single_9"),
        lambda: ruler.score("niah_single_9", ["a"], [["a"]]),
    ):
        with pytest.raises(ValueError, match=r"'niah_single_9'; valid: niah_single_1, .*, qa_2$"):
            call()


def test_task_table():
    assert list(ruler.TASKS) == ALL_TASKS  # upstream's order
    new = {"vt": 30, "cwe": 120, "fwe": 50, "qa_1": 32, "qa_2": 32}
    for task, spec in ruler.TASKS.items():
        assert ruler.max_new_tokens(task) == new.get(task, 128)
        part = task.startswith("qa")
        assert spec.metric == ("string_match_part" if part else "string_match_all")
    niah = {t: ruler.TASKS[t].config for t in ALL_TASKS[:8]}
    assert {
        t: (c.haystack, c.type_k, c.type_v, c.num_k, c.num_v, c.num_q) for t, c in niah.items()
    } == {
        "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
        "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
        "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
        "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
        "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
        "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
        "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
        "niah_multiquery": ("essay", "words", "numbers", 1, 1, 4),
    }
    assert (
        ruler.DEPTHS[:5] == [0, 3, 5, 8, 10] and ruler.DEPTHS[-1] == 100 and len(ruler.DEPTHS) == 40
    )


# --- prompts ------------------------------------------------------------------------------------


def test_prompt_structure():
    samples = ruler.generate(TASK, 4096, 8, Words())
    assert [s.index for s in samples] == list(range(8))
    keys = ruler.word_keys()
    for s in samples:
        key = check_niah_prompt(s)
        assert key in keys
        assert s.task == TASK and s.max_new_tokens == 128
        assert s.num_tokens == len(s.prompt.split())


def test_wrap_goes_around_the_task_text_only():
    head, tail = "<|user|>\n", "<|end|>\n<|assistant|>\n"
    (s,) = ruler.generate(TASK, 2048, 1, Words(), wrap=lambda t: head + t + tail)
    assert s.prompt.startswith(head) and s.prompt.count(tail) == 1
    text, prefix = s.prompt[len(head) :].split(tail)
    assert text.endswith("provided text?") and prefix.startswith(" The special magic number")
    check_niah_prompt(replace(s, prompt=text + prefix))
    assert s.num_tokens == len(s.prompt.split()) <= 2048 - 128


# --- length fitting -----------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1024, 4096, 16384])
def test_fit_whitespace_tokens(length):
    samples = ruler.generate(TASK, length, 10, Words())
    for s in samples:
        assert 0.9 * length <= s.num_tokens + s.max_new_tokens <= length


def test_fit_chars_4096():
    # Upstream's fallback drops a whole step (25 noise items, about 2.2K chars) when a draw comes
    # out longer than the one the search measured, so a minority of samples sit near half length.
    samples = ruler.generate(TASK, 4096, 30, Chars())
    fills = [(s.num_tokens + s.max_new_tokens) / 4096 for s in samples]
    assert all(f <= 1 for f in fills)
    assert statistics.median(fills) >= 0.9
    assert sum(f >= 0.9 for f in fills) >= 0.6 * len(fills)
    for s in samples:
        assert s.num_tokens == len(s.prompt)
        check_niah_prompt(s)


def test_fit_hf_byte_level_tokenizer():
    tok = ByteLevel()
    samples = ruler.generate(TASK, 8192, 5, tok, wrap=lambda t: f"<user>{t}</user>")
    for s in samples:
        assert s.num_tokens == len(s.prompt.encode("utf-8"))
        assert s.num_tokens + 128 <= 8192
    assert max(s.num_tokens for s in samples) + 128 >= 0.9 * 8192


def test_too_small_context_raises():
    msg = r"^context_length 300 is too small for niah_single_1: "
    with pytest.raises(ValueError, match=msg) as e:
        ruler.generate(TASK, 300, 1, Chars())
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError):
        ruler.generate(TASK, 0, 1, Chars())


# --- determinism --------------------------------------------------------------------------------


def test_seeded_and_deterministic():
    state = random.getstate()
    a = ruler.generate(TASK, 2048, 4, Words(), seed=7)
    assert random.getstate() == state  # the global RNG is untouched
    assert ruler.generate(TASK, 2048, 4, Words(), seed=7) == a
    b = ruler.generate(TASK, 2048, 4, Words(), seed=8)
    assert [s.prompt for s in a] != [s.prompt for s in b]
    assert len({s.prompt for s in a}) == 4


def test_golden_sample_is_stable():
    # Pins the RNG call order and the word list: if this fails, bump ruler.VERSION.
    (s,) = ruler.generate(TASK, 1024, 1, Words(), seed=42)
    key = check_niah_prompt(s)
    assert (key, s.references, s.num_tokens) == ("itchy-stiletto", ["5661907"], 894)


# --- word keys ----------------------------------------------------------------------------------


def test_sorted_pairs_matches_brute_force():
    adjs = ["high", "blue", "high-pitched", "ad hoc", "blue", "x-rated", "x", "Early", "high-"]
    nouns = ["ATM", "pitched-ATM", "zebra", "tam-o'-shanter", "ad", "", "rated-x", "zebra"]
    pairs = ruler._SortedPairs(adjs, nouns)
    expected = sorted({f"{a}-{n}" for a in adjs for n in nouns})
    assert list(pairs) == expected and len(pairs) == len(expected)
    assert pairs[-1] == expected[-1] and pairs[2:5] == expected[2:5]
    assert all(w in pairs for w in expected) and "high-zz" not in pairs and "" not in pairs
    with pytest.raises(IndexError):
        pairs[len(expected)]


def test_word_keys_from_wonderwords():
    keys = ruler.word_keys()
    assert ruler.word_keys() is keys  # cached
    rng = random.Random(0)
    for i in [0, len(keys) - 2, *(rng.randrange(len(keys) - 1) for _ in range(2000))]:
        assert keys[i] < keys[i + 1] and "-" in keys[i]
    if version("wonderwords") in ("3.0.0", "3.0.1"):
        assert len(keys) == 6_171_620  # 910 distinct adjectives x 6782 nouns


# --- scoring ------------------------------------------------------------------------------------


def test_postprocess():
    assert ruler.postprocess("  \x00 The answer\x1fis 1234567.\t ") == "The answer\nis 1234567."
    assert ruler.postprocess("\n\n") == ""


def test_string_match_all():
    refs = [["1234567", "7654321", "1111111"], ["abc"]]
    assert ruler.string_match_all(["7654321 and 1234567", "ABC!"], refs) == 83.33
    assert ruler.score(TASK, ["7654321 and 1234567", "nope"], refs) == 33.33
    assert ruler.score(TASK, ["", ""], refs) == 0.0
    assert ruler.score(TASK, ["\x0012\x0034567"], [["1234567"]]) == 0.0  # control char splits it
    assert ruler.score(TASK, ["\x1f  1234567\x00"], [["1234567"]]) == 100.0
    assert ruler.score(TASK, ["It is 91234567"], [["1234567"]]) == 100.0  # no word boundaries


def test_string_match_part_and_metric_selection(monkeypatch):
    refs = [["Paris", "the French capital"], ["Berlin"], ["a", "b"]]
    preds = ["the answer is PARIS", "london", "b only"]
    assert ruler.string_match_part(preds, refs) == 66.67
    assert ruler.string_match_all(preds, refs) == 33.33
    monkeypatch.setitem(ruler.TASKS, "qa_x", replace(ruler.TASKS[TASK], metric="string_match_part"))
    assert ruler.score("qa_x", preds, refs) == 66.67
    assert ruler.score_one("qa_x", "b only", ["a", "b"]) == 100.0


def test_score_one_and_errors():
    assert ruler.score_one(TASK, "1234567", ["1234567", "9"]) == 50.0
    assert ruler.score_one(TASK, "x", ["1", "2", "x"]) == pytest.approx(100 / 3)
    per = [ruler.score_one(TASK, p, r) for p, r in [("1", ["1", "2", "3"]), ("2", ["2"])]]
    assert ruler.score(TASK, ["1", "2"], [["1", "2", "3"], ["2"]]) == round(sum(per) / 2, 2)
    with pytest.raises(ValueError):
        ruler.score(TASK, ["a"], [["a"], ["b"]])
    with pytest.raises(ValueError):
        ruler.score(TASK, [], [])
    with pytest.raises(ValueError):
        ruler.score_one(TASK, "a", [])


# --- all 13 tasks: prompt structure, references in place, fitting -------------------------------

ESSAY_WORDS = " ".join(p.read_text() for p in sorted((FIXTURES / "essays").glob("*.txt"))).split()
NEEDLE_RE = re.compile(r"One of the special magic (\w+) for (.+?) is: ([\w-]+)\.")
TOKENIZERS = {"words-1k": (Words, 1024), "words-4k": (Words, 4096), "bytes-8k": (ByteLevel, 8192)}


def check_niah(task: str, s: ruler.Sample) -> None:
    c = ruler.TASKS[task].config
    single = c.num_q * c.num_v == 1
    t, verb = (c.type_v[:-1], "is") if single else (c.type_v, "are")
    head = (
        f"{'A' if single else 'Some'} special magic {t} {verb} hidden within the following text. "
        f"Make sure to memorize it. I will quiz you about the {t} afterwards.\n"
    )
    m = re.fullmatch(
        rf"(?s){re.escape(head)}(?P<ctx>.*)\nWhat {'is' if single else 'are all'} the special "
        rf"magic {t} for (?P<q>.+) mentioned in the provided text\? The special magic {t} for "
        rf"(?P=q) mentioned in the provided text {verb}",
        s.prompt,
    )
    assert m, s.prompt[-400:]
    ctx, query = m["ctx"], m["q"]
    queried = query.split(", and ")[0].split(", ") + query.split(", and ")[1:]
    assert len(queried) == c.num_q == len(set(queried))
    needles = NEEDLE_RE.findall(ctx)
    assert {n[0] for n in needles} == {c.type_v}  # the needle keeps the plural
    assert len(s.references) == c.num_q * c.num_v
    for ref in s.references:  # every answer sits in a needle of a queried key, once
        assert sum(k in queried and v == ref for _, k, v in needles) == 1
        assert s.prompt.count(ref) == 1
    if c.haystack == "needle":
        assert all(NEEDLE_RE.fullmatch(line) for line in ctx.split("\n"))
        return
    planted = max(c.num_k, c.num_q) * c.num_v
    assert len(needles) == planted and len({k for _, k, _ in needles}) == max(c.num_k, c.num_q)
    if c.haystack == "noise":
        assert sorted(ctx.split("\n"))[planted:] == [ruler.NOISE] * (len(ctx.split("\n")) - planted)
        return
    rest = NEEDLE_RE.sub(" ", ctx).split()  # essay: the corpus, repeated, with needles between
    assert rest == [ESSAY_WORDS[i % len(ESSAY_WORDS)] for i in range(len(rest))]
    for n in NEEDLE_RE.finditer(ctx):  # needles sit at sentence boundaries
        before = ctx[: n.start()].rstrip()
        assert not before or before[-1] in ".!?\"')"


VT_RE = (
    r"Memorize and track the chain\(s\) of variable assignment hidden in the following text\."
    r"\n\n(?P<ctx>.*)\nQuestion: Find all variables that are assigned the value (?P<v>\d{5}) in "
    r"the text above\. Answer: According to the chain\(s\) of variable assignment in the text "
    r"above, 5 variables are assigned the value (?P=v), they are: "
)


def check_chain(ctx: str, names: list[str], value: str) -> None:
    chain = [f"VAR {names[0]} = {value}"] + [
        f"VAR {b} = VAR {a} " for a, b in zip(names, names[1:])
    ]
    assert [line for line in ctx.split("\n") if line != ruler.NOISE] == chain


def check_vt(task: str, s: ruler.Sample) -> None:
    start = s.prompt.rindex("Memorize and track")
    example, text = s.prompt[:start], s.prompt[start:]
    m = re.fullmatch(f"(?s){VT_RE}", text)
    assert m and len(s.references) == 5 and all(re.fullmatch("[A-Z]{5}", r) for r in s.references)
    check_chain(m["ctx"], s.references, m["v"])
    # One example, in the same user turn: 3-letter names, its value re-drawn, its answer given
    # (after the prefix's trailing space and one more, as upstream joins them).
    e = re.fullmatch(rf"(?s){VT_RE} (?P<a>[A-Z]{{3}}(?: [A-Z]{{3}}){{4}})\n\n", example)
    assert e, example[-300:]
    check_chain(e["ctx"], e["a"].split(), e["v"])
    assert e["ctx"].count(ruler.NOISE) >= 5


CWE_Q = (
    "\nQuestion: What are the 10 most common words in the above list? Answer: The top 10 words "
    "that appear most often in the list are:"
)
CWE_HEAD = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)


def numbered(text: str) -> list[str]:
    items = re.findall(r"(\d+)\. (.+?)(?= \d+\. |$)", text)
    assert [int(i) for i, _ in items] == list(range(1, len(items) + 1))
    return [w for _, w in items]


def check_cwe_list(words: list[str], common: list[str], reps: tuple[int, int]) -> None:
    counts = Counter(words)
    assert {w for w, _ in counts.most_common(10)} == set(common) and len(common) == 10
    assert {counts[w] for w in common} == {reps[0]}
    assert set(counts.values()) - {reps[0]} <= {reps[1]}


def check_cwe(task: str, s: ruler.Sample, length: int) -> None:
    shot, answer_and_task, end = s.prompt.split(CWE_Q)
    assert end == "" and shot.startswith(CWE_HEAD)
    answer, task_text = answer_and_task.split("\n", 1)
    assert task_text.startswith(CWE_HEAD)
    ex_reps, reps = ((10, 3), (30, 3)) if length >= 4096 else ((3, 1), (6, 1))
    example = numbered(shot[len(CWE_HEAD) :])
    assert len(set(example)) == (40 if length >= 4096 else 20)
    check_cwe_list(example, numbered(answer.strip()), ex_reps)
    check_cwe_list(numbered(task_text[len(CWE_HEAD) :]), s.references, reps)


def check_fwe(task: str, s: ruler.Sample) -> None:
    head = (
        "Read the following coded text and track the frequency of each coded word. Find the three "
        "most frequently appeared coded words. "
    )
    tail = (
        "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the "
        "three most frequently appeared words in the above coded text? Answer: According to the "
        "coded text above, the three most frequently appeared words are:"
    )
    assert s.prompt.startswith(head) and s.prompt.endswith(tail)
    counts = Counter(s.prompt[len(head) : -len(tail)].split(" "))
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..." and ranked[1:4] == s.references
    assert all(re.fullmatch("[a-z]{6}", w) for w in ranked[1:])
    freq = [counts[w] for w in ranked[:5]]
    assert freq == sorted(set(freq), reverse=True)  # strictly decreasing: the top 3 are unique


def qa_set(task: str) -> ruler.QaSet:
    key = ruler.TASKS[task].source
    read = ruler.read_squad if key == "squad" else ruler.read_hotpotqa
    return read(json.loads(Path(DATA[key]).read_text()))


def qa_documents(prompt: str) -> list[str]:
    ctx = prompt.split("The following are given documents.\n\n", 1)[1]
    ctx = ctx.split("\n\nAnswer the question based on the given documents.", 1)[0]
    parts = re.split(r"(?:^|\n\n)Document (\d+):\n", ctx)
    assert parts[0] == "" and [int(i) for i in parts[1::2]] == list(range(1, len(parts) // 2 + 1))
    return parts[2::2]


def check_qa(task: str, s: ruler.Sample) -> None:
    item = qa_set(task).items[s.index]  # sample i asks question i
    assert s.references == list(item.answers)
    assert s.prompt.startswith("Answer the question based on the given documents. Only give me")
    assert s.prompt.endswith(f"\n\nQuestion: {item.question} Answer:")
    docs = qa_documents(s.prompt)
    assert all(qa_set(task).docs[i] in docs for i in item.gold)
    if task == "qa_1":  # SQuAD answers are spans of the gold paragraph
        assert all(ref in qa_set(task).docs[item.gold[0]] for ref in s.references)


def check_task(task: str, s: ruler.Sample, tok, length: int) -> None:
    assert s.task == task and s.max_new_tokens == ruler.max_new_tokens(task)
    assert s.num_tokens == len(tok.encode(s.prompt))
    assert s.num_tokens + s.max_new_tokens <= length
    check_content(task, s, length)


def check_content(task: str, s: ruler.Sample, length: int) -> None:
    """The prompt (with no chat wrapper) ends with the answer prefix; the references sit where
    the task puts them."""
    if task.startswith("niah"):
        check_niah(task, s)
    elif task == "cwe":
        check_cwe(task, s, length)
    else:
        {"vt": check_vt, "fwe": check_fwe, "qa_1": check_qa, "qa_2": check_qa}[task](task, s)


@pytest.mark.parametrize("tok_name", TOKENIZERS)
@pytest.mark.parametrize("task", ALL_TASKS)
def test_every_task(task, tok_name):
    cls, length = TOKENIZERS[tok_name]
    tok = cls()
    samples = ruler.generate(task, length, 3, tok, data=DATA)
    assert [s.index for s in samples] == [0, 1, 2]
    for s in samples:
        check_task(task, s, tok, length)
    # Byte counts vary with each draw's key length: a draw longer than the one the search
    # measured drops a whole step (500 essay words), as upstream does.
    fill = max(s.num_tokens + s.max_new_tokens for s in samples) / length
    assert fill >= (0.85 if cls is Words else 0.3)


@pytest.mark.parametrize("task", ["vt", "cwe", "qa_2", "niah_multivalue"])
def test_in_context_examples_stay_in_the_user_turn(task):
    head, tail = "<|system|>\n" + "Be brief. " * 150 + "<|user|>\n", "<|end|>\n<|assistant|>\n"
    wrap = lambda t: head + t + tail
    plain = ruler.generate(task, 4096, 1, Words(), data=DATA)[0]
    (s,) = ruler.generate(task, 4096, 1, Words(), wrap=wrap, data=DATA)
    assert s.prompt.startswith(head) and s.prompt.count(head) == s.prompt.count(tail) == 1
    text, prefix = s.prompt[len(head) :].split(tail)
    check_content(task, replace(s, prompt=text + prefix), 4096)
    assert len(text + prefix) < len(plain.prompt)  # the wrapper's tokens count in the budget


def test_vt_example_is_fitted_to_500_tokens():
    for length in (1024, 8192):
        (s,) = ruler.generate("vt", length, 1, Words())
        example = s.prompt[: s.prompt.rindex("Memorize and track")]
        assert 400 <= len(example.split()) <= 500 + 5  # + its 5 answer names
    assert s.num_tokens + s.max_new_tokens > 8192 - 19  # within one noise line of the budget


def test_binary_search_goes_past_a_low_estimate():
    render = lambda units, index=0: ("", [], 1000 + units)  # a fixed part, then 1 token a unit
    # The probe (10 units, 1010 tokens) suggests 101 tokens a unit: upstream's top is 148.
    assert ruler._binary_search(render, 5000, 5000, 10, 10, 3) == 4000
    assert ruler._binary_search(render, 5000, 5000, 10, 10, 3, limit=300) == 300
    assert ruler._binary_search(render, 1005, 1005, 10, 10, 3) is None


@pytest.mark.parametrize("task", ALL_TASKS)
def test_every_task_is_seeded_and_deterministic(task):
    state = random.getstate()
    a = ruler.generate(task, 1024, 2, Words(), seed=7, data=DATA)
    assert random.getstate() == state
    assert ruler.generate(task, 1024, 2, Words(), seed=7, data=DATA) == a
    b = ruler.generate(task, 1024, 2, Words(), seed=8, data=DATA)
    assert [s.prompt for s in a] != [s.prompt for s in b]


# Pins prompts, fitting and RNG call order (sha1 of the prompt): if one changes, bump VERSION.
GOLDEN = {
    "niah_single_2": (["2322047"], 896, "89dd38c34e118772"),
    "niah_multikey_3": (["4a11be44-4aea-4b8f-b43c-de0afa9fc10e"], 888, "c67bdc8947f69a65"),
    "niah_multiquery": (["2191066", "2130789", "1987737", "4694634"], 896, "1ef7b0dfa37c0709"),
    "vt": (["XWXUF", "USMOX", "DDMNO", "ITLVX", "LXLEW"], 985, "0cf656204546eae1"),
    "cwe": (
        ["zonked", "tea", "upward", "fuzzy", "snotty"]
        + ["whimsical", "shape", "destiny", "flatboat", "manipulate"],
        904,
        "2e8bad5ae8e967dc",
    ),
    "fwe": (["uprrsr", "ericjt", "paguhz"], 959, "0e3b664fabf0f2f6"),
    "qa_1": (["whale oil"], 982, "43b7de813d949c4b"),
    "qa_2": (["Agnes Mully"], 992, "0435db7e3d6c2292"),
}


@pytest.mark.parametrize("task", sorted(GOLDEN))
def test_golden_samples(task):
    (s,) = ruler.generate(task, 1024, 1, Words(), seed=42, data=DATA)
    got = (s.references, s.num_tokens, hashlib.sha1(s.prompt.encode()).hexdigest()[:16])
    assert got == GOLDEN[task]


def test_cwe_caps_at_the_vocabulary_and_warns(monkeypatch):
    # At about 128K tokens cwe needs more than the 8,166 wonderwords; a 60-word list shows it here.
    assert len(ruler.cwe_words(42)) == len(set(ruler.cwe_words(42))) >= 8000
    small = ruler.cwe_words(42)[:60]
    monkeypatch.setattr(ruler, "cwe_words", lambda seed: small)
    with pytest.warns(
        UserWarning, match=r"^cwe at 4096 tokens: the word list is capped at the 60 "
    ):
        samples = ruler.generate("cwe", 4096, 2, Words())
    for s in samples:
        check_task("cwe", s, Words(), 4096)
        task_list = s.prompt.split(CWE_Q)[1].split("\n", 2)[2]
        assert len(set(numbered(task_list))) == 60  # all of it
        assert s.num_tokens + s.max_new_tokens < 0.5 * 4096  # the under-fill, as recorded
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ruler.generate("cwe", 1024, 1, Words())  # fits: no warning


# --- data sources -------------------------------------------------------------------------------

MISSING = {
    "niah_single_2": (
        "RULER task niah_single_2 needs an essay haystack: set "
        "benchmark.data.essays=/path/to/essays (a directory of .txt files, a JSON file with a "
        "'text' field, or a hub dataset)"
    ),
    "qa_1": (
        "RULER task qa_1 needs SQuAD v2 dev: set benchmark.data.squad=/path/to/dev-v2.0.json (the "
        "official JSON, or a hub dataset such as rajpurkar/squad_v2)"
    ),
    "qa_2": (
        "RULER task qa_2 needs HotpotQA dev-distractor: set benchmark.data.hotpotqa=/path/to/"
        "hotpot_dev_distractor_v1.json (the official JSON, or a hub dataset such as "
        "hotpotqa/hotpot_qa)"
    ),
}


@pytest.mark.parametrize("task", ALL_TASKS)
def test_missing_source_is_one_line_naming_the_key(task):
    spec = ruler.TASKS[task]
    essay = task.startswith("niah") and spec.config.haystack == "essay"
    sources = {"qa_1": "squad", "qa_2": "hotpotqa"}
    assert spec.source == sources.get(task, "essays" if essay else None)
    if spec.source is None:
        ruler.check_data(task, None)  # needs nothing
        return
    expected = MISSING.get(task, MISSING["niah_single_2"].replace("niah_single_2", task))
    for data in (
        None,
        {},
        {spec.source: None},
        {k: v for k, v in DATA.items() if k != spec.source},
    ):
        with pytest.raises(ValueError) as e:
            ruler.check_data(task, data)
        assert str(e.value) == expected
        with pytest.raises(ValueError) as e:
            ruler.generate(task, 1024, 1, Words(), data=data)
        assert str(e.value) == expected


def test_source_paths_that_do_not_exist(tmp_path):
    with pytest.raises(ValueError, match=r"/nowhere/essays: no such file or directory$"):
        ruler.generate("niah_single_2", 1024, 1, Words(), data={"essays": "/nowhere/essays"})
    with pytest.raises(ValueError, match=r"dev-v2\.0\.json: no such file or directory$"):
        ruler.generate("qa_1", 1024, 1, Words(), data={"squad": "dev-v2.0.json"})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no \.txt files in this directory$"):
        ruler.generate("niah_single_2", 1024, 1, Words(), data={"essays": str(tmp_path / "empty")})


def test_essay_sources_agree(tmp_path, monkeypatch):
    text = "\n\n".join(p.read_text() for p in sorted((FIXTURES / "essays").glob("*.txt")))
    (tmp_path / "essays.json").write_text(json.dumps({"text": text}))
    (tmp_path / "essays.txt").write_text(text)
    rows = [{"text": p.read_text()} for p in sorted((FIXTURES / "essays").glob("*.txt"))]
    monkeypatch.setattr(ruler, "_hub_rows", lambda name, config, split, key: rows)
    runs = [
        ruler.generate("niah_multikey_1", 1024, 2, Words(), data={"essays": src})
        for src in (
            DATA["essays"],
            str(tmp_path / "essays.json"),
            str(tmp_path / "essays.txt"),
            "me/essays",
        )
    ]
    assert all(r == runs[0] for r in runs)
    (tmp_path / "bad.json").write_text(json.dumps({"body": text}))
    with pytest.raises(
        ValueError, match=r"bad\.json: expected a JSON object with a 'text' string$"
    ):
        ruler.generate(
            "niah_single_2", 1024, 1, Words(), data={"essays": str(tmp_path / "bad.json")}
        )


def test_essay_too_small_for_500_words():
    with pytest.raises(
        ValueError,
        match=r"^context_length 2048 is too small for niah_single_3: its smallest haystack "
        r"\(500 units\)",
    ):
        ruler.generate("niah_single_3", 2048, 1, ByteLevel(), data=DATA)


def to_hub_squad(obj: dict) -> list[dict]:
    """The official SQuAD JSON as rajpurkar/squad_v2 rows."""
    return [
        {
            "id": qa["id"],
            "title": a["title"],
            "context": p["context"],
            "question": qa["question"],
            "answers": {
                "text": [x["text"] for x in qa["answers"]],
                "answer_start": [x["answer_start"] for x in qa["answers"]],
            },
        }
        for a in obj["data"]
        for p in a["paragraphs"]
        for qa in p["qas"]
    ]


def to_hub_hotpot(rows: list[dict]) -> list[dict]:
    """The official HotpotQA JSON as hotpotqa/hotpot_qa rows."""
    return [
        {
            "id": r["_id"],
            "question": r["question"],
            "answer": r["answer"],
            "type": r["type"],
            "level": r["level"],
            "supporting_facts": {
                "title": [t for t, _ in r["supporting_facts"]],
                "sent_id": [i for _, i in r["supporting_facts"]],
            },
            "context": {
                "title": [t for t, _ in r["context"]],
                "sentences": [s for _, s in r["context"]],
            },
        }
        for r in rows
    ]


def test_qa_readers_and_hub_mapping(monkeypatch):
    squad_obj = json.loads(Path(DATA["squad"]).read_text())
    hotpot_obj = json.loads(Path(DATA["hotpotqa"]).read_text())
    squad, hotpot = ruler.read_squad(squad_obj), ruler.read_hotpotqa(hotpot_obj)
    # SQuAD: impossible questions skipped, every annotator answer kept, file order.
    assert [i.question[:20] for i in squad.items] == [
        "What fuel did the Ca",
        "How tall is the towe",
        "Who kept the log at ",
        "Where are the log bo",
        "In which month do gr",
        "Where do growers pla",
        "Below what temperatu",
    ]
    assert squad.docs == sorted(squad.docs) and len(squad.docs) == 4
    assert squad.items[1].answers == ("forty-two feet", "forty-two feet tall")
    first = squad.items[0]
    assert squad.docs[first.gold[0]].startswith("The harbour light") and len(first.more) == 1
    assert squad.docs[first.more[0]].startswith("Two keepers")  # same article
    # HotpotQA: "title\nsentences" documents, all paragraphs of a question are its context.
    assert len(hotpot.items) == 3 and hotpot.items[2].answers == ("yes",)
    assert all(len(i.gold) == 5 and not i.more for i in hotpot.items)
    assert (
        "Agnes Mully\nAgnes Mully (1822–1897) was the senior keeper of Carrow Point Light. She "
        "kept its log for thirty-one years." in hotpot.docs
    )
    rows = {
        "rajpurkar/squad_v2": to_hub_squad(squad_obj),
        "hotpotqa/hotpot_qa": to_hub_hotpot(hotpot_obj),
    }
    calls = []

    def hub(name, config, split, key):
        calls.append((name, config, split, key))
        return rows[name]

    monkeypatch.setattr(ruler, "_hub_rows", hub)
    for task, key, name in (
        ("qa_1", "squad", "rajpurkar/squad_v2"),
        ("qa_2", "hotpotqa", "hotpotqa/hotpot_qa"),
    ):
        from_hub = ruler.generate(task, 1024, 3, Words(), data={key: name})
        assert from_hub == ruler.generate(task, 1024, 3, Words(), data=DATA)
    assert calls == [
        ("rajpurkar/squad_v2", None, "validation", "squad"),
        ("hotpotqa/hotpot_qa", "distractor", "validation", "hotpotqa"),
    ]


def edit_fixture(tmp_path, key: str, edit) -> dict:
    obj = json.loads(Path(DATA[key]).read_text())
    edit(obj)
    path = tmp_path / f"{key}.json"
    path.write_text(json.dumps(obj))
    return {key: str(path)}


BAD_SQUAD = [
    (
        lambda o: o["data"][0]["paragraphs"][1]["qas"][0].pop("question"),
        r"SQuAD row 'q4': no 'question' string",
    ),
    (
        lambda o: o["data"][1]["paragraphs"][0]["qas"][1].update(answers="at the edge"),
        r"SQuAD row 'q7': 'answers' is not a list",
    ),
    (
        lambda o: o["data"][1]["paragraphs"][1]["qas"][0].update(answers=[]),
        r"SQuAD row 'q9': answerable but has no answers",
    ),
    (
        lambda o: o["data"][1]["paragraphs"][1].update(context=None),
        r"SQuAD row article 1 paragraph 1: no 'context' string",
    ),
    (lambda o: o.pop("data"), r"expected the SQuAD JSON schema"),
]
BAD_HOTPOT = [
    (
        lambda o: o[1].update(context=[["Carrow Point Light", "It was first lit in 1851."]]),
        r"HotpotQA row 'h2': 'context' is not a list of \[title, sentences\]",
    ),
    (lambda o: o[2].pop("answer"), r"HotpotQA row 'h3': no 'answer' string"),
    (lambda o: o[0].update(question=7), r"HotpotQA row 'h1': no 'question' string"),
]


@pytest.mark.parametrize(
    "key, edit, message",
    [("squad", *b) for b in BAD_SQUAD] + [("hotpotqa", *b) for b in BAD_HOTPOT],
)
def test_bad_rows_are_rejected_with_their_id(tmp_path, key, edit, message):
    data = edit_fixture(tmp_path, key, edit)
    task = "qa_1" if key == "squad" else "qa_2"
    with pytest.raises(ValueError, match=message) as e:
        ruler.generate(task, 1024, 1, Words(), data=data)
    assert str(e.value).startswith(str(tmp_path)) and "\n" not in str(e.value)


def test_bad_hub_rows_are_rejected_with_their_id(monkeypatch):
    squad = to_hub_squad(json.loads(Path(DATA["squad"]).read_text()))
    hotpot = to_hub_hotpot(json.loads(Path(DATA["hotpotqa"]).read_text()))
    squad[3]["answers"] = None
    hotpot[1]["context"] = {"title": ["Carrow Point Light"], "sentences": []}
    hotpot[2]["context"]["sentences"][0] = "not a list of sentences"
    for task, key, rows, message in (
        ("qa_1", "squad", squad, r"^hub/squad: SQuAD row 'q4': no 'answers\.text' list$"),
        ("qa_2", "hotpotqa", hotpot, r"^hub/hotpot: HotpotQA row 'h2': no 'context' title/"),
        ("qa_2", "hotpotqa", hotpot[2:], r"^hub/hotpot: HotpotQA row 'h3': 'context' is not a"),
    ):
        monkeypatch.setattr(ruler, "_hub_rows", lambda *a, rows=rows: rows)
        with pytest.raises(ValueError, match=message):
            ruler.generate(task, 1024, 1, Words(), data={key: f"hub/{key[:6]}"})


def test_hub_failure_is_one_line(monkeypatch):
    datasets = types.ModuleType("datasets")  # the real one takes seconds to import

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'x/y' on the Hub (LocalEntryNotFoundError)\nmore")

    datasets.load_dataset = offline
    monkeypatch.setitem(sys.modules, "datasets", datasets)
    with pytest.raises(ValueError) as e:
        ruler.generate("qa_2", 1024, 1, Words(), data={"hotpotqa": "x/y"})
    assert str(e.value) == (
        "cannot load hub dataset 'x/y' for benchmark.data.hotpotqa (Couldn't reach 'x/y' on the "
        "Hub (LocalEntryNotFoundError)); download it and set benchmark.data.hotpotqa=/local/path"
    )


def test_qa_more_samples_than_questions():
    with pytest.raises(
        ValueError,
        match=r"has 3 answerable questions, fewer than num_samples=4; lower benchmark.num_samples$",
    ):
        ruler.generate("qa_2", 1024, 4, Words(), data=DATA)


def test_qa_documents_gold_then_same_article_then_others(tmp_path):
    # 3 articles x 8 long paragraphs: at 1024 tokens only some fit, so the choice shows.
    rng = random.Random(0)
    obj = {"data": []}
    for a in range(3):
        paragraphs = []
        for p in range(8):
            words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(40))
            qas = [
                {
                    "id": f"a{a}p{p}",
                    "question": f"Question {a}.{p}?",
                    "is_impossible": False,
                    "answers": [{"text": f"answer {a}.{p}", "answer_start": 0}],
                }
            ]
            paragraphs.append({"context": f"answer {a}.{p} {words}", "qas": qas})
        obj["data"].append({"title": f"T{a}", "paragraphs": paragraphs})
    (tmp_path / "squad.json").write_text(json.dumps(obj))
    samples = ruler.generate(
        "qa_1", 1024, 20, Words(), data={"squad": str(tmp_path / "squad.json")}
    )
    for s in samples:
        a, p = divmod(s.index, 8)
        docs = qa_documents(s.prompt)
        assert 10 <= len(docs) < 24 and len(set(docs)) == len(docs)
        assert sum(d.startswith(f"answer {a}.{p} ") for d in docs) == 1  # gold
        assert sum(d.startswith(f"answer {a}.") for d in docs) == 8  # its whole article first
        assert s.references == [f"answer {a}.{p}"]


# --- sentence splitting -------------------------------------------------------------------------


def test_split_sentences():
    text = (
        'Mr. Halloran came. He said "Stop!" Then he left. Why? Dr. J. R. Tolkien, e.g. him, '
        "lived in the U.S. for a while (not long.) Prices rose 3.5 percent... and then fell. "
        "See fig. 2 and vol. 3 etc. for more. end."
    )
    assert ruler.split_sentences(text) == [
        "Mr. Halloran came.",
        'He said "Stop!"',
        "Then he left.",
        "Why?",
        "Dr. J. R. Tolkien, e.g. him, lived in the U.S. for a while (not long.)",
        "Prices rose 3.5 percent...",
        "and then fell.",
        "See fig. 2 and vol. 3 etc. for more.",
        "end.",
    ]
    assert " ".join(ruler.split_sentences(" a  b.\n c ")) == "a b. c"
    assert ruler.split_sentences("") == []
    sents = ruler.split_sentences(" ".join(ESSAY_WORDS))
    assert " ".join(sents) == " ".join(ESSAY_WORDS) and 60 <= len(sents) <= 90


# --- aggregate ----------------------------------------------------------------------------------


def test_aggregate_table_4_layout():
    pd = pytest.importorskip("pandas")
    records = [
        {"task": t, "context_length": n, "score": sc, "index": i}
        for t, n, scores in [
            ("vt", 4096, [100, 80]),
            ("qa_1", 4096, [0, 100]),
            ("niah_single_1", 4096, [100, 100]),
            ("vt", 8192, [60, 60]),
            ("qa_1", 8192, [0, 40]),
            ("niah_single_1", 8192, [40, 40]),
        ]
        for i, sc in enumerate(scores)
    ]
    table = ruler.aggregate(records)
    assert list(table.columns) == ["niah_single_1", "vt", "qa_1", "avg"]  # TASKS order
    assert list(table.index) == [4096, 8192, "avg"]
    assert table.loc[4096].tolist() == [100.0, 90.0, 50.0, 80.0]
    assert table.loc[8192].tolist() == [40.0, 60.0, 20.0, 40.0]
    assert table.loc["avg"].tolist() == [70.0, 75.0, 35.0, 60.0]  # ("avg", "avg"): overall
    third = [{"task": "vt", "context_length": 4096, "score": s} for s in (100, 0, 0)]
    assert ruler.aggregate(third).loc[4096, "vt"] == 33.33  # 2 decimals, like upstream
    assert ruler.aggregate(pd.DataFrame(records)).equals(table)
    partial = ruler.aggregate(
        [r for r in records if (r["task"], r["context_length"]) != ("vt", 8192)]
    )
    assert partial.loc[8192].isna().tolist() == [False, True, False, True]
    with pytest.raises(ValueError, match="missing \\['score'\\]"):
        ruler.aggregate([{"task": "vt", "context_length": 4096}])
    with pytest.raises(ValueError, match="unknown RULER task 'x'"):
        ruler.aggregate([{"task": "x", "context_length": 4096, "score": 1}])


# --- QA scoring (string_match_part) -------------------------------------------------------------


def test_qa_score_any_reference():
    refs = [
        ["forty-two feet", "forty-two feet tall"],
        ["Agnes Mully", "The senior keeper, Agnes Mully"],
        ["yes"],
    ]
    assert ruler.score("qa_1", ["It is Forty-Two Feet.", "Agnes", "Yes."], refs) == 66.67
    assert ruler.score("qa_2", ["\x00 agnes mully\n", "x"], refs[1:]) == 50.0
    assert ruler.score_one("qa_1", "forty-two feet tall", refs[0]) == 100.0  # not 2 x 50
    assert ruler.score_one("qa_2", "no", ["yes"]) == 0.0
    assert ruler.score_one("qa_2", "my eyes", ["yes"]) == 100.0  # substring, as upstream
    assert ruler.score_one("vt", "QHC HHI", ["QHC", "HHI", "ODG", "SSB"]) == 50.0  # match_all


# --- config -------------------------------------------------------------------------------------


def test_ruler_full_config():
    import yaml

    path = Path(__file__).parents[2] / "conf" / "benchmark" / "ruler_full.yaml"
    cfg = yaml.safe_load(path.read_text())
    assert cfg["name"] == "ruler" and cfg["tasks"] == ALL_TASKS
    assert cfg["context_lengths"] == [4096, 8192, 16384, 32768, 65536, 131072]
    assert (cfg["num_samples"], cfg["seed"], cfg["max_new_tokens"]) == (500, 42, None)
    assert cfg["data"] == {"essays": None, "squad": None, "hotpotqa": None}
    with pytest.raises(
        ValueError, match=r"^RULER task qa_1 needs SQuAD v2 dev: set benchmark\.data\.squad="
    ):
        ruler.check_data("qa_1", cfg["data"])
