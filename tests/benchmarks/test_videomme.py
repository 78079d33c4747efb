"""Video-MME: metadata loading and validation, the frame decoder on videos written here, the
official prompt and answer extraction, both denominators, Qwen3-VL video inputs, the sparse hook
over video tokens, and runs on the tiny vision-language model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from rbs_bench import benchmarks, config, methods, models
from rbs_bench.benchmarks import videomme as vm
from rbs_bench.config import UserError
from rbs_bench.models import hf_attention, tiny_vl, vision

av = pytest.importorskip("av")

FIXTURE = Path(__file__).parents[1] / "fixtures" / "videomme" / "test.jsonl"
ROWS = [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines()]
H, W, FPS = 64, 96, 8  # test videos: multiples of 32 pixels, so no resize happens
LEVEL0, STEP = 16, 4  # frame k of a test video is grey LEVEL0 + STEP * k (k < 60)


def write_video(path: Path, num_frames: int, gop: int = 5) -> None:
    """A small constant-rate video whose frame k is uniformly grey LEVEL0 + STEP * k, with a key
    frame every `gop` frames, so reading must seek."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        stream.codec_context.gop_size = gop
        stream.bit_rate = 4_000_000  # grey levels come back within 1 of what was written
        for k in range(num_frames):
            img = np.full((H, W, 3), LEVEL0 + STEP * k, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def frame_number(frame: np.ndarray) -> int:
    """Which frame of a grey test video this is (codec error is far below STEP / 2)."""
    return round((float(frame.mean()) - LEVEL0) / STEP)


@pytest.fixture(scope="module")
def video_dir(tmp_path_factory) -> Path:
    """One test video per fixture videoID: 24, 40 and 56 frames at 8 fps."""
    assert LEVEL0 + STEP * 55 <= 255
    root = tmp_path_factory.mktemp("videos")
    ids = list(dict.fromkeys(r["videoID"] for r in ROWS))
    for j, vid in enumerate(ids):
        write_video(root / f"{vid}.mp4", 24 + 16 * j)
    return root


def data(video_dir, **extra) -> dict:
    return {"dataset": str(FIXTURE), "video_dir": str(video_dir), "num_frames": 4, **extra}


class Bytes:
    def encode(self, text: str) -> list[int]:
        return list(text.encode())


# --- registry, tasks, prompt -------------------------------------------------------------------


def test_registry_and_tasks():
    assert benchmarks.get("videomme") is vm
    assert vm.VERSION.startswith("videomme-")
    assert list(vm.TASKS) == ["all", "thinking"]
    assert (vm.max_new_tokens("all"), vm.max_new_tokens("thinking")) == (16, 8192)
    with pytest.raises(ValueError, match=r"unknown Video-MME task 'x'; valid: all, thinking$"):
        vm.max_new_tokens("x")


def test_official_prompt_golden():
    assert vm.prompt_text(ROWS[0]) == (
        "Select the best answer to the following multiple-choice question based on the video. "
        "Respond with only the letter (A, B, C, or D) of the correct option.\n"
        "How many bells are rung in the opening shot of the video?\n"
        "A. One.\nB. Two.\nC. Three.\nD. Four.\n"
        "The best answer is:"
    )


# --- answer extraction and scores ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "letter"),
    [
        ("C", "C"),
        ("  The best answer is: B\n", "B"),
        ("The answer is (D).", "D"),
        ("d", ""),  # capitals only
        ("I am not sure which option fits the video at all, sorry about that.", ""),
        # the first capital A-D anywhere counts, even inside a word
        ("Because the bell rings twice: B", "B"),
        ("After watching: C", "A"),
        # the official list's glued strings are deleted as glued; apart, "Best" gives a B
        ("Best answer:Best option: C", "C"),
        ("Best answer: C", "B"),
        ("The best option isThe correct option is D", "D"),
        ("", ""),
    ],
)
def test_extract_answer_follows_the_official_rules(response, letter):
    assert vm.extract_answer(response) == letter
    assert vm.extract("all", response) == letter


def test_thinking_reads_after_the_last_think_end():
    assert vm.extract("thinking", "Option A is wrong, so</think>\n\nC") == "C"
    assert vm.extract("thinking", "x</think>A first</think> The best answer is D") == "D"
    assert vm.extract("thinking", "Option A is wrong and the video shows") == ""  # unfinished
    assert vm.extract("all", "Option A is wrong and the video shows") == "A"


def test_scores_and_both_denominators():
    preds = ["C", "The answer is A", "no idea", "B"]
    refs = [["C"], ["B"], ["A"], ["B"]]
    assert [vm.score_one("all", p, r) for p, r in zip(preds, refs)] == [100, 0, 0, 100]
    assert vm.score("all", preds, refs) == 50.0  # 2 right of 4 questions
    assert vm.score("all", preds, refs, denominator="answered") == pytest.approx(200 / 3)
    assert np.isnan(vm.score("all", ["no"], [["A"]], denominator="answered"))
    with pytest.raises(ValueError, match="denominator must be 'all' or 'answered'"):
        vm.score("all", preds, refs, denominator="some")


def test_aggregate_by_duration_with_each_denominator():
    df = pd.DataFrame(
        {
            "method": ["dense"] * 6,
            "task": ["all"] * 6,
            "prediction": ["C", "x y", "A", "B", "D", "no"],
            "references": [["C"], ["B"], ["A"], ["D"], ["D"], ["A"]],
            "meta": [{"duration": r["duration"]} for r in ROWS],
        }
    )
    df["score"] = [vm.score_one("all", p, r) for p, r in zip(df["prediction"], df["references"])]
    every = vm.aggregate(df).iloc[0]
    assert (every["n"], every["answered"]) == (6, 4)
    # short: C right, "x y" unanswered; medium: A right, B wrong; long: D right, "no" unanswered
    assert (every["short"], every["medium"], every["long"]) == (50.0, 50.0, 50.0)
    assert every["overall"] == 50.0
    official = vm.aggregate(df, denominator="answered").iloc[0]
    assert (official["short"], official["medium"], official["long"]) == (100.0, 50.0, 100.0)
    assert official["overall"] == 75.0  # 3 right of 4 answered


# --- metadata ------------------------------------------------------------------------------------


def test_fixture_loads_in_every_local_format(tmp_path):
    rows = vm.load_rows({"dataset": str(FIXTURE)})
    assert [r["question_id"] for r in rows] == [r["question_id"] for r in ROWS]
    assert {r["duration"] for r in rows} == set(vm.DURATIONS)
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    hub_like = tmp_path / "videomme"
    hub_like.mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS), hub_like / "test-00000-of-00001.parquet")
    (tmp_path / "copy.json").write_text(json.dumps(ROWS), encoding="utf-8")
    assert vm.load_rows({"dataset": str(tmp_path)}) == rows  # the hub snapshot's layout
    assert vm.load_rows({"dataset": str(tmp_path / "copy.json")}) == rows


def test_hub_metadata_is_the_videomme_test_split(monkeypatch):
    import datasets

    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        if kwargs.get("revision") == "offline":
            raise ConnectionError("Couldn't reach the hub\nsecond line")
        return list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    vm._hub_rows.cache_clear()
    assert vm.load_rows({"dataset": vm.HUB_ID}) == vm.load_rows({"dataset": str(FIXTURE)})
    assert calls[0] == ((vm.HUB_ID, "videomme"), {"split": "test", "revision": None})
    with pytest.raises(ValueError) as err:
        vm.load_rows({"dataset": vm.HUB_ID, "revision": "offline"})
    assert str(err.value) == (
        "benchmark.data.dataset=lmms-lab/Video-MME: cannot load it from the hub (Couldn't reach "
        "the hub); download the parquet file and set benchmark.data.dataset=/path/to/file.parquet"
    )
    vm._hub_rows.cache_clear()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"question": None}, r"row question_id='001-1' .*field 'question' must be a string"),
        ({"duration": "brief"}, r"question_id='001-1' .*'duration' is 'brief'; valid: short"),
        ({"answer": "E"}, r"question_id='001-1' .*field 'answer' is 'E'"),
        ({"options": ["One", "B. Two.", "C. Three.", "D. Four."]}, r"starting 'A.' to 'D.'"),
        ({"options": "A. One."}, r"field 'options' must be a list of strings, got str"),
    ],
)
def test_bad_rows_name_their_question_id(tmp_path, change, message):
    path = tmp_path / "bad.jsonl"
    rows = [{**ROWS[0], **change}, ROWS[1]]
    path.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        vm.load_rows({"dataset": str(path)})


def test_missing_field_names_the_row(tmp_path):
    path = tmp_path / "bad.json"
    row = {k: v for k, v in ROWS[3].items() if k != "videoID"}
    path.write_text(json.dumps([row]), encoding="utf-8")
    with pytest.raises(ValueError, match=r"row question_id='301-2' \(row 0 of .*\): missing field"):
        vm.load_rows({"dataset": str(path)})


def test_settings_errors_name_the_key(tmp_path, video_dir):
    with pytest.raises(ValueError, match=r"^benchmark.data.video_dir is not set"):
        vm.check_data("all", {"dataset": str(FIXTURE)})
    with pytest.raises(ValueError, match=r"benchmark.data.video_dir=.* is not a directory"):
        vm.check_data("all", data(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"benchmark.data.num_frames=1; give an integer"):
        vm.check_data("all", data(video_dir, num_frames=1))
    with pytest.raises(ValueError, match=r"benchmark.data.videos is not a Video-MME setting"):
        vm.check_data("all", data(video_dir, videos="x"))
    with pytest.raises(ValueError, match=r"benchmark.data.dataset=.*cannot read"):
        vm.check_data("all", data(video_dir, dataset=str(tmp_path / "none.jsonl")))
    vm.check_data("all", data(video_dir))


# --- frame decoder -------------------------------------------------------------------------------


def test_sample_indices_spread_like_linspace():
    assert vm.sample_indices(40, 4) == (0, 13, 26, 39)
    idx = vm.sample_indices(3600, 32)
    assert len(idx) == 32 and idx[0] == 0 and idx[-1] == 3599
    assert all(b - a in (116, 117) for a, b in zip(idx, idx[1:]))  # 3599 / 31 = 116.1
    assert vm.sample_indices(3, 5) == (0, 0, 1, 1, 2)  # fewer frames than asked: repeats


@pytest.mark.parametrize("suffix", [".mp4", ".mkv"])
def test_decoder_returns_the_frames_asked_for(tmp_path, suffix):
    path = tmp_path / f"clip{suffix}"
    write_video(path, 40)
    info = vm.probe(path)
    assert (info.total_frames, info.fps, info.height, info.width) == (40, FPS, H, W)
    idx = vm.sample_indices(info.total_frames, 7)
    frames = vm.read_frames(path, idx)
    assert frames.shape == (7, H, W, 3) and frames.dtype == np.uint8
    assert [frame_number(f) for f in frames] == list(idx)
    backwards = list(range(39, -1, -3))  # each one before the last: a seek back every time
    assert [frame_number(f) for f in vm.read_frames(path, backwards)] == backwards
    assert [frame_number(f) for f in vm.read_frames(path, [39, 45])] == [39, 39]  # past the end


def test_bad_video_file_is_one_line(tmp_path):
    path = tmp_path / "broken.mp4"
    path.write_bytes(b"not a video at all")
    with pytest.raises(ValueError, match=r"^cannot decode video .*broken.mp4"):
        vm.probe(path)


# --- generation ----------------------------------------------------------------------------------


def test_generate_samples_are_deterministic(video_dir):
    a = vm.generate("all", 4096, 0, Bytes(), data=data(video_dir))
    b = vm.generate("all", 4096, 0, Bytes(), data=data(video_dir))
    assert a == b and len(a) == len(ROWS)
    s = a[3]
    assert (s.task, s.index, s.id, s.references) == ("all", 3, "301-2", ["D"])
    assert s.prompt == vm.VIDEO_PLACEHOLDER + vm.prompt_text(ROWS[3])
    assert s.num_tokens == len(s.prompt.encode()) and s.max_new_tokens == 16
    assert s.meta == {
        "duration": "medium",
        "domain": "Sports Competition",
        "sub_category": "Athletics",
        "task_type": "OCR Problems",
    }
    assert s.video.path == str(video_dir / "Zp7wXc0aB4s.mp4")
    assert (s.video.total_frames, s.video.fps) == (40, FPS)
    assert s.video.indices == vm.sample_indices(40, 4)
    assert [frame_number(f) for f in s.video.frames()] == list(s.video.indices)
    assert len(vm.generate("thinking", 20000, 2, Bytes(), data=data(video_dir))) == 2
    assert (
        vm.generate("thinking", 20000, 1, Bytes(), data=data(video_dir))[0].max_new_tokens == 8192
    )


def test_generate_finds_hub_layout_and_reports_missing_videos(tmp_path, video_dir):
    (tmp_path / "data").mkdir()
    for vid in ("kQ3vR8tLm2A", "Zp7wXc0aB4s"):  # .MP4 under data/, as some chunks unpack
        os.link(video_dir / f"{vid}.mp4", tmp_path / "data" / f"{vid}.MP4")
    found = vm.generate("all", 4096, 4, Bytes(), data=data(tmp_path))
    assert Path(found[2].video.path).name == "Zp7wXc0aB4s.MP4"
    with pytest.raises(ValueError, match=r"row question_id='601-1': no video r2Hn9Ye5TqU.*"):
        vm.generate("all", 4096, 0, Bytes(), data=data(tmp_path))
    with pytest.raises(ValueError, match=r"context_length 100 is too small .*question_id='001-1'"):
        vm.generate("all", 100, 1, Bytes(), data=data(video_dir))


# --- Qwen3-VL video inputs -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vl_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RBS_BENCH_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


def tiny_vl_cfg(**kw):
    from omegaconf import OmegaConf

    base = {
        "name": "tiny_vl",
        "hf_id": None,
        "revision": None,
        "max_context": 32768,
        "dtype": "float32",
        "chat_template": True,
        "chat_template_kwargs": {},
        "trust_remote_code": False,
        "config_overrides": {},
    }
    return OmegaConf.create({**base, **kw})


@pytest.fixture(scope="module")
def loaded(tiny_vl_cache):
    cfg = tiny_vl_cfg()
    model, tok = models.load(cfg)
    return cfg, model, tok, models.load_video_processor(cfg, model, tok)


def test_pixel_patches_follow_the_vision_tower_layout(loaded):
    proc = loaded[3]
    n, c = 3, 3  # 3 frames: padded to 4 by repeating the last
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(n, H, W, c), dtype=np.uint8)
    pixels, grid = proc.pixel_values(frames)
    tp, p, m = proc.temporal_patch_size, proc.patch_size, proc.merge_size
    assert grid == (2, H // p, W // p)
    assert pixels.shape == (2 * (H // p) * (W // p), c * tp * p * p)
    norm = (frames.astype(np.float32) / 255 - 0.5) / 0.5
    norm = np.concatenate([norm, norm[-1:]])  # [4, H, W, C]
    r = 0  # rows: temporal patch, merge-block row, block column, row and column in the block
    for t in range(2):
        for by in range(H // p // m):
            for bx in range(W // p // m):
                for iy in range(m):
                    for ix in range(m):
                        y, x = (by * m + iy) * p, (bx * m + ix) * p
                        patch = norm[t * tp : (t + 1) * tp, y : y + p, x : x + p, :]  # [T,P,P,C]
                        want = patch.transpose(3, 0, 1, 2).reshape(-1)  # (c, t, py, px)
                        np.testing.assert_allclose(pixels[r].numpy(), want, atol=1e-6)
                        r += 1
    assert r == pixels.shape[0]


def test_pixels_match_transformers_processor_where_torchvision_runs(loaded):
    """Where torchvision works, transformers' own Qwen3-VL video processor gives the same
    patches and grid (the resize is the same bicubic kernel, so within one uint8 step)."""
    try:
        import torchvision.transforms.v2.functional  # noqa: F401
    except Exception as e:  # absent, or a build that does not match this torch
        pytest.skip(f"torchvision unusable here ({type(e).__name__})")
    from transformers import AutoVideoProcessor
    from transformers.video_utils import VideoMetadata

    proc = loaded[3]
    official = AutoVideoProcessor.from_pretrained(tiny_vl.materialize())
    rng = np.random.default_rng(1)
    for shape in ((4, H, W, 3), (5, 70, 150, 3)):  # on the 32-pixel grid, and resized
        frames = rng.integers(0, 256, size=shape, dtype=np.uint8)
        ours, grid = proc.pixel_values(frames)
        meta = VideoMetadata(shape[0], fps=FPS, frames_indices=list(range(shape[0])))
        theirs = official(
            videos=[frames],
            video_metadata=[meta],
            do_sample_frames=False,
            cap_pixels_per_frame=True,
            return_tensors="pt",
        )
        assert theirs["video_grid_thw"][0].tolist() == list(grid)
        torch.testing.assert_close(ours, theirs["pixel_values_videos"], atol=2 / 255 / 0.5, rtol=0)


def test_frame_budget_caps_large_videos(loaded):
    proc = loaded[3]
    h, w = proc.frame_size(32, 720, 1280)
    factor = proc.patch_size * proc.merge_size
    assert h % factor == 0 and w % factor == 0
    assert (h // factor) * (w // factor) <= proc.max_video_tokens  # per temporal patch
    assert abs(w / h - 1280 / 720) < 0.35  # keeps the aspect ratio near
    assert proc.num_video_tokens(32, 720, 1280) == 16 * (h // factor) * (w // factor)
    assert proc.frame_size(4, H, W) == (H, W)  # already on the grid and within budget


def test_video_prompt_expands_to_timestamped_tokens(loaded, video_dir):
    cfg, _, tok, proc = loaded
    wrap = lambda t, video=False: models.wrap_prompt(tok, cfg, t, video=video, processor=proc)
    (s,) = vm.generate("all", 4096, 1, models.encoder(tok), wrap=wrap, data=data(video_dir))
    assert s.prompt.startswith("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>")
    assert s.prompt.endswith("The best answer is:<|im_end|>\n<|im_start|>assistant\n")
    inputs = proc.inputs(tok, s.prompt, s.video)
    grid = inputs["video_grid_thw"][0].tolist()
    assert grid == [2, H // 16, W // 16]
    per_patch = (H // 32) * (W // 32)
    ids = inputs["input_ids"][0]
    assert int((ids == tiny_vl.TOKEN_IDS["video_token_id"]).sum()) == 2 * per_patch
    assert torch.equal(inputs["mm_token_type_ids"][0], (ids == 262).int() * 2)
    # frames 0, 7, 15, 23 at 8 fps: patches (0, 7) and (15, 23) -> 0.4375 s and 2.375 s
    assert s.video.indices == (0, 7, 15, 23)
    text = tok.decode(ids)
    assert text.startswith(
        "<|im_start|>user\n<0.4 seconds><|vision_start|>"
        + "<|video_pad|>" * per_patch
        + "<|vision_end|><2.4 seconds><|vision_start|>"
    )
    assert inputs["pixel_values_videos"].shape == (2 * (H // 16) * (W // 16), 3 * 2 * 16 * 16)
    with pytest.raises(ValueError, match="needs exactly one"):
        proc.expand("no video here", (2, 4, 6), [0.0, 1.0])


def test_text_model_refuses_video_prompts(loaded):
    cfg, _, tok, _ = loaded
    with pytest.raises(ValueError, match=r"'tiny' is not a vision-language model"):
        models.wrap_prompt(tok, tiny_vl_cfg(name="tiny"), "x", video=True, processor=None)


def test_sparse_prefill_covers_the_video_tokens(loaded, video_dir):
    """The selector runs in every language-model layer over text and video tokens together."""
    cfg, model, tok, proc = loaded
    wrap = lambda t, video=False: models.wrap_prompt(tok, cfg, t, video=video, processor=proc)
    (s,) = vm.generate("all", 4096, 1, models.encoder(tok), wrap=wrap, data=data(video_dir))
    inputs = proc.inputs(tok, s.prompt, s.video)
    n = inputs["input_ids"].shape[1]
    layers = model.config.text_config.num_hidden_layers
    attn = hf_attention.attention_modules(model)
    assert len(attn) == layers  # the vision tower's attention is not hooked
    assert all(type(m).__name__ == "Qwen3VLTextAttention" for m in attn)

    with torch.no_grad():
        reference = model(**inputs).logits
    sel = methods.build("rbs", block_size=16, alpha_base=0.9, alpha_rescue=0.9)
    seen = []

    class Watched(type(sel)):  # the real selector; records the sequence lengths it is given
        def select(self, q, k, scale=None):
            seen.append((q.shape[2], k.shape[2]))
            return super().select(q, k, scale=scale)

    watched = Watched(**sel.fields())
    recorder = hf_attention.install(model, methods.build("dense"))
    try:
        with torch.no_grad():
            dense = model(**inputs).logits
        assert torch.allclose(dense, reference, atol=1e-5)  # dense through the hook = SDPA
        recorder = hf_attention.install(model, watched)
        vision.reset_position_state(model)
        with torch.no_grad():
            sparse = model(**inputs).logits
    finally:
        hf_attention.uninstall(model)
    assert seen == [(n, n)] * layers
    summary = recorder.summary()
    assert summary["num_layers"] == layers and summary["density_mean"] < 1.0
    assert not torch.allclose(sparse, reference, atol=1e-5)  # pruning changed the output


def test_decode_steps_continue_the_prompts_positions(loaded, video_dir):
    """The runner prefills with the video inputs and then feeds one token at a time: each step's
    logits equal a single forward over the whole sequence, also for a text prompt that follows
    a video one (whose multimodal RoPE offset must not carry over)."""
    cfg, model, tok, proc = loaded
    wrap = lambda t, video=False: models.wrap_prompt(tok, cfg, t, video=video, processor=proc)
    (s,) = vm.generate("all", 4096, 1, models.encoder(tok), wrap=wrap, data=data(video_dir))
    video = proc.inputs(tok, s.prompt, s.video)
    text = {"input_ids": tok("No video here.", return_tensors="pt").input_ids}
    forced = torch.tensor([[65, 66, 67]])

    def stepwise(inputs) -> torch.Tensor:
        vision.reset_position_state(model)
        out = model(**inputs, use_cache=True)
        logits, past = [out.logits[:, -1]], out.past_key_values
        for t in forced[0, :-1]:
            out = model(input_ids=t.view(1, 1), past_key_values=past, use_cache=True)
            logits.append(out.logits[:, -1])
            past = out.past_key_values
        return torch.stack(logits, 1)

    def whole(inputs) -> torch.Tensor:
        vision.reset_position_state(model)
        ext = {**inputs, "input_ids": torch.cat([inputs["input_ids"], forced], 1)}
        if "mm_token_type_ids" in inputs:
            text_types = torch.zeros_like(forced, dtype=torch.int32)
            ext["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], text_types], 1)
        n = inputs["input_ids"].shape[1]
        return model(**ext).logits[:, n - 1 : n - 1 + forced.shape[1]]

    with torch.no_grad():
        for inputs in (video, text):  # the text prompt runs after the video one
            torch.testing.assert_close(stepwise(inputs), whole(inputs), atol=1e-5, rtol=1e-5)


def test_moe_variant_hooks_text_layers_only():
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    text = {**tiny_vl.TEXT_CONFIG, "num_experts": 4, "num_experts_per_tok": 2}
    text |= {"moe_intermediate_size": 64, "decoder_sparse_step": 1}
    cfg = Qwen3VLMoeConfig(
        text_config=text, vision_config=dict(tiny_vl.VISION_CONFIG), **tiny_vl.TOKEN_IDS
    )
    model = Qwen3VLMoeForConditionalGeneration(cfg)
    attn = hf_attention.attention_modules(model)
    assert [m.layer_idx for m in attn] == list(range(text["num_hidden_layers"]))
    vision.check_supported(cfg)


# --- runs ----------------------------------------------------------------------------------------


def run_cfg(tmp_path, video_dir, *extra):
    from hydra import compose, initialize_config_module

    config.register_schemas()
    overrides = [
        "benchmark=videomme",
        "model=tiny_vl",
        f"benchmark.data.dataset={FIXTURE}",
        f"benchmark.data.video_dir={video_dir}",
        "benchmark.data.num_frames=2",
        "benchmark.max_new_tokens=1",  # prefill, the part the methods change
        "device=cpu",
        "progress=false",
        f"results_dir={tmp_path}",
        *extra,
    ]
    with initialize_config_module(config_module=config.CONFIG_MODULE, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@pytest.fixture(scope="module")
def session(tiny_vl_cache):
    from rbs_bench.session import Session

    return Session()


def test_dense_and_rbs_runs_write_duration_tables(tmp_path, video_dir, session):
    """Dense over every question (the per-duration tables), RBS over the first two (the sparse
    path through the runner); the CLI test below runs both over all of them."""
    from rbs_bench import report
    from rbs_bench.records import read_records
    from rbs_bench.runner import run_cell

    cfg = run_cfg(tmp_path, video_dir, "method=dense")
    samples = session.samples(cfg, session.load(cfg), "all", 32768)
    run_cell(cfg, "vmme", session)
    rbs = ("method=rbs", "method.block_size=16", "method.alpha_base=0.9", "method.alpha_rescue=0.9")
    run_cell(run_cfg(tmp_path, video_dir, *rbs, "benchmark.num_samples=2"), "vmme", session)
    exp = tmp_path / "runs" / "vmme" / "tiny_vl"
    dense = read_records(exp / "dense" / "default" / "records.jsonl")
    sparse = read_records(exp / "rbs" / "default" / "records.jsonl")
    assert [r["index"] for r in dense] == list(range(len(ROWS)))
    assert [r["index"] for r in sparse] == [0, 1]
    per_patch = (H // 32) * (W // 32)  # 2 frames: one temporal patch
    for d, s in zip(dense, samples):
        # the one pad of the prompt became "<t seconds>", start, pads, end (start/end were there)
        seconds = (s.video.indices[0] + s.video.indices[1]) / 2 / s.video.fps
        assert d["input_tokens"] == s.num_tokens - 1 + len(f"<{seconds:.1f} seconds>") + per_patch
        assert d["benchmark_version"] == vm.VERSION and d["new_tokens"] == 1
        assert d["density"] == 1.0
        assert d["score"] == vm.score_one("all", d["prediction"], d["references"])
        # the video tokens' share of the context, recorded beside the prompt's length
        assert d["visual_tokens"] == per_patch
        assert d["visual_token_share"] == round(per_patch / d["input_tokens"], 6)
    for d, r in zip(dense, sparse):
        assert (d["input_tokens"], d["prompt_sha1"]) == (r["input_tokens"], r["prompt_sha1"])
        assert 0 < r["density"] < 1.0  # pruned over text and video tokens
    report.write_summary(exp)
    by_duration = pd.read_csv(exp / "summary_by_duration.csv")
    got = {(m, d): n for m, d, n in by_duration[["method", "duration", "n"]].itertuples(False)}
    assert got == {
        ("dense", "short"): 2,
        ("dense", "medium"): 2,
        ("dense", "long"): 2,
        ("rbs", "short"): 2,
    }
    assert "## By duration" in (exp / "summary.md").read_text()
    table = vm.aggregate(pd.DataFrame(dense + sparse))
    assert list(table["method"]) == ["dense", "rbs"] and list(table["n"]) == [len(ROWS), 2]
    # a rerun finds every sample recorded
    run_cell(run_cfg(tmp_path, video_dir, "method=dense"), "vmme", session)
    assert len(read_records(exp / "dense" / "default" / "records.jsonl")) == len(ROWS)


def test_run_errors_are_one_line(tmp_path, video_dir, session):
    from rbs_bench.runner import run_cell
    from rbs_bench.session import Session

    with pytest.raises(UserError, match=r"^benchmark.data.video_dir is not set"):
        run_cell(run_cfg(tmp_path, video_dir, "benchmark.data.video_dir=null"), "e", session)
    with pytest.raises(UserError, match=r"is not a vision-language model"):
        run_cell(run_cfg(tmp_path, video_dir, "model=tiny"), "e", Session())
    # text fits, text + video tokens + new tokens do not: stops before running the sample
    cfg = run_cfg(tmp_path, video_dir, "benchmark.num_samples=1")
    (s,) = session.samples(cfg, session.load(cfg), "all", 32768)
    tight = s.num_tokens + 1 + 1  # room for the text, the new token and one video token
    cfg = run_cfg(
        tmp_path, video_dir, "benchmark.num_samples=1", f"benchmark.context_lengths=[{tight}]"
    )
    with pytest.raises(UserError, match=r"with its video, \+1 new > context length"):
        run_cell(cfg, "e", session)


@pytest.mark.slow
def test_cli_runs_videomme_on_tiny_vl(tmp_path, video_dir):
    cmd = [
        sys.executable,
        "-m",
        "rbs_bench",
        "benchmark=videomme",
        "model=tiny_vl",
        f"benchmark.data.dataset={FIXTURE}",
        "benchmark.data.num_frames=2",
        "benchmark.max_new_tokens=1",
        "progress=false",
        f"results_dir={tmp_path}",
    ]
    env = dict(os.environ, RBS_BENCH_CACHE=str(tmp_path / "cache"))
    exp = tmp_path / "runs" / "adhoc" / "tiny_vl"
    for method in (["method=dense"], ["method=rbs", "method.block_size=16"]):
        res = subprocess.run(
            [*cmd, f"benchmark.data.video_dir={video_dir}", *method],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
            cwd=tmp_path,
        )
        assert res.returncode == 0, res.stderr[-3000:]
    assert "| Dense | default |" in res.stdout and "| RBS-Attention | default |" in res.stdout
    by_duration = pd.read_csv(exp / "summary_by_duration.csv")
    assert len(by_duration) == 6 and (by_duration["n"] == 2).all()  # 2 methods x 3 durations
    res = subprocess.run(
        [*cmd, "benchmark.data.video_dir=null"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "rbs-bench: error: benchmark.data.video_dir is not set; give the local directory of the "
        "Video-MME videos (<videoID>.mp4, as the hub's videos_chunked_*.zip unpack)"
    ]
