"""An embedded image-caption task for vision-language training: coloured shapes, drawn with numpy.

Each image holds one shape (circle, square or triangle) in one of four colours, small or
large, on the left, in the middle or on the right of a noisy dark background; its caption
says so: ``"a small red circle on the left"``. 72 captions, endless images. A model that
does not read the image can only learn the template and guess: ``ln 72 = 4.28`` nats per
caption, 0.125 nats per labelled token; a validation loss below that means it reads them.

Tokens are byte-level (ids 0..255 are UTF-8 bytes, ``BYTE_EOS`` 256 ends captions) plus the
image placeholder; labels are -100 on EOS/IMG/padding and the caption bytes and closing EOS:

    [EOS] [IMG] x num_image_tokens  a   _ s m a l l ... l e f t [EOS] [EOS] (padding) ...

Padding follows each sequence's last EOS, where no labelled token attends to it (causal
attention): batches need no attention mask. ``pixel_values`` are fp32 ``(images, 3, S, S)``,
``(rgb / 255 - mean) / std`` with SigLIP's ``mean = std = 0.5`` (``CLIP_MEAN`` / ``CLIP_STD``
for a CLIP tower). Everything is a function of ``(seed, split, index)``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from ..vila import num_image_tokens  # noqa: F401 (re-exported for the trainer's modules)
from .data import BYTE_EOS, BYTE_VOCAB

IMAGE_TOKEN_ID = BYTE_VOCAB  # 257: the id after the byte-level tokenizer's ids
# Micro-batches per optimizer step that draw disjoint samples (more would repeat the next
# step's): --grad-accum times the ranks
MICRO_BATCHES = 2**16
VL_VOCAB = BYTE_VOCAB + 1  # ids the task uses: 256 bytes, EOS, IMG
IGNORE_INDEX = -100

SHAPES = ("circle", "square", "triangle")
COLOURS = {
    "red": (220, 50, 40),
    "green": (40, 190, 70),
    "blue": (50, 90, 230),
    "yellow": (235, 215, 40),
}
SIZES = {"small": 0.11, "large": 0.18}  # radius / image size
POSITIONS = {"on the left": 0.22, "in the middle": 0.5, "on the right": 0.78}  # x / image size
SIGLIP_MEAN = SIGLIP_STD = (0.5, 0.5, 0.5)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_SPLITS = {"train": 0, "val": 1}


def caption(size: str, colour: str, shape: str, position: str) -> str:
    return f"a {size} {colour} {shape} {position}"


CAPTIONS = [caption(*c) for c in itertools.product(SIZES, COLOURS, SHAPES, POSITIONS)]
MAX_CAPTION_BYTES = max(len(c.encode()) for c in CAPTIONS)


def min_seq_len(image_tokens: int, images: int = 1) -> int:
    """The shortest sequence that holds ``images`` images and their captions."""
    return 1 + images * (image_tokens + MAX_CAPTION_BYTES + 1)


def render(
    size: str, colour: str, shape: str, position: str, image_size: int, rng: np.random.Generator
) -> np.ndarray:
    """uint8 RGB ``(image_size, image_size, 3)``; ``rng`` draws the jitter and the noise."""
    s = image_size
    r = SIZES[size] * s * rng.uniform(0.92, 1.08)
    cx = POSITIONS[position] * s + rng.uniform(-0.03, 0.03) * s
    cy = s / 2 + rng.uniform(-0.15, 0.15) * s
    y, x = np.mgrid[0:s, 0:s] + 0.5  # pixel centres
    if shape == "circle":
        inside = (x - cx) ** 2 + (y - cy) ** 2 <= r * r
    elif shape == "square":
        inside = (np.abs(x - cx) <= 0.85 * r) & (np.abs(y - cy) <= 0.85 * r)
    else:  # triangle, apex up: half-width grows linearly from 0 at the apex to r at the base
        top, base = cy - r, cy + 0.8 * r
        inside = (y >= top) & (y <= base) & (np.abs(x - cx) <= (y - top) / (base - top) * r)
    background = rng.uniform(15, 60)
    img = np.full((s, s, 3), background) + rng.normal(0, 6, (s, s, 3))
    img[inside] = np.asarray(COLOURS[colour]) + rng.normal(0, 6, (int(inside.sum()), 3))
    return np.clip(img, 0, 255).round().astype(np.uint8)


@dataclass(frozen=True)
class Sample:
    image: np.ndarray  # uint8 (H, W, 3)
    caption: str


def sample(seed: int, split: str, index: int, image_size: int) -> Sample:
    """Sample ``index`` of ``split`` ("train" or "val"): a pure function of its arguments."""
    rng = np.random.default_rng([seed, _SPLITS[split], index])
    attrs = (
        list(SIZES)[rng.integers(len(SIZES))],
        list(COLOURS)[rng.integers(len(COLOURS))],
        SHAPES[rng.integers(len(SHAPES))],
        list(POSITIONS)[rng.integers(len(POSITIONS))],
    )
    return Sample(render(*attrs, image_size, rng), caption(*attrs))


class ShapesCaptions:
    """Batches of the shapes task for a ``LlavaForConditionalGeneration``: square images of
    side ``image_size`` (the tower's), ``image_tokens`` placeholders ``image_token_id`` per
    image (any id >= ``IMAGE_TOKEN_ID``), ``images_per_sample`` image-caption pairs per
    sequence padded to ``seq_len`` (default: the shortest that fits), ``val_size`` images in
    the fixed validation set.

    >>> data = ShapesCaptions(32, 16, IMAGE_TOKEN_ID)
    >>> b = data.batch(step=0, batch_size=8)
    >>> b["input_ids"].shape, b["pixel_values"].shape  # (8, 55), (8, 3, 32, 32)
    """

    def __init__(
        self,
        image_size: int,
        image_tokens: int,
        image_token_id: int = IMAGE_TOKEN_ID,
        *,
        images_per_sample: int = 1,
        seq_len: int | None = None,
        seed: int = 0,
        val_size: int = 256,
        mean=SIGLIP_MEAN,
        std=SIGLIP_STD,
    ):
        if image_token_id < IMAGE_TOKEN_ID:
            raise ValueError(
                f"image_token_id {image_token_id} collides with a byte or the EOS id: use "
                f"an id >= {IMAGE_TOKEN_ID}"
            )
        if images_per_sample < 1:
            raise ValueError(f"images_per_sample must be >= 1, got {images_per_sample}")
        need = min_seq_len(image_tokens, images_per_sample)
        if seq_len is not None and seq_len < need:
            raise ValueError(
                f"seq_len {seq_len} is too short: {images_per_sample} image(s) of {image_tokens} "
                f"tokens and their captions need {need}; pass seq_len >= {need} or None"
            )
        self.image_size, self.image_tokens = image_size, image_tokens
        self.image_token_id = image_token_id
        self.images_per_sample, self.seq_len = images_per_sample, seq_len or need
        self.seed, self.val_size = seed, val_size
        self.mean = np.asarray(mean, dtype=np.float32)
        self.std = np.asarray(std, dtype=np.float32)

    def _sequence(self, samples: list[Sample]) -> tuple[np.ndarray, np.ndarray]:
        ids, labels = [BYTE_EOS], [IGNORE_INDEX]
        for s in samples:
            text = list(s.caption.encode()) + [BYTE_EOS]
            ids += [self.image_token_id] * self.image_tokens + text
            labels += [IGNORE_INDEX] * self.image_tokens + text
        pad = self.seq_len - len(ids)
        ids, labels = ids + [BYTE_EOS] * pad, labels + [IGNORE_INDEX] * pad
        return np.asarray(ids, dtype=np.int64), np.asarray(labels, dtype=np.int64)

    def collate(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        """``input_ids``/``labels`` int64 ``(B, seq_len)`` and ``pixel_values`` fp32
        ``(B * images_per_sample, 3, S, S)``, from ``B * images_per_sample`` samples in order."""
        k = self.images_per_sample
        if len(samples) % k:
            raise ValueError(f"{len(samples)} samples do not fill sequences of {k} images")
        rows = [self._sequence(samples[i : i + k]) for i in range(0, len(samples), k)]
        pixels = np.stack([s.image for s in samples]).astype(np.float32) / 255
        pixels = ((pixels - self.mean) / self.std).transpose(0, 3, 1, 2)
        return {
            "input_ids": torch.from_numpy(np.stack([r[0] for r in rows])),
            "labels": torch.from_numpy(np.stack([r[1] for r in rows])),
            "pixel_values": torch.from_numpy(np.ascontiguousarray(pixels)),
        }

    def batch(self, step: int, batch_size: int, micro: int = 0) -> dict[str, torch.Tensor]:
        """Training batch of optimizer step ``step``, micro-batch ``micro``: a function of
        ``(seed, step, micro)`` only, so every mode of a comparison sees the same data."""
        if not 0 <= micro < MICRO_BATCHES:
            raise ValueError(f"micro must be in [0, {MICRO_BATCHES}), got {micro}")
        n = batch_size * self.images_per_sample
        first = (step * MICRO_BATCHES + micro) * n  # disjoint index ranges per (step, micro)
        size = self.image_size
        return self.collate([sample(self.seed, "train", first + i, size) for i in range(n)])

    def val_batches(self, batch_size: int) -> list[dict[str, torch.Tensor]]:
        """The fixed validation set (``val_size`` images) in batches of ``batch_size`` sequences."""
        samples = [sample(self.seed, "val", i, self.image_size) for i in range(self.val_size)]
        n = batch_size * self.images_per_sample
        usable = len(samples) - len(samples) % self.images_per_sample
        return [self.collate(samples[i : min(i + n, usable)]) for i in range(0, usable, n)]


def decode(ids) -> str:
    """Text of byte ids (EOS as newline, image placeholders and other ids left out)."""
    out = bytearray()
    for i in (int(t) for t in ids):
        if i < 256:
            out.append(i)
        elif i == BYTE_EOS:
            out += b"\n"
    return out.decode("utf-8", errors="replace")
