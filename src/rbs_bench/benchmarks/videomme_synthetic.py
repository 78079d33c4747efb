"""Synthetic Video-MME data: seeded videos of Video-MME's lengths and a resolution it holds, with
questions in its schema, to rehearse a Video-MME cell where the real videos are not at hand.

    python -m rbs_bench.benchmarks.videomme_synthetic --out DIR [--seed 0] [--fps 2] \\
        [--size 1280x720] [--seconds 90 600 2400]
    python -m rbs_bench +experiment=videomme model=... \\
        benchmark.data.dataset=DIR/videomme_synthetic.jsonl benchmark.data.video_dir=DIR/videos

writes one video per Video-MME duration class (short: under 2 minutes, medium: 4-15 minutes,
long: 30-60 minutes; `--seconds` must fall in them) to `DIR/videos/<videoID>.mp4`, and one
question per video to `DIR/videomme_synthetic.jsonl`, a row with every field of the hub's
metadata (`rbs_bench.benchmarks.videomme.check_row`).

Each video is a field of coloured 80-pixel tiles scrolling sideways with a square of one colour
moving over it, drawn from the seed; its question asks the square's colour, and the answer is
the colour it has: a model that sees the frames can answer it. Frames are encoded with MPEG-4
Part 2 (`mpeg4`, in every FFmpeg build PyAV ships), a key frame every 10 seconds.

The frame rate (`--fps`, 2 by default) does not change what a model is shown: the harness
samples `num_frames` frames evenly over the whole video and stamps each pair with its time, so a
video of the same length and size at 30 frames per second gives the same frame positions in time
and the same number of video tokens (`rbs_bench.models.vision`); a low rate keeps a 40-minute
video quick to write. At 1280x720 the 32 frames of Qwen3-VL's processor config already exceed
its pixel budget, so any larger frame size gives the same video tokens too.

Rerunning skips the videos already written (each written to a temporary file and renamed): a
video's name carries a hash of everything that draws it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np

from rbs_bench.benchmarks import videomme

VERSION = 1  # bump when the drawing changes: it is in every video's name
DATASET = "videomme_synthetic.jsonl"
# Video-MME's duration classes, in seconds (lower bound inclusive, upper exclusive)
CLASSES = {"short": (1, 120), "medium": (240, 900), "long": (1800, 3600)}
DEFAULT_SECONDS = (90, 600, 2400)
TILE = 80  # pixels of one background tile
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 215, 40),
    "white": (245, 245, 245),
    "purple": (150, 60, 190),
}


def video_id(seed: int, duration: str, seconds: int, fps: int, size: tuple[int, int]) -> str:
    """The video's name: its class and a hash of everything that draws it."""
    blob = json.dumps([VERSION, seed, duration, seconds, fps, list(size)])
    return f"synth-{duration}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


def draw(seed: int, index: int, frames: int, size: tuple[int, int]):
    """(frame function k -> uint8 [H, W, 3], the square's colour name) of video `index`."""
    height, width = size
    rng = np.random.default_rng([seed, index])
    names = list(COLOURS)
    colour = names[int(rng.integers(len(names)))]
    tiles = rng.integers(0, 160, size=(height // TILE + 2, width // TILE + 2, 3), dtype=np.uint8)
    field = np.kron(tiles, np.ones((TILE, TILE, 1), np.uint8))[: height + TILE, : width + TILE]
    side = max(8, min(height, width) // 6)
    path = rng.uniform(0, 1, size=4)  # start and end of the square's path, as fractions
    step = int(rng.integers(1, 8))

    def frame(k: int) -> np.ndarray:
        shift = (k * step) % TILE
        img = np.ascontiguousarray(field[:height, shift : shift + width])
        t = k / max(frames - 1, 1)
        y = int((path[0] + (path[2] - path[0]) * t) * (height - side))
        x = int((path[1] + (path[3] - path[1]) * t) * (width - side))
        img[y : y + side, x : x + side] = COLOURS[colour]
        return img

    return frame, colour


def write_video(path: Path, frame, frames: int, fps: int, size: tuple[int, int]) -> None:
    """Encode `frames` frames to `path` (through a temporary file renamed into place)."""
    av = videomme._av()
    height, width = size
    tmp = path.with_name(path.name + ".tmp.mp4")
    with av.open(str(tmp), "w") as container:
        stream = container.add_stream("mpeg4", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = 10 * fps
        stream.bit_rate = 4_000_000
        for k in range(frames):
            image = av.VideoFrame.from_ndarray(frame(k), format="rgb24")
            for packet in stream.encode(image):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    os.replace(tmp, path)


def question(vid: str, duration: str, index: int, colour: str, seed: int) -> dict:
    """The video's question as a Video-MME row: the square's colour among four."""
    rng = np.random.default_rng([seed, index, 1])
    others = [c for c in COLOURS if c != colour]
    choices = [colour] + [others[i] for i in rng.choice(len(others), 3, replace=False)]
    order = rng.permutation(4)
    choices = [choices[i] for i in order]
    letters = "ABCD"
    return {
        "video_id": f"{index + 1:03d}",
        "duration": duration,
        "domain": "Synthetic",
        "sub_category": "Moving square",
        "url": "",
        "videoID": vid,
        "question_id": f"{index + 1:03d}-1",
        "task_type": "Object Recognition",
        "question": "What colour is the square that moves across the video?",
        "options": [f"{letters[i]}. {c.capitalize()}." for i, c in enumerate(choices)],
        "answer": letters[choices.index(colour)],
    }


def write(
    out,
    seed: int = 0,
    fps: int = 2,
    size: tuple[int, int] = (720, 1280),
    seconds: tuple[int, ...] = DEFAULT_SECONDS,
    progress: bool = True,
) -> Path:
    """Write the videos and the question file under `out` (see the module docstring); returns
    the question file's path."""
    from tqdm import tqdm

    if len(seconds) != len(CLASSES):
        raise ValueError(f"--seconds takes {len(CLASSES)} lengths (short, medium, long)")
    for (name, (lo, hi)), s in zip(CLASSES.items(), seconds, strict=True):
        if not lo <= s < hi:
            raise ValueError(f"--seconds {s} is not a {name} Video-MME video ({lo}-{hi - 1} s)")
    if fps < 1 or min(size) < 32:
        raise ValueError(f"--fps {fps} --size {size[1]}x{size[0]}: need fps >= 1, sides >= 32")
    out = Path(out).expanduser()
    videos = out / "videos"
    videos.mkdir(parents=True, exist_ok=True)
    rows = []
    total = sum(s * fps for s in seconds)
    bar = tqdm(total=total, unit="frame", desc="videos", disable=not progress, dynamic_ncols=True)
    for index, (duration, s) in enumerate(zip(CLASSES, seconds, strict=True)):
        vid = video_id(seed, duration, s, fps, size)
        frames = s * fps
        frame, colour = draw(seed, index, frames, size)
        path = videos / f"{vid}.mp4"
        if not path.is_file():
            write_video(path, frame, frames, fps, size)
        bar.update(frames)
        rows.append(videomme.check_row(question(vid, duration, index, colour, seed), str(path)))
    bar.close()
    dataset = out / DATASET
    tmp = dataset.with_name(dataset.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, dataset)
    print(f"{dataset}: {len(rows)} questions on videos in {videos}")
    return dataset


def _size(text: str) -> tuple[int, int]:
    """'1280x720' (width x height) -> (height, width)."""
    try:
        width, height = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxHEIGHT, e.g. 1280x720") from None
    return height, width


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for videos/ and the question file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fps", type=int, default=2)
    ap.add_argument("--size", type=_size, default=(720, 1280), help="WIDTHxHEIGHT (1280x720)")
    ap.add_argument(
        "--seconds", type=int, nargs=3, default=list(DEFAULT_SECONDS), help="short medium long"
    )
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        write(args.out, args.seed, args.fps, args.size, tuple(args.seconds), not args.no_progress)
    except (ValueError, OSError) as e:
        print(f"rbs-bench: error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
