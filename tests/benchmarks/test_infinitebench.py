"""InfiniteBench: loading and validation, the ten prompts, middle truncation, per-task scorers."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from rbs_bench import benchmarks
from rbs_bench.benchmarks import infinitebench as ib

FIXTURES = Path(__file__).parents[1] / "fixtures" / "infinitebench"
DATA = {"dataset": str(FIXTURES)}
TABLE_5 = {
    "kv_retrieval": ("Ret.KV", 50),
    "passkey": ("Ret.PassKey", 6),
    "number_string": ("Ret.Num", 12),
    "longbook_sum_eng": ("En.Sum", 1200),
    "longbook_choice_eng": ("En.MC", 40),
    "longbook_qa_eng": ("En.QA", 40),
    "longbook_qa_chn": ("Zh.QA", 40),
    "longdialogue_qa_eng": ("En.Dia", 40),
    "math_find": ("Math.Find", 3),
    "code_debug": ("Code.Debug", 5),
}


def rows(task: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / f"{task}.jsonl").read_text().splitlines()]


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


def golden(task: str, row: dict) -> str:
    """Upstream's yarn_mistral template for `task`, spelled out here, filled from `row`."""
    c, q, o = row["context"], row["input"], row["options"]
    options = "".join(f"\n{letter}. {text}" for letter, text in zip("ABCD", o))
    return {
        "passkey": "There is an important info hidden inside a lot of irrelevant text. Find it and "
        "memorize it. I will quiz you about the important information.\n\n"
        f"{c}\n\n{q}\n\nThe pass key is",
        "number_string": "There is an important info hidden inside a lot of irrelevant text. Find "
        "it. I will quiz you about the important information there.\n\n"
        f"{c}\n\n{q}\n\nThe sequence of digits is",
        "kv_retrieval": "Extract the value corresponding to the specified key in the JSON object "
        f"below.\n\n{c}\n\n{q}",
        "longbook_sum_eng": f"Summarize the book below.\n\n{c}\n\nSummary:",
        "longbook_choice_eng": f"Read the book and answer the question.\n\n{c}\n\nQuestion: {q}"
        f"{options}\n\nThe letter of the correct answer is",
        "longbook_qa_eng": "Read the book and answer the question. Be very concise in your "
        f"answer.\n\n{c}\n\nQuestion: {q}\nAnswer:",
        "longbook_qa_chn": f"阅读以下书籍然后回答问题。\n\n{c}\n\n问题：{q}\n答案：",
        "longdialogue_qa_eng": "Below is a dialogue script where one random occurrence of a "
        'character name is replaced with "$$MASK$$", and you should try to guess who that '
        f"character is.\n\n{c}\n\nThe name that has been replaced with $$MASK$$ is likely",
        "math_find": f"What is {{}} in the following list?\n\n{c}\n\n{q}",
        "code_debug": "Following is a Python code where exactly one of the functions/methods has "
        f"a deliberate error that makes it crash.\n\n{c}\n\nOptions:{options}\n\n"
        "The correct option is:",
    }[task]


# --- registry and tasks -------------------------------------------------------------------------


def test_registry_and_table_5_tasks():
    assert benchmarks.get("infinitebench") is ib
    assert ib.VERSION.startswith("infinitebench-")
    assert {t: (s.paper_name, s.max_new_tokens) for t, s in ib.TASKS.items()} == TABLE_5
    assert list(ib.TASKS) == list(TABLE_5)
    assert ib.max_new_tokens("longbook_sum_eng") == 1200
    with pytest.raises(ValueError, match=r"unknown InfiniteBench task 'code_run'; valid: kv_"):
        ib.generate("code_run", 4096, 1, Bytes(), data=DATA)


# --- prompts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", list(TABLE_5))
def test_golden_prompts(task):
    samples = ib.generate(task, 16384, 0, Bytes(), data=DATA)
    assert len(samples) == 2 and [s.index for s in samples] == [0, 1]
    for s, row in zip(samples, rows(task), strict=True):
        expected = golden(task, row)
        if task == "math_find":
            expected = expected.format(
                ["the largest number", "the second smallest number"][s.index]
            )
        assert s.prompt == expected
        assert s.num_tokens == len(expected.encode()) and s.max_new_tokens == TABLE_5[task][1]
        assert (s.task, s.meta, s.id) == (task, {"task": task}, str(row["id"]))


def test_references():
    refs = {
        t: [s.references for s in ib.generate(t, 16384, 0, Bytes(), data=DATA)] for t in TABLE_5
    }
    assert refs["longbook_choice_eng"] == [["Brannoch", "A"], ["To pay debts", "B"]]
    assert refs["code_debug"] == [["mean", "C"], ["Store.put", "B"]]
    assert refs["math_find"] == [["99"], ["7"]]  # raw ints, kept as text, parsed when scoring
    assert refs["longdialogue_qa_eng"][1] == ["OSGOOD", "Osgood Fell"]
    assert refs["passkey"] == [["40719"], ["88203"]]


def test_chat_template_takes_the_answer_prefix_into_the_assistant_turn():
    head, tail = "<|user|>\n", "<|end|>\n<|assistant|>\n"
    wrap = lambda t: head + t + tail
    for task, prefix in [
        ("passkey", "The pass key is"),
        ("longbook_qa_eng", "Answer:"),
        ("kv_retrieval", ""),
    ]:
        (s,) = ib.generate(task, 16384, 1, Bytes(), wrap=wrap, data=DATA)
        body = golden(task, rows(task)[0])
        body = body[: len(body) - len(prefix)].rstrip("\n") if prefix else body
        assert s.prompt == head + body + tail + prefix
        assert s.num_tokens == len(s.prompt.encode())


def test_num_samples_takes_the_first_rows():
    every = ib.generate("passkey", 16384, 0, Bytes(), data=DATA)
    assert ib.generate("passkey", 16384, 1, Bytes(), data=DATA) == every[:1]
    assert ib.generate("passkey", 16384, 5, Bytes(), data=DATA) == every


# --- middle truncation --------------------------------------------------------------------------


def test_truncation_keeps_head_and_tail_tokens():
    full = golden("passkey", rows("passkey")[1])  # ASCII: one token per character
    s = ib.generate("passkey", 1000, 2, Bytes(), data=DATA)[1]
    assert len(full) > 1000 and s.num_tokens == 1000 - 6
    assert s.prompt == full[:497] + full[-497:]
    assert s.prompt.startswith("There is an important info hidden")
    assert s.prompt.endswith("\n\nWhat is the pass key?\n\nThe pass key is")
    s = ib.generate("passkey", 1000, 2, Bytes(), max_new_tokens=1, data=DATA)[1]
    assert s.prompt == full[:499] + full[-500:]


def test_truncation_with_chat_template_cuts_the_user_turn_only():
    head, tail, prefix = "<|user|>\n", "<|end|>\n<|assistant|>\n", "The pass key is"
    s = ib.generate("passkey", 1000, 2, Bytes(), wrap=lambda t: head + t + tail, data=DATA)[1]
    assert s.num_tokens == len(s.prompt) == 994
    assert s.prompt.startswith(head + "There is") and s.prompt.endswith(tail + prefix)
    keep = 994 - len(head + tail + prefix)
    body = golden("passkey", rows("passkey")[1])[: -len("\n\n" + prefix)]
    assert (
        s.prompt[len(head) : -len(tail + prefix)] == body[: keep // 2] + body[-(keep - keep // 2) :]
    )


def test_chinese_prompt_cut_at_any_byte_still_fits(tmp_path):
    row = {"id": 3, "context": "第一章。" + "山高水长，" * 400, "input": "谁？", "answer": ["我"]}
    (tmp_path / "longbook_qa_chn.jsonl").write_text(json.dumps(row | {"options": []}) + "\n")
    for length in (340, 341, 342):
        (s,) = ib.generate("longbook_qa_chn", length, 1, Bytes(), data={"dataset": str(tmp_path)})
        assert s.num_tokens == len(s.prompt.encode()) <= length - 40
        assert s.prompt.startswith("阅读以下书籍然后回答问题。\n\n第一章。")
        assert s.prompt.endswith("\n\n问题：谁？\n答案：")


def test_too_small_context_is_one_line():
    with pytest.raises(
        ValueError, match=r"^context_length 20 is too small for InfiniteBench passkey"
    ):
        ib.generate("passkey", 20, 1, Bytes(), wrap=lambda t: "#" * 30 + t, data=DATA)


# --- scorers (exact values on hand-made predictions) --------------------------------------------

UUID = "5f4e3d2c-1b0a-4f9e-8d7c-6b5a4f3e2d1c"
CASES = {
    "passkey": [
        (" 40719.", ["40719"], 100),
        ("The pass key is 40719", ["40719"], 100),
        ("key 0040719", ["40719"], 0),
        ("40719 or 88203", ["88203"], 0),
        ("4-0719", ["4"], 100),
        ("none", ["40719"], 0),
    ],
    "number_string": [
        ("5038217746 is the sequence", ["5038217746"], 100),
        ("503821774612", ["5038217746"], 0),
        ("0912384756", ["0912384756"], 100),
    ],
    "kv_retrieval": [
        (f'"{UUID}".', [UUID], 100),
        (f"value:{UUID}\nKey", [UUID], 100),
        (f"{UUID}-extra", [UUID], 0),
        (UUID.upper(), [UUID], 0),
        (f"({UUID})", [UUID], 0),
    ],
    "longbook_choice_eng": [
        ("A", ["Brannoch", "A"], 100),
        (" To pay debts ", ["To pay debts", "B"], 100),  # the option text itself
        ("Brannoch walks it", ["Brannoch", "A"], 0),  # the first character 'B' is the answer
        ("B. The ferryman", ["Brannoch", "A"], 0),
        ("the answer is: A", ["Brannoch", "A"], 100),
        ("so the answer is A", ["Brannoch", "A"], 100),
        ("so the option is Brannoch, surely", ["Brannoch", "A"], 100),
        ("the answer is To pay debts", ["To pay debts", "B"], 100),
        ("so the answer is", ["Brannoch", "A"], 0),
        ("i pick A here", ["Brannoch", "A"], 100),
        ("i pick BC then A", ["Brannoch", "A"], 0),  # "BC" is in "ABCD": upstream stops there
        ("", ["Brannoch", "A"], 0),
        ("zzz", ["Brannoch", "A"], 0),
    ],
    "longbook_qa_eng": [
        ("Inside the red umbrella.", ["inside a red umbrella", "in the umbrella"], 100),
        ("a red umbrella", ["inside a red umbrella", "in the umbrella"], 80),
        ("in an umbrella", ["inside a red umbrella", "in the umbrella"], 100),
        ("red, red umbrella", ["inside a red umbrella"], 2 / 3 * 100),
        ("", ["each spring"], 0),
    ],
    "longbook_qa_chn": [
        ("去茶馆。", ["茶馆"], 80),
        ("茶 馆！", ["茶馆"], 100),
        ("邻村渔夫", ["邻村的渔夫", "渔夫"], 800 / 9),
        ("渔夫", ["邻村的渔夫", "渔夫"], 100),
        ("", ["茶馆"], 0),
    ],
    "longdialogue_qa_eng": [
        ("Osgood.", ["OSGOOD", "Osgood Fell"], 100),
        ("osgood fell", ["OSGOOD", "Osgood Fell"], 100),
        ("Fell", ["OSGOOD", "Osgood Fell"], 0),  # only the first label counts
        ("Osgoods", ["OSGOOD"], 0),
        ("It is Maren: surely", ["MAREN"], 100),
    ],
    "math_find": [
        ("99", ["99"], 100),
        ("099 is it", ["99"], 100),
        ("The answer is 99.0", ["99"], 0),  # a decimal answer to an integer label
        ("9 9", ["99"], 0),
        ("none", ["99"], 0),
        ("3.50", ["3.5"], 100),
        ("3", ["3.5"], 0),
    ],
    "code_debug": [
        ("C. mean", ["mean", "C"], 100),
        ("C:", ["mean", "C"], 100),
        ("C", ["mean", "C"], 0),  # neither "C." nor "C:", and no answer phrase
        ("The answer is: C", ["mean", "C"], 100),
        ("The correct option is: mean", ["mean", "C"], 100),
        ("answer: `mean`", ["mean", "C"], 100),
        ("The answer is:", ["mean", "C"], 0),
        ("Option C", ["mean", "C"], 0),
        ("B. parse", ["mean", "C"], 0),
        ("", ["mean", "C"], 0),
    ],
}


@pytest.mark.parametrize(
    ("task", "pred", "refs", "expected"), [(t, *c) for t, cs in CASES.items() for c in cs]
)
def test_scorers(task, pred, refs, expected):
    assert ib.score_one(task, pred, refs) == pytest.approx(expected)


def test_rouge_lsum():
    pytest.importorskip("rouge_score")
    # Summary-level LCS over newline-split sentences: 4 of 5 tokens each way.
    assert ib.score_one("longbook_sum_eng", "a c\nd x e", ["a b c\nd e"]) == pytest.approx(80)
    # The best reference counts; case and punctuation are dropped by rouge's tokenizer.
    got = ib.score_one(
        "longbook_sum_eng", "The cat, on the mat!", ["zzz", "the cat sat on the mat"]
    )
    assert got == pytest.approx(100 * 10 / 11)
    assert ib.score_one("longbook_sum_eng", "::::", ["the cat"]) == 0.0


def test_score_is_the_rounded_mean():
    assert ib.score("passkey", ["1", "2", "3"], [["1"], ["2"], ["4"]]) == 66.67
    with pytest.raises(ValueError, match="as many predictions"):
        ib.score("passkey", ["1"], [])


def test_aggregate_per_task_and_macro_average():
    df = pd.DataFrame(
        {
            "method": "rbs",
            "budget": "d5",
            "context_length": 131072,
            "task": ["passkey", "passkey", "math_find", "kv_retrieval"],
            "score": [100.0, 0.0, 0.0, 100.0],
        }
    )
    (row,) = ib.aggregate(df).to_dict("records")
    assert row == {
        "method": "rbs",
        "budget": "d5",
        "context_length": 131072,
        "kv_retrieval": 100.0,
        "passkey": 50.0,
        "math_find": 0.0,
        "average": 50.0,
    }
    table = ib.aggregate(df[["task", "score"]])
    assert list(table.columns) == ["kv_retrieval", "passkey", "math_find", "average"]
    assert table["average"].tolist() == [50.0]


# --- validation and data sources ----------------------------------------------------------------


def _dir(tmp_path, task, *rows_) -> dict:
    (tmp_path / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return {"dataset": str(tmp_path)}


GOOD = {"id": 4, "context": "c", "input": "q", "answer": ["a"], "options": []}
CHOICE = GOOD | {"answer": ["x"], "options": ["w", "x", "y", "z"]}
MATH = GOOD | {"input": "The largest number of the list is: ", "answer": [5]}


@pytest.mark.parametrize(
    ("task", "row", "message"),
    [
        ("passkey", GOOD | {"id": "4"}, r"row id='4' \(line 2 of .*\): field 'id' must be an int"),
        ("passkey", {k: v for k, v in GOOD.items() if k != "id"}, r"row without id \(line 2"),
        ("passkey", GOOD | {"context": None}, r"row id=4 .*'context' must be a string, got null"),
        ("passkey", GOOD | {"input": 3}, r"row id=4 .*'input' must be a string, got int"),
        ("passkey", GOOD | {"answer": []}, r"row id=4 .*'answer' must be a non-empty list"),
        ("passkey", GOOD | {"answer": [True]}, r"row id=4 .*'answer' must be a non-empty list"),
        ("passkey", GOOD | {"options": "abc"}, r"row id=4 .*'options' must be a list of strings"),
        (
            "passkey",
            {k: v for k, v in GOOD.items() if k != "options"},
            r"row id=4 .*'options' must",
        ),
        ("code_debug", CHOICE | {"options": ["w", "x", "y"]}, r"row id=4 .*needs 4 options, got 3"),
        ("longbook_choice_eng", CHOICE | {"answer": ["v"]}, r"row id=4 .*answer \['v'\] is not"),
        (
            "math_find",
            MATH | {"input": "Which is largest?"},
            r"row id=4 .*no 'The \.\.\. of' phrase",
        ),
        ("math_find", MATH | {"answer": ["many"]}, r"row id=4 .*answer 'many' is not a number"),
    ],
)
def test_bad_rows_name_the_row(tmp_path, task, row, message):
    good = CHOICE if ib.TASKS[task].choices else MATH if task == "math_find" else GOOD
    data = _dir(tmp_path, task, good | {"id": 0}, row)
    with pytest.raises(ValueError, match=rf"^InfiniteBench {task} {message}") as e:
        ib.generate(task, 4096, 1, Bytes(), data=data)
    assert "\n" not in str(e.value)


def test_raw_types_are_normalised(tmp_path):
    data = _dir(tmp_path, "passkey", GOOD | {"answer": "40719"}, GOOD | {"id": 5, "answer": 88203})
    assert [s.references for s in ib.generate("passkey", 4096, 0, Bytes(), data=data)] == [
        ["40719"],
        ["88203"],
    ]
    data = _dir(tmp_path, "code_debug", CHOICE | {"answer": ["y", "C"]}, CHOICE | {"answer": "z"})
    assert [s.references for s in ib.generate("code_debug", 4096, 0, Bytes(), data=data)] == [
        ["y", "C"],
        ["z", "D"],
    ]


@pytest.mark.parametrize("data", [None, {}, {"dataset": ""}])
def test_missing_dataset_names_the_key(data):
    with pytest.raises(ValueError, match=r"^benchmark\.data\.dataset is not set; give the hub id"):
        ib.generate("passkey", 4096, 1, Bytes(), data=data)


def test_unreadable_paths_name_the_key(tmp_path):
    cases = {
        str(tmp_path / "nope"): r"benchmark\.data\.dataset=.*nope: cannot read .*passkey\.jsonl",
        str(tmp_path): r"benchmark\.data\.dataset=.*: cannot read .*passkey\.jsonl",
    }
    for src, message in cases.items():
        with pytest.raises(ValueError, match=message) as e:
            ib.generate("passkey", 4096, 1, Bytes(), data={"dataset": src})
        assert "\n" not in str(e.value)
    (tmp_path / "passkey.jsonl").write_text('{"id": 0,\n')
    with pytest.raises(ValueError, match=r"^benchmark\.data\.dataset: cannot read .* as JSONL"):
        ib.generate("passkey", 4096, 1, Bytes(), data={"dataset": str(tmp_path)})


def test_hub_loads_one_task_file_with_explicit_features(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake(path, **kwargs):
        calls.append((path, kwargs))
        if path == "nobody/nothing":
            raise FileNotFoundError("no such dataset")
        # what the hub gives with the explicit features: every answer a list of strings
        return [
            {"id": 0, "context": "[1, 99]", "input": MATH["input"], "answer": ["99"], "options": []}
        ]

    monkeypatch.setattr(datasets, "load_dataset", fake)
    ib._hub_rows.cache_clear()
    data = {"dataset": "xinrongzhang2022/InfiniteBench", "revision": "r1"}
    (s,) = ib.generate("math_find", 4096, 0, Bytes(), data=data)
    assert s.references == ["99"] and ib.score_one("math_find", " 99", s.references) == 100
    ((path, kwargs),) = calls
    assert path == "xinrongzhang2022/InfiniteBench"
    assert kwargs == {
        "data_files": {"math_find": "math_find.jsonl"},
        "split": "math_find",
        "features": ib._hub_features(),
        "revision": "r1",
    }
    assert kwargs["features"]["id"] == datasets.Value("int64")
    assert kwargs["features"]["answer"] == datasets.List(datasets.Value("string"))
    with pytest.raises(ValueError, match=r"^benchmark\.data\.dataset=nobody/nothing: cannot load"):
        ib.generate("passkey", 4096, 0, Bytes(), data={"dataset": "nobody/nothing"})
    ib._hub_rows.cache_clear()
