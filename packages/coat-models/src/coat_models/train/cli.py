"""``coat-train``: train a Llama-family causal LM (or a LLaVA-style vision-language preset)
with BF16 and/or COAT FP8 and compare.

    coat-train --preset tiny --compare bf16,coat --out runs/demo

See the "coat-train" section of packages/coat-models/README.md for every option. Every check
that can be made up front runs before anything is written; bad input is one line, exit 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import importlib
import importlib.metadata
import itertools
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..checkpoint import CheckpointError, has_checkpoints
from ..distributed import grad_copy_in_choice, run_on_rank0
from . import interrupt
from .args import PROG, RankUsageError, UsageError
from .data import DataError, token_file_suffix
from .jobs import Job, check_fits, lm_job, vl_job
from .memory import is_oom
from .options import (
    DATA_DEFAULTS,
    KEEP_CHECKPOINTS,
    MODES,
    NEWEST,
    OUTPUT_OPTIONS,
    PRESET_FIELDS,
    TRAIN_OPTIONS,
    build_parser,
    versions,
)
from .outdir import (
    OUT_FILES,
    OutInUse,
    barrier,
    check_inputs_outside,
    check_not_in_use,
    check_out,
    check_resume,
    check_resume_settings,
    note_lost_records,
    output_lock,
    process_rank,
    resume_point,
    say,
    supersede,
    unusable_given,
    unusable_newest,
)
from .presets import (
    MODEL_DIR_DEFAULTS,
    PRESETS,
    VL_PRESETS,
    ModelError,
    first_line,
)
from .report import (
    TENSORBOARD_HINT,
    MetricsFileError,
    ReportError,
    write_atomic,
    write_run_report,
)
from .report import curves as read_curves
from .trainer import (
    COMPILE_OR_GRAPHS,
    CUDA_GRAPHS_ALONE,
    NO_RESHARD_WITHOUT_FSDP,
    PLANS_ALONE,
    ResumeSettingsError,
    TrainConfig,
    Trainer,
    TrainError,
)


# -- checks of the command line --------------------------------------------------------------
def _modes(args) -> list[str]:
    if args.mode and args.compare:
        raise UsageError("use --mode or --compare, not both")
    return (args.compare or args.mode or "bf16").split(",")  # checked by _mode_list


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        raise UsageError(
            f"--device cuda: no CUDA device is available (torch {torch.__version__}"
            f" is {built}): use --device cpu"
        )
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def _strategy(args) -> str | None:
    """``"fsdp"``, ``"ddp"`` or ``None`` (one process), checked against torchrun's
    environment before anything starts."""
    if args.fsdp and args.ddp:
        raise UsageError("use --fsdp or --ddp, not both")
    strategy = "fsdp" if args.fsdp else "ddp" if args.ddp else None
    world = os.environ.get("WORLD_SIZE")
    if world is not None and not (world.isdigit() and int(world) >= 1):
        raise UsageError(
            f"WORLD_SIZE is {world!r}, not a number of processes: launch under torchrun, or "
            "unset WORLD_SIZE to train in one process"
        )
    launch = f"launch `torchrun --nproc-per-node N --no-python {PROG} ... --{strategy}`"
    if strategy and world is None:
        raise UsageError(
            f"--{strategy} trains one process per GPU under torchrun, but WORLD_SIZE is not "
            f"set: {launch}"
        )
    # torchrun sets all of these; without them the process group cannot form.
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if strategy and missing:
        raise UsageError(f"--{strategy}: WORLD_SIZE is set but {', '.join(missing)} not: {launch}")
    if strategy is None and world is not None and int(world) > 1:
        raise UsageError(
            f"this is one of {world} torchrun processes, but neither --fsdp nor --ddp is "
            "given: each would train the whole run alone and write the same files; add "
            "--fsdp or --ddp"
        )
    if strategy == "fsdp":
        try:
            grad_copy_in_choice()
        except ValueError as e:
            raise UsageError(f"{e} (or unset it)") from None
    return strategy


def _rank_device() -> torch.device:
    """Join torchrun's process group; this rank's device (cuda:LOCAL_RANK, else cpu)."""
    from ..distributed import LaunchError, init_distributed

    try:
        device = init_distributed()
    except LaunchError as e:
        raise RankUsageError(str(e)) from None
    # COAT's decoder layer returns a view; the Llama loop does no in-place op on it, so
    # FSDP2's warning about one does not apply (coat-models README, multi-GPU limits)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    return device


def _check_rank_device(name: str, device: torch.device) -> None:
    if name not in ("auto", device.type):
        raise UsageError(
            f"--device {name}: under torchrun each rank takes {device} (cuda:LOCAL_RANK where "
            "CUDA is available, else cpu): leave out --device"
        )


def _settings(args):
    """(preset defaults, model label) for --preset or --model-dir."""
    if args.preset and args.model_dir:
        raise UsageError("use --preset or --model-dir, not both")
    if args.model_dir:
        if args.vocab_size:
            raise UsageError("--vocab-size applies to presets; a --model-dir has its own")
        # Resolved: a resume names the same directory however it is written.
        return MODEL_DIR_DEFAULTS, f"model dir {Path(args.model_dir).resolve()}"
    name = args.preset or "tiny"
    # A VLPreset has the training-default field names of a Preset.
    return PRESETS.get(name) or VL_PRESETS[name], f"preset {name}"


def _warmup_note(c0: TrainConfig, whose: str) -> str:
    """The header's note when the default warmup (a preset's, --model-dir's) spans the run
    (an explicit --warmup that does is refused). Warmup's LR is ``lr * s / warmup`` at 0-based
    step ``s``: a one-step run's only step has LR 0 and changes no weight."""
    if c0.warmup < c0.steps:
        return ""
    note = f"; {whose} LR warmup ({c0.warmup} steps) spans the run: "
    if c0.steps == 1:
        return note + "its one step has LR 0 and leaves the weights as they were (set --warmup 0)"
    return note + "the LR stays below --lr (set --warmup)"


def _train_config(args, defaults, mode: str, master: str, graphs: bool, plans: bool) -> TrainConfig:
    fields = {k: getattr(args, k) for k, _, _ in (*TRAIN_OPTIONS, *OUTPUT_OPTIONS)}
    fields["keep_checkpoints"] = args.keep_checkpoints
    fields |= {k: getattr(defaults, k) for k in PRESET_FIELDS if fields[k] is None}
    if args.warmup is not None and args.warmup >= fields["steps"] > 0:
        raise UsageError(
            f"--warmup {args.warmup} covers all {fields['steps']} steps: the learning rate "
            f"would never reach --lr; pass --warmup below {fields['steps']} (0: none)"
        )
    try:
        return TrainConfig(
            mode=mode,
            master_dtype=master,
            **fields,
            report_to=args.report_to,
            weight_cache=args.fp8_weight_cache,
            cuda_graphs=graphs and MODES[mode][0],
            compile=args.compile,
            launch_plans=plans and MODES[mode][0],
        )
    except ValueError as e:
        raise UsageError(str(e)) from None


def _default_cuda_graphs(args, device, strategy) -> bool:
    """Whether a run that says neither --cuda-graphs nor --no-cuda-graphs records the COAT
    layers: wherever graphs apply."""
    return (
        device.type == "cuda"
        and strategy is None
        and not args.activation_checkpointing
        and not args.fp8_weight_cache
        and not args.compile
        and not args.launch_plans
    )


def _default_launch_plans(args, device, strategy) -> bool:
    """Whether a run that says neither --launch-plans nor --no-launch-plans replays the COAT
    layers from launch plans: on CUDA GPUs where CUDA graphs do not run by default, under
    --fsdp (sharded parameters move) and --ddp, without --activation-checkpointing,
    --compile, --cuda-graphs or --fp8-weight-cache."""
    return (
        device.type == "cuda"
        and strategy is not None
        and not args.fp8_weight_cache
        and not args.activation_checkpointing
        and not args.compile
        and not args.cuda_graphs
    )


def _graphs_and_plans(args, device, strategy) -> tuple[bool, bool]:
    """(CUDA graphs, launch plans) for the run: what the command line says, else the
    defaults."""
    graphs, plans = args.cuda_graphs, args.launch_plans
    if graphs is None:
        graphs = _default_cuda_graphs(args, device, strategy)
    if plans is None:
        plans = _default_launch_plans(args, device, strategy)
    return graphs, plans


def _on_note(what: str, cfgs: list[TrainConfig], on: list[bool]) -> str:
    """The run header's note ``; <what> on``, naming the modes when not all of them have it."""
    modes = [c.mode for c, o in zip(cfgs, on, strict=True) if o]
    if not modes:
        return ""
    return f"; {what} on" + (f" ({', '.join(modes)})" if len(modes) < len(cfgs) else "")


def _graphs_note(cfgs: list[TrainConfig]) -> str:
    return _on_note("CUDA graphs", cfgs, [c.cuda_graphs for c in cfgs]) + _on_note(
        "launch plans", cfgs, [c.launch_plans for c in cfgs]
    )


def _val_note(job, cfg: TrainConfig) -> str:
    """Where the validation split holds fewer sequences than --eval-batches x --batch-size
    asks for (fewer batches, or a short last one)."""
    batches = job.tasks[0].val
    have = sum(len(b["input_ids"] if isinstance(b, dict) else b) for b in batches)
    asked = cfg.eval_batches * cfg.batch_size
    if have >= asked:
        return ""
    seqs, n = f"{have} sequence{'s' * (have != 1)}", len(batches)
    return (
        f"; validation: {seqs} in {n} batch{'es' * (n != 1)}, all the split holds "
        f"(--eval-batches {cfg.eval_batches} x --batch-size {cfg.batch_size} asks for {asked})"
    )


def _cache_note(cfgs: list[TrainConfig], strategy: str | None) -> str:
    return _on_note("FP8 weight cache", cfgs, [c.fp8_weight_cache(strategy) for c in cfgs])


def _check_launch_plans(args, modes) -> None:
    if not any(MODES[m][0] for m in modes):
        raise UsageError(
            "--launch-plans records COAT's FP8 decoder layers: add a mode with FP8 "
            "activations (coat or coat-act)"
        )
    if args.cuda_graphs or args.compile or args.activation_checkpointing:
        raise UsageError(PLANS_ALONE)


def _check_cuda_graphs(args, modes, device, strategy) -> None:
    if args.compile:  # the first conflict to name, whatever the modes
        raise UsageError(COMPILE_OR_GRAPHS)
    if not any(MODES[m][0] for m in modes):
        raise UsageError(
            "--cuda-graphs records COAT's FP8 decoder layers: add a mode with FP8 "
            "activations (coat or coat-act)"
        )
    if strategy == "fsdp" or args.activation_checkpointing:
        raise UsageError(CUDA_GRAPHS_ALONE)
    if device.type != "cuda":
        raise UsageError("--cuda-graphs needs a CUDA device (--device cuda)")


def _check_fp8_backend(modes: list[str], device: torch.device) -> None:
    """``FP8_QUANT_BACKEND`` (the kernels of the FP8 modes), checked before anything is
    written rather than at the first COAT layer."""
    from fp8_quant import Backend, resolve_backend

    env = os.environ.get("FP8_QUANT_BACKEND")
    if env is None or not env.strip() or not any(any(MODES[m]) for m in modes):
        return  # (blank is unset, as fp8_quant reads it)
    try:
        backend = Backend.parse(env, "FP8_QUANT_BACKEND")
    except ValueError as e:
        raise UsageError(f"{e}: set one of them, or unset it") from None
    try:
        resolve_backend(torch.empty(0, device=device), backend)
    except ValueError:  # triton without a GPU or the interpreter
        raise UsageError(
            f"FP8_QUANT_BACKEND=triton needs a CUDA device, or TRITON_INTERPRET=1 on "
            f"{device.type} (slow): unset FP8_QUANT_BACKEND, or set it to reference"
        ) from None


def _check_data_options(args) -> None:
    """Refuse a data option that does not apply to the data chosen (it would be ignored, and
    the user would not learn it). Those left out stay None (summary.json's args keep what was
    given); the job fills in DATA_DEFAULTS."""
    if (args.preset or "tiny") in VL_PRESETS:
        for name in ("data", "vocab_size", *DATA_DEFAULTS):
            if getattr(args, name) is not None:
                raise UsageError(
                    f"--{name.replace('_', '-')} does not apply to --preset {args.preset}: it "
                    "trains on the built-in shapes-caption task"
                )
    bin_file = args.data is not None and token_file_suffix(args.data) == ".bin"
    applies = {
        "data_dtype": (bin_file, "a .bin --data file"),
        "val_fraction": (args.data is not None, "a --data file"),
        "corpus_mib": (args.data is None, "the built-in corpus (no --data)"),
    }
    for name, (ok, what) in applies.items():
        if getattr(args, name) is not None and not ok:
            raise UsageError(f"--{name.replace('_', '-')} applies to {what} only: leave it out")


# -- the run ------------------------------------------------------------------------------------
def run(args) -> int:
    """Validate everything, then train. Nothing is written before every check that can be
    made up front has passed; then the output directory is locked, and each mode's earlier
    results are replaced only once its model and trainer are built."""
    strategy = _strategy(args)
    if strategy is None:
        plan = _plan(args, strategy, _device(args.device))
    else:
        device = _rank_device()
        plan = _agreed(args, lambda: _plan(args, strategy, device))
    modes, cfgs, job, out, device, label = plan
    c0 = cfgs[0]
    whose = "--model-dir's default" if args.model_dir else "the preset's"
    say(
        f"{PROG}: {label} ({job.shape}) on {device.type}"
        + (f" ({strategy})" if strategy else "")
        + f"; data: {job.data}; {c0.steps} steps x {c0.batch_size} x {c0.seq_len} tokens"
        + (f" x {c0.grad_accum} accum" if c0.grad_accum > 1 else "")
        + (f" x {dist.get_world_size()} ranks" if strategy else "")
        + f"; modes: {', '.join(modes)}"
        + _cache_note(cfgs, strategy)
        + _graphs_note(cfgs)
        + _val_note(job, c0)
        + ("; torch.compile on (each decoder layer)" if args.compile else "")
        + ("; layers stay gathered until backward" if args.reshard_after_forward is False else "")
        + _warmup_note(c0, whose),
        flush=True,
    )
    summaries, curves = [], {}
    with output_lock(out):
        parallel = strategy and {"strategy": strategy, "world_size": dist.get_world_size()}
        check_resume_settings(args, cfgs, job, out, parallel)
        for cfg, task in zip(cfgs, job.tasks, strict=True):
            summary = _train_mode(args, job, cfg, task, out / cfg.mode, device, strategy)
            summaries.append(summary)
            if process_rank() == 0:
                curves[cfg.mode] = read_curves(out / cfg.mode / "metrics.jsonl")
        if process_rank() != 0:
            return 0
        run_info = {"args": vars(args), "device": device.type, "model": job.describe,
                    "data": job.source}  # fmt: skip
        print(write_run_report(out, run_info, summaries, curves))
        return 0


class Plan(NamedTuple):
    """What the checks before anything is written settle: the modes and one TrainConfig
    each, the job (model and data), ``--out``, the device and the model's label."""

    modes: list[str]
    cfgs: list[TrainConfig]
    job: Job
    out: Path
    device: torch.device
    label: str


def _plan(args, strategy: str | None, device: torch.device) -> Plan:
    """Every check that can be made before anything is written, on this process; raises the
    first error found."""
    modes = _modes(args)
    if strategy is not None:
        _check_rank_device(args.device, device)
    if args.reshard_after_forward is False and strategy != "fsdp":
        raise UsageError(NO_RESHARD_WITHOUT_FSDP)
    compare = args.compare is not None
    # bf16 master weights only where CoatAdamW's stochastic rounding is used; TrainConfig
    # refuses the other combinations for a single --mode.
    masters = [args.master_dtype if MODES[m][1] or not compare else "fp32" for m in modes]
    if args.master_dtype == "bf16" and "bf16" not in masters:  # else ignored by every mode
        raise UsageError(
            f"--master-dtype bf16 applies to the modes with CoatAdamW (coat, coat-optim), and "
            f"--compare {args.compare} has none: add one, or drop --master-dtype"
        )
    defaults, label = _settings(args)
    if args.keep_checkpoints is None:
        args.keep_checkpoints = KEEP_CHECKPOINTS
    elif not args.save_every:
        raise UsageError(
            "--keep-checkpoints applies with --save-every N (without it no checkpoint is "
            "written): add --save-every, or leave --keep-checkpoints out"
        )
    # args keep what was given (None: the default); summary.json's runs say what was used.
    graphs, plans = _graphs_and_plans(args, device, strategy)
    cfgs = [
        _train_config(args, defaults, m, d, graphs, plans)
        for m, d in zip(modes, masters, strict=True)
    ]
    if args.launch_plans:
        _check_launch_plans(args, modes)
    if args.cuda_graphs:
        _check_cuda_graphs(args, modes, device, strategy)
    _check_fp8_backend(modes, device)
    _check_data_options(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.report_to == "tensorboard":
        try:
            importlib.import_module("torch.utils.tensorboard")  # imports tensorboard
        except ImportError:
            raise UsageError(TENSORBOARD_HINT) from None
    if not args.out.strip():  # Path("") is the current directory
        raise UsageError("--out is empty: pass a directory, e.g. --out runs/demo")
    if Path(args.out).resolve() == Path(args.out).resolve().parent:  # the file system's root
        # (as root, the run's .lock, reports and mode directories landed beside /etc and /usr)
        raise UsageError(f"--out {args.out} is the file system's root: pass a directory of "
                         "its own, e.g. --out runs/demo")  # fmt: skip
    if args.fp8_weight_cache and not any(MODES[m][0] for m in modes):
        raise UsageError(
            "--fp8-weight-cache applies to modes with FP8 activations (coat, coat-act): add "
            "one, or drop it"
        )
    if args.fp8_weight_cache and strategy == "fsdp":
        raise UsageError(
            "--fp8-weight-cache does not apply under --fsdp (FSDP2 gathers each layer's weights "
            "into reused memory, which the cache cannot tell from the weights it cast): drop it"
        )
    out = Path(args.out)
    check_out(out, modes)
    check_inputs_outside(out, modes, {"--model-dir": args.model_dir, "--data": args.data})
    if (args.preset or "tiny") in VL_PRESETS:
        job = vl_job(args, cfgs, device, label)
    else:
        job = lm_job(args, cfgs, modes, device, label)
    check_fits(job.n_params, modes, masters, device, label, strategy, cfgs[0], job.vocab, job.tune)
    check_not_in_use(out)
    check_resume(args, out, modes)
    return Plan(modes, cfgs, job, out, device, label)


class OtherRankFailed(Exception):
    """Under torchrun: this rank's checks passed, another rank's did not (that rank said
    why): exit 2 without a word."""


# The errors of bad input, said in one line (exit 2).
INPUT_ERRORS = (
    UsageError,
    DataError,
    ModelError,
    CheckpointError,
    ResumeSettingsError,
    MetricsFileError,
)


def _agreed(args, plan: Callable[[], tuple]) -> tuple:
    """``plan()`` on every torchrun rank, then one exchange of the outcomes, so that every
    rank leaves together: all passed (started alike, on the same data), or each raises. An
    input error every rank found is said once, by rank 0; one found by some ranks only, by
    each of them with its rank. Other errors are raised as they are, ``every_rank`` set on
    them when every rank raised the same."""
    given = dict(vars(args))  # before plan() fills in defaults
    result = error = None
    try:
        result = plan()
    except Exception as e:
        error = e
    data = None if result is None else [task.fingerprint for task in result.job.tasks]
    said = "" if error is None else f"{type(error).__name__}: {error}"
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"args": given, "data": data, "error": said})
    check_ranks_agree(everyone)
    # --out in use (rank 0 probes its lock): the other ranks' findings there are the running
    # run's files; every rank raises rank 0's line.
    in_use = [t["error"] for t in everyone if t["error"].startswith(f"{OutInUse.__name__}: ")]
    if in_use:
        raise UsageError(in_use[0].split(": ", 1)[1])
    same = len({theirs["error"] for theirs in everyone}) == 1
    if error is not None:
        if isinstance(error, INPUT_ERRORS) and not same:
            raise RankUsageError(str(error)) from error
        with contextlib.suppress(AttributeError):  # (an exception without a __dict__)
            error.every_rank = same
        raise error
    if any(theirs["error"] for theirs in everyone):
        raise OtherRankFailed
    if any(theirs["data"] != data for theirs in everyone):
        rank = next(r for r, theirs in enumerate(everyone) if theirs["data"] != everyone[0]["data"])
        raise UsageError(_differs(rank, "the data read"))
    return result


def _differs(rank: int, what: str) -> str:
    return (
        f"rank {rank} was started with other settings than rank 0 ({what}): launch every "
        "rank with the same command and the same data"
    )


def check_ranks_agree(everyone: list[dict]) -> None:
    """Under torchrun, ``everyone``: each rank's ``{"args": vars(args), ...}``. Every rank must
    be started with rank 0's options (else they train other numbers, hang or abort)."""
    first = everyone[0]["args"]
    for rank, theirs in enumerate(everyone[1:], start=1):
        theirs = theirs["args"]
        if theirs != first:
            keys = sorted(k for k in set(first) | set(theirs) if first.get(k) != theirs.get(k))
            raise UsageError(_differs(rank, ", ".join("--" + k.replace("_", "-") for k in keys)))


def _oom_cache_note(cfg: TrainConfig, strategy: str | None) -> str:
    """What the out-of-memory message says of the FP8 weight cache: it was on; or lowering
    --batch-size and raising --grad-accum, as the message advises, would turn it on."""
    if cfg.fp8_weight_cache(strategy):
        return "; or --no-fp8-weight-cache (the FP8 weight copies take 2 bytes/param)"
    accumulating = dataclasses.replace(cfg, grad_accum=2)
    if cfg.weight_cache is None and accumulating.fp8_weight_cache(strategy):
        return (
            " (with --grad-accum > 1 the FP8 weight cache adds 2 bytes/param: "
            "--no-fp8-weight-cache)"
        )
    return ""


def _oom_graphs_note(cfg: TrainConfig) -> str:
    """What the out-of-memory message says of CUDA graphs or launch plans: the memory they
    keep, and that without them accumulation turns the FP8 weight cache on (unless told)."""
    if cfg.launch_plans:
        note = "; or --no-launch-plans (the plans keep each layer's saved buffers and a scratch"
        if cfg.weight_cache is None:
            note += "; with --grad-accum > 1 add --no-fp8-weight-cache too"
        return note + ")"
    if not cfg.cuda_graphs:
        return ""
    note = "; or --no-cuda-graphs (the graphs' memory pool holds the layers' buffers"
    if cfg.weight_cache is None:  # the advice above may raise --grad-accum
        note += "; with --grad-accum > 1 add --no-fp8-weight-cache too"
    return note + ")"


def _first_step_refused(trainer: Trainer, e: ValueError) -> bool:
    """Whether ``e`` came from a transformers model's own code (its innermost frame under
    transformers/models/) during the first step this run trains."""
    if trainer.step + 1 != trainer.first_step:
        return False
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    parts = Path(tb.tb_frame.f_code.co_filename).parts if tb is not None else ()
    return any(a == "transformers" and b == "models" for a, b in itertools.pairwise(parts))


def _train_mode(args, job: Job, cfg: TrainConfig, task, mode_dir: Path, device, strategy):
    """Train one mode into ``mode_dir``; its summary (rank 0 writes and prints it)."""
    resume = resume_point(args, mode_dir)
    t0 = time.perf_counter()
    trainer = oom = export_error = None
    try:
        model = job.build(cfg)
        trainer = Trainer(
            model,
            task,
            cfg,
            device=device,
            out_dir=mode_dir,
            progress=not args.no_progress,
            describe=job.describe,
            strategy=strategy,
            activation_checkpointing=args.activation_checkpointing,
            reshard_after_forward=args.reshard_after_forward is not False,
        )
        del model
        if resume is None:
            # A fresh run replaces what an earlier one left (never a complete checkpoint:
            # resume_point refuses those), only now that the model and trainer exist.
            barrier()
            run_on_rank0(lambda: shutil.rmtree(mode_dir, ignore_errors=True))

        # An earlier run's report (rewritten at the end) goes too: left, it would describe
        # that run beside this one's files if this one stops. Only once a resumed checkpoint
        # is accepted: a refused resume leaves the earlier run's results as they were.
        def drop_report():
            run_on_rank0(lambda: [(mode_dir.parent / n).unlink(missing_ok=True) for n in OUT_FILES])
            if resume is not None:
                note_lost_records(mode_dir, resume, len(task.val), cfg.steps)
                run_on_rank0(lambda: supersede(mode_dir, resume))

        summary = trainer.fit(resume, on_start=drop_report)
        summary["export"] = None
        if not args.no_export:
            try:
                summary["export"] = str(trainer.export(mode_dir / "final", job.tokenizer))
            except OSError as e:  # a full disk: the run's results are kept, below
                export_error = e
    except CheckpointError as e:
        if args.resume == NEWEST and resume is not None:
            raise unusable_newest(e, resume) from None
        if resume is not None:  # --resume DIR
            raise unusable_given(e, resume, Path(args.out), cfg.mode) from None
        raise
    except (RuntimeError, torch.OutOfMemoryError) as e:
        if not is_oom(e):
            raise
        oom = True
    except ValueError as e:
        # A model's own refusal of the run's first batch (Reformer: a --seq-len that is not
        # the product of its axial_pos_shape) is bad input, not a bug of coat-train.
        if isinstance(e, INPUT_ERRORS) or trainer is None or not _first_step_refused(trainer, e):
            raise
        model = getattr(trainer.model, "module", trainer.model)  # (DDP's wrapper)
        name = type(model).__name__.removeprefix("FSDP")  # (FSDP2's class is FSDP<name>)
        raise ModelError(
            f"mode {cfg.mode}: the model ({name}) refused a batch of {cfg.batch_size} x "
            f"{cfg.seq_len} tokens: {first_line(e).rstrip('.')}; change --seq-len or "
            "--batch-size, or the model's config.json"
        ) from None
    finally:
        if trainer is not None:
            trainer.close()
        trainer = None
        # The next mode starts from the memory this one held: FSDP2's and DDP's state hold
        # tensors in reference cycles; on one CPU process the mode's tensors are freed as
        # the trainer goes (tested), and a full collection costs a few hundred ms.
        if device.type == "cuda" or strategy is not None:
            gc.collect()
        if device.type == "cuda":  # (its peak memory starts from an empty cache)
            torch.cuda.empty_cache()
    if oom:
        cache = _oom_cache_note(cfg, strategy) + _oom_graphs_note(cfg)
        if args.reshard_after_forward is False:
            cache += (
                "; or drop --no-reshard-after-forward (it keeps every layer's weights gathered)"
            )
        raise TrainError(
            f"out of memory in mode {cfg.mode} with micro-batch {cfg.batch_size} x "
            f"{cfg.seq_len} tokens on {device.type}: lower --batch-size (raise "
            f"--grad-accum to keep the batch){job.tune}{cache}"
        )
    summary["wall_s"] = time.perf_counter() - t0
    if process_rank() == 0:  # under torchrun rank 0 alone writes files and prints
        write_atomic(mode_dir / "summary.json", json.dumps(summary, indent=1))
    if export_error is not None:  # on every rank: none goes on to the next mode
        raise TrainError(
            f"mode {cfg.mode} trained (metrics and summary in {mode_dir}), but writing the model "
            f"to {mode_dir / 'final'} failed: {export_error.strerror or export_error}; free "
            "space there or pass --no-export"
        )
    acc = summary.get("val_caption_acc")
    say(
        f"[{cfg.mode}] done in {summary['wall_s']:.1f}s: train loss "
        f"{summary['train_loss']:.4f}, val loss {summary['val_loss']:.4f}"
        + ("" if acc is None else f", caption accuracy {acc:.2f}")
        + f"; model: {summary['export'] or 'not exported (--no-export)'}",
        flush=True,
    )
    return summary


def _way_on(args) -> str:
    """After an interrupt: how to continue from the completed checkpoints, if any."""
    out = Path(args.out)
    with contextlib.suppress(OSError, UsageError):  # (this run's modes only)
        if any(has_checkpoints(out / mode / "checkpoints") for mode in _modes(args)):
            return (
                f"completed checkpoints are under {out}: run the same command with --resume "
                "to continue from the newest"
            )
    why = "" if args.save_every else " (--save-every N writes them)"
    if args.resume not in (None, NEWEST):  # (plain --resume would start from step 0)
        return (
            f"no checkpoint was written to {out}{why}: run the same command, with --resume "
            f"{args.resume}, to start again from that checkpoint"
        )
    return f"no checkpoint was written to {out}{why}"


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0), or a bad command line (2) the parser has printed
        return e.code
    if args.version:
        print(versions())
        return 0
    own_group = not dist.is_initialized()  # run() joins torchrun's group for --fsdp / --ddp
    hf_bars = None
    if args.no_progress:  # transformers' bars too (writing the export, loading --model-dir)
        from transformers.utils import logging as hf_logging

        hf_bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
    forced = (
        f"{PROG}: a second interrupt ({{signal}}) while busy in one operation: stopped at "
        f"once; completed checkpoints (if any) are under {args.out}"
    )
    code = None
    try:
        with interrupt.handled(forced):
            code = _run_reporting(args, own_group, hf_bars)
    except KeyboardInterrupt:
        if code is None:
            raise
    return code  # (a signal after the run was reported, as the handlers go back: no change)


def _run_reporting(args, own_group: bool, hf_bars) -> int:
    """``run(args)``, its errors reported on one line each with the exit status; a signal
    received on the way reports as the interrupt, whatever error it turned into."""
    try:
        try:
            return run(args)
        except (Exception, KeyboardInterrupt):
            interrupt.raise_pending()  # e.g. torch.save's "unexpected pos" after a Ctrl-C
            raise
    except RankUsageError as e:
        print(f"{PROG}: error: rank {process_rank()}: {e}", file=sys.stderr)
        return 2
    except OtherRankFailed:
        return 2
    except INPUT_ERRORS as e:
        say(f"{PROG}: error: {e}", file=sys.stderr)  # the same on every rank
        return 2
    except (TrainError, ReportError) as e:
        if getattr(e, "every_rank", False):
            say(f"{PROG}: error: {e}", file=sys.stderr)
            return 1
        rank = (
            f"rank {process_rank()}: "
            if dist.is_initialized() and dist.get_world_size() > 1
            else ""
        )
        print(f"{PROG}: error: {rank}{e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk, a file that vanished: what the OS said, on one line
        where = f"{e.filename}: " if e.filename else ""
        full = e.errno in (errno.ENOSPC, errno.EDQUOT) or "bytes free there" in str(e)
        hint = f"; free space there or pass another --out (now {args.out})" if full else ""
        # _agreed's: found by every rank (said once, by rank 0) or by some (each says it)
        every = getattr(e, "every_rank", None)
        rank = f"rank {process_rank()}: " if every is False else ""
        (say if every else print)(f"{PROG}: error: {rank}{where}{e.strerror or e}{hint}",
                                  file=sys.stderr)  # fmt: skip
        return 1
    except KeyboardInterrupt as e:
        what = "terminated" if isinstance(e, interrupt.Terminated) else "interrupted"
        try:
            way = _way_on(args)  # (a walk of --out)
        except KeyboardInterrupt:  # a second signal meanwhile: the line without it
            way = f"completed checkpoints (if any) are under {args.out}"
        with contextlib.suppress(KeyboardInterrupt):
            say(f"\n{PROG}: {what}; {way}", file=sys.stderr)
        return 128 + interrupt.signal_number(e)
    finally:
        # A signal landing in this clean-up (after the run was reported) changes nothing.
        with contextlib.suppress(KeyboardInterrupt):
            if hf_bars:
                from transformers.utils import logging as hf_logging

                hf_logging.enable_progress_bar()
            if own_group and dist.is_initialized():
                dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
