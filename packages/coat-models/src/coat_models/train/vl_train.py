"""Vision-language training for coat-train: ``train_vlm`` trains a LLaVA preset on the embedded
shapes-caption task (``vl_data``) in one precision mode and returns the summary that
``coat_models.train.Trainer.fit`` returns, with the same ``metrics.jsonl`` records, so the
CLI's compare table, memory breakdown and loss plot work unchanged.

Modes as in ``train.py``: ``bf16`` (autocast + torch AdamW, fp32 master weights), ``coat``
(``apply_coat_vlm`` + ``create_optimizer``), ``coat-act``, ``coat-optim``; everything runs
under bf16 autocast. Checkpoints and ``--resume`` are not supported here yet.

>>> summary = train_vlm("llava-tiny", vl_train_config("llava-tiny", "coat", steps=50))
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..vila import _llava_parts, apply_coat_vlm, llava_tiny_config, vila7b_config
from .trainer import (
    MASTER_DTYPES,
    MODES,
    TRAIN_LOSS_WINDOW,
    MemoryTracker,
    PeakMeter,
    Progress,
    StepLog,
    TrainConfig,
    TrainError,
    decay_groups,
    enable_graphs,
    export_pretrained,
    fmt_bytes,
    log_scalars,
    loss_error,
    lr_scheduler,
    memory_report,
    pinned,
    tensorboard_writer,
)
from .vl_data import IGNORE_INDEX, MAX_CAPTION_BYTES, ShapesCaptions, num_image_tokens


@dataclass(frozen=True)
class VLPreset:
    """A LLaVA shape, how it is trained, and the training defaults that suit it (the field
    names of ``presets.Preset`` that the CLI reads, so its option handling applies as is)."""

    config: object  # () -> LlavaConfig
    images_per_sample: int
    freeze_vision: bool  # VILA stage 3: the tower is frozen, projector + LM train
    vision_fp8: bool  # FP8 activations in the tower too (coat, coat-act)
    batch_size: int
    seq_len: int  # padded length; must fit images_per_sample images and captions
    steps: int
    lr: float
    warmup: int
    eval_every: int
    eval_batches: int


def _min_seq_len(config, images: int) -> int:
    return 1 + images * (num_image_tokens(config) + MAX_CAPTION_BYTES + 1)


VL_PRESETS = {
    # 0.16 M params, 16 image tokens + caption = 55 tokens, trained end to end (tower too).
    # bf16 on CPU: val loss 0.67 nats/token at step 50 (template), 0.049 and caption accuracy
    # 0.32 at step 300 (template-only floor 0.125, chance 1/72): the images are read.
    "llava-tiny": VLPreset(llava_tiny_config, 1, False, True,
                           32, _min_seq_len(llava_tiny_config(), 1), 300, 3e-3, 20, 50, 4),
    # VILA1.5-7B shapes (7.17 B params), stage-3 SFT: tower frozen; 2 images of 729 tokens
    # and their captions in 2048 tokens.
    "vila-7b": VLPreset(vila7b_config, 2, True, False, 1, 2048, 200, 2e-5, 20, 50, 2),
}  # fmt: skip


def vl_train_config(preset: str, mode: str = "bf16", **overrides) -> TrainConfig:
    """``TrainConfig`` with ``preset``'s training defaults, ``overrides`` (field=value) on top."""
    p = _preset(preset)
    names = ("batch_size", "seq_len", "steps", "lr", "warmup", "eval_every", "eval_batches")
    fields = {k: getattr(p, k) for k in names}
    return TrainConfig(mode=mode, **{**fields, **overrides})


def _preset(name: str) -> VLPreset:
    if name not in VL_PRESETS:
        raise ValueError(
            f"unknown vision-language preset {name!r}: choose one of {', '.join(VL_PRESETS)}"
        )
    return VL_PRESETS[name]


def vl_param_count(preset: str) -> int:
    """Parameters of ``preset`` (counted on the meta device: nothing allocated)."""
    from transformers import LlavaForConditionalGeneration

    with torch.device("meta"):
        model = LlavaForConditionalGeneration(_preset(preset).config())
    return sum(p.numel() for p in model.parameters())


def build_vlm(config, *, device, master_dtype: torch.dtype = torch.float32, seed: int = 0):
    """``LlavaForConditionalGeneration(config)``, random init seeded with ``seed`` in fp32 on
    ``device`` (the same weights for every mode), then cast to ``master_dtype``."""
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlavaForConditionalGeneration(config)
    return model.to(master_dtype).train()


def prepare_vlm(
    model,
    mode: str,
    *,
    lr: float,
    weight_decay: float = 0.1,
    betas=(0.9, 0.95),
    vision: bool = False,
    freeze_vision: bool = False,
    fp8_config=None,
):
    """(model, optimizer) for ``mode``: ``apply_coat_vlm`` (with ``fp8_config``, an
    ``fp8_activations.FP8Config``) for FP8 activations, ``create_optimizer`` (CoatAdamW) for
    FP8 optimizer states, else bf16 autocast's plain modules and torch AdamW (fused on CUDA).
    A frozen tower gets no optimizer state."""
    fp8_act, fp8_opt = MODES[mode]
    if fp8_act:
        apply_coat_vlm(model, config=fp8_config, vision=vision, freeze_vision=freeze_vision)
    elif freeze_vision:
        _llava_parts(model).vision_tower.requires_grad_(False)
    if fp8_opt:
        from ..optim import create_optimizer

        return model, create_optimizer(model, lr=lr, weight_decay=weight_decay, betas=betas)
    groups = decay_groups(model, weight_decay)
    fused = next(model.parameters()).is_cuda  # the baseline users run on GPUs
    return model, torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)


def vlm_loss(model, batch: dict, device) -> torch.Tensor:
    """Mean caption-token loss of one batch under bf16 autocast."""
    batch = {k: pinned(v, device).to(device, non_blocking=True) for k, v in batch.items()}
    with torch.autocast(device.type, dtype=torch.bfloat16):
        return model(**batch).loss


@torch.no_grad()
def evaluate_vlm(model, batches: list[dict], device) -> tuple[float, float]:
    """(mean loss, caption accuracy) over ``batches`` on the plain path (``model.eval()``).

    Caption accuracy: the share of captions whose every token (caption bytes and the closing
    EOS) is the argmax prediction under teacher forcing, i.e. size, colour, shape and
    position all read off the image. Chance is 1/72.
    """
    was_training = model.training
    model.eval()
    loss_sum = tokens = right = captions = 0
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(**batch)
        labels = batch["labels"][:, 1:]
        mask = labels != IGNORE_INDEX
        n = int(mask.sum())
        loss_sum += float(out.loss) * n
        tokens += n
        hit = out.logits[:, :-1].argmax(-1) == labels
        # A caption is a run of labelled positions (bytes and EOS); unlabelled ones (image
        # tokens, padding) separate runs, so a cumulative count of them numbers the captions.
        run = torch.cumsum((~mask).long(), dim=1)
        run = (run + torch.arange(len(run), device=device)[:, None] * (run.shape[1] + 1))[mask]
        misses = torch.zeros(int(run.max()) + 1, dtype=torch.long, device=device)
        misses.index_add_(0, run, (~hit[mask]).long())
        runs = run.unique()
        right += int((misses[runs] == 0).sum())
        captions += runs.numel()
    model.train(was_training)
    return loss_sum / tokens, right / captions


def train_vlm(
    preset: str = "llava-tiny",
    cfg: TrainConfig | None = None,
    *,
    device: torch.device | str | None = None,
    out_dir: str | Path | None = None,
    progress: bool = True,
    vision: bool | None = None,
    freeze_vision: bool | None = None,
    fp8_config=None,
) -> dict:
    """Train ``preset`` (``VL_PRESETS``) with ``cfg`` (default ``vl_train_config(preset)``).

    ``vision`` / ``freeze_vision`` default to the preset's (FP8 activations in the tower; a
    frozen tower); ``fp8_config`` (``fp8_activations.FP8Config``) goes to ``apply_coat_vlm``.
    Writes ``out_dir/metrics.jsonl`` when ``out_dir`` is given (``train`` records per step,
    written when read from the device every ``cfg.log_every`` steps as in ``Trainer.fit``;
    ``eval`` records with ``val_loss`` and ``val_caption_acc``). Returns the dict of
    ``Trainer.summary()`` plus ``preset``, ``val_caption_acc``, ``vision_fp8``,
    ``freeze_vision``, ``seq_len``, ``losses`` (every step's training loss) and ``export``
    (``out_dir/final``, the trained VLM saved by ``save_pretrained``; None without ``out_dir``).
    Without ``fp8_config``, FP8 activations use ``FP8Config(weight_cache=cfg.weight_cache)``.
    Raises ``TrainError`` for settings it cannot run (checkpoints, a too short ``seq_len``,
    a non-finite loss).
    """
    p = _preset(preset)
    cfg = cfg or vl_train_config(preset)
    if cfg.save_every:
        raise TrainError("checkpoints (--save-every/--resume) are not supported for "
                         "vision-language presets yet: use --save-every 0")  # fmt: skip
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    vision = p.vision_fp8 if vision is None else vision
    freeze_vision = p.freeze_vision if freeze_vision is None else freeze_vision
    config = p.config()
    try:
        task = ShapesCaptions(config.vision_config.image_size, num_image_tokens(config),
                              config.image_token_id, images_per_sample=p.images_per_sample,
                              seq_len=cfg.seq_len, seed=cfg.seed)  # fmt: skip
    except ValueError as e:
        raise TrainError(f"preset {preset}: {e}") from None
    model = build_vlm(config, device=device, master_dtype=MASTER_DTYPES[cfg.master_dtype],
                      seed=cfg.seed)  # fmt: skip
    if fp8_config is None:
        from fp8_activations import FP8Config

        fp8_config = FP8Config(weight_cache=cfg.weight_cache)
    model, optimizer = prepare_vlm(
        model, cfg.mode, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas,
        vision=vision, freeze_vision=freeze_vision, fp8_config=fp8_config,
    )  # fmt: skip
    enable_graphs(model, cfg)
    scheduler = lr_scheduler(optimizer, cfg)
    val = task.val_batches(cfg.batch_size)[: cfg.eval_batches]
    tracker, meter = MemoryTracker(model), PeakMeter(device)
    bar = Progress(cfg.mode, cfg.steps, enabled=progress)
    step_log = StepLog(cfg.tokens_per_step)
    trained = [q for q in model.parameters() if q.requires_grad]
    torch.manual_seed(cfg.seed)  # whatever setup drew, every mode starts alike
    tracker.reset_peak()
    meter.reset()
    losses, timed_tokens, timed_time, val_loss, val_acc = [], 0, 0.0, None, None
    with contextlib.ExitStack() as stack:
        stack.callback(tracker.close)
        stack.callback(bar.close)
        log = None
        if out_dir is not None:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            log = stack.enter_context(open(Path(out_dir) / "metrics.jsonl", "w"))
        board = None
        if cfg.report_to == "tensorboard" and out_dir is not None:
            board = stack.enter_context(tensorboard_writer(Path(out_dir) / "tensorboard"))
        for step in range(1, cfg.steps + 1):
            # Memory is counted on the first timed step and the last (as in Trainer.fit).
            track = step == min(2, cfg.steps) or step == cfg.steps
            _train_step(model, optimizer, scheduler, tracker, task, cfg, step, device,
                        step_log, trained, track)  # fmt: skip
            evaluating = step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)
            # The host waits for the device only at these steps (see Trainer.fit).
            if not (step == 1 or evaluating or step % cfg.log_every == 0 or step % bar.every == 0):
                continue
            recs = step_log.read()
            for rec in recs:
                if not math.isfinite(rec["loss"]):
                    raise loss_error(cfg.mode, cfg.lr, rec, step)
                rec["mem_tracked_peak"], rec["mem_measured_peak"] = tracker.peak, meter.peak()
                losses.append(rec["loss"])
                _emit(log, board, cfg.mode, {"type": "train", **rec})
            if recs[0]["step"] > 1:  # the first step warms up (kernels, caches, optimizer state)
                timed_tokens += sum(r["tokens"] for r in recs)
                timed_time += sum(r["step_time_s"] for r in recs)
            rec = recs[-1]
            fields = {"loss": f"{rec['loss']:.4f}", "tok/s": f"{rec['tokens_per_s']:,.0f}",
                      "mem": fmt_bytes(rec["mem_measured_peak"] or tracker.peak)}  # fmt: skip
            if evaluating:
                val_loss, val_acc = evaluate_vlm(model, val, device)
                _emit(log, board, cfg.mode, {"type": "eval", "step": step, "val_loss": val_loss,
                                      "val_caption_acc": val_acc})  # fmt: skip
                fields["val"] = f"{val_loss:.4f}"
                fields["caption acc"] = f"{val_acc:.2f}"
            bar.update(step, fields)
        memory = memory_report(tracker, meter)
    # The VLM as a Hugging Face directory (AutoModelForImageTextToText.from_pretrained).
    export = None if out_dir is None else str(export_pretrained(model, Path(out_dir) / "final"))
    window = losses[-TRAIN_LOSS_WINDOW:]
    return {
        "mode": cfg.mode,
        "master_dtype": cfg.master_dtype,
        "steps": cfg.steps,
        "tokens_per_step": cfg.tokens_per_step,
        "train_loss": sum(window) / len(window),
        "train_loss_window": len(window),
        "val_loss": val_loss,
        "tokens_per_s": timed_tokens / timed_time if timed_time else None,
        "params": sum(q.numel() for q in model.parameters()),
        "memory": memory,
        "preset": preset,
        "val_caption_acc": val_acc,
        "vision_fp8": vision and MODES[cfg.mode][0],
        "freeze_vision": freeze_vision,
        "seq_len": cfg.seq_len,
        "losses": losses,
        "export": export,
    }


def _train_step(model, optimizer, scheduler, tracker, task, cfg, step, device, step_log,
                trained, track: bool) -> None:  # fmt: skip
    """One optimizer step over ``cfg.grad_accum`` micro-batches, queued without waiting for
    the device: its loss and gradient norm go to ``step_log``. ``track``: count its memory."""
    step_log.open()
    if track and not tracker.active:
        tracker.start(optimizer)
    elif not track and tracker.active:
        tracker.stop()
    loss_sum = torch.zeros((), device=device)
    with tracker.saving() if track else contextlib.nullcontext():
        for micro in range(cfg.grad_accum):
            loss = vlm_loss(model, task.batch(step, cfg.batch_size, micro), device)
            (loss / cfg.grad_accum).backward()
            loss_sum += loss.detach().float()
    if cfg.grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(trained, cfg.grad_clip)
    else:  # the norm alone: clipping at inf would still rescale every gradient by 1
        grad_norm = torch.nn.utils.get_total_norm([q.grad for q in trained if q.grad is not None])
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    if track:
        tracker.after_optimizer_step(optimizer)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if track:
        tracker.grads_dropped()
    step_log.add(step, loss_sum / cfg.grad_accum, grad_norm, lr)


def _emit(log, board, mode: str, record: dict) -> None:
    if log is not None:
        log.write(json.dumps({"mode": mode, **record}) + "\n")
        log.flush()
    log_scalars(board, record)
