"""coat-train's options: its parser and the names and ranges it checks, in the standard
library only, so that ``coat-train --help``, ``--version`` and a mistyped option answer without
importing torch and transformers (seconds). The modules that train read the same names from
here; a test keeps the preset and dtype names equal to theirs."""

from __future__ import annotations

import argparse
import importlib.metadata
import os

from .args import PROG, OneLineParser, Range, float_in, int_in

MODES = {  # mode -> (FP8 activations, FP8 optimizer states)
    "bf16": (False, False),
    "coat": (True, True),
    "coat-optim": (False, True),
    "coat-act": (True, False),
}
# The keys of presets.PRESETS / VL_PRESETS and trainer.MASTER_DTYPES (a test checks).
PRESET_NAMES = ("tiny", "125m", "350m", "1b", "llama2-7b", "llama2-13b")
VL_PRESET_NAMES = ("llava-tiny", "vila-7b")
MASTER_DTYPE_NAMES = ("fp32", "bf16")
REPORT_TO = ("none", "tensorboard")


class _Newest(str):
    """``--resume`` alone (argparse passes it through ``type`` too, told by identity)."""


NEWEST = _Newest("latest")  # --resume alone: each mode's newest checkpoint under --out
# The TrainConfig fields a preset gives defaults for.
PRESET_FIELDS = ("batch_size", "seq_len", "steps", "lr", "warmup", "eval_every", "eval_batches")
STDLIB_MAX_BYTES = 32 * 2**20  # the built-in corpus's default cap (data.py)
# Refusals that the command line and Trainer both make.
CUDA_GRAPHS_ALONE = (
    "--cuda-graphs runs neither with --fsdp nor with --activation-checkpointing (sharded "
    "parameters move; checkpointed layers run eagerly): drop one of them"
)
COMPILE_OR_GRAPHS = "--compile and --cuda-graphs both take over the decoder layers: choose one"
PLANS_ALONE = (
    "--launch-plans takes over the decoder layers like --cuda-graphs and --compile, and does "
    "not run with --activation-checkpointing (checkpointed layers run eagerly): drop one of "
    "them"
)
NO_RESHARD_WITHOUT_FSDP = (
    "--no-reshard-after-forward is FSDP2's (sharded weights gathered per layer): add --fsdp "
    "under torchrun, or drop it"
)

# The numeric fields' ranges: TrainConfig checks them, coat-train's parser parses with them.
_COUNT, _COUNT0 = Range(1), Range(0)
RANGES = {
    "batch_size": _COUNT,
    # Labels are the inputs shifted by one: one token predicts nothing and the loss is 0/0,
    # which would surface as a NaN with the wrong remedy (--lr).
    "seq_len": Range(2, why=" (a causal LM predicts each token from those before it)"),
    "grad_accum": Range(1, 2**31 - 1),
    "steps": _COUNT,
    "eval_batches": _COUNT,
    "log_every": _COUNT,
    "warmup": _COUNT0,
    "eval_every": _COUNT0,
    "save_every": _COUNT0,
    "keep_checkpoints": _COUNT0,
    "seed": Range(0, 2**63 - 1, why=" (numpy's and torch's generators take int64 seeds)"),
    "lr": Range(0, integer=False, open_low=True),
    "min_lr_ratio": Range(0, 1, integer=False),
    "grad_clip": Range(0, integer=False),
    "weight_decay": Range(0, integer=False),
}

# The data options' defaults, filled in after parsing: one given where it does not apply is
# refused rather than ignored.
DATA_DEFAULTS = {
    "data_dtype": "uint16",
    "val_fraction": 0.05,
    "corpus_mib": STDLIB_MAX_BYTES / 2**20,
}
# TrainConfig fields given by options of the same name: (field, parser default, help); a
# default of None is the preset's. Each option parses with the field's range (``RANGES``).
TRAIN_OPTIONS = (
    ("batch_size", None, "sequences per micro-batch"),
    ("seq_len", None, "tokens per sequence"),
    ("grad_accum", 1, "micro-batches per step"),
    ("steps", None, "optimizer steps"),
    ("lr", None, "peak learning rate"),
    ("min_lr_ratio", 0.1, "cosine floor / peak lr"),
    ("warmup", None, "linear warmup steps"),
    ("weight_decay", 0.1, "AdamW's, on matrices"),
    ("grad_clip", 1.0, "max grad norm; 0: off"),
    ("seed", 0, "of the initial weights and the batches"),
    ("eval_every", None, "steps between validation passes; 0: at the end only"),
    ("eval_batches", None, "validation batches per pass"),
    (
        "log_every",
        10,
        "steps between reads of loss, grad norm and speed from the GPU (the loop "
        "does not wait for the GPU in between; metrics.jsonl still has every step)",
    ),
)
OUTPUT_OPTIONS = (("save_every", 0, "checkpoint every N steps and at the last; 0: off"),)
# --keep-checkpoints' default, filled in after parsing: given without --save-every (no
# checkpoint is written), it is refused rather than ignored.
KEEP_CHECKPOINTS = 2
VERSIONED = ("fp8-quant", "fp8-optim", "fp8-activations", "coat-models", "torch", "triton",
             "transformers")  # fmt: skip


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _mode_list(text: str) -> str:
    """``--compare``'s type: comma-separated modes, each once; the names joined by commas."""
    names = [s.strip() for s in text.split(",")]
    if not any(names):  # `--compare ""` must not fall back to the default mode
        raise argparse.ArgumentTypeError(f"names no mode: list some of {', '.join(MODES)}")
    if not all(names):  # `bf16,,coat` or `bf16,`: a mode left out by mistake?
        raise argparse.ArgumentTypeError(f"has an empty item: {text!r}")
    bad = [n for n in names if n not in MODES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown mode {', '.join(bad)}: choose from {', '.join(MODES)}"
        )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"lists a mode twice: {text}")
    return ",".join(names)


def _checkpoint_dir(text: str) -> str:
    """``--resume CHECKPOINT``'s type: a directory named ``latest`` is one too (``./latest``:
    only ``--resume`` alone means each mode's newest checkpoint under --out)."""
    if text is NEWEST:
        return text
    if not text.strip():  # (`--resume=` had meant the current directory)
        raise argparse.ArgumentTypeError(
            "is empty: pass a checkpoint directory, or --resume alone for the newest under --out"
        )
    return os.path.join(".", text) if text == NEWEST else text  # (Path would drop the ./)


def _add_fields(group, options) -> None:
    for name, default, text in options:
        if default is not None:
            text += f" (default {default})"
        group.add_argument(
            f"--{name.replace('_', '-')}", type=RANGES[name].parse, default=default, help=text
        )


def build_parser() -> argparse.ArgumentParser:
    # Checks of one option at a time are its type's; those of several options, run()'s.
    p = OneLineParser(
        prog=PROG,
        description="Train a Llama-family causal LM (or a LLaVA-style vision-language preset) with "
        "BF16 and/or COAT FP8 (activations and optimizer states) on the same data, seed and "
        "schedule, and compare loss, speed and memory. Defaults: --preset tiny on the Python "
        "standard library's own source.",
        epilog="example: coat-train --preset tiny --compare bf16,coat --out runs/demo",
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--preset",
        choices=[*PRESET_NAMES, *VL_PRESET_NAMES],
        help="Llama shape built in code, random init (default: tiny); llava-tiny and vila-7b: "
        "LLaVA-style vision-language models trained on a generated shapes-caption task",
    )
    m.add_argument(
        "--model-dir",
        help="Hugging Face config or checkpoint directory on disk; trained with the 125m "
        "preset's batch size, length, steps, lr and warmup unless given",
    )
    m.add_argument(
        "--vocab-size",
        type=int_in(1, 2**40, why=" (token ids, 2^40 at most)"),
        help="override a language preset's vocabulary (default: 32000, tiny: the data's; "
        "refused for the vision-language presets)",
    )
    r = p.add_argument_group("precision")
    r.add_argument("--mode", choices=list(MODES), help="one precision mode (default: bf16)")
    r.add_argument(
        "--compare",
        type=_mode_list,
        metavar="MODES",
        help="comma-separated modes trained one after another, e.g. bf16,coat",
    )
    r.add_argument(
        "--fp8-weight-cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="FP8 activations: keep each weight's FP8 copies (2 bytes/param) between "
        "micro-batches until the optimizer step; saves casts with --grad-accum, costs memory "
        "(default: on with --grad-accum > 1, with or without --compile; off under --fsdp and "
        "where CUDA graphs or launch plans run, which they do by default on CUDA GPUs: graphs "
        "in one process, plans under --fsdp and --ddp)",
    )
    r.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="FP8 activations on CUDA: replay the COAT decoder layers as CUDA graphs (faster "
        "when the host cannot keep up; same numbers; the graphs' pool costs memory); other "
        "modes of --compare run as usual; under --ddp when asked for (default: on in one process "
        "on a CUDA GPU, without --activation-checkpointing, --fp8-weight-cache or --compile)",
    )
    r.add_argument(
        "--launch-plans",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="FP8 activations: record each COAT decoder layer's step once and replay its "
        "kernels from the record (coat_models.plans; same numbers, eager semantics, little host "
        "time); an alternative to CUDA graphs, which it turns off; FP8 weight cache off; not "
        "with --activation-checkpointing or --compile (default: on under --fsdp and --ddp on "
        "CUDA GPUs, without --activation-checkpointing, --compile, --cuda-graphs or "
        "--fp8-weight-cache)",
    )
    r.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each decoder layer (coat_models.compile_layers; every mode): the "
        "layer's forward and backward run as one compiled graph each, COAT's FP8 kernels "
        "inside; the first step compiles (tens of seconds); replaces CUDA graphs; with "
        "--fsdp, --ddp and --activation-checkpointing too",
    )
    r.add_argument(
        "--master-dtype",
        choices=list(MASTER_DTYPE_NAMES),
        default="fp32",
        help="master weights (default fp32); bf16 needs CoatAdamW (modes coat, coat-optim); "
        "in --compare, modes with torch AdamW keep fp32",
    )
    d = p.add_argument_group("data")
    d.add_argument(
        "--data",
        help="text file, or token ids in .npy / .bin (default: the interpreter's stdlib .py "
        "source, byte-level)",
    )
    # No parser defaults for these three: see DATA_DEFAULTS.
    d.add_argument(
        "--data-dtype",
        choices=["uint16", "int32"],
        help=f"dtype of a .bin --data file (default {DATA_DEFAULTS['data_dtype']})",
    )
    d.add_argument(
        "--val-fraction",
        type=float_in(0, 1, exclusive=True),
        help=f"held-out tail of a --data file (default {DATA_DEFAULTS['val_fraction']}; the "
        "built-in corpus holds out every 20th file)",
    )
    d.add_argument(
        "--corpus-mib",
        type=float_in(0, exclusive=True),
        help=f"cap on the built-in corpus size (default {DATA_DEFAULTS['corpus_mib']:g})",
    )
    t = p.add_argument_group("training (where no default is stated: the preset's)")
    _add_fields(t, TRAIN_OPTIONS)
    g = p.add_argument_group(
        "several GPUs (under torchrun --nproc-per-node N; rank r takes micro-batches "
        "r, N + r, ...: N ranks with --grad-accum A see the tokens of one process with N*A)"
    )
    g.add_argument(
        "--fsdp",
        action="store_true",
        help="FSDP2: parameters, gradients and optimizer states sharded over the ranks; bf16 "
        "compute, fp32 gradient reduction",
    )
    g.add_argument(
        "--ddp",
        action="store_true",
        help="DDP: every rank holds the whole model and optimizer; gradients all-reduced",
    )
    g.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each decoder layer in backward: less memory, same numbers (also in "
        "one process)",
    )
    g.add_argument(
        "--no-reshard-after-forward",
        dest="reshard_after_forward",
        action="store_const",
        const=False,  # default None: FSDP2's own default, resharding after forward
        help="with --fsdp: keep each decoder layer's gathered weights from its forward to its "
        "backward (FSDP2's reshard_after_forward=False): one all-gather a layer and "
        "micro-batch fewer, the same numbers, the whole model's gathered weights more memory "
        "on every rank",
    )
    o = p.add_argument_group("output and checkpoints")
    o.add_argument(
        "--out",
        default="runs/coat-train",
        help="output directory, made with any missing parents; an existing one may hold other "
        "files, but none that coat-train would replace and did not write (default %(default)s)",
    )
    _add_fields(o, OUTPUT_OPTIONS)
    o.add_argument(
        "--keep-checkpoints",
        type=RANGES["keep_checkpoints"].parse,
        help=f"newest N kept per mode, with --save-every (default {KEEP_CHECKPOINTS})",
    )
    o.add_argument(
        "--resume",
        nargs="?",
        const=NEWEST,
        type=_checkpoint_dir,
        metavar="CHECKPOINT",
        help="continue from each mode's newest checkpoint under --out, or from the given "
        "checkpoint directory (single mode)",
    )
    o.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    o.add_argument(
        "--no-export",
        action="store_true",
        help="do not write the trained model to <out>/<mode>/final (a Hugging Face directory "
        "in the master dtype: 27 GB per mode for a 7B model in fp32)",
    )
    o.add_argument(
        "--report-to",
        choices=list(REPORT_TO),
        default="none",
        help="metrics besides --out/MODE/metrics.jsonl: tensorboard writes event files to "
        "--out/MODE/tensorboard (needs the tensorboard package; default: none)",
    )
    h = p.add_argument_group("machine")
    h.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: cuda where available, else cpu (default auto)",
    )
    # Far more threads than cores only slows torch down; tens of thousands crash it.
    h.add_argument(
        "--threads",
        type=int_in(1, os.cpu_count() or 1, why=" (this machine's CPUs)"),
        help="CPU threads of torch (default: its own choice); 1 avoids OpenMP's spin-waits "
        "slowing a small model down many times on a machine busy with other work",
    )
    p.add_argument(
        "--version",
        action="store_true",
        help="print the versions of the COAT packages, torch, triton and transformers, and exit",
    )
    return p


def versions() -> str:
    """``--version``'s lines: each of ``VERSIONED`` with its installed version (from the
    packages' metadata: nothing is imported)."""
    return "\n".join(f"{name} {_version(name)}" for name in VERSIONED)
