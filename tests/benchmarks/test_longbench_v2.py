"""LongBench-v2: loading and validation, prompts, middle truncation, answer extraction, scoring."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from rbs_bench import benchmarks
from rbs_bench.benchmarks import longbench_v2 as lb

FIXTURE = Path(__file__).parents[1] / "fixtures" / "longbench_v2" / "data.json"
DATA = {"dataset": str(FIXTURE)}
ROWS = json.loads(FIXTURE.read_text(encoding="utf-8"))


class Bytes:
    """An HF `tokenizers` byte-level BPE with no merges (one token per UTF-8 byte), with decode."""

    def __init__(self):
        tokenizers = pytest.importorskip("tokenizers")
        alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
        tok = tokenizers.Tokenizer(
            tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[])
        )
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tokenizers.decoders.ByteLevel()
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens=True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


class Words:
    """Whitespace 'tokens' and no decode: truncation falls back to cutting characters."""

    def encode(self, text: str) -> list[str]:
        return text.split()


GOLDEN_0 = (
    "Please read the following text and answer the question below.\n\n<text>\n"
    "Mara kept the lighthouse on the cape for eleven winters. On the morning the barometer fell, "
    "she climbed the spiral stair with a tin of oil and a new wick, and by noon the lamp turned "
    "again. The harbour bell had been silent for years; nobody missed it.\n</text>\n\n"
    "What is the correct answer to this question: What does Mara repair before the storm "
    "arrives?\nChoices:\n(A) The harbour bell\n(B) The lighthouse lamp\n(C) Her father's boat\n"
    '(D) The pier railing\n\nFormat your response as follows: "The correct answer is (insert '
    'answer here)".'
)
GOLDEN_COT_3 = (
    "Please read the following text and answer the questions below.\n\n<text>\n"
    "Ines: Shall we meet on Thursday?\nTomas: Thursday works, see you at ten.\n</text>\n\n"
    "What is the correct answer to this question: Who proposed meeting on Thursday? Mention "
    "$DOC$ nowhere.\nChoices:\n(A) Ines\n(B) Tomas\n(C) Both of them\n(D) Neither\n\n"
    "Let\u2019s think step by step:"
)


# --- registry and tasks -------------------------------------------------------------------------


def test_registry_and_tasks():
    assert benchmarks.get("longbench_v2") is lb
    assert lb.VERSION.startswith("longbench_v2-")
    assert list(lb.TASKS) == ["all", "cot"]
    assert (lb.max_new_tokens("all"), lb.max_new_tokens("cot")) == (128, 1024)
    with pytest.raises(ValueError, match=r"unknown LongBench-v2 task 'x'; valid: all, cot$"):
        lb.generate("x", 4096, 1, Bytes(), data=DATA)


# --- prompts ------------------------------------------------------------------------------------


def test_golden_prompt_and_sample_fields():
    (s,) = lb.generate("all", 4096, 1, Bytes(), data=DATA)
    assert s.prompt == GOLDEN_0
    assert (s.task, s.index, s.id, s.references) == ("all", 0, "fx-lbv2-0001", ["B"])
    assert s.num_tokens == len(GOLDEN_0.encode()) == 600 and s.max_new_tokens == 128
    assert s.meta == {"difficulty": "easy", "length": "short", "domain": "Single-Document QA"}


def test_cot_prompt_keeps_placeholders_inside_fields():
    s = lb.generate("cot", 8192, 0, Bytes(), data=DATA)[3]
    assert s.prompt == GOLDEN_COT_3 and s.max_new_tokens == 1024
    answer_call = lb.fill(lb.COT_ANSWER_TEMPLATE, ROWS[3], cot="Ines asks first.")
    assert answer_call.startswith(
        "Please read the following text and answer the questions below.\n\n"
        "The text is too long and omitted here.\n\nWhat is the correct answer to this question: "
    )
    assert answer_call.endswith(
        "(D) Neither\n\nLet\u2019s think step by step: Ines asks first.\n\nBased on the above, "
        "what is the single, most likely answer choice? Format your response as follows: "
        '"The correct answer is (insert answer here)".'
    )


def test_fields_are_stripped():
    s = lb.generate("all", 8192, 2, Bytes(), data=DATA)[1]
    assert "<text>\nTide log of the northern cape.\n" in s.prompt
    assert "End of the log.\n</text>" in s.prompt
    assert "question: Which reading did the keeper log in the last entry?\n" in s.prompt
    assert "\n(D) 77 centimetres\n\n" in s.prompt


def test_rows_in_file_order_and_num_samples(tmp_path):
    every = lb.generate("all", 8192, 0, Bytes(), data=DATA)
    assert [s.id for s in every] == [r["_id"] for r in ROWS] and len(every) == 4
    assert [s.index for s in every] == [0, 1, 2, 3]
    assert lb.generate("all", 8192, 2, Bytes(), data=DATA) == every[:2]
    assert lb.generate("all", 8192, 99, Bytes(), data=DATA) == every
    jsonl = tmp_path / "copy.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    assert lb.generate("all", 8192, 0, Bytes(), data={"dataset": str(jsonl)}) == every
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "data.json").write_text(json.dumps(ROWS), encoding="utf-8")
    assert lb.generate("all", 8192, 0, Bytes(), data={"dataset": str(tmp_path / "dir")}) == every


def test_wrap_is_the_user_turn():
    head, tail = "<|user|>\n", "<|end|>\n<|assistant|>\n"
    (s,) = lb.generate("all", 4096, 1, Bytes(), wrap=lambda t: head + t + tail, data=DATA)
    assert s.prompt == head + GOLDEN_0 + tail
    assert s.num_tokens == len(s.prompt.encode())


# --- middle truncation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("context", "new", "head", "tail"), [(1000, None, 436, 436), (1001, 8, 496, 497)]
)
def test_truncation_keeps_head_and_tail_tokens(context, new, head, tail):
    full = lb.fill(lb.TEMPLATE_0SHOT, ROWS[1])  # ASCII: one token per character
    assert len(full) > context
    s = lb.generate("all", context, 2, Bytes(), max_new_tokens=new, data=DATA)[1]
    assert s.prompt == full[:head] + full[-tail:]
    assert s.num_tokens == head + tail == context - s.max_new_tokens
    assert s.prompt.startswith("Please read the following text and answer the question below.")
    assert s.prompt.endswith('"The correct answer is (insert answer here)".')


def test_truncation_leaves_room_for_the_chat_template():
    head, tail = "<|user|>\n", "<|end|>\n<|assistant|>\n"
    s = lb.generate("all", 1000, 2, Bytes(), wrap=lambda t: head + t + tail, data=DATA)[1]
    assert s.num_tokens == 1000 - 128 == len(s.prompt)
    assert s.prompt.startswith(head + "Please read") and s.prompt.endswith('here)".' + tail)
    inner, keep = s.prompt[len(head) : -len(tail)], 872 - len(head) - len(tail)
    full = lb.fill(lb.TEMPLATE_0SHOT, ROWS[1])
    assert inner == full[: keep // 2] + full[-(keep - keep // 2) :]


def test_truncation_through_the_runners_encoder():
    from rbs_bench.models import encoder, tiny

    s = lb.generate("all", 1000, 2, encoder(tiny.build_tokenizer()), data=DATA)[1]
    full = lb.fill(lb.TEMPLATE_0SHOT, ROWS[1])
    assert s.prompt == full[:436] + full[-436:] and s.num_tokens == 872


def test_truncation_at_a_multibyte_seam_still_fits():
    text = "开头。" + "长江之水天上来，奔流到海不复回。" * 200 + "结尾。"
    tok = Bytes()
    for limit in (301, 302, 303, 500):
        prompt, n = lb.fit_middle(text, limit, tok)
        assert n == len(tok.encode(prompt)) <= limit and n >= limit - 6
        assert prompt.startswith("开头。") and prompt.endswith("结尾。")


def test_truncation_without_decode_cuts_characters():
    full = lb.fill(lb.TEMPLATE_0SHOT, ROWS[1])
    s = lb.generate("all", 600, 2, Words(), data=DATA)[1]
    words = full.split()
    assert s.num_tokens == len(s.prompt.split()) <= 600 - 128
    assert s.prompt.split()[:200] == words[:200] and s.prompt.split()[-200:] == words[-200:]


def test_untruncated_prompt_is_untouched():
    prompt, n = lb.fit_middle("a b  c\n", 3, Words())
    assert (prompt, n) == ("a b  c\n", 3)


def test_too_small_context_is_one_line():
    wrap = lambda t: "#" * 300 + t
    with pytest.raises(ValueError, match=r"^context_length 400 is too small for LongBench-v2 all"):
        lb.generate("all", 400, 1, Bytes(), wrap=wrap, data=DATA)
    with pytest.raises(ValueError, match=r"need context_length > 0"):
        lb.generate("all", 0, 1, Bytes(), data=DATA)


# --- answer extraction and scoring --------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "letter"),
    [
        ("The correct answer is (B)", "B"),
        ("**The correct answer is (C)**", "C"),
        ("The correct answer is *(D)*", "D"),
        ("The correct answer is **A**.", "A"),
        ("The correct answer is B.", "B"),
        ("The correct answer is Apple", "A"),  # the bare form takes any capital A-D
        ("I think The correct answer is (A) but The correct answer is (B)", "A"),
        ("The correct answer is B, or rather The correct answer is (C)", "C"),  # parens first
        ("the correct answer is (B)", None),  # case-sensitive
        ("The correct answer is (b)", None),
        ("The correct answer is (E)", None),
        ("The correct answer is: (A)", None),
        ("The correct answer is  (A)", None),
        ("The correct answer is\n(A)", None),
        ("The correct answer is (AB)", None),
        ("The correct answer is (insert answer here)", None),
        ("The correct answer isA", None),
        ("(A)", None),
        ("", None),
    ],
)
def test_extract_answer(response, letter):
    assert lb.extract_answer(response) == letter


def test_score_one_and_score():
    assert lb.score_one("all", "The correct answer is (B).", ["B"]) == 100.0
    assert lb.score_one("cot", "Step 1 ... The correct answer is (C)", ["B"]) == 0.0
    assert lb.score_one("all", "B", ["B"]) == 0.0  # nothing to extract scores 0
    preds = ["The correct answer is (A)", "no idea", "The correct answer is D"]
    assert lb.score("all", preds, [["A"], ["B"], ["C"]]) == 33.3
    with pytest.raises(ValueError, match="as many predictions"):
        lb.score("all", preds, [["A"]])


def _records():
    cats = [("easy", "short"), ("easy", "medium"), ("hard", "long"), ("hard", "medium")]
    scores = [100.0, 0.0, 100.0, 0.0]
    preds = [
        "The correct answer is (B)",
        "no idea",
        "The correct answer is C",
        "The correct answer is (A)",
    ]
    return pd.DataFrame(
        {
            "method": "dense",
            "budget": "default",
            "task": "all",
            "context_length": 4096,
            "score": scores,
            "prediction": preds,
            "meta": [{"difficulty": d, "length": n, "domain": "x"} for d, n in cats],
        }
    )


def test_aggregate():
    (row,) = lb.aggregate(_records()).to_dict("records")
    assert row["method"] == "dense" and row["context_length"] == 4096 and row["n"] == 4
    got = {k: row[k] for k in lb.COLUMNS}
    assert got == {"overall": 50, "easy": 50, "hard": 50, "short": 100, "medium": 0, "long": 100}
    (row,) = lb.aggregate(_records(), compensated=True).to_dict("records")
    assert (row["overall"], row["easy"], row["medium"]) == (56.25, 62.5, 12.5)


def test_aggregate_flat_columns_and_missing_classes():
    df = pd.DataFrame({"score": [100.0, 0.0, 100.0], "difficulty": ["easy", "hard", "hard"]})
    df["length"] = ["short", "short", "medium"]
    (row,) = lb.aggregate(df).to_dict("records")
    assert row["overall"] == pytest.approx(200 / 3) and row["hard"] == 50 and row["short"] == 50
    assert pd.isna(row["long"])


# --- validation and data sources ----------------------------------------------------------------


def _write(tmp_path, rows) -> dict:
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows), encoding="utf-8")
    return {"dataset": str(path)}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"question": None}, r"row _id='fx-lbv2-0002' \(row 1 of .*\): field 'question' must be a"),
        ({"answer": "E"}, r"row _id='fx-lbv2-0002' .*'answer' is 'E'; valid: A, B, C, D"),
        ({"difficulty": "medium"}, r"_id='fx-lbv2-0002' .*'difficulty' is 'medium'; valid: easy"),
        ({"length": 3}, r"_id='fx-lbv2-0002' .*field 'length' must be a string, got int"),
        ({"context": ["a"]}, r"_id='fx-lbv2-0002' .*field 'context' must be a string, got list"),
        ({"_id": 7}, r"row _id=7 .*field '_id' must be a string, got int"),
    ],
)
def test_bad_rows_name_the_row(tmp_path, change, message):
    rows = [dict(r) for r in ROWS]
    rows[1] |= change
    with pytest.raises(ValueError, match=message):
        lb.generate("all", 8192, 1, Bytes(), data=_write(tmp_path, rows))


def test_missing_fields_name_the_row(tmp_path):
    rows = [dict(r) for r in ROWS]
    del rows[2]["choice_C"]
    with pytest.raises(
        ValueError, match=r"_id='fx-lbv2-0003' \(row 2 of .*missing field 'choice_C'"
    ):
        lb.generate("all", 8192, 0, Bytes(), data=_write(tmp_path, rows))
    del rows[2]["_id"]
    with pytest.raises(ValueError, match=r"row without _id \(row 2 of .*\): missing field '_id'"):
        lb.generate("all", 8192, 0, Bytes(), data=_write(tmp_path, rows))
    with pytest.raises(ValueError, match=r"row 0 of .*: a row must be a JSON object, got list"):
        lb.generate("all", 8192, 0, Bytes(), data=_write(tmp_path, [[1]]))
    with pytest.raises(ValueError, match=r"expected a list of rows, got dict"):
        lb.generate("all", 8192, 0, Bytes(), data=_write(tmp_path, {"rows": ROWS}))


@pytest.mark.parametrize("data", [None, {}, {"dataset": ""}, {"dataset": None}])
def test_missing_dataset_names_the_key(data):
    with pytest.raises(ValueError, match=r"^benchmark\.data\.dataset is not set; give the hub id"):
        lb.generate("all", 8192, 1, Bytes(), data=data)


def test_unreadable_paths_name_the_key(tmp_path):
    cases = {
        str(tmp_path / "nope.json"): r"benchmark\.data\.dataset=.*nope\.json: cannot read",
        str(tmp_path): r"benchmark\.data\.dataset=.*: cannot read .*data\.json",
        "fixtures/nope.jsonl": r"benchmark\.data\.dataset=fixtures/nope\.jsonl: cannot read",
    }
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"_id": "x"\n', encoding="utf-8")
    cases[str(bad)] = r"benchmark\.data\.dataset=.*bad\.jsonl: cannot read it as JSON/JSONL"
    for src, message in cases.items():
        with pytest.raises(ValueError, match=message) as e:
            lb.generate("all", 8192, 1, Bytes(), data={"dataset": src})
        assert "\n" not in str(e.value)


def test_hub_split_train_and_revision(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake(path, **kwargs):
        calls.append((path, kwargs))
        if path == "nobody/nothing":
            raise ConnectionError("Couldn't reach the hub\nmore")
        return ROWS[:2]

    monkeypatch.setattr(datasets, "load_dataset", fake)
    lb._hub_rows.cache_clear()
    data = {"dataset": "THUDM/LongBench-v2", "revision": "abc123"}
    assert [s.id for s in lb.generate("all", 8192, 0, Bytes(), data=data)] == [
        "fx-lbv2-0001",
        "fx-lbv2-0002",
    ]
    assert calls == [("THUDM/LongBench-v2", {"split": "train", "revision": "abc123"})]
    with pytest.raises(
        ValueError, match=r"^benchmark\.data\.dataset=nobody/nothing: cannot load"
    ) as e:
        lb.generate("all", 8192, 0, Bytes(), data={"dataset": "nobody/nothing"})
    assert "(Couldn't reach the hub);" in str(e.value) and "\n" not in str(e.value)
    lb._hub_rows.cache_clear()
