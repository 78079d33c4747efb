"""Video inputs of Qwen3-VL models: sampled frames -> pixel patches, their grid, and the prompt's
video tokens, in the layout Qwen3-VL's vision tower and multimodal RoPE read.

This follows what transformers' `Qwen3VLProcessor` and `Qwen3VLVideoProcessor` (5.x) produce for
frames that are already sampled, without their torchvision dependency, so the same code runs on a
CPU machine and on the cluster:

- size: `smart_resize` (transformers' own function) to multiples of patch x merge (32 px), within
  `size.shortest_edge`..`size.longest_edge` pixels for the whole clip; with `cap_pixels_per_frame`
  each frame gets at most `max_video_tokens` merged-patch areas or its even share of the budget,
  as the reference implementation (qwen-vl-utils) does. A checkpoint that leaves the cap unset
  gets it (transformers' announced default; its 5.2x releases still default to no cap).
- pixels: bicubic with antialiasing on the uint8 values, rounded back to 0..255 (torchvision's
  tensor resize calls the same kernel), then `x / 255`, normalised with the checkpoint's mean/std;
- patches: frames padded to a multiple of `temporal_patch_size` by repeating the last one, then
  flattened to `[t * h * w, C * temporal_patch_size * patch_size**2]`, rows in (t, merge-block row,
  merge-block column, row in block, column in block) order;
- text: the chat template's `<|vision_start|><|video_pad|><|vision_end|>` becomes, per temporal
  patch, `<{seconds:.1f} seconds><|vision_start|>` + one `<|video_pad|>` per merged patch +
  `<|vision_end|>`, the seconds being the mean timestamp of the patch's first and last frame
  (frame index / fps); `mm_token_type_ids` marks the video pads with 2.

Every language-model layer then prefills text and video tokens as one causal sequence, so the
`rbs_sparse` attention hook selects blocks over the video tokens too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
CONFIG_FILES = ("video_preprocessor_config.json", "preprocessor_config.json")
_FIELDS = (
    "size",
    "patch_size",
    "temporal_patch_size",
    "merge_size",
    "image_mean",
    "image_std",
    "rescale_factor",
    "cap_pixels_per_frame",
    "max_video_tokens",
)


def is_vision_language(config) -> bool:
    """True for a config with a vision tower (a `vision_config`)."""
    return getattr(config, "vision_config", None) is not None


def check_supported(config) -> None:
    """ValueError unless the config is a Qwen3-VL (dense or MoE) model."""
    if config.model_type not in MODEL_TYPES:
        raise ValueError(
            f"vision-language model type {config.model_type!r} is not supported; video inputs "
            f"are built for {', '.join(MODEL_TYPES)}"
        )


def official_defaults() -> dict:
    """The video processor fields as transformers' `Qwen3VLVideoProcessor` class sets them."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    out = {k: getattr(Qwen3VLVideoProcessor, k, None) for k in _FIELDS}
    out["rescale_factor"] = out["rescale_factor"] or 1 / 255
    return out


@dataclass(frozen=True)
class VideoProcessor:
    """Qwen3-VL video preprocessing for one checkpoint (see the module docstring)."""

    min_pixels: int  # size.shortest_edge: fewest pixels of the whole resized clip
    max_pixels: int  # size.longest_edge: most pixels of the whole resized clip
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    cap_pixels_per_frame: bool
    max_video_tokens: int
    video_token: str  # <|video_pad|>
    vision_start: str  # <|vision_start|>
    vision_end: str  # <|vision_end|>
    video_token_id: int
    chat_template: str | None = None  # the processor's template, if the tokenizer has none

    @property
    def placeholder(self) -> str:
        """What a chat template writes for one video: start, one pad, end."""
        return self.vision_start + self.video_token + self.vision_end

    @classmethod
    def from_config(cls, fields: dict, model_config, tokenizer, chat_template: str | None = None):
        """From video processor fields (a checkpoint's json; missing keys take transformers'
        defaults) and the model config's token ids, spelled by `tokenizer`."""
        check_supported(model_config)
        ids = [model_config.video_token_id, model_config.vision_start_token_id]
        ids.append(model_config.vision_end_token_id)
        pad, start, end = tokenizer.convert_ids_to_tokens(ids)
        tokens = (pad, start, end, int(model_config.video_token_id))
        return cls._build(fields, tokens, chat_template)

    @classmethod
    def for_counting(cls, fields: dict):
        """Frame sizes and video-token counts of a processor config, with no model or tokenizer
        (e.g. for a memory estimate); its token fields are empty, so it builds no inputs."""
        return cls._build(fields, ("", "", "", -1), None)

    @classmethod
    def _build(cls, fields: dict, tokens: tuple, chat_template: str | None):
        f = official_defaults() | {k: v for k, v in fields.items() if v is not None}
        size = f["size"]
        if not isinstance(size, dict) or not {"shortest_edge", "longest_edge"} <= set(size):
            raise ValueError(
                f"video processor size must hold shortest_edge and longest_edge, got {size!r}"
            )
        cap = f.get("cap_pixels_per_frame")
        pad, start, end, video_token_id = tokens
        return cls(
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
            patch_size=int(f["patch_size"]),
            temporal_patch_size=int(f["temporal_patch_size"]),
            merge_size=int(f["merge_size"]),
            image_mean=tuple(float(x) for x in f["image_mean"]),
            image_std=tuple(float(x) for x in f["image_std"]),
            rescale_factor=float(f["rescale_factor"]),
            cap_pixels_per_frame=True if cap is None else bool(cap),
            max_video_tokens=int(f["max_video_tokens"]),
            video_token=pad,
            vision_start=start,
            vision_end=end,
            video_token_id=video_token_id,
            chat_template=chat_template,
        )

    @classmethod
    def from_pretrained(cls, source: str, model_config, tokenizer, revision: str | None = None):
        """Read the video processor json and the processor's chat template of a local directory or
        hub checkpoint (the first of video_preprocessor_config.json, preprocessor_config.json)."""
        fields = {}
        for name in CONFIG_FILES:
            path = _checkpoint_file(source, name, revision)
            if path is not None:
                fields = json.loads(Path(path).read_text(encoding="utf-8"))
                break
        template = None
        jinja = _checkpoint_file(source, "chat_template.jinja", revision)
        if jinja is not None:
            template = Path(jinja).read_text(encoding="utf-8")
        else:
            js = _checkpoint_file(source, "chat_template.json", revision)
            if js is not None:
                template = json.loads(Path(js).read_text(encoding="utf-8")).get("chat_template")
        return cls.from_config(fields, model_config, tokenizer, template)

    # -----------------------------------------------------------------------------------------
    # Sizes

    def frame_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) every frame of a `num_frames` clip is resized to."""
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        factor = self.patch_size * self.merge_size
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:
            per_frame = min(self.max_video_tokens * factor * factor, self.max_pixels // num_frames)
            max_pixels = max(per_frame, int(self.min_pixels * 1.05)) * num_frames
        return smart_resize(
            num_frames=num_frames,
            height=height,
            width=width,
            temporal_factor=self.temporal_patch_size,
            factor=factor,
            min_pixels=self.min_pixels,
            max_pixels=max_pixels,
        )

    def grid(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patch grid of a clip: temporal patches, patch rows, patch columns."""
        h, w = self.frame_size(num_frames, height, width)
        t = -(-num_frames // self.temporal_patch_size)
        return t, h // self.patch_size, w // self.patch_size

    def num_video_tokens(self, num_frames: int, height: int, width: int) -> int:
        """Video pad tokens a clip takes in the prompt (one per merged patch)."""
        t, h, w = self.grid(num_frames, height, width)
        return t * h * w // self.merge_size**2

    # -----------------------------------------------------------------------------------------
    # Pixels

    def pixel_values(self, frames: np.ndarray) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(patches [t*h*w, C*T*P*P] float32, grid (t, h, w)) of uint8 frames [N, H, W, C]."""
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise ValueError(
                f"frames must be uint8 [N, H, W, 3], got {frames.dtype} {tuple(frames.shape)}"
            )
        n, height, width = frames.shape[:3]
        if n < self.temporal_patch_size:
            raise ValueError(f"a clip needs at least {self.temporal_patch_size} frames, got {n}")
        h, w = self.frame_size(n, height, width)
        x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()  # [N,C,H,W]
        if (h, w) != (height, width):
            x = F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
            x = x.clamp(0, 255).round()  # back to the uint8 values the processor resizes to
        mean = torch.tensor(self.image_mean).view(1, -1, 1, 1)
        std = torch.tensor(self.image_std).view(1, -1, 1, 1)
        x = (x * self.rescale_factor - mean) / std
        return self._patchify(x)

    def _patchify(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        if pad := -x.shape[0] % tp:  # repeat the last frame to fill the temporal patch
            x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
        n, c, h, w = x.shape
        t, gh, gw = n // tp, h // p, w // p
        x = x.view(t, tp, c, gh // m, m, p, gw // m, m, p)
        # rows: (t, block row, block col, row in block, col in block); features: (c, tp, py, px)
        x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return x.reshape(t * gh * gw, c * tp * p * p), (t, gh, gw)

    # -----------------------------------------------------------------------------------------
    # Prompt

    def timestamps(self, indices, fps: float) -> list[float]:
        """Seconds of each temporal patch: the mean of its first and last frame's time."""
        idx = [int(i) for i in indices]
        tp = self.temporal_patch_size
        idx += [idx[-1]] * (-len(idx) % tp)
        return [(idx[i] + idx[i + tp - 1]) / 2 / fps for i in range(0, len(idx), tp)]

    def expand(self, prompt: str, grid: tuple[int, int, int], seconds: list[float]) -> str:
        """The prompt with its one video placeholder replaced by the per-patch video tokens."""
        t, h, w = grid
        per_patch = self.video_token * (h * w // self.merge_size**2)
        video = "".join(
            f"<{s:.1f} seconds>{self.vision_start}{per_patch}{self.vision_end}" for s in seconds
        )
        if len(seconds) != t:
            raise ValueError(f"{len(seconds)} timestamps for {t} temporal patches")
        for marker in (self.placeholder, self.video_token):
            if prompt.count(marker) == 1:
                return prompt.replace(marker, video)
        raise ValueError(
            f"a video prompt needs exactly one {self.placeholder!r} (or {self.video_token!r}), "
            f"found {prompt.count(self.video_token)}"
        )

    def inputs(self, tokenizer, prompt: str, video) -> dict[str, torch.Tensor]:
        """Model inputs of a prompt with one video: input_ids and mm_token_type_ids [1, L],
        pixel_values_videos [patches, dim], video_grid_thw [1, 3].

        `video` has `frames()` (uint8 [N, H, W, 3]), `indices` (the frames' positions in the
        file) and `fps`.
        """
        frames = video.frames()
        if len(frames) != len(video.indices):
            raise ValueError(f"{len(frames)} frames decoded for {len(video.indices)} indices")
        pixels, grid = self.pixel_values(frames)
        text = self.expand(prompt, grid, self.timestamps(video.indices, video.fps))
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        types = (ids == self.video_token_id).int() * 2
        want = grid[0] * grid[1] * grid[2] // self.merge_size**2
        if int((types == 2).sum()) != want:
            raise ValueError(
                f"the tokenizer made {int((types == 2).sum())} video tokens of {want} pads; it "
                f"must keep {self.video_token!r} as one special token"
            )
        return {
            "input_ids": ids,
            "mm_token_type_ids": types,
            "pixel_values_videos": pixels,
            "video_grid_thw": torch.tensor([grid], dtype=torch.long),
        }


def _checkpoint_file(source: str, name: str, revision: str | None) -> str | None:
    """Path of `name` in a local model directory or a hub checkpoint; None if it has none."""
    local = Path(source).expanduser()
    if local.is_dir():
        path = local / name
        return str(path) if path.is_file() else None
    from transformers.utils import cached_file

    return cached_file(
        source,
        name,
        revision=revision,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
    )


def reset_position_state(model: torch.nn.Module) -> None:
    """Forget the multimodal RoPE offset of the previous prompt.

    Qwen3-VL keeps `rope_deltas` from a prefill and uses it for the decode steps after it; a text
    prompt after a video one would otherwise decode with the video's offset.
    """
    for m in model.modules():
        if getattr(m, "rope_deltas", None) is not None:
            m.rope_deltas = None


def video_prompt_messages(user_text: str) -> list[dict[str, Any]]:
    """One user turn: the video first, then the text (how Video-MME runs Qwen-VL models)."""
    return [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": user_text}]}]
