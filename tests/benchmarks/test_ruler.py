"""RULER generation, length fitting and scoring (niah_single_1)."""

from __future__ import annotations

import random
import re
import statistics
from dataclasses import replace
from importlib.metadata import version

import pytest

from rbs_bench import benchmarks
from rbs_bench.benchmarks import ruler

TASK = "niah_single_1"
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
    with pytest.raises(ValueError, match=r"^unknown benchmark 'x'; valid: ruler$"):
        benchmarks.get("x")


def test_unknown_task_lists_valid_tasks():
    for call in (
        lambda: ruler.generate("niah_single_9", 4096, 1, Words()),
        lambda: ruler.max_new_tokens("niah_single_9"),
        lambda: ruler.score("niah_single_9", ["a"], [["a"]]),
    ):
        with pytest.raises(ValueError, match=r"'niah_single_9'; valid: niah_single_1$"):
            call()


def test_task_table():
    assert list(ruler.TASKS) == [TASK]
    assert ruler.max_new_tokens(TASK) == 128
    assert ruler.TASKS[TASK].metric == "string_match_all"


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
