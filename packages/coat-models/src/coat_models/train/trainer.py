"""The coat-train training loop: one precision mode, one run, with memory accounting,
metrics, progress, evaluation and atomic checkpoints that resume bit-exactly. One loop for
every model kind: what differs (batches, validation metrics, the FP8 conversion) is the
task's (``tasks.LMTask`` for causal LMs, ``tasks.VLTask`` for the LLaVA presets).

Modes (FP8 activations, FP8 optimizer states):

==========  ===============================  =====================================
mode        activations                      optimizer
==========  ===============================  =====================================
bf16        bf16 autocast                    torch.optim.AdamW (fp32 states)
coat        ``apply_coat`` (FP8, COAT)       ``create_optimizer`` -> CoatAdamW
coat-optim  bf16 autocast                    CoatAdamW
coat-act    ``apply_coat``                   torch.optim.AdamW
==========  ===============================  =====================================

All modes run under bf16 autocast with master weights in ``master_dtype`` (fp32 by default;
bf16 only with CoatAdamW, whose stochastic rounding keeps small updates).

Under ``torchrun`` (``Trainer(..., strategy="fsdp" | "ddp")``) each rank trains on its own
micro-batches (micro-batch ``micro * world + rank`` of a step), so N ranks with
``grad_accum = A`` see the tokens of one process with ``grad_accum = N * A``; losses are the
mean over ranks, tokens/s and memory are per rank (memory: the largest rank), rank 0 writes
the files and checkpoints go through ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pickle
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .. import checkpoint, distributed
from ..graphs import enable_cuda_graphs
from ..optim import create_optimizer, param_groups
from .data import TokenData
from .memory import MemoryTracker, PeakMeter, memory_report
from .presets import PRESETS, VL_PRESETS, ModelError
from .report import MetricsLog, Progress, fmt_bytes
from .tasks import LMTask

MODES = {  # mode -> (FP8 activations, FP8 optimizer states)
    "bf16": (False, False),
    "coat": (True, True),
    "coat-optim": (False, True),
    "coat-act": (True, False),
}
MASTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TRAIN_LOSS_WINDOW = 10  # the summary's train loss is the mean of the last 10 steps
REPORT_TO = ("none", "tensorboard")
CHECKPOINT_FILES = ("model.pt", "optimizer.pt", "trainer.pt")  # one process; under torchrun: DCP


class TrainError(RuntimeError):
    """A run that cannot go on; the message says why and what to change."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides the numbers of a run (and a few things that do not)."""

    mode: str = "bf16"
    master_dtype: str = "fp32"
    batch_size: int = 8  # sequences per micro-batch
    seq_len: int = 128
    grad_accum: int = 1  # micro-batches per optimizer step
    steps: int = 100  # optimizer steps
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup: int = 10
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # 0: no clipping (the norm is still logged)
    seed: int = 0
    # Not part of the numbers: may change when resuming.
    eval_every: int = 25
    eval_batches: int = 4
    # Steps between reads of the loss, grad norm and speed from the device (the host waits
    # for the GPU only then, and at evaluations, checkpoints, 10% marks and the last step).
    log_every: int = 10
    save_every: int = 0  # 0: no checkpoints
    keep_checkpoints: int = 2
    # FP8 activations: keep each weight's two FP8 copies (2 B/param) from one micro-batch to
    # the next until the optimizer changes the weight (saves one cast per linear and micro-
    # batch with --grad-accum). Off: each linear casts its weight in forward and again in
    # backward and keeps nothing, so the copies never sit in memory at the peak. Same bits.
    weight_cache: bool = False
    # FP8 activations on CUDA: record the COAT decoder layers as CUDA graphs at the first
    # training step and replay them after (coat_models.enable_cuda_graphs; bit for bit the
    # eager step, tested). Their saved activations then live in the graphs' memory pool, which
    # the memory breakdown cannot see ("other"). Not part of the numbers.
    cuda_graphs: bool = False
    # Where metrics go besides metrics.jsonl: "none", or "tensorboard" (event files in
    # out_dir/tensorboard; needs the tensorboard package). Not part of the numbers.
    report_to: str = "none"

    def __post_init__(self):
        if self.report_to not in REPORT_TO:
            raise ValueError(
                f"--report-to must be one of {', '.join(REPORT_TO)}, got {self.report_to!r}"
            )
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.master_dtype not in MASTER_DTYPES:
            raise ValueError(f"--master-dtype must be fp32 or bf16, got {self.master_dtype!r}")
        if self.master_dtype == "bf16" and not MODES[self.mode][1]:
            raise ValueError(
                f"--master-dtype bf16 needs CoatAdamW's stochastic rounding (modes coat, "
                f"coat-optim); mode {self.mode} uses torch AdamW, whose bf16 updates round "
                f"away every change below 1/256 of a weight: use --master-dtype fp32"
            )
        for name in ("batch_size", "seq_len", "grad_accum", "steps", "eval_batches", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("warmup", "eval_every", "save_every", "keep_checkpoints"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if self.save_every and self.keep_checkpoints < 1:
            raise ValueError(
                "--keep-checkpoints must be >= 1 with --save-every (0 would delete each "
                "checkpoint as soon as it is written)"
            )
        if not 0 <= self.seed < 2**63:  # numpy's and torch's generators take int64 seeds
            raise ValueError(f"--seed must be in [0, 2**63 - 1], got {self.seed}")
        # Comparisons alone let nan through (every comparison with nan is false) and inf.
        for name in ("lr", "min_lr_ratio", "grad_clip", "weight_decay"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.grad_clip >= 0):
            raise ValueError("need --lr > 0, 0 <= --min-lr-ratio <= 1 and --grad-clip >= 0")
        if self.weight_decay < 0:
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.cuda_graphs and not MODES[self.mode][0]:
            raise ValueError(
                f"--cuda-graphs records COAT's FP8 decoder layers: mode {self.mode} has none "
                "(use coat or coat-act)"
            )
        if self.cuda_graphs and self.weight_cache:
            raise ValueError(
                "--cuda-graphs replays what it recorded, so the FP8 weight cache (a decision "
                "made in Python) must be off: drop --fp8-weight-cache"
            )

    @classmethod
    def from_preset(cls, name: str, mode: str = "bf16", **overrides) -> TrainConfig:
        """The training defaults of preset ``name`` (``presets.PRESETS`` or ``VL_PRESETS``),
        ``overrides`` (field=value) on top.

        >>> cfg = TrainConfig.from_preset("llava-tiny", "coat", steps=50)
        """
        preset = PRESETS.get(name) or VL_PRESETS.get(name)
        if preset is None:
            known = ", ".join([*PRESETS, *VL_PRESETS])
            raise ValueError(f"unknown preset {name!r}: choose one of {known}")
        names = ("batch_size", "seq_len", "steps", "lr", "warmup", "eval_every", "eval_batches")
        return cls(mode=mode, **{**{k: getattr(preset, k) for k in names}, **overrides})

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.grad_accum

    def numerics(self) -> dict:
        """The fields a resumed run must share with the run that wrote the checkpoint."""
        skip = {
            "eval_every",
            "eval_batches",
            "log_every",
            "save_every",
            "keep_checkpoints",
            "weight_cache",
            "cuda_graphs",
            "report_to",
        }
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}


def lr_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig):
    """The run's LR schedule: transformers' ``get_cosine_with_min_lr_schedule_with_warmup``
    (a ``LambdaLR``; its state goes into checkpoints). The LR of 0-based step ``s`` is
    ``lr * s / warmup`` while ``s < warmup`` (the first step at 0), then a half cosine from
    ``lr`` down to ``lr * min_lr_ratio``, reached after ``steps`` steps."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer,
        num_warmup_steps=cfg.warmup,
        num_training_steps=cfg.steps,
        min_lr_rate=cfg.min_lr_ratio,
    )


# ---------------------------------------------------------------------------------------------
# Model and optimizer per mode


def prepare(
    model: torch.nn.Module,
    task,
    cfg: TrainConfig,
    device: torch.device,
    strategy: str | None = None,
    activation_checkpointing: bool = False,
):
    """(model, optimizer) for ``cfg.mode``: the task's FP8 conversion (``apply_coat`` /
    ``apply_coat_vlm``) where the mode has FP8 activations, CUDA graphs with
    ``cfg.cuda_graphs``; under torchrun the model sharded by FSDP2 (``strategy="fsdp"``: bf16
    compute, fp32 gradient reduce-scatter) or wrapped by DDP (``"ddp"``); then CoatAdamW
    (``create_optimizer``) or torch AdamW (fused on CUDA) as the mode says, over the
    parameters this rank updates, decay on matrices only (``param_groups``)."""
    fp8_act, fp8_optim = MODES[cfg.mode]
    fp8_config = None
    if fp8_act:
        from fp8_activations import FP8ActivationConfig

        # FSDP2 all-gathers into reused storage, which the weight cache cannot tell from the
        # weights it cached (coat_models.distributed.shard_model turns it off for COAT layers).
        fp8_config = FP8ActivationConfig(weight_cache=cfg.weight_cache and strategy != "fsdp")
    try:
        model = task.convert(model, fp8_config)
    except TypeError as e:  # documented: an unsupported architecture, named in e
        raise ModelError(f"mode {cfg.mode}: {e}") from None
    if cfg.cuda_graphs:
        try:
            enable_cuda_graphs(model)
        except ValueError as e:  # a CPU model, another attention implementation
            raise TrainError(f"--cuda-graphs: {e}") from None
    if strategy == "fsdp":
        target = distributed.shard_model(model, activation_checkpointing=activation_checkpointing)
    elif strategy == "ddp":
        model = distributed.wrap_ddp(
            model,
            activation_checkpointing=activation_checkpointing,
            find_unused_parameters=task.find_unused_parameters,
        )
        target = model.module
    else:
        if activation_checkpointing:
            distributed.enable_activation_checkpointing(model)
        target = model
    if fp8_optim:
        opt = create_optimizer(target, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas)
    else:
        fused = device.type == "cuda"  # the baseline users run on GPUs
        groups = param_groups(target, cfg.weight_decay)
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=fused)
    return model, opt


# ---------------------------------------------------------------------------------------------
# Per-step values, read from the device in batches


class StepLog:
    """Each step's loss and gradient norm stay on the device until ``read``, which fetches
    every step since the last read in one device-to-host copy: the host waits for the GPU
    once per read instead of once per step, and keeps queueing kernels meanwhile.

    Speed is measured per window, the steps between two reads: from the start of its first
    step (``open``) to the moment ``read`` has the values, when the GPU has finished them.
    Each record gets the window's mean step time and tokens/s and says which steps it
    covers (``window: [first, last]``). Under torchrun ``rank_mean`` (a float64 tensor of
    losses) and ``rank_max`` (the window's time) reduce over ranks.

    >>> log.open(); ...; log.add(step, loss, grad_norm, lr); records = log.read()
    """

    def __init__(self, tokens_per_step: int, rank_mean=None, rank_max=None):
        self.tokens_per_step = tokens_per_step
        self._mean, self._max = rank_mean, rank_max
        self._steps: list[tuple] = []  # (step, loss, grad norm, lr), tensors on the device
        self._t0: float | None = None

    def open(self) -> None:
        """Call at the start of every step: the first after a read starts the clock."""
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def add(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr) -> None:
        self._steps.append((step, loss.detach(), grad_norm.detach(), lr))

    def read(self) -> list[dict]:
        """``train`` records of the steps added since the last read (waits for them)."""
        steps, self._steps = self._steps, []
        if not steps:
            return []
        # Exact: float64 holds every fp32/bf16 value; the same numbers as float(tensor).
        losses = torch.stack([s[1] for s in steps]).double()
        if self._mean is not None:
            losses = self._mean(losses)
        norms = torch.stack([s[2] for s in steps]).double()
        values = torch.cat([losses, norms.to(losses.device)]).tolist()  # the one sync
        dt = time.perf_counter() - self._t0
        self._t0 = None
        if self._max is not None:
            dt = self._max(dt)  # the slowest rank sets the pace
        n, window = len(steps), [steps[0][0], steps[-1][0]]
        return [
            {
                "step": step,
                "loss": values[i],
                "lr": float(lr),
                "grad_norm": values[n + i],
                "tokens": self.tokens_per_step,  # per rank
                "step_time_s": dt / n,
                "tokens_per_s": self.tokens_per_step * n / dt,
                "window": window,
            }
            for i, (step, _, _, lr) in enumerate(steps)
        ]


def loss_error(mode: str, lr: float, rec: dict, read_at: int) -> TrainError:
    """The error for a non-finite loss in ``rec``, found when step ``read_at`` was read."""
    late = f" (read at step {read_at})" if read_at != rec["step"] else ""
    return TrainError(
        f"mode {mode}: the loss became {rec['loss']} at step {rec['step']}{late}: lower --lr "
        f"(now {lr:g}) or raise --warmup"
    )


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` in page-locked memory when it goes to a GPU: a copy from pageable memory makes
    the host wait even with ``non_blocking=True``; torch's pinned-memory cache recycles the
    block once the copy is done."""
    return t.pin_memory() if device.type == "cuda" else t


# ---------------------------------------------------------------------------------------------
# Checkpoints


def _rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }


def _set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available() and len(s["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(s["cuda"])
    name, keys, *rest = s["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    random.setstate((s["python"][0], tuple(s["python"][1]), s["python"][2]))


def _launch(parallel: dict | None) -> str:
    """How a run was launched, in words: "one process", "--fsdp on 2 ranks"."""
    if parallel is None:
        return "one process"
    return f"--{parallel['strategy']} on {parallel['world_size']} ranks"


def export_pretrained(
    model: torch.nn.Module, path: Path, *, tokenizer=None, state_dict: dict | None = None
) -> Path:
    """Write ``model`` as a Hugging Face directory at ``path``: ``save_pretrained``
    (safetensors weights in the master dtype, ``config.json``) and the tokenizer's files when
    given; ``AutoModelForCausalLM.from_pretrained(path)`` loads it. ``apply_coat`` keeps the
    weights' names and the model's class name, so a COAT model is saved as the plain model.
    ``state_dict``: the full weights when ``model`` is sharded (then ``model`` supplies the
    config and the class name). Written to a temporary directory, then renamed into place
    (an earlier export at ``path`` is replaced)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, state_dict=state_dict)
        # FSDP2 renames the class (FSDPLlamaForCausalLM): the config must name the model's own.
        name = type(model).__name__.removeprefix("FSDP")
        if model.config.architectures != [name]:
            model.config.architectures = [name]
            model.config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial copy (a full disk) is not left behind
        raise
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------
# The run


class Trainer:
    """Train one mode: ``Trainer(...).fit()`` returns the summary; ``run_step`` is the unit the
    benchmarks time."""

    def __init__(
        self,
        model: torch.nn.Module,
        task,
        cfg: TrainConfig,
        *,
        device: torch.device,
        out_dir: Path | None = None,
        progress: bool = True,
        describe: dict | None = None,
        strategy: str | None = None,
        activation_checkpointing: bool = False,
    ):
        """``task``: what is trained on (``tasks.LMTask``, ``tasks.VLTask``); a ``TokenData``
        is a causal LM on it. ``strategy``: ``None`` (one process), or ``"fsdp"`` / ``"ddp"``
        for one rank of a ``torchrun`` job (the process group must exist:
        ``distributed.init_distributed()``); ``activation_checkpointing`` recomputes each
        decoder layer in backward (same numbers, less memory)."""
        if strategy is not None and strategy not in distributed.STRATEGIES:
            raise ValueError(
                f"strategy must be None or one of {distributed.STRATEGIES}, got {strategy!r}"
            )
        if strategy is not None and not dist.is_initialized():
            raise TrainError(
                f"strategy {strategy!r} needs torch.distributed: launch under torchrun and call "
                "coat_models.distributed.init_distributed() first"
            )
        if cfg.cuda_graphs and (strategy is not None or activation_checkpointing):
            raise TrainError(
                "--cuda-graphs runs in one process without activation checkpointing (sharded "
                "parameters move; checkpointed layers run eagerly): drop one of them"
            )
        if isinstance(task, TokenData):
            task = LMTask(task, cfg)
        self.cfg, self.device, self.task = cfg, device, task
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.describe = describe or {}
        self.strategy = strategy
        self.world = dist.get_world_size() if strategy else 1
        self.rank = dist.get_rank() if strategy else 0
        self.is_main = self.rank == 0  # writes metrics, prints progress, prunes checkpoints
        self.model, self.optimizer = prepare(
            model, task, cfg, device, strategy, activation_checkpointing
        )
        self.scheduler = lr_scheduler(self.optimizer, cfg)
        self.tracker = MemoryTracker(self.model, grad_hooks=strategy != "fsdp")
        self.step = 0  # optimizer steps done
        self.meter = PeakMeter(device)
        self.step_log = StepLog(
            cfg.tokens_per_step,
            rank_mean=self._mean if strategy else None,
            rank_max=self._max if strategy else None,
        )
        self.totals = {"timed_tokens": 0, "timed_time": 0.0, "memory": None}
        self.train_losses: list[float] = []
        self.val_metrics: dict | None = None  # of the last evaluation: val_loss, ...
        self.progress = Progress(cfg.mode, cfg.steps, enabled=progress and self.is_main)

    # -- ranks -------------------------------------------------------------------------------
    def _mean(self, t: torch.Tensor) -> torch.Tensor:
        """Mean over ranks of a float64 tensor (the tensor itself in one process): one
        all-reduce, on the device with NCCL (gloo takes CPU tensors)."""
        if self.strategy is None:
            return t
        if dist.get_backend() != "nccl":
            t = t.cpu()
        dist.all_reduce(t)
        return t / self.world

    def _max(self, value):
        """Max over ranks of a number, ``None`` staying ``None`` (CPU has no measured peak)."""
        if self.strategy is None or value is None:
            return value
        return distributed.all_ranks_max(value)

    # -- one optimizer step ----------------------------------------------------------------
    def queue_step(self, track_memory: bool = False) -> None:
        """Forward/backward over ``grad_accum`` micro-batches, clip, optimizer step, without
        waiting for the device: the loss and gradient norm stay there until ``read_steps``.
        ``track_memory``: count this step's tensors (``MemoryTracker``; costs host time).

        Rank r of W takes micro-batch ``micro * W + r``: the tokens of one process with
        ``grad_accum * W``. DDP all-reduces once, after the last micro-batch; FSDP2
        reduce-scatters (in fp32) after each one into the sharded gradient, so that only
        shards of the gradients live between micro-batches."""
        cfg, step, tracker = self.cfg, self.step + 1, self.tracker
        self.step_log.open()
        if track_memory and not tracker.active:
            tracker.start(self.optimizer)
        elif not track_memory and tracker.active:
            tracker.stop()
        loss_sum = torch.zeros((), device=self.device)
        with tracker.saving() if track_memory else contextlib.nullcontext():
            for micro in range(cfg.grad_accum):
                batch = self.task.batch(step, micro * self.world + self.rank)
                batch = {
                    k: pinned(v, self.device).to(self.device, non_blocking=True)
                    for k, v in batch.items()
                }
                last = micro == cfg.grad_accum - 1
                no_sync = self.strategy == "ddp" and not last
                with self.model.no_sync() if no_sync else contextlib.nullcontext():
                    with torch.autocast(self.device.type, dtype=torch.bfloat16):
                        loss = self.model(**batch).loss
                    (loss / cfg.grad_accum).backward()
                loss_sum += loss.detach().float()
        if track_memory:
            tracker.count_grads()
        if cfg.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        else:  # the norm alone: clipping at inf would still rescale every gradient by 1
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads)
        full_tensor = getattr(grad_norm, "full_tensor", None)  # FSDP2: a DTensor
        if full_tensor is not None:
            grad_norm = full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        if track_memory:
            tracker.after_optimizer_step(self.optimizer)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if track_memory:
            tracker.grads_dropped()
        self.step = step
        self.step_log.add(step, loss_sum / cfg.grad_accum, grad_norm, lr)

    def read_steps(self) -> list[dict]:
        """Wait for the queued steps; their ``train`` records (``StepLog.read``): loss (mean
        over ranks), lr, grad_norm, tokens, step_time_s and tokens_per_s over their window."""
        return self.step_log.read()

    def run_step(self, track_memory: bool = False) -> dict:
        """One optimizer step, waited for: its record (the unit the benchmarks time; steps
        still queued are read too, and the last record returned). ``track_memory``: count
        its tensors (``MemoryTracker``), as ``queue_step``. Raises ``TrainError`` for a
        non-finite loss."""
        self.queue_step(track_memory)
        recs = self.read_steps()
        bad = next((r for r in recs if not math.isfinite(r["loss"])), None)
        if bad is not None:
            raise loss_error(self.cfg.mode, self.cfg.lr, bad, self.step)
        return recs[-1]

    def evaluate(self) -> dict:
        """The task's metrics over its fixed validation batches (``val_loss``, ...), on the
        plain path (``model.eval()``). Under torchrun every rank runs every batch (FSDP2's
        forward is collective): the same values on every rank."""
        self.model.eval()
        try:
            return self.task.evaluate(self.model, self.device)
        finally:
            self.model.train()

    # -- checkpoints -------------------------------------------------------------------------
    @property
    def ckpt_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    def save_checkpoint(self) -> Path:
        """Write model, optimizer (its FP8 states included), scheduler, step, RNG states and
        data position as ``ckpt_dir/step_NNNNNNN``, then prune to the newest
        ``keep_checkpoints``. A ``step_*`` directory is always complete and carries a
        manifest with the SHA-256 of every file (``coat_models.checkpoint``: written into a
        temporary directory, the manifest last, then renamed into place). One process:
        ``torch.save`` files. Under torchrun: every rank calls it and
        ``torch.distributed.checkpoint`` writes each rank's shards; rank 0 writes the
        manifest and renames (``distributed.save_checkpoint``)."""
        final = self.ckpt_dir / checkpoint.checkpoint_name(self.step)
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        state = self._trainer_state()
        info = {"parallel": self.parallel}
        if self.strategy is not None:
            rngs = [None] * self.world
            dist.all_gather_object(rngs, state["rng"])
            state["rng"] = rngs  # DCP keeps one copy of ``extra``: every rank's, by rank
            distributed.save_checkpoint(
                final, self.model, self.optimizer, extra=state, step=self.step, info=info
            )
        else:
            tmp = self.ckpt_dir / f".tmp-{final.name}-{os.getpid()}"
            if tmp.exists():  # this process was here before and failed (e.g. disk full)
                checkpoint.remove(tmp)
            tmp.mkdir()
            checkpoint.write_torch_files(
                tmp,
                {
                    "model.pt": self.model.state_dict(),
                    "optimizer.pt": self.optimizer.state_dict(),
                    "trainer.pt": state,
                },
            )
            serial = checkpoint.next_serial(self.ckpt_dir)
            checkpoint.write_manifest(
                tmp, kind="torch", world_size=1, step=self.step, serial=serial, info=info
            )
            checkpoint.publish(tmp, final)
        if self.is_main:
            # By serial: the checkpoint just written is the newest, even where a run resumed
            # from an older one left checkpoints of higher steps.
            checkpoint.prune(self.ckpt_dir, self.cfg.keep_checkpoints)
        return final

    def _trainer_state(self) -> dict:
        """A checkpoint's training state besides model and optimizer; equal on every rank
        except the RNG states (``save_checkpoint`` gathers those)."""
        return {
            "format": 1,
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "rng": _rng_state(),
            # Batches are a pure function of (seed, step): the step is the position.
            "data": {"next_step": self.step + 1, "fingerprint": self.task.fingerprint},
            "config": self.cfg.numerics(),
            "describe": self.describe,
            "parallel": self.parallel,
            "totals": self.totals,
            "train_losses": self.train_losses,
        }

    @property
    def parallel(self) -> dict | None:
        """How this run is spread over processes (``None``: one process)."""
        if self.strategy is None:
            return None
        return {"strategy": self.strategy, "world_size": self.world}

    def load_checkpoint(self, path: Path) -> None:
        """Restore everything ``save_checkpoint`` wrote; refuses a checkpoint of other
        numerics (mode, schedule, batch, data, ...), which could not continue exactly.

        Nothing is read before the manifest is: it says how the checkpoint was written, and
        every file is hashed against it before any is opened (``CheckpointError`` on a
        difference). Model, optimizer and trainer state go through
        ``torch.load(weights_only=True)``; DCP only under torchrun, for a checkpoint whose
        manifest says DCP.

        Refused (``TrainError``): a checkpoint of another launch (one process vs torchrun,
        ``--fsdp`` vs ``--ddp``, another number of ranks). Its weights would load (DCP
        reshards), but the run would not continue with the numbers of the run that wrote
        it: another reduction order and, under FSDP2, bf16 instead of autocast compute."""
        path = Path(path)
        manifest = checkpoint.read_manifest(path)
        written_by = manifest.info.get("parallel")
        if not (written_by is None or isinstance(written_by, dict)):
            raise checkpoint.CheckpointError(f"{path}: its manifest's launch is {written_by!r}")
        if manifest.kind == "torch" and self.strategy is not None:
            raise TrainError(
                f"cannot resume from {path} with --{self.strategy} on {self.world} ranks: it "
                "was written by a run in one process; resume it in one process (without "
                "torchrun, --fsdp or --ddp), or start this run afresh with another --out"
            )
        if manifest.kind == "dcp" and (self.strategy is None or written_by != self.parallel):
            written = _launch(written_by) if written_by else f"{manifest.world_size} ranks"
            raise TrainError(
                f"cannot resume from {path}: it was written by {written}, this run is "
                f"{_launch(self.parallel)}; resume with the launch that wrote it (the same "
                "--fsdp/--ddp and torchrun --nproc-per-node), or start afresh with another --out"
            )
        if manifest.kind == "dcp":
            distributed.verify_checkpoint(path)
            state = distributed.read_checkpoint_extra(path, verify=False)
        else:
            checkpoint.verify(path, manifest)
            if set(manifest.files) != set(CHECKPOINT_FILES):
                raise checkpoint.CheckpointError(
                    f"{path} holds {', '.join(sorted(manifest.files))}, not "
                    f"{', '.join(CHECKPOINT_FILES)}: not a coat-train checkpoint"
                )
            state = self._load_file(path / "trainer.pt")
        _check_trainer_state(state, path, manifest.step)
        diff = {
            k: (v, self.cfg.numerics().get(k))
            for k, v in state["config"].items()
            if _plain(self.cfg.numerics().get(k)) != _plain(v)
        }
        if state["data"]["fingerprint"] != self.task.fingerprint:
            diff["data"] = (state["data"]["fingerprint"], self.task.fingerprint)
        if state["describe"] != self.describe:
            diff["model"] = (state["describe"], self.describe)
        if diff:
            said = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise TrainError(
                f"cannot resume from {path}: settings differ ({said}): pass the settings of "
                "the run that wrote it, or start afresh with another --out"
            )
        try:
            if manifest.kind == "dcp":
                distributed.load_checkpoint(path, self.model, self.optimizer, verify=False)
                rng = state["rng"][self.rank]
            else:
                self.model.load_state_dict(self._load_file(path / "model.pt"))
                self.optimizer.load_state_dict(self._load_file(path / "optimizer.pt"))
                rng = state["rng"]
            self.scheduler.load_state_dict(state["scheduler"])
            _set_rng_state(rng)
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
            # Same settings and model, yet the tensors do not fit: not a file this run's
            # code wrote. Nothing is half-loaded that the run goes on with: it stops here.
            if isinstance(e, checkpoint.CheckpointError):
                raise
            raise checkpoint.CheckpointError(
                f"{path} does not fit this model and optimizer: {_first_line(e)}"
            ) from None
        self.step = state["step"]
        self.totals = state["totals"]
        self.train_losses = list(state["train_losses"])

    def _load_file(self, path: Path):
        """``torch.load(weights_only=True)`` of a verified file; what it cannot read becomes a
        ``CheckpointError`` (one line)."""
        try:
            return torch.load(path, map_location=self.device, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:
            raise checkpoint.CheckpointError(
                f"{path} is not a checkpoint file this code can read: {_first_line(e)}"
            ) from None

    # -- the whole run -----------------------------------------------------------------------
    def fit(self, resume: Path | None = None) -> dict:
        """Train ``cfg.steps`` steps (from ``resume`` if given), evaluating, logging metrics to
        ``out_dir/metrics.jsonl``, checkpointing; returns the summary (on every rank; rank 0
        alone writes the metrics)."""
        cfg = self.cfg
        if resume is not None:  # refused (other settings): nothing was written
            self.load_checkpoint(resume)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if resume is None:
            torch.manual_seed(cfg.seed)  # whatever setup drew, every mode starts alike
        self.tracker.reset_peak()
        self.meter.reset()
        first = self.step + 1
        with MetricsLog(
            self.out_dir,
            cfg.mode,
            resume_step=None if resume is None else self.step,
            tensorboard=cfg.report_to == "tensorboard",
            enabled=self.is_main,
        ) as metrics:
            emit = metrics.write

            def log_steps():
                """Read the queued steps, log them; the last record (None if none)."""
                recs = self.read_steps()
                if not recs:
                    return None
                measured = self._max(self.meter.peak())  # per rank: the largest
                tracked = self._max(self.tracker.peak)  # of the steps counted so far
                for rec in recs:
                    if not math.isfinite(rec["loss"]):
                        raise loss_error(cfg.mode, cfg.lr, rec, self.step)
                    rec["mem_tracked_peak"] = tracked
                    rec["mem_measured_peak"] = measured
                    emit({"type": "train", **rec})
                    self.train_losses.append(rec["loss"])
                if recs[0]["step"] > first:  # the first step of a process warms up alone
                    self.totals["timed_tokens"] += sum(r["tokens"] for r in recs)
                    self.totals["timed_time"] += sum(r["step_time_s"] for r in recs)
                return recs[-1]

            try:
                while self.step < cfg.steps:
                    step = self.step + 1
                    evaluating = step == cfg.steps or (
                        cfg.eval_every and step % cfg.eval_every == 0
                    )
                    saving = bool(cfg.save_every) and step % cfg.save_every == 0
                    # Memory is counted on the first timed step (a steady state: optimizer
                    # state exists) and on the steps whose breakdown is recorded.
                    self.queue_step(track_memory=step in (first + 1, cfg.steps) or saving)
                    # The host waits for the device only here: the first step (timed
                    # apart), every --log-every steps, the progress line's steps (the same
                    # on every rank), evaluations, checkpoints and the last step.
                    if not (
                        step == first
                        or evaluating
                        or saving
                        or step % cfg.log_every == 0
                        or step % self.progress.every == 0
                    ):
                        continue
                    rec = log_steps()
                    fields = {
                        "loss": f"{rec['loss']:.4f}",
                        "lr": f"{rec['lr']:.2e}",
                        "tok/s": f"{rec['tokens_per_s']:,.0f}",
                        "mem": fmt_bytes(rec["mem_measured_peak"] or rec["mem_tracked_peak"]),
                    }
                    if evaluating:
                        self.val_metrics = self.evaluate()
                        emit({"type": "eval", "step": self.step, **self.val_metrics})
                        fields["val"] = f"{self.val_metrics['val_loss']:.4f}"
                        for name, value in list(self.val_metrics.items())[1:]:
                            fields[name.removeprefix("val_").replace("_", " ")] = f"{value:.2f}"
                    if step == cfg.steps or saving:
                        self._record_memory()
                    if saving:
                        self.save_checkpoint()
                    self.progress.update(self.step, fields, first)
            except BaseException:
                # Log the steps done before an error or Ctrl-C. Not under torchrun: reading
                # is a collective, and the other ranks may be elsewhere.
                if self.strategy is None:
                    with contextlib.suppress(Exception):
                        log_steps()
                raise
        if self.val_metrics is None:  # resumed at the final step: nothing trained here
            self.val_metrics = self.evaluate()
        return self.summary()

    def _record_memory(self):
        """Keep the breakdown of the highest peak seen by this run (across resumes); under
        torchrun, that of the rank with the highest peak."""
        report = memory_report(self.tracker, self.meter)
        key = "measured_peak" if report["measured_peak"] is not None else "tracked_peak"
        if self.strategy is not None:
            reports = [None] * self.world
            dist.all_gather_object(reports, report)
            report = max(reports, key=lambda r: r[key] or 0)
        best = self.totals["memory"]
        if best is None or (report[key] or 0) >= (best[key] or 0):
            self.totals["memory"] = report

    def summary(self) -> dict:
        """Losses (mean over ranks), ``tokens_per_s`` and ``memory`` per rank (the slowest
        and the largest rank), ``tokens_per_step`` over all ranks."""
        t = self.totals
        window = self.train_losses[-TRAIN_LOSS_WINDOW:]
        return {
            "mode": self.cfg.mode,
            "master_dtype": self.cfg.master_dtype,
            "parallel": self.parallel,
            "world_size": self.world,
            "steps": self.step,
            "tokens_per_step": self.cfg.tokens_per_step * self.world,
            "train_loss": sum(window) / len(window) if window else None,
            "train_loss_window": len(window),
            **(self.val_metrics or {"val_loss": None}),
            "tokens_per_s": t["timed_tokens"] / t["timed_time"] if t["timed_time"] else None,
            "params": sum(p.numel() for p in self.model.parameters()),
            "memory": t["memory"],
            **self.task.summary(),
        }

    def export(self, path: Path, tokenizer=None) -> Path:
        """The trained model as a Hugging Face directory at ``path`` (``export_pretrained``).
        Under torchrun every rank must call it: the full weights are gathered to the CPU of
        rank 0 (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``), which
        writes; the others wait for it."""
        if self.strategy is None:
            return export_pretrained(self.model, path, tokenizer=tokenizer)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)  # collective
        model = getattr(self.model, "module", self.model)  # DDP wraps, FSDP2 does not
        error = None
        if self.is_main:
            try:
                export_pretrained(model, path, tokenizer=tokenizer, state_dict=state)
            except OSError as e:  # e.g. a full disk: every rank must learn it, below
                error = e
        # Rank 0's outcome to every rank (this also stands for the barrier): raised on rank 0
        # alone, the others would wait for it here, or go on to train the next mode.
        failed = torch.tensor(float(error is not None), device=self.device)
        dist.broadcast(failed, src=0)
        if error is not None:
            raise error
        if failed.item():
            raise OSError(f"rank 0 could not write {path} (its error says why)")
        return Path(path)

    def close(self):
        self.tracker.close()
        self.progress.close()


def _plain(v):
    return list(v) if isinstance(v, tuple) else v


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


_TRAINER_STATE = {  # key -> type of what trainer.pt / DCP's extra holds
    "step": int,
    "scheduler": dict,
    "rng": (dict, list),
    "data": dict,
    "config": dict,
    "describe": dict,
    "totals": dict,
    "train_losses": list,
}


def _check_trainer_state(state, path: Path, step: int | None) -> None:
    """The training state a checkpoint must hold, with the step its manifest names."""
    if not isinstance(state, dict):
        raise checkpoint.CheckpointError(
            f"{path} is not a coat-train checkpoint (no training state)"
        )
    for key, kind in _TRAINER_STATE.items():
        if not isinstance(state.get(key), kind):
            raise checkpoint.CheckpointError(
                f"{path} is not a coat-train checkpoint (its training state has no valid {key!r})"
            )
    if "fingerprint" not in state["data"]:
        raise checkpoint.CheckpointError(f"{path}: its training state names no data")
    if step is not None and state["step"] != step:
        raise checkpoint.CheckpointError(
            f"{path}: its manifest says step {step}, its training state step {state['step']}"
        )
