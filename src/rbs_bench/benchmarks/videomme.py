"""Video-MME (Fu et al., 2024): 2,700 multiple-choice questions on 900 videos of 11 s to 1 h.

Follows the official prompt and scorer (BradyFU/Video-MME README at 07d7282,
`evaluation/eval_your_results.py` at 4e7566d) and lmms-eval's frame sampling, written anew, not
from upstream code; docs/benchmarks.md §4 describes both. The question
metadata is the hub's (`lmms-lab/Video-MME`, config videomme, split test) or a local copy in that
schema (.parquet, .json or .jsonl); the videos are never shipped: `data["video_dir"]` is a local
directory holding `<videoID>.mp4` (or .MP4 / .mkv), directly or under `data/` as the hub's zips
unpack.

Each sample is one question: `data["num_frames"]` frames (32 by default) at
`np.linspace(0, total_frames - 1, num_frames, dtype=int)` of its video, decoded with PyAV when the
sample runs, then the official prompt (no subtitles) after the video in one user turn. A
vision-language model's processor turns the frames into video tokens (`rbs_bench.models.vision`),
so the sparse prefill runs over text and video tokens alike.

Tasks:
- "all": the official protocol; the answer letter is extracted from the whole response by the
  official rules; 16 new tokens (lmms-eval's setting; the official README names none).
- "thinking": the same prompt for reasoning models (Qwen3-VL ...-Thinking): the answer is
  extracted from what follows the last `</think>`, and a response that never closes its reasoning
  counts as unanswered; 8192 new tokens (our choice; set benchmark.max_new_tokens to change it).

Scoring and its denominator: each record scores 100 if the extracted letter is the answer, else 0,
so the run tables (report.py, by duration, domain, sub_category and task_type) are accuracies
over ALL questions: an answer that cannot be extracted counts as wrong (lmms-eval's convention).
The official scorer divides by the questions with a non-empty extraction only;
`aggregate(df, denominator="answered")` gives that, and `denominator="all"` the first.

Deliberate differences from upstream:
- Frames are found by seeking to `index / fps` (constant frame rate assumed; decord reads by
  index). Containers that do not store a frame count get it from duration x frame rate.
- Decoding is greedy (lmms-eval: temperature 0).
- The paper evaluates 1,000 of the 2,700 questions without saying which; `num_samples` takes the
  first rows in file order (0: all).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from rbs_bench.benchmarks import _text
from rbs_bench.benchmarks._text import Encoder, first_line, is_local, kind, source

# Bump the suffix whenever the prompt, frame sampling or extraction change: it is in every record.
VERSION = "videomme-4e7566d.rbs1"

HUB_ID = "lmms-lab/Video-MME"
HUB_CONFIG, HUB_SPLIT = "videomme", "test"
DEFAULT_FRAMES = 32
VIDEO_SUFFIXES = (".mp4", ".MP4", ".mkv")
# Qwen-VL's spelling of one video in a prompt, used when no chat wrapper is given.
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
DURATIONS = ("short", "medium", "long")
DATA_KEYS = ("dataset", "revision", "video_dir", "num_frames")


@dataclass(frozen=True)
class TaskSpec:
    max_new_tokens: int
    reasoning: bool  # answer after the last </think>; none means unanswered


TASKS: dict[str, TaskSpec] = {
    "all": TaskSpec(16, reasoning=False),
    "thinking": TaskSpec(8192, reasoning=True),
}


def _spec(task: str) -> TaskSpec:
    if task not in TASKS:
        raise ValueError(f"unknown Video-MME task {task!r}; valid: {', '.join(TASKS)}")
    return TASKS[task]


def max_new_tokens(task: str) -> int:
    """Tokens to generate for `task` (greedy)."""
    return _spec(task).max_new_tokens


# ---------------------------------------------------------------------------------------------
# Prompt (BradyFU/Video-MME README, without subtitles; quoted exactly)

INSTRUCTION = (
    "Select the best answer to the following multiple-choice question based on the video. "
    "Respond with only the letter (A, B, C, or D) of the correct option."
)
ANSWER_PROMPT = "The best answer is:"


def prompt_text(row: dict) -> str:
    """The instruction, the question, the four options ("A. ..." as stored) and the answer cue,
    one per line."""
    return "\n".join([INSTRUCTION, row["question"], *row["options"], ANSWER_PROMPT])


# ---------------------------------------------------------------------------------------------
# Frames (PyAV)


def _av():
    try:
        import av
    except ImportError:
        raise ValueError("reading Video-MME videos needs PyAV: pip install av") from None
    return av


@dataclass(frozen=True)
class VideoInfo:
    total_frames: int
    fps: float
    height: int
    width: int


def probe(path: str | Path) -> VideoInfo:
    """Frame count, frame rate and size of a video file's first video stream."""
    path = Path(path)
    try:
        stamp = path.stat().st_mtime_ns
    except OSError as e:
        raise ValueError(f"cannot read video {path} ({e.strerror or e})") from None
    return _probe(str(path), stamp)


@lru_cache(maxsize=4096)
def _probe(path: str, stamp: int) -> VideoInfo:
    av = _av()
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise ValueError(f"video {path} has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else 0.0
            total = int(stream.frames or 0)
            if total <= 0 and fps > 0:  # e.g. mkv stores no frame count: duration x rate
                if stream.duration:
                    seconds = float(stream.duration * stream.time_base)
                else:
                    seconds = (container.duration or 0) / av.time_base
                total = int(round(seconds * fps))
            if total <= 0:  # count the stream's packets, one per frame
                total = sum(1 for p in container.demux(stream) if p.size)
            size = stream.codec_context.height, stream.codec_context.width
    except av.error.FFmpegError as e:
        raise ValueError(f"cannot decode video {path} ({first_line(e)})") from None
    if total <= 0 or fps <= 0:
        raise ValueError(f"video {path} reports {total} frames at {fps} fps; cannot sample it")
    return VideoInfo(total, fps, *size)


def sample_indices(total_frames: int, num_frames: int) -> tuple[int, ...]:
    """`num_frames` frame indices spread evenly over the video, first and last included, as
    lmms-eval samples them (repeats when the video has fewer frames)."""
    return tuple(int(i) for i in np.linspace(0, total_frames - 1, num_frames, dtype=int))


def read_frames(path: str | Path, indices: Sequence[int]) -> np.ndarray:
    """uint8 RGB frames [len(indices), H, W, 3] of a video, in the order of `indices`.

    Frame i is the one shown at time i / fps: each wanted time is reached by seeking to the key
    frame before it and decoding forward; frames past the stream's end repeat its last frame.
    """
    av = _av()
    wanted = sorted(set(int(i) for i in indices))
    got: dict[int, np.ndarray] = {}
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            rate = stream.average_rate or stream.guessed_rate
            fps, base = float(rate), float(stream.time_base)
            start = stream.start_time or 0
            last = None
            for i in wanted:
                if i in got:
                    continue
                container.seek(start + int(i / fps / base), stream=stream, backward=True)
                for frame in container.decode(stream):
                    if frame.pts is None:
                        continue
                    last = frame
                    at = (frame.pts - start) * base * fps  # this frame's index
                    for j in wanted:  # keep every wanted frame decoding passes over
                        if j not in got and abs(at - j) < 0.5:
                            got[j] = frame.to_ndarray(format="rgb24")
                    if at > i - 0.5:
                        break
                if i not in got:  # ran off the end: the last frame is still on screen
                    if last is None:
                        raise ValueError(f"video {path} decoded no frame")
                    got[i] = last.to_ndarray(format="rgb24")
    except av.error.FFmpegError as e:
        raise ValueError(f"cannot decode video {path} ({first_line(e)})") from None
    return np.stack([got[int(i)] for i in indices])


@dataclass(frozen=True)
class Video:
    """The frames one sample shows: a file and the frame indices sampled from it."""

    path: str
    indices: tuple[int, ...]
    fps: float
    total_frames: int

    def frames(self) -> np.ndarray:
        return read_frames(self.path, self.indices)

    def key(self) -> str:
        """What identifies the frames across machines (not the directory)."""
        return f"{Path(self.path).name} fps={self.fps:g} frames={list(self.indices)}"


@dataclass(frozen=True)
class Sample(_text.Sample):
    video: Video | None = None  # decoded when the sample runs


# ---------------------------------------------------------------------------------------------
# Data

_STRINGS = (
    "video_id",
    "duration",
    "domain",
    "sub_category",
    "url",
    "videoID",
    "question_id",
    "task_type",
    "question",
    "answer",
)
_CHOICES = {"duration": DURATIONS, "answer": ("A", "B", "C", "D")}


def check_row(row: Any, where: str) -> dict:
    """The row (options as a list) if it has every hub field with the right type; else
    ValueError naming its question_id."""
    if not isinstance(row, dict):
        raise ValueError(f"Video-MME {where}: a row must be an object, got {kind(row)}")
    name = f"row question_id={row['question_id']!r}" if "question_id" in row else "row"

    def bad(why: str) -> ValueError:
        return ValueError(f"Video-MME {name} ({where}): {why}")

    for key in _STRINGS + ("options",):
        if key not in row:
            raise bad(f"missing field {key!r}")
    for key in _STRINGS:
        if not isinstance(row[key], str):
            raise bad(f"field {key!r} must be a string, got {kind(row[key])}")
    for key, valid in _CHOICES.items():
        if row[key] not in valid:
            raise bad(f"field {key!r} is {row[key]!r}; valid: {', '.join(valid)}")
    options = row["options"]
    if isinstance(options, tuple | np.ndarray):
        options = list(options)
    if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
        raise bad(f"field 'options' must be a list of strings, got {kind(options)}")
    if len(options) != 4 or any(not o.startswith(f"{c}.") for c, o in zip("ABCD", options)):
        raise bad(f"field 'options' must be 4 strings starting 'A.' to 'D.', got {options!r}")
    return {**row, "options": options}


def load_rows(data: dict | None) -> list[dict]:
    """Every question of the data set named by `data["dataset"]` (hub id, or a local .parquet,
    .json or .jsonl file, or a directory with the hub's videomme/test-*.parquet), validated."""
    src = source(data, f"the hub id {HUB_ID} or a local .parquet/.json/.jsonl copy")
    if not is_local(src, (".json", ".jsonl", ".parquet")):
        return _hub_rows(src, (data or {}).get("revision"))
    path = Path(src).expanduser()
    files = sorted(path.glob("videomme/test-*.parquet")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"benchmark.data.dataset={src}: no videomme/test-*.parquet in it")
    rows = []
    for f in files:
        try:
            stamp = f.stat().st_mtime_ns
        except OSError as e:
            raise ValueError(
                f"benchmark.data.dataset={src}: cannot read {f} ({e.strerror or e})"
            ) from None
        rows += _local_rows(str(f), stamp)
    return rows


@lru_cache(maxsize=4)
def _local_rows(path: str, stamp: int) -> list[dict]:
    where = f"benchmark.data.dataset={path}"
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            rows = pq.read_table(path).to_pylist()
        elif path.endswith(".jsonl"):
            text = Path(path).read_text(encoding="utf-8")
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            rows = json.loads(Path(path).read_text(encoding="utf-8"))
    except Exception as e:  # unreadable file of any kind: the user's to fix
        raise ValueError(f"{where}: cannot read it ({first_line(e)})") from None
    if not isinstance(rows, list):
        raise ValueError(f"{where}: expected a list of rows, got {kind(rows)}")
    return [check_row(r, f"row {i} of {path}") for i, r in enumerate(rows)]


@lru_cache(maxsize=1)
def _hub_rows(hub_id: str, revision: str | None) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(hub_id, HUB_CONFIG, split=HUB_SPLIT, revision=revision)
    except Exception as e:  # offline, unknown id, gated: all the user's to fix
        raise ValueError(
            f"benchmark.data.dataset={hub_id}: cannot load it from the hub ({first_line(e)}); "
            f"download the parquet file and set benchmark.data.dataset=/path/to/file.parquet"
        ) from None
    return [check_row(dict(r), f"row {i} of {hub_id}") for i, r in enumerate(ds)]


def options(data: dict | None) -> tuple[Path, int]:
    """(video directory, frames per video) from `data`, or ValueError naming the key to set."""
    data = data or {}
    unknown = sorted(set(data) - set(DATA_KEYS))
    if unknown:
        raise ValueError(
            f"benchmark.data.{unknown[0]} is not a Video-MME setting; valid: {', '.join(DATA_KEYS)}"
        )
    video_dir = data.get("video_dir")
    if not video_dir or not isinstance(video_dir, str):
        raise ValueError(
            "benchmark.data.video_dir is not set; give the local directory of the Video-MME "
            "videos (<videoID>.mp4, as the hub's videos_chunked_*.zip unpack)"
        )
    path = Path(video_dir).expanduser()
    if not path.is_dir():
        raise ValueError(f"benchmark.data.video_dir={video_dir} is not a directory")
    n = data.get("num_frames", DEFAULT_FRAMES)
    n = DEFAULT_FRAMES if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise ValueError(f"benchmark.data.num_frames={n!r}; give an integer of at least 2")
    return path, n


def find_video(video_dir: Path, row: dict) -> Path:
    """`<video_dir>[/data]/<videoID>.mp4|.MP4|.mkv`, or ValueError naming the row and the key."""
    for folder in (video_dir, video_dir / "data"):
        for suffix in VIDEO_SUFFIXES:
            path = folder / f"{row['videoID']}{suffix}"
            if path.is_file():
                return path
    raise ValueError(
        f"Video-MME row question_id={row['question_id']!r}: no video {row['videoID']}"
        f"{'/'.join(VIDEO_SUFFIXES)} in benchmark.data.video_dir={video_dir} (nor in its data/)"
    )


def check_data(task: str, data: dict | None) -> None:
    """Fail before any model loads if the settings, the metadata or the video directory are
    missing or bad (each video file is checked when its sample is built)."""
    _spec(task)
    options(data)
    load_rows(data)


# ---------------------------------------------------------------------------------------------
# Generation


def generate(
    task: str,
    context_length: int,
    num_samples: int,
    tokenizer: Encoder,
    seed: int = 42,
    wrap: Callable[..., str] | None = None,
    max_new_tokens: int | None = None,
    data: dict | None = None,
) -> list[Sample]:
    """The first `num_samples` questions in file order (0: all), each with its video's frames.

    The prompt is `wrap(prompt_text(row), video=True)`: one user turn with the video first, as a
    single placeholder that the model's processor expands once the frames are decoded (without
    `wrap`, Qwen-VL's placeholder and the text). `num_tokens` counts the text only; the runner
    checks the expanded prompt plus `max_new_tokens` against `context_length`. `seed` is unused:
    the data is fixed and the frames are spread evenly.
    """
    spec = _spec(task)
    if context_length <= 0 or num_samples < 0:
        raise ValueError(
            f"need context_length > 0 and num_samples >= 0, got {context_length}, {num_samples}"
        )
    video_dir, num_frames = options(data)
    new_tokens = spec.max_new_tokens if max_new_tokens is None else max_new_tokens
    rows = load_rows(data)
    rows = rows[:num_samples] if num_samples else rows
    samples = []
    for index, row in enumerate(rows):
        path = find_video(video_dir, row)
        info = probe(path)
        text = prompt_text(row)
        prompt = wrap(text, video=True) if wrap is not None else VIDEO_PLACEHOLDER + text
        n = len(tokenizer.encode(prompt))
        if n + new_tokens > context_length:
            raise ValueError(
                f"context_length {context_length} is too small for Video-MME {task}: the text of "
                f"row question_id={row['question_id']!r} and {new_tokens} new tokens need {n} + "
                f"{new_tokens}, before any video token"
            )
        indices = sample_indices(info.total_frames, num_frames)
        video = Video(str(path), indices, info.fps, info.total_frames)
        meta = {k: row[k] for k in ("duration", "domain", "sub_category", "task_type")}
        samples.append(
            Sample(
                task, index, prompt, [row["answer"]], n, new_tokens, meta, row["question_id"], video
            )
        )
    return samples


# ---------------------------------------------------------------------------------------------
# Scoring (official eval_your_results.py extract_characters_regex)

# Deleted before the letter is searched, in this order. The last two are what the official list
# holds where a missing comma glued two strings together; they are kept glued, as they run.
ANSWER_PREFIXES = (
    "The best answer is",
    "The correct answer is",
    "The answer is",
    "The answer",
    "The best option isThe correct option is",
    "Best answer:Best option:",
)
_LETTER = re.compile(r"[ABCD]")
THINK_END = "</think>"


def extract_answer(response: str) -> str:
    """The official answer letter of a response, or "" (unanswered).

    Strip, delete each prefix of ANSWER_PREFIXES, then the first capital A, B, C or D anywhere,
    or "" if there is none. (The official rule "more than 10 words and no A-D gives empty" only
    names a case that has no letter to find, so it never changes the result.)
    """
    s = response.strip()
    for prefix in ANSWER_PREFIXES:
        s = s.replace(prefix, "")
    m = _LETTER.search(s)
    return m.group(0) if m else ""


def answer_text(task: str, response: str) -> str:
    """The part of a response the answer is extracted from: all of it, or for "thinking" what
    follows the last </think> ("" when the reasoning never closes)."""
    if not _spec(task).reasoning:
        return response
    _, sep, tail = response.rpartition(THINK_END)
    return tail if sep else ""


def extract(task: str, response: str) -> str:
    """The task's answer letter of a response, or "" (unanswered)."""
    return extract_answer(answer_text(task, response))


def score_one(task: str, prediction: str, references: Sequence[str]) -> float:
    """100 if the extracted letter is the answer, else 0 (an unanswered response included)."""
    if not references:
        raise ValueError("every sample needs its answer letter as reference")
    return 100.0 if extract(task, prediction) == references[0] else 0.0


def score(
    task: str,
    predictions: Sequence[str],
    references: Sequence[Sequence[str]],
    denominator: str = "all",
) -> float:
    """Accuracy 0-100 over all questions ("all", lmms-eval) or over the answered ones
    ("answered", the official scorer; NaN if none is answered)."""
    if not predictions or len(predictions) != len(references):
        raise ValueError(
            f"need as many predictions as references, at least one; got "
            f"{len(predictions)} and {len(references)}"
        )
    _denominator(denominator)
    scores = [score_one(task, p, r) for p, r in zip(predictions, references, strict=True)]
    if denominator == "all":
        return sum(scores) / len(scores)
    answered = [s for s, p in zip(scores, predictions, strict=True) if extract(task, p)]
    return sum(answered) / len(answered) if answered else float("nan")


def _denominator(denominator: str) -> None:
    if denominator not in ("all", "answered"):
        raise ValueError(f"denominator must be 'all' or 'answered', got {denominator!r}")


_CELL = ("method", "budget", "task", "context_length")
COLUMNS = ("short", "medium", "long", "overall")


def aggregate(df, denominator: str = "all"):
    """Accuracy (0-100) by duration and overall, one row per cell (the paper's Table layout).

    `df` holds run records: `score`, `task` and `prediction`, and the duration in a `meta` dict
    column or a `duration` column; rows are grouped by whichever of method, budget, task and
    context_length it has. `denominator`: "all" counts every question (an unanswered one is
    wrong); "answered" counts only questions whose answer could be extracted (the official
    scorer). Columns: n, answered, short, medium, long, overall (NaN where a group has none).
    """
    import pandas as pd

    _denominator(denominator)
    df = df.reset_index(drop=True)
    if "duration" in df:
        duration = df["duration"]
    else:
        duration = df["meta"].map(lambda m: m.get("duration") if isinstance(m, dict) else None)
    answered = [bool(extract(t, p)) for t, p in zip(df["task"], df["prediction"], strict=True)]
    keys = [k for k in _CELL if k in df]
    table = pd.DataFrame(
        {k: df[k] for k in keys}
        | {"duration": duration, "acc": df["score"].astype(float), "answered": answered}
    )

    def summary(g) -> pd.Series:
        counted = g if denominator == "all" else g[g["answered"]]
        out = {"n": len(g), "answered": int(g["answered"].sum())}
        out |= {d: counted.loc[counted["duration"] == d, "acc"].mean() for d in DURATIONS}
        out["overall"] = counted["acc"].mean()
        return pd.Series(out)

    if not keys:
        return summary(table).to_frame().T
    cols = ["duration", "acc", "answered"]
    return table.groupby(keys, sort=False)[cols].apply(summary).reset_index()


def main() -> None:
    """Print the prompt of a made-up question and how three responses are scored."""
    row = {
        "question": "What colour is the kite at the end of the video?",
        "options": ["A. Red.", "B. Blue.", "C. Green.", "D. Yellow."],
    }
    print(f"{VERSION}: 32 frames at np.linspace(0, n - 1, 32, dtype=int)\n")
    print(VIDEO_PLACEHOLDER + prompt_text(row))
    for response in ("The best answer is: B", "b", "<think>It is blue.</think>\nB."):
        print(f"{response!r}: all -> {extract('all', response)!r}, ", end="")
        print(f"thinking -> {extract('thinking', response)!r}")


if __name__ == "__main__":
    main()
