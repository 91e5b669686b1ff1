"""What differs between the model kinds coat-train trains, as a *task*: the batches, the fixed
validation set and its metrics, and how a precision mode converts the model. ``Trainer`` runs
one loop for every task: ``LMTask`` (a causal LM on token data; ``val_loss``) and ``VLTask``
(a LLaVA-style preset on the shapes-caption task; loss on the caption tokens, ``val_loss``
and ``val_caption_acc``). A training batch is a function of ``(seed, step, index)`` alone, so
every mode sees the same data, a resume continues exactly, and ranks draw disjoint batches.
"""

from __future__ import annotations

import hashlib
import json

import torch

from ..convert import apply_coat
from ..vila import _llava_parts, apply_coat_vlm
from .data import BatchSampler, TokenData, val_batches
from .presets import VL_PRESETS
from .vl_data import IGNORE_INDEX, ShapesCaptions, num_image_tokens


class LMTask:
    """A causal LM on ``data`` with ``cfg``'s batch size, sequence length, seed and number of
    validation batches."""

    # Every parameter gets a gradient in every step: DDP need not look for unused ones.
    find_unused_parameters = False

    def __init__(self, data: TokenData, cfg):
        self.data = data
        more = data.more("training")
        self.sampler = BatchSampler(data.train, cfg.batch_size, cfg.seq_len, cfg.seed, more)
        more = data.more("validation")
        self.val = val_batches(data.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches, more)

    @property
    def fingerprint(self) -> str:
        return self.data.fingerprint

    def batch(self, step: int, index: int) -> dict[str, torch.Tensor]:
        ids = self.sampler.batch(step, index)
        return {"input_ids": ids, "labels": ids}

    def convert(self, model: torch.nn.Module, fp8_config) -> torch.nn.Module:
        """FP8 activations (``apply_coat`` with ``fp8_config``); ``None``: the model as is."""
        return model if fp8_config is None else apply_coat(model, config=fp8_config)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict:
        """Mean loss over the validation batches (the model in eval mode)."""
        total, n = 0.0, 0
        for ids in self.val:
            ids = ids.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            total += float(loss) * len(ids)
            n += len(ids)
        return {"val_loss": total / n}

    def summary(self) -> dict:
        return {}


class VLTask:
    """VL preset ``preset`` on the shapes-caption task with ``cfg``'s batch size, sequence
    length (``ValueError`` if too short for the preset's images and captions), seed and
    number of validation batches."""

    def __init__(self, preset: str, cfg):
        p = VL_PRESETS[preset]
        self.preset, self.config = preset, p.config()
        self.vision, self.freeze_vision = p.vision_fp8, p.freeze_vision
        self.shapes = ShapesCaptions(
            self.config.vision_config.image_size,
            num_image_tokens(self.config),
            self.config.image_token_id,
            images_per_sample=p.images_per_sample,
            seq_len=cfg.seq_len,
            seed=cfg.seed,
        )
        self.batch_size = cfg.batch_size
        self.val = self.shapes.val_batches(cfg.batch_size)[: cfg.eval_batches]
        self.vision_fp8 = False  # set by convert
        # The features are the tower's last hidden states, taken before its post_layernorm,
        # which thus never gets a gradient: DDP must be told, unless the tower is frozen.
        self.find_unused_parameters = not self.freeze_vision

    @property
    def fingerprint(self) -> str:
        s = self.shapes
        what = [self.preset, s.image_size, s.image_tokens, s.image_token_id,
                s.images_per_sample, s.seq_len, s.seed, s.val_size]  # fmt: skip
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]

    def batch(self, step: int, index: int) -> dict[str, torch.Tensor]:
        return self.shapes.batch(step, self.batch_size, index)

    def convert(self, model: torch.nn.Module, fp8_config) -> torch.nn.Module:
        """FP8 activations (``apply_coat_vlm``: the language model and the projector, the
        tower too with ``vision``) with ``fp8_config``, or none (``None``); the tower frozen
        with ``freeze_vision``."""
        self.vision_fp8 = fp8_config is not None and self.vision
        if fp8_config is not None:
            return apply_coat_vlm(
                model, config=fp8_config, vision=self.vision, freeze_vision=self.freeze_vision
            )
        if self.freeze_vision:
            _llava_parts(model).vision_tower.requires_grad_(False)
        return model

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict:
        """Mean caption-token loss, and caption accuracy: the share of captions whose every
        token (bytes and closing EOS) is the argmax prediction under teacher forcing (size,
        colour, shape and position read off the image; chance is 1/72)."""
        loss_sum = tokens = right = captions = 0
        for batch in self.val:
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = model(**batch, use_cache=False)
            labels = batch["labels"][:, 1:]
            mask = labels != IGNORE_INDEX
            n = int(mask.sum())
            loss_sum += float(out.loss) * n
            tokens += n
            hit = out.logits[:, :-1].argmax(-1) == labels
            # A caption is a run of labelled positions (bytes and EOS); unlabelled ones (image
            # tokens, padding) separate runs, so a cumulative count of them numbers captions.
            run = torch.cumsum((~mask).long(), dim=1)
            run = (run + torch.arange(len(run), device=device)[:, None] * (run.shape[1] + 1))[mask]
            misses = torch.zeros(int(run.max()) + 1, dtype=torch.long, device=device)
            misses.index_add_(0, run, (~hit[mask]).long())
            runs = run.unique()
            right += int((misses[runs] == 0).sum())
            captions += runs.numel()
        return {"val_loss": loss_sum / tokens, "val_caption_acc": right / captions}

    def summary(self) -> dict:
        return {
            "preset": self.preset,
            "vision_fp8": self.vision_fp8,
            "freeze_vision": self.freeze_vision,
            "seq_len": self.shapes.seq_len,
        }
