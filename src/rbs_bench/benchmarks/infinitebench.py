"""InfiniteBench (Zhang et al., 2024): the ten tasks of the paper's Table 5, beyond 100K tokens.

Follows OpenBMB/InfiniteBench at commit 88b3daa (`src/prompt.py` yarn_mistral_templates,
`src/eval_utils.py`, `src/compute_scores.py`), written anew, not from upstream code;
docs/benchmarks.md §3 describes both. The data is not generated:
`data["dataset"]` names the hub copy (xinrongzhang2022/InfiniteBench, one split per task, read with
explicit feature types) or a local directory of the per-task `<task>.jsonl` files.

Prompts are the completion-style templates of the open-model scripts (Yi, ChatGLM3, YaRN-Mistral;
MInference's default), each ending in an answer prefix. Decoding is greedy, as upstream.

Deliberate differences from upstream:
- The prompt is cut to `context_length - max_new_tokens` tokens (MInference's rule; upstream's
  YaRN-Mistral script cuts to 128K and generates beyond it).
- With a chat template the template text is the user turn and its answer prefix, without its
  leading newlines, opens the assistant turn (as RULER's does); then only the template text is
  cut. Without one the prompt is upstream's completion text, cut as a whole.
- Labels stored as lists are unwrapped for Ret.KV (upstream's `label in words` compares the list
  itself and never matches; MInference unwraps too).
- Math.Find compares the first number in the prediction with the label as numbers: a decimal
  answer to an integer label is wrong here (upstream's int() raises on it).
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

# The sample type, middle truncation and data-source parsing are shared (benchmarks._text).
from rbs_bench.benchmarks._text import Encoder, Sample, fit_middle, is_local, source, stamped
from rbs_bench.errors import first_line

# Bump the suffix whenever prompts, truncation or scorers change: it goes into every result row.
VERSION = "infinitebench-88b3daa.rbs1"

HUB_ID = "xinrongzhang2022/InfiniteBench"


@dataclass(frozen=True)
class TaskSpec:
    paper_name: str  # the column of the paper's Table 5
    template: str  # the completion template less its answer prefix; str.format fields
    answer_prefix: str  # appended after the template text (with its leading newlines)
    max_new_tokens: int  # upstream DATA_NAME_TO_MAX_NEW_TOKENS
    metric: str  # a METRICS key
    choices: bool = False  # options A-D; the label becomes [option text, letter]


# Upstream yarn_mistral_templates, split before the answer prefix (quoted exactly).
_OPTIONS = "\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}"
_MASK = (
    "Below is a dialogue script where one random occurrence of a character name is replaced with "
    '"$$MASK$$", and you should try to guess who that character is.'
)
TASKS: dict[str, TaskSpec] = {
    "kv_retrieval": TaskSpec(
        "Ret.KV",
        "Extract the value corresponding to the specified key in the JSON object below.\n\n"
        "{context}\n\n{input}",
        "",
        50,
        "kv_retrieval",
    ),
    "passkey": TaskSpec(
        "Ret.PassKey",
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
        "it. I will quiz you about the important information.\n\n{context}\n\n{input}",
        "\n\nThe pass key is",
        6,
        "first_int",
    ),
    "number_string": TaskSpec(
        "Ret.Num",
        "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz "
        "you about the important information there.\n\n{context}\n\n{input}",
        "\n\nThe sequence of digits is",
        12,
        "first_int",
    ),
    "longbook_sum_eng": TaskSpec(
        "En.Sum", "Summarize the book below.\n\n{context}", "\n\nSummary:", 1200, "rouge_lsum"
    ),
    "longbook_choice_eng": TaskSpec(
        "En.MC",
        "Read the book and answer the question.\n\n{context}\n\nQuestion: {input}" + _OPTIONS,
        "\n\nThe letter of the correct answer is",
        40,
        "choice",
        choices=True,
    ),
    "longbook_qa_eng": TaskSpec(
        "En.QA",
        "Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\n"
        "Question: {input}",
        "\nAnswer:",
        40,
        "qa_f1",
    ),
    "longbook_qa_chn": TaskSpec(
        "Zh.QA",
        "阅读以下书籍然后回答问题。\n\n{context}\n\n问题：{input}",
        "\n答案：",
        40,
        "qa_f1_zh",
    ),
    "longdialogue_qa_eng": TaskSpec(
        "En.Dia",
        _MASK + "\n\n{context}",
        "\n\nThe name that has been replaced with $$MASK$$ is likely",
        40,
        "dialogue",
    ),
    "math_find": TaskSpec("Math.Find", "{prefix}\n\n{context}\n\n{input}", "", 3, "math_find"),
    "code_debug": TaskSpec(
        "Code.Debug",
        "Following is a Python code where exactly one of the functions/methods has a deliberate "
        "error that makes it crash.\n\n{context}\n\nOptions:" + _OPTIONS,
        "\n\nThe correct option is:",
        5,
        "code_debug",
        choices=True,
    ),
}


def _spec(task: str) -> TaskSpec:
    if task not in TASKS:
        raise ValueError(f"unknown InfiniteBench task {task!r}; valid: {', '.join(TASKS)}")
    return TASKS[task]


def max_new_tokens(task: str) -> int:
    """Tokens to generate for `task` (upstream DATA_NAME_TO_MAX_NEW_TOKENS; greedy)."""
    return _spec(task).max_new_tokens


def _math_target(question: str) -> str | None:
    # "... The largest number of the list is: " -> "the largest number" (greedy, first match)
    found = re.findall(r"The .+ of", question)
    return found[0].lower()[:-3] if found else None


def template_text(task: str, row: dict) -> str:
    """The task's template filled from a validated row, without the answer prefix."""
    fields = {"context": row["context"], "input": row["input"]}
    if task == "math_find":
        fields["prefix"] = f"What is {_math_target(row['input'])} in the following list?"
    if _spec(task).choices:
        fields |= {f"OPTION_{c}": o for c, o in zip("ABCD", row["options"], strict=True)}
    return _spec(task).template.format(**fields)


# ---------------------------------------------------------------------------------------------
# Data


def _hub_features():
    from datasets import Features, List, Value

    # Plain load_dataset fails to cast the columns (upstream issue #19); with these every answer
    # is a list of strings, so numeric labels are parsed back when scoring.
    return Features(
        {
            "id": Value("int64"),
            "context": Value("string"),
            "input": Value("string"),
            "answer": List(Value("string")),
            "options": List(Value("string")),
        }
    )


def check_row(task: str, row: Any, where: str) -> dict:
    """The row normalised (answer as a list of strings; for choice tasks [option text, letter]);
    ValueError naming its id if a field is missing or of the wrong type."""
    if not isinstance(row, dict):
        raise ValueError(f"InfiniteBench {task} {where}: a row must be a JSON object")
    rid = row.get("id")
    name = f"row id={rid!r}" if "id" in row else "row without id"

    def bad(why: str) -> ValueError:
        return ValueError(f"InfiniteBench {task} {name} ({where}): {why}")

    if not isinstance(rid, int) or isinstance(rid, bool):
        raise bad(f"field 'id' must be an integer, got {_kind(rid)}")
    for key in ("context", "input"):
        if not isinstance(row.get(key), str):
            raise bad(f"field {key!r} must be a string, got {_kind(row.get(key))}")
    answer, options = row.get("answer"), row.get("options")
    answer = answer if isinstance(answer, list) else [answer]
    if not answer or not all(_is_label(a) for a in answer):
        raise bad(f"field 'answer' must be a non-empty list of strings or numbers: {answer!r}")
    if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
        raise bad(f"field 'options' must be a list of strings, got {_kind(options)}")
    refs = [str(a) for a in answer]
    if _spec(task).choices:
        if len(options) != 4:
            raise bad(f"needs 4 options, got {len(options)}")
        if len(refs) == 2 and refs[1] in "ABCD" and len(refs[1]) == 1:
            pass  # already [text, letter]
        elif len(refs) == 1 and refs[0] in options:
            refs = [refs[0], "ABCD"[options.index(refs[0])]]
        else:
            raise bad(f"answer {refs!r} is not one of the options")
    if task == "math_find":
        if _math_target(row["input"]) is None:
            raise bad("field 'input' has no 'The ... of' phrase naming the number asked for")
        if _number(refs[0]) is None:
            raise bad(f"answer {refs[0]!r} is not a number")
    return {
        "id": rid,
        "context": row["context"],
        "input": row["input"],
        "answer": refs,
        "options": options,
    }


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _is_label(a: Any) -> bool:
    return isinstance(a, (str, int, float)) and not isinstance(a, bool)


def load_rows(task: str, data: dict | None) -> list[dict]:
    """Every row of one task (hub split or `<dir>/<task>.jsonl`), validated and normalised.

    `data["revision"]` pins a hub revision (En.QA was revised in 2024: pin it for comparisons).
    """
    _spec(task)
    src = source(data, SOURCE_HINT)
    if is_local(src):
        path, stamp = _local_file(task, src)
        return _local_rows(task, str(path), stamp)
    return _hub_rows(task, src, (data or {}).get("revision"))


SOURCE_HINT = f"the hub id {HUB_ID} or a local directory of <task>.jsonl files"


def _local_file(task: str, src: str) -> tuple[Path, int]:
    """The task's file `<src>/<task>.jsonl` and its modification time."""
    return stamped(src, Path(src).expanduser() / f"{task}.jsonl")


def check_data(task: str, data: dict | None) -> None:
    """Fail before any model loads if the task's local file cannot be read or holds a malformed
    row (the error names the file and the line); a hub id is checked when it is loaded."""
    _spec(task)
    src = source(data, SOURCE_HINT)
    if is_local(src):
        load_rows(task, data)


@lru_cache(maxsize=1)
def _local_rows(task: str, path: str, stamp: int) -> list[dict]:
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    rows.append(check_row(task, json.loads(line), f"line {n} of {path}"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"benchmark.data.dataset: cannot read {path} as JSONL ({first_line(e)})"
        ) from None
    return rows


@lru_cache(maxsize=1)
def _hub_rows(task: str, hub_id: str, revision: str | None) -> list[dict]:
    import datasets

    try:  # only this task's file, not all 2.5 GB
        ds = datasets.load_dataset(
            hub_id,
            data_files={task: f"{task}.jsonl"},
            split=task,
            features=_hub_features(),
            revision=revision,
        )
    except Exception as e:  # offline, unknown id, missing file: all the user's to fix
        raise ValueError(
            f"benchmark.data.dataset={hub_id}: cannot load {task} from the hub "
            f"({first_line(e)}); download the jsonl files and set "
            f"benchmark.data.dataset=/path/to/dir"
        ) from None
    return [check_row(task, dict(r), f"row {i} of {hub_id}") for i, r in enumerate(ds)]


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
    """The first `num_samples` rows of `task` in file order (0: all), each prompt cut to fit.

    Without a chat template (`wrap` leaves text unchanged) the prompt is the completion template
    with its answer prefix, middle-truncated as a whole to `context_length - max_new_tokens`
    tokens. With one it is `wrap(template text) + answer prefix`, only the template text cut.
    `seed` is unused: the data is fixed and read in order.
    """
    spec = _spec(task)
    if context_length <= 0 or num_samples < 0:
        raise ValueError(
            f"need context_length > 0 and num_samples >= 0, got {context_length}, {num_samples}"
        )
    wrap = wrap or (lambda t: t)
    if wrap("x") != "x":  # a chat template: the answer prefix opens the assistant turn
        prefix = spec.answer_prefix.lstrip("\n")
        suffix, render = "", lambda t: wrap(t) + prefix
    else:  # completion text, cut as a whole
        suffix, render = spec.answer_prefix, None
    if spec.metric == "rouge_lsum":
        _rouge()  # a missing scorer package fails here, before any generation
    new_tokens = spec.max_new_tokens if max_new_tokens is None else max_new_tokens
    rows = load_rows(task, data)
    rows = rows[:num_samples] if num_samples else rows
    samples = []
    for index, row in enumerate(rows):
        text = template_text(task, row) + suffix
        try:
            prompt, n = fit_middle(text, context_length - new_tokens, tokenizer, render)
        except ValueError:
            raise ValueError(
                f"context_length {context_length} is too small for InfiniteBench {task}: the "
                f"template and {new_tokens} new tokens leave no room for the context"
            ) from None
        samples.append(
            Sample(
                task, index, prompt, row["answer"], n, new_tokens, {"task": task}, str(row["id"])
            )
        )
    return samples


# ---------------------------------------------------------------------------------------------
# Scoring (upstream compute_scores.py); each returns 0-1


def _first_int(pred: str) -> str:
    m = re.search(r"[0-9]+", pred)
    return m.group(0) if m else ""


def _first_int_match(pred: str, refs: Sequence[str]) -> float:
    return float(_first_int(pred) == refs[0])


def _words(pred: str, chars: str) -> list[str]:
    return re.sub(f"[{re.escape(chars)}]", " ", pred).split()


def _kv_retrieval(pred: str, refs: Sequence[str]) -> float:
    return float(refs[0] in _words(pred, "\n:\"'.,?!{}"))


def _dialogue(pred: str, refs: Sequence[str]) -> float:
    return float(refs[0] in [w.upper() for w in _words(pred.strip(), "\n:\"'.,?!{}")])


def _squeeze(text: str) -> str:
    return re.sub(" {2,}", " ", text)  # runs of spaces only


def _after_prefix(text: str, prefixes: Sequence[str], refs: Sequence[str]) -> float | None:
    """At the first of `prefixes` found: 1 if what follows it, less one character, starts with
    a reference; 0 if it does not or the text ends with the prefix. None if none is found."""
    for prefix in prefixes:
        i = text.find(prefix)
        if i == -1:
            continue
        if i + len(prefix) == len(text):
            return 0.0
        rest = text[i + len(prefix) + 1 :]
        return float(any(rest.startswith(r) for r in refs))
    return None


def _choice(pred: str, refs: Sequence[str]) -> float:
    pred = pred.strip()
    if not pred:
        return 0.0
    if pred[0] in "ABCD":
        return float(pred[0] in refs)
    if pred in refs:
        return 1.0
    pred = _squeeze(re.sub("[\n\"'.,?!{}]", " ", pred))
    found = _after_prefix(pred, ("answer is:", "answer:", "answer is", "option is"), refs)
    if found is not None:
        return found
    for word in pred.split():
        if word in "ABCD":  # a substring of "ABCD", as upstream tests it
            return float(word in refs)
    return 0.0


def _code_debug(pred: str, refs: Sequence[str]) -> float:
    name, letter = refs[0], refs[1]
    pred = pred.strip()
    if pred[:2] in (f"{letter}.", f"{letter}:"):
        return 1.0
    for old in ("\n", "`", "'", '"', "-", "*", "Option", "option"):
        pred = pred.replace(old, " ")
    prefixes = ("answer is:", "is:", "answer:", "correct option is:")
    return _after_prefix(_squeeze(pred), prefixes, (letter, name)) or 0.0


def _number(text: str) -> int | float | None:
    try:
        return int(text) if re.fullmatch(r"\s*[-+]?\d+\s*", text) else float(text)
    except ValueError:
        return None


def _math_find(pred: str, refs: Sequence[str]) -> float:
    m = re.search(r"\d+\.\d+|\d+", pred)
    if m is None:
        return 0.0
    label, found = _number(refs[0]), m.group(0)
    if isinstance(label, int):  # upstream int(found): a decimal answer is wrong
        return float("." not in found and int(found) == label)
    return float(float(found) == label)


def _f1(pred_tokens: Sequence[str], ref_tokens: Sequence[str]) -> float:
    same = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


# Upstream's Chinese punctuation set, added to string.punctuation (data, quoted exactly).
ZH_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣"
    "､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ZH_DROP = set(string.punctuation + ZH_PUNCTUATION)


def normalize_zh_answer(text: str) -> str:
    """Lower case, no ASCII or Chinese punctuation, no whitespace at all."""
    return "".join("".join(ch for ch in text.lower() if ch not in _ZH_DROP).split())


def _qa_f1(pred: str, refs: Sequence[str]) -> float:
    return max(_f1(normalize_answer(pred).split(), normalize_answer(r).split()) for r in refs)


def _qa_f1_zh(pred: str, refs: Sequence[str]) -> float:  # one character, one token
    return max(_f1(list(normalize_zh_answer(pred)), list(normalize_zh_answer(r))) for r in refs)


@cache
def _rouge():
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        raise ValueError(
            "scoring longbook_sum_eng needs the rouge-score package: pip install rouge-score"
        ) from None
    # HF evaluate's "rouge" defaults: no stemming, rouge_score's own tokenizer.
    return rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=False)


def _rouge_lsum(pred: str, refs: Sequence[str]) -> float:
    # rougeLsum splits sentences on newlines only, as evaluate passes the texts through.
    return max(_rouge().score(r, pred)["rougeLsum"].fmeasure for r in refs)


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "first_int": _first_int_match,  # the first run of digits equals the label
    "kv_retrieval": _kv_retrieval,  # the label is one of the punctuation-split words
    "rouge_lsum": _rouge_lsum,  # rougeLsum F, max over references
    "choice": _choice,  # En.MC's cascade of rules
    "qa_f1": _qa_f1,  # SQuAD token F1, max over references
    "qa_f1_zh": _qa_f1_zh,  # character F1, max over references
    "dialogue": _dialogue,  # the first label among the upper-cased words
    "math_find": _math_find,  # the first number equals the label
    "code_debug": _code_debug,  # "X." / "X:" or the letter or name after an answer phrase
}


def score_one(task: str, prediction: str, references: Sequence[str]) -> float:
    """One sample's official score, 0-100 and unrounded (accuracy tasks: 0 or 100)."""
    if not references:
        raise ValueError("every sample needs at least one reference")
    return 100 * float(METRICS[_spec(task).metric](prediction, references))


def score(task: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """The task's official score, the mean of `score_one`, 0-100 rounded to 2 decimals."""
    if not predictions or len(predictions) != len(references):
        raise ValueError(
            f"need as many predictions as references, at least one; got "
            f"{len(predictions)} and {len(references)}"
        )
    scores = [score_one(task, p, r) for p, r in zip(predictions, references, strict=True)]
    return round(sum(scores) / len(scores), 2)


_CELL = ("method", "budget", "context_length")


def aggregate(df):
    """Per-task mean scores (0-100) and their macro average, one row per cell.

    `df` holds run records (`task`, `score`); rows are grouped by whichever of method, budget and
    context_length it has. Columns: the tasks present, in Table 5 order, then `average`, the
    unweighted mean over those tasks.
    """
    keys = [k for k in _CELL if k in df]
    means = df.groupby([*keys, "task"], sort=False)["score"].mean()
    by_task = means.unstack("task") if keys else means.to_frame().T
    table = by_task[[t for t in TASKS if t in by_task.columns]].copy()
    table.columns.name = None
    table["average"] = table.mean(axis=1)
    return table.reset_index(drop=not keys)


def main() -> None:
    """Print the passkey prompt of a made-up row, cut to 60 whitespace 'tokens', and its score."""

    class Words:
        def encode(self, text: str) -> list[str]:
            return text.split()

    noise = "The grass is green. The sky is blue. " * 20
    row = {"id": 0, "context": noise + "The pass key is 12345. " + noise, "input": "What is it?"}
    row = check_row("passkey", row | {"answer": ["12345"], "options": []}, "example")
    text = template_text("passkey", row) + TASKS["passkey"].answer_prefix
    prompt, n = fit_middle(text, 60, Words())
    print(f"{VERSION}: {n} tokens\n{prompt}")
    print("score of ' 12345.':", score_one("passkey", " 12345.", row["answer"]))


if __name__ == "__main__":
    main()
