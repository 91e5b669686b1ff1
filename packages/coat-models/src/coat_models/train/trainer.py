"""The coat-train training loop: one precision mode, one run. One loop for every model kind;
what differs (batches, validation metrics, the FP8 conversion) is the task's (``tasks``).

==========  ==========================  ==================================
mode        activations                 optimizer
==========  ==========================  ==================================
bf16        bf16 autocast               torch.optim.AdamW (fp32 states)
coat        ``apply_coat`` (FP8)        ``create_optimizer`` -> CoatAdamW
coat-optim  bf16 autocast               CoatAdamW
coat-act    ``apply_coat``              torch.optim.AdamW
==========  ==========================  ==================================

Master weights are fp32, or bf16 with CoatAdamW (its stochastic rounding keeps small
updates). Under ``torchrun`` rank r of W takes micro-batch ``micro * W + r`` of a step, so W
ranks with ``grad_accum = A`` see the tokens of one process with ``W * A``; losses are means
over ranks, tokens/s and memory per rank; rank 0 writes the files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import glob
import inspect
import logging
import math
import os
import pickle
import random
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from fp8_activations import FP8ActivationConfig
from fp8_optim import CoatAdamW
from safetensors import SafetensorError
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .. import checkpoint, distributed
from ..compiling import compile_layers
from ..graphs import cuda_graph_replays, enable_cuda_graphs
from ..optim import training_optimizer
from ..plans import (
    enable_launch_plans,
    launch_plan_bytes,
    launch_plan_check_retries,
    launch_plan_eager_steps,
    launch_plan_refusals,
    launch_plan_replays,
)
from . import interrupt
from .data import TokenData
from .memory import MemoryTracker, PeakMeter, memory_report
from .options import (  # (their home: the parser reads them without importing torch)
    COMPILE_OR_GRAPHS,
    CUDA_GRAPHS_ALONE,
    MODES,
    NO_RESHARD_WITHOUT_FSDP,
    PLANS_ALONE,
    PRESET_FIELDS,
    RANGES,
    REPORT_TO,
)
from .presets import PRESETS, VL_PRESETS, ModelError, fine_tunable, first_line, one_line
from .report import MetricsLog, Progress, fmt_bytes
from .tasks import LMTask

MASTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TRAIN_LOSS_WINDOW = 10  # the summary's train loss is the mean of the last 10 steps
CHECKPOINT_FILES = ("model.pt", "optimizer.pt", "trainer.pt")  # one process; under torchrun: DCP


class TrainError(RuntimeError):
    """A run that cannot go on; the message says why and what to change. ``every_rank``:
    under torchrun every rank raises it with the same message (a loss or norm reduced over
    the ranks), so rank 0 alone says it."""

    def __init__(self, message: str, *, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


class ResumeSettingsError(TrainError):
    """A checkpoint written with other settings or under another launch than this run's: bad
    input (coat-train exits 2), refused before anything of the run is written."""


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
    # Not part of the numbers (NOT_NUMERICS): may change when resuming.
    eval_every: int = 25
    eval_batches: int = 4
    # Steps between reads of loss, grad norm and speed from the device: the host waits for
    # the GPU only then (and at evaluations, checkpoints, 10% marks and the last step).
    log_every: int = 10
    save_every: int = 0  # 0: no checkpoints
    keep_checkpoints: int = 2
    # FP8 activations: keep each weight's FP8 copies (2 B/param) between micro-batches until
    # the optimizer step. None: see ``uses_weight_cache``.
    weight_cache: bool | None = None
    cuda_graphs: bool = False  # FP8 activations on CUDA: replay the COAT layers as CUDA graphs
    compile: bool = False  # torch.compile each transformer layer (coat_models.compile_layers)
    launch_plans: bool = False  # FP8 activations: replay the COAT layers from launch plans
    report_to: str = "none"  # or "tensorboard": event files in out_dir/tensorboard

    NOT_NUMERICS = ("eval_every", "eval_batches", "log_every", "save_every", "keep_checkpoints",
                    "weight_cache", "cuda_graphs", "launch_plans",
                    "report_to")  # fmt: skip

    def __post_init__(self):
        for name, known in {
            "mode": MODES,
            "master_dtype": MASTER_DTYPES,
            "report_to": REPORT_TO,
        }.items():
            value = getattr(self, name)
            if value not in known:
                raise ValueError(f"unknown {name} {value!r}: choose one of {', '.join(known)}")
        if self.master_dtype == "bf16" and not MODES[self.mode][1]:
            raise ValueError(
                f"--master-dtype bf16 needs CoatAdamW's stochastic rounding (modes coat, "
                f"coat-optim); mode {self.mode} uses torch AdamW, whose bf16 updates round "
                f"away every change below 1/256 of a weight: use --master-dtype fp32"
            )
        for name, allowed in RANGES.items():
            value = getattr(self, name)
            message = allowed.error(value)
            if message:
                raise ValueError(f"--{name.replace('_', '-')} {message}, got {value!r}")
        if self.save_every and self.keep_checkpoints < 1:
            raise ValueError(
                "--keep-checkpoints must be >= 1 with --save-every (0 would delete each "
                "checkpoint as soon as it is written)"
            )
        if self.lr * self.weight_decay >= 1:
            # AdamW multiplies each weight by 1 - lr * weight_decay every step: at >= 1 that
            # zeroes or flips every weight, and the loss diverges for a reason --lr hides.
            raise ValueError(
                f"--weight-decay {self.weight_decay:g} with --lr {self.lr:g} decays each "
                "weight by lr x weight_decay >= 1 per step (zeroing or flipping it): lower "
                "--lr (typical: 1e-4 to 1e-3) or --weight-decay (typical: 0.01-0.1)"
            )
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
        if self.compile and self.cuda_graphs:
            raise ValueError(COMPILE_OR_GRAPHS)
        if self.launch_plans and not MODES[self.mode][0]:
            raise ValueError(
                f"--launch-plans records COAT's FP8 decoder layers: mode {self.mode} has none "
                "(use coat or coat-act)"
            )
        if self.launch_plans and (self.cuda_graphs or self.compile):
            raise ValueError(PLANS_ALONE)
        if self.launch_plans and self.weight_cache:
            raise ValueError(
                "--launch-plans replays what it recorded, so the FP8 weight cache (a decision "
                "made in Python) must be off: drop --fp8-weight-cache"
            )

    @classmethod
    def from_preset(cls, name: str, mode: str = "bf16", **overrides) -> TrainConfig:
        """The training defaults of preset ``name``, ``overrides`` (field=value) on top.

        >>> cfg = TrainConfig.from_preset("llava-tiny", "coat", steps=50)
        """
        preset = PRESETS.get(name) or VL_PRESETS.get(name)
        if preset is None:
            known = ", ".join([*PRESETS, *VL_PRESETS])
            raise ValueError(f"unknown preset {name!r}: choose one of {known}")
        return cls(mode=mode, **{**{k: getattr(preset, k) for k in PRESET_FIELDS}, **overrides})

    @property
    def uses_weight_cache(self) -> bool:
        """Whether the FP8 weight cache is asked for: ``weight_cache``, or when None, with
        gradient accumulation and without CUDA graphs (micro-batches 2.. reuse the casts)."""
        if self.weight_cache is not None:
            return self.weight_cache
        return self.grad_accum > 1 and not (self.cuda_graphs or self.launch_plans)

    def fp8_weight_cache(self, strategy: str | None = None) -> bool:
        """Whether this mode trains with the FP8 weight cache under ``strategy``: a mode
        with FP8 activations that asks for it (``uses_weight_cache``), not under FSDP."""
        return MODES[self.mode][0] and self.uses_weight_cache and strategy != "fsdp"

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.grad_accum

    def numerics(self) -> dict:
        """The fields a resumed run must share with the run that wrote the checkpoint,
        ``compile`` included: Inductor fuses bf16 autocast ops and, on the CPU, COAT's
        plain-PyTorch kernels, which then round otherwise than eagerly (a coat run on the
        CPU resumed with --compile went on with other losses, accepted without a word).
        Checkpoints of the COAT modes from earlier versions do not record it: they resume
        with or without it."""
        fields = dataclasses.asdict(self)
        return {k: v for k, v in fields.items() if k not in self.NOT_NUMERICS}


def lr_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig):
    """transformers' cosine schedule with warmup and a floor: LR ``lr * s / warmup`` at
    0-based step ``s < warmup``, then a half cosine down to ``lr * min_lr_ratio`` at ``steps``."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup  # lazy: slow to import

    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer,
        num_warmup_steps=cfg.warmup,
        num_training_steps=cfg.steps,
        min_lr_rate=cfg.min_lr_ratio,
    )


def prepare(
    model, task, cfg: TrainConfig, device, strategy=None, activation_checkpointing=False,
    reshard_after_forward=True,
):  # fmt: skip
    """(model, optimizer) for ``cfg.mode``: the task's FP8 conversion, CUDA graphs or
    compiled layers, FSDP2 / DDP under torchrun, then CoatAdamW or torch AdamW over what this
    rank updates. ``reshard_after_forward``: FSDP2's, for every layer."""
    fp8_act, fp8_optim = MODES[cfg.mode]
    fp8_config = None
    if fp8_act:
        # FSDP2 all-gathers into reused storage, which the weight cache cannot tell from the
        # weights it cached.
        fp8_config = FP8ActivationConfig(weight_cache=cfg.fp8_weight_cache(strategy))
    try:
        model = task.convert(model, fp8_config)
    except TypeError as e:  # documented: an unsupported architecture, named in e
        raise ModelError(f"mode {cfg.mode}: {e}") from None
    if cfg.cuda_graphs:
        try:
            enable_cuda_graphs(model)
        except ValueError as e:  # a CPU model, another attention implementation
            raise TrainError(f"--cuda-graphs: {e}") from None
    if cfg.launch_plans:
        if activation_checkpointing:
            raise TrainError(PLANS_ALONE)
        try:
            enable_launch_plans(model)
        except ValueError as e:  # another attention implementation
            raise TrainError(f"--launch-plans: {e}") from None
    if cfg.compile:
        compile_layers(model)
    if strategy == "fsdp":
        target = distributed.shard_model(
            model,
            activation_checkpointing=activation_checkpointing,
            reshard_after_forward=reshard_after_forward,
        )
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
    opt = training_optimizer(
        target, fp8=fp8_optim, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas
    )
    return model, opt


def _window(tokens=0, time=0.0, steps=0, first=None, last=None) -> dict:
    """Tokens, seconds, number, first and last of a set of timed steps."""
    return {"tokens": tokens, "time": time, "steps": steps, "first": first, "last": last}


def _totals_of_old_checkpoint(old: dict, cfg: TrainConfig, step: int) -> dict:
    """``totals`` of a checkpoint written before the memory-counting steps were timed apart:
    one window from step 2 to the checkpoint's ``step``, of ``timed_tokens /
    tokens_per_step`` steps (exact: resuming needs the same batch shape)."""
    n = old["timed_tokens"] // cfg.tokens_per_step
    span = (2, step) if n else (None, None)
    timed = _window(old["timed_tokens"], old["timed_time"], n, *span)
    return {"timed": timed, "counting": _window(), "memory": old["memory"]}


def finite(rec: dict) -> bool:
    """Whether a step's loss and gradient norm are finite. A non-finite norm ends the run as
    a non-finite loss does: torch's AdamW would have made the weights NaN, CoatAdamW skipped
    the update (a run of skipped steps trains nothing, and reported "done")."""
    return math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"])


def loss_error(mode: str, lr: float, rec: dict, read_at: int) -> TrainError:
    """The error for a non-finite loss or gradient norm in ``rec``, found when step
    ``read_at`` was read."""
    late = f" (read at step {read_at})" if read_at != rec["step"] else ""
    what, value = ("loss", rec["loss"]) if not math.isfinite(rec["loss"]) else \
        ("gradient norm", rec["grad_norm"])  # fmt: skip
    return TrainError(
        f"mode {mode}: the {what} became {value} at step {rec['step']}{late}: lower --lr "
        f"(now {lr:g}) or raise --warmup",
        every_rank=True,
    )


class _ExpectedCacheNotices(logging.Filter):
    """Drops transformers' notices that checkpointed layers run without a KV cache: the
    training forward wants none (it passes ``NoKVCache``)."""

    NOTICES = (
        "`use_cache=True` is incompatible with gradient checkpointing",
        "Caching is incompatible with gradient checkpointing",
    )
    LOGGERS = ("transformers.utils.generic", "transformers.modeling_layers")

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.NOTICES)


def _quiet_expected_cache_notices() -> None:
    """Install ``_ExpectedCacheNotices`` on the loggers that write them (once)."""
    for name in _ExpectedCacheNotices.LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ExpectedCacheNotices) for f in logger.filters):
            logger.addFilter(_ExpectedCacheNotices())


class NoKVCache(DynamicCache):
    """A KV cache that keeps nothing, passed to every training forward: transformers would
    otherwise fill one (host time per layer) or, with ``use_cache=False``, read
    ``position_ids`` on the host (a wait for the GPU in every forward)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states


def no_kv_cache(config) -> Callable[[], NoKVCache] | None:
    """What makes each training forward's ``NoKVCache``: an empty one where every layer is
    attention; built from ``config`` where layers keep other states (conv or recurrent
    states of hybrid models: LFM2, Jamba, Qwen3-Next, ...), which read them from their
    cache layers (an empty cache has none: an IndexError at the first step). Those states
    are kept for the forward; keys and values still are not. None where no layer is
    attention (a hybrid's config of Mamba layers only: transformers' mask code asks the
    cache's attention layers for their sizes, a ValueError without one)."""
    layers = DynamicCache(config=config).layers
    attention = [type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers]
    if layers and not any(attention):
        return None
    return NoKVCache if all(attention) else functools.partial(NoKVCache, config=config)


def training_cache_kwargs(model) -> dict[str, Callable]:
    """The cache keywords of each training forward of ``model`` (a name -> a factory of its
    value): ``no_kv_cache``'s under the forward's cache argument (``cache``, or
    ``past_key_values`` in older transformers); ``use_cache=False`` for models with a cache
    class of their own (xLSTM read its states off NoKVCache, MiniMax refused it) or no
    attention layer to keep nothing for; none for RecurrentGemma, which resets the states
    its modules hold only when it makes its cache itself (given one, step 2 backpropagated
    into step 1's freed graph). ``cache_params`` (transformers 5.17's name of the cache of
    xLSTM and the Mamba family, ``cache`` later) is a cache of the model's own."""
    params = inspect.signature(model.forward).parameters
    names = [n for n in ("cache", "past_key_values") if n in params]
    own = "cache_params" in params
    if not (names or own) or hasattr(getattr(model, "base_model", None), "_setup_cache"):
        return {}
    dynamic = getattr(type(model), "_supports_default_dynamic_cache", None)
    if own or (dynamic is not None and not dynamic()):
        make = None
    else:
        make = no_kv_cache(model.config)
    if make is not None:
        return {names[0]: make}
    takes = "use_cache" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )  # (GraniteMoeHybrid's forward takes it through **kwargs)
    return {"use_cache": lambda: False} if takes else {}


@contextlib.contextmanager
def frozen_heap(active: bool = True):
    """Within it, Python's collector skips the objects alive before it (torch, transformers,
    the model: a full collection of them stalls the host that feeds the GPU). ``active``
    False (training on the CPU, where no GPU waits on the host) does nothing: the full
    collection that goes first costs a few hundred ms with torch and transformers loaded.
    (``gc.unfreeze`` has no scope: what was frozen before it is unfrozen too.)"""
    if not active:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` in page-locked memory when it goes to a GPU: from pageable memory the host waits
    for the copy even with ``non_blocking=True``."""
    return t.pin_memory() if device.type == "cuda" else t


def _rng_state(device: torch.device) -> dict:
    """The generators a run draws from: CPU, NumPy, Python, and the training GPU's (only
    that one, so that a machine showing another number of GPUs can restore it)."""
    np_state, py_state = np.random.get_state(), random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": [torch.cuda.get_rng_state(device)] if device.type == "cuda" else [],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }


def _set_rng_state(s: dict, device: torch.device) -> None:
    """Restore ``_rng_state``'s generators; the training GPU's from the one saved state, or
    (checkpoints that saved every visible GPU's) from the state at its index."""
    torch.set_rng_state(s["torch"])
    cuda = s["cuda"]
    if device.type == "cuda" and cuda:
        index = torch.cuda.current_device() if device.index is None else device.index
        state = cuda[0] if len(cuda) == 1 else cuda[index] if index < len(cuda) else None
        if state is not None:
            torch.cuda.set_rng_state(state, device)
    name, keys, *rest = s["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    random.setstate((s["python"][0], tuple(s["python"][1]), s["python"][2]))


def _own_implementation(saved: dict, optimizer: torch.optim.Optimizer) -> dict:
    """``saved`` (an optimizer state dict) with this run's implementation switches
    (``distributed.IMPLEMENTATION_KEYS``) in its param groups, not the checkpoint's."""
    groups = saved.get("param_groups")
    if isinstance(groups, list) and len(groups) == len(optimizer.param_groups):
        for ours, theirs in zip(optimizer.param_groups, groups, strict=True):
            if isinstance(theirs, dict):
                theirs.update({k: ours[k] for k in distributed.IMPLEMENTATION_KEYS if k in ours})
    return saved


def _launch(parallel: dict | None) -> str:
    """How a run was launched, in words: "one process", "--fsdp on 2 ranks"."""
    if parallel is None:
        return "one process"
    n = parallel["world_size"]
    return f"--{parallel['strategy']} on {n} rank{'s' * (n != 1)}"


def check_launch(path: Path, manifest, parallel: dict | None) -> None:
    """Refuse (``ResumeSettingsError``) checkpoint ``path`` written under another launch than
    this run's (``parallel``: None for one process, else the strategy and world size)."""
    written_by = manifest.info.get("parallel")
    if not (written_by is None or isinstance(written_by, dict)):
        raise checkpoint.CheckpointError(f"{path}: its manifest's launch is {written_by!r}")
    if manifest.kind == "torch" and parallel is not None:
        raise ResumeSettingsError(
            f"cannot resume from {path} with {_launch(parallel)}: it was written by a run in "
            "one process; resume it in one process (without torchrun, --fsdp or --ddp), or "
            "start this run afresh with another --out"
        )
    if manifest.kind == "dcp" and (parallel is None or written_by != parallel):
        written = _launch(written_by) if written_by else f"{manifest.world_size} ranks"
        raise ResumeSettingsError(
            f"cannot resume from {path}: it was written by {written}, this run is "
            f"{_launch(parallel)}; resume with the launch that wrote it (the same "
            "--fsdp/--ddp and torchrun --nproc-per-node), or start afresh with another --out"
        )


def export_pretrained(model, path: Path, *, tokenizer=None, state_dict=None) -> Path:
    """Write ``model`` (and ``tokenizer``) as a Hugging Face directory at ``path`` (a COAT
    model as the plain model; ``state_dict``: the full weights of a sharded ``model``),
    through a temporary directory renamed into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    # Every process's: one killed while exporting left its copy (only one writes here).
    for stale in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
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
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial copy (a full disk) is not left behind
        if isinstance(e, SafetensorError):  # its I/O errors (a full disk) are not OSErrors
            raise OSError(str(e)) from e
        raise
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


class Trainer:
    """Train one mode: ``Trainer(...).fit()`` returns the summary; ``run_step`` is the unit the
    benchmarks time. ``task``: ``tasks.LMTask`` / ``tasks.VLTask`` (a ``TokenData`` is a causal
    LM on it). ``strategy``: ``None`` (one process), or ``"fsdp"`` / ``"ddp"`` for one rank of a
    torchrun job (after ``distributed.init_distributed()``). ``reshard_after_forward=False``:
    FSDP2's, keeping each layer's gathered weights until its backward."""

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
        reshard_after_forward: bool = True,
    ):
        if strategy is not None and strategy not in distributed.STRATEGIES:
            raise ValueError(
                f"strategy must be None or one of {distributed.STRATEGIES}, got {strategy!r}"
            )
        if strategy is not None and not dist.is_initialized():
            raise TrainError(
                f"strategy {strategy!r} needs torch.distributed: launch under torchrun and call "
                "coat_models.distributed.init_distributed() first"
            )
        if cfg.cuda_graphs and (strategy == "fsdp" or activation_checkpointing):
            raise TrainError(CUDA_GRAPHS_ALONE)
        if not reshard_after_forward and strategy != "fsdp":
            raise TrainError(NO_RESHARD_WITHOUT_FSDP)
        if isinstance(task, TokenData):
            task = LMTask(task, cfg)
        self.cfg, self.device, self.task = cfg, torch.device(device), task
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.describe = describe or {}
        self.strategy = strategy
        self.activation_checkpointing = activation_checkpointing
        if activation_checkpointing:
            _quiet_expected_cache_notices()
        self.world = dist.get_world_size() if strategy else 1
        self.rank = dist.get_rank() if strategy else 0
        # How this run is spread over processes (``None``: one process).
        self.parallel = strategy and {"strategy": strategy, "world_size": self.world}
        self.is_main = self.rank == 0  # writes metrics, prints progress, prunes checkpoints
        self.model, self.optimizer = prepare(
            model, task, cfg, device, strategy, activation_checkpointing, reshard_after_forward
        )
        self.scheduler = lr_scheduler(self.optimizer, cfg)
        plans = functools.partial(launch_plan_bytes, self.model) if cfg.launch_plans else None
        self.tracker = MemoryTracker(self.model, grad_hooks=strategy != "fsdp", plan_bytes=plans)
        model = getattr(self.model, "module", self.model)  # DDP wraps the model
        model = getattr(model, "_orig_mod", model)  # and torch.compile
        self._cache_kwargs = training_cache_kwargs(model)
        self.meter = PeakMeter(device)
        self.step = 0  # optimizer steps done
        self.first_step = 1  # the first step this process trains (fit: after a resume's)
        self._queued: list[tuple] = []  # (step, loss, grad norm, lr) not yet read, on the device
        self._t0: float | None = None  # start of the first queued step
        # Steps after the first: ``timed`` (the steady state) and ``counting`` (memory), under
        # ``speed``, the settings that change speed and memory but no number.
        self.totals = self._fresh_totals()
        self._plans_before = (0, 0, [])  # plans' replays, eager steps, refusals before a resume
        self.train_losses: list[float] = []
        self.val_metrics: dict | None = None  # of the last evaluation: val_loss, ...
        self.progress = Progress(cfg.mode, cfg.steps, enabled=progress and self.is_main)

    def _mean(self, t: torch.Tensor) -> torch.Tensor:
        """Mean over ranks of a float64 tensor: one all-reduce (gloo takes CPU tensors)."""
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
        """One optimizer step, without waiting for the device: the loss and gradient norm
        stay there until ``read_steps``. ``track_memory``: count this step's tensors
        (``MemoryTracker``; costs host time)."""
        step, tracker = self.step + 1, self.tracker
        if self._t0 is None:  # the first step after a read starts the clock
            self._t0 = time.perf_counter()
        if track_memory and not tracker.active:
            tracker.start(self.optimizer)
        elif not track_memory and tracker.active:
            tracker.stop()
        with tracker.saving() if track_memory else contextlib.nullcontext():
            loss = self._accumulate_gradients(step)
        if track_memory:
            tracker.count_grads()
        grad_norm, grad_scale = self._clip_gradients()
        lr = self.optimizer.param_groups[0]["lr"]
        if grad_scale is None:
            self.optimizer.step()
        else:
            self.optimizer.step(grad_scale=grad_scale)
        if track_memory:
            tracker.after_optimizer_step(self.optimizer)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if track_memory:
            tracker.grads_dropped()
        self.step = step
        self._queued.append((step, loss, grad_norm, lr))

    def _accumulate_gradients(self, step: int) -> torch.Tensor:
        """Forward and backward over the step's ``grad_accum`` micro-batches; their mean loss.
        DDP all-reduces after the last one; FSDP2 reduce-scatters after each (only shards of
        the gradients live between micro-batches)."""
        accum, dev = self.cfg.grad_accum, self.device
        loss_sum = torch.zeros((), device=dev)
        for micro in range(accum):
            batch = self.task.batch(step, micro * self.world + self.rank)
            batch = {k: pinned(v, dev).to(dev, non_blocking=True) for k, v in batch.items()}
            no_sync = self.strategy == "ddp" and micro < accum - 1
            with self.model.no_sync() if no_sync else contextlib.nullcontext():
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    no_cache = {k: make() for k, make in self._cache_kwargs.items()}
                    loss = self.model(**batch, **no_cache).loss
                (loss / accum).backward()
            loss_sum += loss.detach().float()
            # A Ctrl-C that landed where Python drops it stops the run after this
            # micro-batch, not after the step (which a large --grad-accum makes long).
            interrupt.raise_pending()
        return loss_sum / accum

    def _clip_gradients(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The gradients' total norm, and the clipping factor for the optimizer to apply (or
        None when clipped here, or not at all). CoatAdamW scales inside its update
        (``step(grad_scale=)``): ``clip_grad_norm_``'s bits without its pass over every
        gradient. Not under FSDP2, whose gradients and norm are DTensors."""
        clip = self.cfg.grad_clip
        fused = clip > 0 and isinstance(self.optimizer, CoatAdamW) and self.strategy != "fsdp"
        if clip > 0 and not fused:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        else:  # the norm alone: clipping at inf would still rescale every gradient by 1
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
        full_tensor = getattr(norm, "full_tensor", None)  # FSDP2: a DTensor
        norm = (full_tensor() if full_tensor is not None else norm).detach()
        # clip_grad_norm_'s factor, computed as it does.
        scale = torch.clamp(clip / (norm + 1e-6), max=1.0) if fused else None
        return norm, scale

    def read_steps(self) -> list[dict]:
        """Wait for the queued steps, in one device-to-host copy; their ``train`` records.
        Times are the mean over the ``window`` of steps read together (under torchrun, the
        slowest rank's); losses the mean over ranks."""
        steps, self._queued = self._queued, []
        if not steps:
            return []
        # Exact: float64 holds every fp32/bf16 value; the same numbers as float(tensor).
        losses = self._mean(torch.stack([s[1] for s in steps]).double())
        norms = torch.stack([s[2] for s in steps]).double()
        values = torch.cat([losses, norms.to(losses.device)]).tolist()  # the one sync
        dt = self._max(time.perf_counter() - self._t0)
        self._t0 = None
        n, window, tokens = len(steps), [steps[0][0], steps[-1][0]], self.cfg.tokens_per_step
        return [
            {
                "step": step,
                "loss": values[i],
                "lr": float(lr),
                "grad_norm": values[n + i],
                "tokens": tokens,  # per rank
                "step_time_s": dt / n,
                "tokens_per_s": tokens * n / dt,
                "window": window,
            }
            for i, (step, _, _, lr) in enumerate(steps)
        ]

    def run_step(self, track_memory: bool = False) -> dict:
        """One optimizer step, waited for: its record (steps still queued are read too).
        Raises ``TrainError`` for a non-finite loss or gradient norm."""
        self.queue_step(track_memory)
        recs = self.read_steps()
        bad = next((r for r in recs if not finite(r)), None)
        if bad is not None:
            raise loss_error(self.cfg.mode, self.cfg.lr, bad, self.step)
        return recs[-1]

    def evaluate(self) -> dict:
        """The task's metrics over its fixed validation batches (``val_loss``, ...) in eval
        mode; under torchrun every rank runs every batch."""
        self.model.eval()
        try:
            return self.task.evaluate(self.model, self.device)
        finally:
            self.model.train()

    # -- the whole run -----------------------------------------------------------------------
    def fit(self, resume: Path | None = None, on_start: Callable[[], None] | None = None) -> dict:
        """Train ``cfg.steps`` steps (from checkpoint ``resume`` if given), evaluating,
        logging to ``out_dir/metrics.jsonl`` and checkpointing; returns the summary.
        ``on_start`` runs once the checkpoint is loaded, before anything is written (e.g. to
        remove an earlier run's report only when this run will replace it)."""
        cfg = self.cfg
        if resume is not None:  # refused (other settings): nothing was written
            self.load_checkpoint(resume)
        if on_start is not None:
            on_start()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if resume is None:  # whatever setup drew, every mode starts alike
            torch.manual_seed(cfg.seed)
            # numpy's and Python's too (nothing of coat-train draws from them, but a model's
            # code may: transformers' set_seed seeds all three); a checkpoint carries them.
            np.random.seed(divmod(cfg.seed, 2**32)[::-1])
            random.seed(cfg.seed)
        self.tracker.reset_peak()
        self.meter.reset()
        first = self.first_step = self.step + 1
        metrics = MetricsLog(
            self.out_dir,
            cfg.mode,
            resume_step=None if resume is None else self.step,
            reevaluated=resume is not None and self.step >= cfg.steps,
            tensorboard=cfg.report_to == "tensorboard",
            enabled=self.is_main,
        )
        with metrics, frozen_heap(self.device.type == "cuda"):
            try:
                while self.step < cfg.steps:
                    step = self.step + 1
                    evaluating = step == cfg.steps or (
                        cfg.eval_every and step % cfg.eval_every == 0
                    )
                    # The last step is saved too: the run's end state, optimizer included.
                    saving = bool(cfg.save_every) and (
                        step % cfg.save_every == 0 or step == cfg.steps
                    )
                    # Memory is counted on the first step after the warm-up (optimizer
                    # state exists by then) and on the steps whose breakdown is recorded.
                    # Its hooks cost host time, so such a step is read alone and left out
                    # of tokens/s when other steps are timed (the steady state).
                    counting = step in (first + 1, cfg.steps) or saving
                    if counting:
                        self._log_steps(metrics, first)
                    self.queue_step(track_memory=counting)
                    interrupt.raise_pending()  # a Ctrl-C that landed where Python drops it
                    # The host waits for the device only at these steps (the same on every
                    # rank); the first is timed apart.
                    if not (
                        step == first
                        or counting
                        or evaluating
                        or saving
                        or step % cfg.log_every == 0
                        or step % self.progress.every == 0
                    ):
                        continue
                    fields = self._log_steps(metrics, first, counting)
                    if evaluating:
                        fields |= self._evaluate_and_log(metrics)
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
                        self._log_steps(metrics, first)
                raise
            if self.val_metrics is None:
                # Resumed at the final step: nothing trained here. Evaluated again (with this
                # run's --eval-batches), its record replacing the one the run wrote, so the
                # summary's val loss is the metrics file's last.
                self._evaluate_and_log(metrics)
        val = self.val_metrics.get("val_loss")
        if val is not None and not math.isfinite(val):
            # The losses read so far were finite, but the last update was not (e.g. a NaN
            # gradient norm under torch AdamW): nothing to export.
            raise TrainError(
                f"mode {cfg.mode}: the validation loss became {val} after step {self.step}: "
                f"the weights are no longer finite; lower --lr (now {cfg.lr:g}) or raise "
                "--warmup",
                every_rank=True,
            )
        return self.summary()

    def _log_steps(self, metrics: MetricsLog, first: int, counting: bool = False) -> dict:
        """Read the queued steps and log them; the progress line's fields of the last.
        ``counting``: they are one memory-counting step, timed apart."""
        recs = self.read_steps()
        if not recs:
            return {}
        measured = self._max(self.meter.peak())  # per rank: the largest
        tracked = self._max(self.tracker.peak)  # of the steps counted so far
        for rec in recs:
            rec["mem_tracked_peak"] = tracked
            rec["mem_measured_peak"] = measured
            metrics.write({"type": "train", **rec})  # a diverged step's too (null where nan)
            if not finite(rec):  # before anything of this step is saved
                raise loss_error(self.cfg.mode, self.cfg.lr, rec, self.step)
            self.train_losses.append(rec["loss"])
        if recs[0]["step"] > first:  # the first step of a process warms up alone
            t = self.totals["counting" if counting else "timed"]
            t["tokens"] += sum(r["tokens"] for r in recs)
            t["time"] += sum(r["step_time_s"] for r in recs)
            t["steps"] += len(recs)
            t["first"] = t["first"] or recs[0]["step"]
            t["last"] = recs[-1]["step"]
        rec = recs[-1]
        return {
            "loss": f"{rec['loss']:.4f}",
            "lr": f"{rec['lr']:.2e}",
            "tok/s": f"{rec['tokens_per_s']:,.0f}",
            "mem": fmt_bytes(measured or tracked),
        }

    def _evaluate_and_log(self, metrics: MetricsLog) -> dict:
        self.val_metrics = self.evaluate()
        # eval_batches: a resume may change --eval-batches, so each record says what it averages
        record = {"type": "eval", "step": self.step, **self.val_metrics}
        metrics.write({**record, "eval_batches": len(self.task.val)})
        fields = {"val": f"{self.val_metrics['val_loss']:.4f}"}
        for name, value in list(self.val_metrics.items())[1:]:
            fields[name.removeprefix("val_").replace("_", " ")] = f"{value:.2f}"
        return fields

    def _record_memory(self):
        """Keep the breakdown of the highest peak of this run (across resumes and ranks)."""
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
        t = self.totals["timed"] if self.totals["timed"]["time"] else self.totals["counting"]
        window = self.train_losses[-TRAIN_LOSS_WINDOW:]
        plan_replays, plan_eager, plan_refusals = self._plans_counted()
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
            "tokens_per_s": t["tokens"] / t["time"] if t["time"] else None,
            "timed_steps": [t["steps"], t["first"], t["last"]],  # number, first, last
            "params": sum(p.numel() for p in self.model.parameters()),
            "fp8_weight_cache": self.cfg.fp8_weight_cache(self.strategy),
            # Asked for and replayed (a layer given an attention mask, say, runs eagerly).
            "cuda_graphs": self._graphs_replayed(),
            "compile": self.cfg.compile,
            # Layer steps replayed from launch plans (0: none, or not asked for; a resumed run
            # adds those of the run it resumed).
            "launch_plan_replays": plan_replays,
            # Layer steps that ran eagerly with plans on (an attention mask, a refusal...).
            "launch_plan_eager_steps": plan_eager,
            # Why layers ran eagerly at a key (one line per layer and key; one per layer
            # at its cap of keys).
            "launch_plan_refusals": plan_refusals,
            # Replays the plans' checks took beyond each plan's first (this process only).
            "launch_plan_check_retries": launch_plan_check_retries(self.model),
            "memory": self.totals["memory"],
            # What the run used, preset defaults filled in (the top-level "args" keep what was
            # given: None for a default).
            "config": {k: v for k, v in dataclasses.asdict(self.cfg).items() if k != "mode"},
            **self.task.summary(),
        }

    # -- checkpoints -------------------------------------------------------------------------
    @property
    def ckpt_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    def save_checkpoint(self) -> Path:
        """Write the training state as ``ckpt_dir/step_NNNNNNN`` (``coat_models.checkpoint``:
        ``torch.save`` files in one process, DCP shards under torchrun, where every rank
        calls it), then prune to the newest ``keep_checkpoints``."""
        final = self.ckpt_dir / checkpoint.checkpoint_name(self.step)
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        state = self._trainer_state()
        # The settings in the manifest too (plain JSON): coat-train checks every mode's
        # before training any (outdir.check_resume_settings).
        settings = {"config": self.cfg.numerics(), "data": self.task.fingerprint}
        info = {"parallel": self.parallel, "settings": {**settings, "describe": self.describe}}
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
            files = [self.model.state_dict(), self.optimizer.state_dict(), state]
            try:
                checkpoint.write_torch_files(tmp, dict(zip(CHECKPOINT_FILES, files, strict=True)))
                serial = checkpoint.next_serial(self.ckpt_dir)
                checkpoint.write_manifest(
                    tmp, kind="torch", world_size=1, step=self.step, serial=serial, info=info
                )
            except BaseException:  # e.g. a full disk: its partial files would keep the space
                with contextlib.suppress(OSError):
                    checkpoint.remove(tmp)
                raise
            checkpoint.publish(tmp, final)
        if self.is_main:
            # By serial: the checkpoint just written is the newest, even where a run resumed
            # from an older one left checkpoints of higher steps.
            checkpoint.prune(self.ckpt_dir, self.cfg.keep_checkpoints)
        return final

    def _fresh_totals(self) -> dict:
        speed = {
            "cuda_graphs": self.cfg.cuda_graphs,
            "compile": self.cfg.compile,
            "launch_plans": self.cfg.launch_plans,
            "fp8_weight_cache": self.cfg.fp8_weight_cache(self.strategy),
            "activation_checkpointing": self.activation_checkpointing,
        }
        return {"timed": _window(), "counting": _window(), "memory": None, "speed": speed,
                "graphs_replayed": False, "plan_replays": 0, "plan_eager": 0,
                "plan_refusals": []}  # fmt: skip

    def _plans_counted(self) -> tuple[int, int, list[str]]:
        """Layer steps replayed from launch plans, layer steps run eagerly with plans on, and
        the plans' refusals, in the steps the totals count: those of this process added to
        the checkpoint's a resume carried on from (kept in the totals, so that a run resumed
        at its end still says so)."""
        replays, eager, refusals = self._plans_before
        replays += launch_plan_replays(self.model)
        eager += launch_plan_eager_steps(self.model)
        refusals = refusals + [r for r in launch_plan_refusals(self.model) if r not in refusals]
        self.totals["plan_replays"], self.totals["plan_eager"] = replays, eager
        self.totals["plan_refusals"] = refusals
        return replays, eager, refusals

    def _graphs_replayed(self) -> bool:
        """Whether the steps the totals count ran their COAT layers from CUDA graphs (kept in
        the totals, so that a run resumed at its end still says so)."""
        replayed = self.totals.get("graphs_replayed", False) or (
            self.cfg.cuda_graphs and cuda_graph_replays(self.model) > 0
        )
        self.totals["graphs_replayed"] = replayed
        return replayed

    def _trainer_state(self) -> dict:
        """The training state besides model and optimizer (equal on every rank but ``rng``)."""
        self._graphs_replayed()  # into the totals
        self._plans_counted()
        return {
            "format": TRAINER_STATE_FORMAT,
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "rng": _rng_state(self.device),
            # Batches are a pure function of (seed, step): the step is the position.
            "data": {"next_step": self.step + 1, "fingerprint": self.task.fingerprint},
            "config": self.cfg.numerics(),
            "describe": self.describe,
            "parallel": self.parallel,
            "totals": self.totals,
            "train_losses": self.train_losses,
        }

    def load_checkpoint(self, path: Path) -> None:
        """Restore what ``save_checkpoint`` wrote, once every file is hashed against the
        manifest (``torch.load(weights_only=True)``; DCP under torchrun). Refused: other
        numerics (mode, schedule, data, ...) or another launch."""
        path = Path(path)
        manifest = checkpoint.read_manifest(path)
        check_launch(path, manifest, self.parallel)
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
            # On the CPU: generator states are CPU ByteTensors (torch.set_rng_state and
            # torch.cuda.set_rng_state_all refuse them on a GPU).
            state = self._load_file(path / "trainer.pt", "cpu")
        _check_trainer_state(state, path, manifest.step)
        recorded = {
            "config": state["config"],
            "data": state["data"]["fingerprint"],
            "describe": state["describe"],
        }
        check_settings(path, recorded, self.cfg, self.task.fingerprint, self.describe)
        try:
            if manifest.kind == "dcp":
                distributed.load_checkpoint(path, self.model, self.optimizer, verify=False)
                rng = state["rng"][self.rank]
            else:
                self.model.load_state_dict(self._load_file(path / "model.pt"))
                saved = self._load_file(path / "optimizer.pt")
                _check_state_shapes(saved, self.optimizer, path)
                self.optimizer.load_state_dict(_own_implementation(saved, self.optimizer))
                rng = state["rng"]
            self.scheduler.load_state_dict(state["scheduler"])
            if self.scheduler.last_epoch != state["step"]:  # (it steps once a step)
                raise checkpoint.CheckpointError(
                    f"{path}: its LR schedule is at step {self.scheduler.last_epoch}, its "
                    f"training state at step {state['step']}: not a checkpoint coat-train wrote"
                )
            _set_rng_state(rng, self.device)
        except checkpoint.CheckpointError:
            raise
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            # Same settings and model, yet the tensors do not fit: not a file this run's code
            # wrote. torch's message, on one line, shortened (a key list can be long).
            why = one_line(e)
            why = why if len(why) <= 300 else why[:297] + "..."
            raise checkpoint.CheckpointError(
                f"{path} does not fit this model and optimizer: {why}"
            ) from None
        self.step = state["step"]
        self.totals = state["totals"]
        if "timed_tokens" in self.totals:
            self.totals = _totals_of_old_checkpoint(self.totals, self.cfg, self.step)
        now = self._fresh_totals()
        # Totals that name no settings (or no "compile") had this run's: they carry on.
        then = self.totals.setdefault("speed", now["speed"])
        then.setdefault("compile", False)
        if then != now["speed"] and self.step < self.cfg.steps:
            # Resumed with other settings that change speed and memory but no number:
            # tokens/s and memory count this run's steps only, not a blend.
            self.totals = now
        counts = [self.totals.get(k) for k in ("plan_replays", "plan_eager")]
        refusals = self.totals.get("plan_refusals")
        ok = all(isinstance(n, int) and n >= 0 for n in counts) and isinstance(refusals, list)
        self._plans_before = (*counts, [str(r) for r in refusals]) if ok else (0, 0, [])
        self.train_losses = list(state["train_losses"])

    def _load_file(self, path: Path, device=None):
        """``torch.load(weights_only=True)`` of a verified file onto ``device`` (default: the
        run's), or a one-line error."""
        checkpoint.check_archive_stored(path, path)
        try:
            with warnings.catch_warnings():
                # torch warns of a pickle protocol torch.save does not write before refusing
                # (or reading) the file: the one line below says what is wrong instead.
                warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
                return torch.load(path, map_location=device or self.device, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:
            # Not torch's own text for a refused pickle: it suggests weights_only=False,
            # i.e. running the file's code, which coat-train never does.
            why = (
                "it holds objects other than tensors and plain containers"
                if isinstance(e, pickle.UnpicklingError)
                else first_line(e)
            )
            raise checkpoint.CheckpointError(
                f"{path} is not a checkpoint file this code can read: {why}"
            ) from None

    def export(self, path: Path, tokenizer=None) -> Path:
        """The trained model as a Hugging Face directory at ``path`` (``export_pretrained``).
        Under torchrun every rank calls it; rank 0 writes the gathered weights."""
        if self.strategy is None:
            return export_pretrained(self.model, path, tokenizer=tokenizer)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)  # collective
        model = getattr(self.model, "module", self.model)  # DDP wraps, FSDP2 does not
        error = None
        if self.is_main:
            try:
                export_pretrained(model, path, tokenizer=tokenizer, state_dict=state)
            except OSError as e:  # e.g. a full disk: every rank must learn it, below
                error = e
        # Rank 0's outcome to every rank (also the barrier): no rank goes on alone.
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


def _resolved(describe):
    """A run's model description with its ``--model-dir`` resolved (older checkpoints
    record the path as typed)."""
    model = describe.get("model") if isinstance(describe, dict) else None
    if not (isinstance(model, str) and model.startswith("model dir ")):
        return describe
    return {**describe, "model": f"model dir {Path(model[len('model dir ') :]).resolve()}"}


def _model_key(describe):
    """What a resume compares of a run's model description: with its config.json's
    fingerprint recorded, the --model-dir's contents, not its path."""
    d = _resolved(describe)
    if isinstance(d, dict) and "config" in d:
        d = {**d, "model": "model dir"}
    return d


def _vision_language(describe) -> bool:
    """Whether a run's model description is of a vision-language preset."""
    label = describe.get("model") if isinstance(describe, dict) else None
    return isinstance(label, str) and label.removeprefix("preset ") in VL_PRESETS


def check_settings(path, recorded: dict, cfg: TrainConfig, fingerprint: str, describe) -> None:
    """Refuse (``ResumeSettingsError``, naming each difference) to resume from checkpoint
    ``path`` whose ``recorded`` settings (``config``: its numerics, ``data``: the data's
    fingerprint, ``describe``: the model) are not this run's."""
    numerics = cfg.numerics()
    # (a recorded field this run's numerics leave out is still this run's setting, read
    # from cfg: a bf16 checkpoint's compile False against a coat run had read "now None")
    now = {k: numerics.get(k, getattr(cfg, k, None)) for k in recorded["config"]}
    diff = {k: (v, now[k]) for k, v in recorded["config"].items() if _plain(now[k]) != _plain(v)}
    was, now = _model_key(recorded["describe"]), _model_key(describe)
    if isinstance(was, dict) and isinstance(now, dict) and "config" not in was:
        now = {k: v for k, v in _resolved(describe).items() if k != "config"}  # (older runs)
    if was != now:
        if (
            isinstance(was, dict)
            and isinstance(now, dict)
            and was.get("config") != now.get("config")
            and {**was, "config": None} == {**now, "config": None}
        ):
            diff["--model-dir's config.json"] = (
                f"fingerprint {was['config']}",
                f"fingerprint {now['config']} (it changed)",
            )
        else:
            diff["model"] = (recorded["describe"], describe)
    if recorded["data"] != fingerprint:
        # The fingerprints alone did not say what changed; another model (a VL preset's
        # checkpoint resumed as a text one) has another task: its data differ with it.
        vl = _vision_language(describe)
        if _vision_language(recorded["describe"]) != vl:
            why = "another model's task"
        elif vl:  # (the shapes task's data follow from these alone; --data is refused)
            why = "the --seed or --seq-len of the shapes task changed"
        else:
            why = (
                "the --data file, --data-dtype, --val-fraction, --corpus-mib, the tokenizer "
                "or coat-train's tokenization changed"
            )
        what = "task" if vl else "tokens"
        diff["data"] = (f"{what} {recorded['data']}", f"{what} {fingerprint} ({why})")
    if "model" in diff:  # named first: the other differences follow from it
        diff = {"model": diff.pop("model"), **diff}
    if diff:
        said = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in diff.items())
        # A run's schedule is fixed by its --steps: going on past them is a new run from the
        # weights (the export at the end, when there is one).
        final = Path(path).parent.parent / "final"
        further = (
            f" (to train its model further: --model-dir {final}, its export, starts a new "
            "run from its weights)"
            if "steps" in diff and fine_tunable(final)
            else ""
        )
        raise ResumeSettingsError(
            f"cannot resume from {path}: settings differ ({said}): pass the settings of "
            f"the run that wrote it, or start afresh with another --out{further}"
        )


# The layout of the training state below; a coat-train that changes it bumps this, and an
# older or newer checkpoint is refused by its number (it was written and never read).
TRAINER_STATE_FORMAT = 1
_TRAINER_STATE = {  # key -> type of what trainer.pt / DCP's extra holds
    "format": int,
    "step": int,
    "scheduler": dict,
    "rng": (dict, list),
    "data": dict,
    "config": dict,
    "describe": dict,
    "totals": dict,
    "train_losses": list,
}


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _valid_window(w) -> bool:
    """A ``_window`` as a checkpoint holds it: numbers, first and last a step or None."""
    return (
        isinstance(w, dict)
        and all(_is_number(w.get(k)) for k in ("tokens", "time", "steps"))
        and all(w.get(k) is None or _is_number(w[k]) for k in ("first", "last"))
    )


def _check_state_shapes(saved, optimizer, path: Path) -> None:
    """A torch optimizer's saved state shaped like its parameters (torch's load_state_dict
    takes any shape). CoatAdamW checks its own."""
    if isinstance(optimizer, CoatAdamW) or not isinstance(saved, dict):
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in saved.get("param_groups", ()) for i in g.get("params", ())]
    by_id = dict(zip(ids, params, strict=False))
    for pid, st in (saved.get("state") or {}).items():
        p = by_id.get(pid)
        if p is None or not isinstance(st, dict):
            continue  # (load_state_dict names what does not fit)
        for name, value in st.items():
            if name != "step" and isinstance(value, torch.Tensor) and value.shape != p.shape:
                raise checkpoint.CheckpointError(
                    f"{path} does not fit this model and optimizer: optimizer state {name!r} of "
                    f"parameter {pid} has shape {tuple(value.shape)}, the parameter "
                    f"{tuple(p.shape)}"
                )


def _check_trainer_state(state, path: Path, step: int | None) -> None:
    """The training state a checkpoint must hold, with the step its manifest names."""
    if not isinstance(state, dict):
        raise checkpoint.CheckpointError(
            f"{path} is not a coat-train checkpoint (no training state)"
        )
    if "format" in state and state["format"] != TRAINER_STATE_FORMAT:
        raise checkpoint.CheckpointError(
            f"{path}: its training state is of format {state.get('format')!r}, this coat-train "
            f"reads format {TRAINER_STATE_FORMAT}: resume it with the coat-train that wrote it"
        )
    invalid = [key for key, kind in _TRAINER_STATE.items() if not isinstance(state.get(key), kind)]
    if not invalid:
        # This code's totals, or those of a checkpoint written before the memory-counting
        # steps were timed apart (read as one window: _totals_of_old_checkpoint).
        totals = state["totals"]
        new = "timed" in totals
        windows = ("timed", "counting") if new else ("timed_tokens", "timed_time")
        if not all(k in totals for k in (*windows, "memory")) or not all(
            _valid_window(totals[w]) if new else _is_number(totals[w]) for w in windows
        ):
            invalid = ["totals"]
        elif not all(_is_number(x) for x in state["train_losses"]):
            invalid = ["train_losses"]
    if invalid:
        raise checkpoint.CheckpointError(
            f"{path} is not a coat-train checkpoint (its training state has no valid "
            f"{invalid[0]!r})"
        )
    if "fingerprint" not in state["data"]:
        raise checkpoint.CheckpointError(f"{path}: its training state names no data")
    steps = state["config"].get("steps")
    if isinstance(steps, int) and not 0 <= state["step"] <= steps:
        raise checkpoint.CheckpointError(
            f"{path}: its training state is at step {state['step']} of a {steps}-step run: not "
            "a checkpoint coat-train wrote"
        )
    if step is not None and state["step"] != step:
        raise checkpoint.CheckpointError(
            f"{path}: its manifest says step {step}, its training state step {state['step']}"
        )
