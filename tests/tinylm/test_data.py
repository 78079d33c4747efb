"""The training mixture: answers recoverable from the context, lengths, packing, determinism,
and no RULER text in it (RULER stays held out)."""

import random
import re
from collections import Counter

import numpy as np
import pytest

from rbs_bench.benchmarks import ruler
from rbs_bench.tinylm import data


def _examples(task, budget, n=6, seed=0, fillers=None):
    data.set_fillers(fillers)
    try:
        rng = random.Random(f"{task}:{budget}:{seed}")
        return [e for e in (data.example(task, rng, budget) for _ in range(n)) if e is not None]
    finally:
        data.set_fillers(None)


@pytest.mark.parametrize("task", data.TASKS)
@pytest.mark.parametrize("budget", [1024, 4096])
def test_examples_fit_and_fill_their_budget(task, budget):
    exs = _examples(task, budget)
    # a list where 10 words repeat up to 30 times needs room: at 1K tokens most draws give up
    # (the row builder then picks another task)
    assert len(exs) >= (1 if (task, budget) == ("common_words", 1024) else 4)
    for e in exs:
        assert len(e) <= budget
        assert e.prompt.isascii() and e.answer.isascii()  # one token per character
        assert e.context in e.prompt
    # the haystack grows to the budget (examples are built to fill it, not to a fixed size)
    assert np.mean([len(e) for e in exs]) >= 0.85 * budget


def test_example_lengths_track_the_budget_up_to_16k():
    for task in ("kv_single", "kv_lookup", "var_chain"):
        (e,) = _examples(task, 16384, n=1)
        assert 0.95 * 16384 <= len(e) <= 16384


@pytest.mark.parametrize("task", ["kv_single", "kv_lookup", "kv_multi"])
def test_retrieval_answers_are_in_the_context(task):
    for fillers in (None, {"copula": 1}):
        for e in _examples(task, 2048, n=8, fillers=fillers):
            for ref in e.references:
                assert ref in e.context, (ref, e.prompt[-200:])
                assert ref in e.answer


def test_lookup_keys_are_unique_in_the_haystack():
    # the asked key appears once as a fact, so exactly one value answers it
    for e in _examples("kv_lookup", 4096, n=6):
        assert all(e.context.count(ref) >= 1 for ref in e.references)
        values = re.findall(r"\b\d{7}\b", e.context)
        repeated = {v for v, c in Counter(values).items() if c > 1}
        recalled = {e.prompt[a:b] for a, b in e.recall}
        assert repeated <= recalled  # a value occurs twice only when its fact is restated


def test_recall_targets_were_stated_before():
    seen = 0
    for task in ("kv_single", "kv_lookup", "kv_multi", "var_chain"):
        for e in _examples(task, 4096, n=8):
            for a, b in e.recall:
                value = e.prompt[a:b]
                assert value and value in e.prompt[:a], (task, value)
                seen += 1
    assert seen > 10


def test_var_chain_answers_follow_the_assignments():
    for e in _examples("var_chain", 4096, n=8):
        names = list(e.references)
        lines = e.context.split("\n")
        value = re.search(
            r"value (\d+)|hold(?:ing)? (\d+)|equal to (\d+)|assigned (\d+)",
            e.prompt.split(e.context)[-1],
        )
        value = next(g for g in value.groups() if g)
        # the first variable is set to the value, each next one to the previous variable,
        # always after it
        first = next(
            i
            for i, ln in enumerate(lines)
            if re.search(rf"\b{names[0]}\b", ln) and re.search(rf"\b{value}\b", ln)
        )
        at = first
        for prev, name in zip(names, names[1:]):
            at = next(
                i
                for i, ln in enumerate(lines)
                if i > at and re.search(rf"\b{name}\b", ln) and re.search(rf"\b{prev}\b", ln)
            )
        assert all(n in e.answer for n in names)


def test_common_words_are_the_most_frequent():
    for e in _examples("common_words", 4096, n=6):
        items = re.findall(r"[a-z][a-z'-]*", re.sub(r"\d+[.)]", " ", e.context))
        counts = Counter(items)
        c = len(e.references)
        top = {w for w, _ in counts.most_common(c)}
        assert set(e.references) == top
        assert min(counts[w] for w in top) > max(n for w, n in counts.items() if w not in top)


def test_frequent_words_are_ranked_by_count():
    for e in _examples("frequent_words", 4096, n=6):
        counts = Counter(e.context.split())
        ranked = [w for w, _ in counts.most_common() if w.isalpha()]
        assert list(e.references) == ranked[: len(e.references)]


def test_word_count_matches_the_list():
    for e in _examples("word_count", 2048, n=6):
        word = re.search(
            r'word "([^"]+)"|how often is (\S+) listed|occurrences of (\S+) in',
            e.prompt.split(e.context)[-1],
        )
        word = next(g for g in word.groups() if g)
        items = re.findall(r"[a-z][a-z'-]*", re.sub(r"\d+[.)]", " ", e.context))
        assert str(items.count(word)) == e.references[0]


def _ruler_sentences() -> set[str]:
    """Sentences of every RULER template, needle and noise text (placeholders cut out)."""
    texts = [
        ruler.NOISE,
        ruler.NIAH_NEEDLE,
        ruler.NIAH_TEMPLATE,
        ruler.NIAH_ANSWER_PREFIX,
        ruler.VT_TEMPLATE,
        ruler.VT_ANSWER_PREFIX,
        ruler.CWE_TEMPLATE,
        ruler.CWE_ANSWER_PREFIX,
        ruler.FWE_TEMPLATE,
        ruler.FWE_ANSWER_PREFIX,
    ]
    out = set()
    for t in texts:
        for piece in re.split(r"\{[a-z_]+\}|(?<=[.?!])\s", t):
            piece = piece.strip()
            if len(piece) >= 12:
                out.add(piece)
    return out


def test_no_ruler_text_in_the_mixture():
    held_out = _ruler_sentences()
    assert "The grass is green." in held_out and "special magic" in " ".join(held_out)
    texts = []
    for task in data.TASKS:
        for fillers in (None, {"copula": 1, "repeat": 1}):
            texts += [e.prompt + e.answer for e in _examples(task, 3000, n=6, fillers=fillers)]
    for text in texts:
        assert "special magic" not in text
        for sentence in held_out:
            assert sentence not in text, sentence


def test_rows_pack_examples_and_label_answers():
    b = data.batch(3, 7, rows=2, length=1024)
    ids, task = b["ids"], b["task"]
    assert ids.shape == task.shape == (2, 1025)
    for r in range(2):
        ans = task[r] >= 0
        assert ans.any() and (task[r] == -1).any()
        # every answer run ends with end-of-text, and every end-of-text outside padding ends one
        edges = np.flatnonzero(np.diff(np.concatenate([[0], ans.astype(np.int8), [0]])))
        for start, stop in zip(edges[::2], edges[1::2]):
            labels = set(task[r, start:stop].tolist())
            assert len(labels) == 1
            if labels != {data.RECALL}:
                assert ids[r, stop - 1] == data.EOS_ID
        text = bytes(int(x) for x in ids[r] if x < 256).decode()
        assert text.isascii()
        assert (task[r] == -2).sum() == 0 or ids[r, task[r] == -2].tolist() == [data.EOS_ID] * int(
            (task[r] == -2).sum()
        )


def test_batches_are_a_function_of_seed_and_step():
    a = data.batch(0, 5, rows=2, length=512)
    b = data.batch(0, 5, rows=2, length=512)
    c = data.batch(0, 6, rows=2, length=512)
    d = data.batch(1, 5, rows=2, length=512)
    assert np.array_equal(a["ids"], b["ids"]) and np.array_equal(a["task"], b["task"])
    assert not np.array_equal(a["ids"], c["ids"]) and not np.array_equal(a["ids"], d["ids"])


def test_mixture_and_fillers_select_what_is_generated():
    b = data.batch(0, 0, rows=4, length=2048, mixture={"word_count": 1.0})
    labels = set(b["task"][b["task"] >= 0].tolist())
    assert labels == {data.TASKS.index("word_count")}
    with pytest.raises(ValueError, match="kinds are"):
        data.set_fillers({"noise": 1})
    data.set_fillers(None)


def test_encode_matches_the_tokenizer():
    from rbs_bench.models.tiny import build_tokenizer

    tok = build_tokenizer()
    (e,) = _examples("kv_lookup", 600, n=1)
    text = e.prompt + e.answer
    assert data.encode(text) == tok.encode(text, add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<|endoftext|>") == data.EOS_ID
