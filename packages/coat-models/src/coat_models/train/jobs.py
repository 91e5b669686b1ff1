"""What a coat-train run trains (its job): the model builder, the data and one task per mode, for
a preset, a ``--model-dir`` or a vision-language preset, with the checks that need them (the
architecture, the sequence length, the memory the model and its logits need), all before
``--out`` is touched."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .args import UsageError
from .data import BYTE_EOS, DataError, load_data
from .options import DATA_DEFAULTS
from .presets import (
    ModelError,
    build_model,
    build_vlm,
    check_causal_config,
    check_weight_shapes,
    first_line,
    longest_sequence,
    model_dir_config,
    model_dir_tokenizer,
    preset_config,
    quiet_transformers,
    vl_min_seq_len,
    vl_param_count,
)
from .report import fmt_bytes
from .tasks import LMTask, VLTask
from .trainer import MASTER_DTYPES, MODES, TrainConfig
from .vl_data import MICRO_BATCHES


def check_fits(n_params, modes, masters, device, label, strategy, cfg, vocab, tune) -> None:
    """Refuse up front a model whose weights, gradients and optimizer state alone exceed the
    device's memory (CPU: physical RAM, shared by the ranks of this machine), or a micro-batch
    whose logits over ``vocab`` alone do, instead of being killed half-way (on CPU the
    kernel's OOM killer ends the process without a word). FSDP2 splits the former."""
    shards = dist.get_world_size() if strategy == "fsdp" else 1
    sharing = 1
    if device.type == "cuda":
        total, where = torch.cuda.get_device_properties(device).total_memory, "the GPU"
    else:
        total, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine"
        if strategy:  # the ranks of this machine share its RAM
            sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # No tokenizer has a million tokens: such a vocabulary (the data's largest id + 1) says
    # the ids were misread, which no smaller model or master dtype fixes.
    odd = (
        f" (a vocabulary of {vocab:,} tokens: if it is the data's largest id + 1, check "
        "--data-dtype and the file's ids; else --vocab-size)"
        if vocab > 2**20
        else ""
    )
    for mode, master in zip(modes, masters, strict=True):
        w = 4 if master == "fp32" else 2
        # Every rank first builds the whole model in its master dtype, then shards it.
        whole = n_params * w * sharing
        if shards > 1 and whole > total:
            raise UsageError(
                f"{label} has {n_params / 1e9:.2f} B parameters: under --fsdp every rank first "
                f"builds the whole model ({fmt_bytes(whole)} in {master}) before sharding it, "
                f"but {where} has {fmt_bytes(total)}: choose a smaller model or "
                f"--master-dtype bf16{odd}"
            )
        # weights and gradients, and the optimizer state: CoatAdamW ~2.08 B, torch AdamW 8 B
        need = n_params * (2 * w + (2 if MODES[mode][1] else 8)) * sharing // shards
        if need > total:
            # (only what is not in effect already: coat with bf16 masters was told to use them)
            smaller = [] if MODES[mode][1] else ["--mode coat (or coat-optim)"]
            if master != "bf16":
                smaller.append("--master-dtype bf16")
            how = f", or {' with '.join(smaller)}" if smaller else ""
            raise UsageError(
                f"{label} has {n_params / 1e9:.2f} B parameters: mode {mode} ({master} master) "
                f"needs at least {fmt_bytes(need)} for weights, gradients and optimizer state, "
                f"but {where} has {fmt_bytes(total)}: choose a smaller model{how}{odd}"
            )
    # The loss reads the logits of every position: bf16 from the head and their fp32 copy
    # (transformers upcasts before cross-entropy) exist together, besides everything else.
    logits = cfg.batch_size * cfg.seq_len * vocab * (2 + 4) * sharing
    if logits > total:
        raise UsageError(
            f"a micro-batch of {cfg.batch_size} x {cfg.seq_len} tokens needs at least "
            f"{fmt_bytes(logits)} for its logits (vocab {vocab}), but {where} has "
            f"{fmt_bytes(total)}: lower --batch-size (raise --grad-accum to keep the batch){tune}"
            f"{odd}"
        )


@dataclass(frozen=True)
class Job:
    """What ``run`` trains, checked before ``--out`` is touched."""

    tasks: list  # one per mode: tasks.LMTask or tasks.VLTask
    build: Callable[[TrainConfig], torch.nn.Module]  # the mode's model, seeded, on the device
    n_params: int
    describe: dict  # the model, in summaries and checkpoints (resume refuses another)
    shape: str  # e.g. "0.89 M params, vocab 320", for the header
    data: str  # the data in the header
    source: str  # the data in summary.json
    vocab: int  # the logits' width
    tokenizer: object = None  # exported with the model
    tune: str = " or --seq-len"  # what else to lower when memory runs out


def count_params(config, modes, weights_dir=None, model_dir=None) -> int:
    """Parameters of the model ``config`` describes, built on the meta device (no memory).
    For modes with FP8 activations, ``apply_coat``'s checks run on it too (the structure,
    and its probe of the layers' arithmetic on narrow CPU copies), so an architecture it
    does not support is refused before anything is written (under --compare bf16,coat
    too: the check at coat's start came after bf16 had trained), naming the modes that
    train it unless ``model_dir``'s model is not causal (then no mode does); so are
    ``weights_dir``'s safetensors weights whose shapes are not the config's."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"), quiet_transformers():
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as e:  # e.g. a config transformers has no causal LM for (T5, BART)
        raise ModelError(
            f"cannot build a causal LM from this config: {first_line(e)}; coat-train trains "
            "decoder-only models (Llama, Mistral, Qwen2, ...)"
        ) from None
    except RuntimeError as e:  # sizes torch refuses (a negative hidden_size); meta: no OOM
        raise ModelError(
            f"cannot build a causal LM from this config ({first_line(e)}): check its sizes"
        ) from None
    except Exception as e:  # values its code cannot take (a None where a number goes)
        raise ModelError(
            f"cannot build a causal LM from this config ({type(e).__name__}: {first_line(e)}): "
            "check its config.json"
        ) from None
    if weights_dir is not None:
        check_weight_shapes(Path(weights_dir), model)
    fp8 = [m for m in modes if MODES[m][0]]
    if fp8:
        from coat_models import apply_coat
        from coat_models.llama import FILTER_HINT

        try:
            apply_coat(model)
        except TypeError as e:
            # The reason without apply_coat's long text of what it supports (the remedy
            # below says it), nor its option (no CLI flag has it).
            why = getattr(e, "reason", str(e)).replace(FILTER_HINT, "")
            if model_dir is not None:  # (bf16 and coat-optim refuse what is not causal)
                check_causal_config(config, model_dir)
            raise ModelError(
                f"mode {fp8[0]}: {why}; train it in bf16 or coat-optim, or pass a Llama-shaped "
                "model"
            ) from None
    return sum(p.numel() for p in model.parameters())


def lm_job(args, cfgs, modes, device, label) -> Job:
    """A causal LM: model config first (cheap), then data (the tokenizer may come from the
    model dir)."""
    seq_len = cfgs[0].seq_len  # the same in every mode
    weights_dir = tokenizer = None
    if args.model_dir:
        config, has_weights = model_dir_config(args.model_dir)
        longest = longest_sequence(config)  # (presets size their positions to the run)
        if longest is not None and longest[0] < seq_len:
            default = " (the default)" if args.seq_len is None else ""
            raise UsageError(
                f"--seq-len {seq_len}{default} is longer than --model-dir {args.model_dir}'s "
                f"{longest[1]}: pass --seq-len <= {longest[0]}"
            )
        weights_dir = args.model_dir if has_weights else None
        tokenizer = model_dir_tokenizer(args.model_dir)
    given = {k: getattr(args, k, None) for k in DATA_DEFAULTS}
    used = {k: DATA_DEFAULTS[k] if v is None else v for k, v in given.items()}
    data = load_data(
        args.data,
        bin_dtype=used["data_dtype"],
        dtype_given=given["data_dtype"] is not None,
        val_fraction=used["val_fraction"],
        max_bytes=int(used["corpus_mib"] * 2**20),
        tokenizer=tokenizer,
    )
    if not args.model_dir:
        config = preset_config(args.preset or "tiny", data.vocab_size, args.vocab_size, seq_len)
        if data.builtin and tokenizer is None:
            # The byte-level corpus ends each file with BYTE_EOS: the exported model's
            # generate() stops there (its config named no end-of-sequence id).
            config.eos_token_id = BYTE_EOS
    data.check_fits(config.vocab_size, model_dir=bool(args.model_dir))
    huge = config.vocab_size > 2**20 and not (args.vocab_size or args.model_dir)
    if data.vocab_from == "ids" and huge:
        # No tokenizer has a million tokens: ids that need one were misread (the model sized
        # to them passed the memory check and was then killed without a word).
        raise DataError(
            f"the data's largest token id is {data.vocab_size - 1:,}: no tokenizer has so many "
            "tokens; check the file's ids and --data-dtype (a .bin is uint16 unless told), or "
            f"pass --vocab-size {config.vocab_size} to train such a vocabulary anyway"
        )
    tasks = [LMTask(data, cfg) for cfg in cfgs]  # refuses too short a split
    n_params = count_params(config, modes, weights_dir, args.model_dir)

    def build(cfg):
        master = MASTER_DTYPES[cfg.master_dtype]
        return build_model(
            config, device=device, master_dtype=master, seed=cfg.seed, weights_dir=weights_dir,
            model_dir=args.model_dir, seq_len=cfg.seq_len,
        )  # fmt: skip

    return Job(
        tasks=tasks,
        build=build,
        n_params=n_params,
        describe={
            "model": label,
            "params": n_params,
            "vocab_size": config.vocab_size,
            **({"config": config_fingerprint(args.model_dir)} if args.model_dir else {}),
        },
        shape=f"{n_params / 1e6:.2f} M params, vocab {config.vocab_size}",
        data=f"{data.source}, {len(data.train):,} train / {len(data.val):,} val tokens",
        source=data.source,
        vocab=config.vocab_size,
        tokenizer=tokenizer,
    )


def vl_job(args, cfgs, device, label) -> Job:
    """A vision-language preset on the generated shapes-caption task."""
    name, need = args.preset, vl_min_seq_len(args.preset)
    if cfgs[0].seq_len < need:
        raise UsageError(
            f"--seq-len {cfgs[0].seq_len} is too short for --preset {name}: its images and "
            f"their captions need {need} tokens: pass --seq-len >= {need} or leave it out"
        )
    tasks = [VLTask(name, cfg) for cfg in cfgs]
    world = dist.get_world_size() if dist.is_initialized() else 1
    if cfgs[0].grad_accum * world > MICRO_BATCHES:
        raise UsageError(
            f"--grad-accum {cfgs[0].grad_accum} x {world} rank(s) is past the {MICRO_BATCHES} "
            f"micro-batches a step of --preset {name}'s generated data holds: lower --grad-accum"
        )
    longest = tasks[0].config.text_config.max_position_embeddings
    if cfgs[0].seq_len > longest:  # (positions past the table: a model unlike its export)
        raise UsageError(
            f"--seq-len {cfgs[0].seq_len} is longer than --preset {name}'s position table "
            f"({longest}): pass --seq-len <= {longest} or leave it out"
        )
    n_params = vl_param_count(name)

    def build(cfg):
        master = MASTER_DTYPES[cfg.master_dtype]
        return build_vlm(tasks[0].config, device=device, master_dtype=master, seed=cfg.seed)

    return Job(
        tasks=tasks,
        build=build,
        n_params=n_params,
        describe={"model": label, "params": n_params},
        shape=f"{n_params / 1e6:.2f} M params, LLaVA-style",
        data="generated shapes-caption images",
        source="shapes-caption (generated)",
        vocab=tasks[0].config.text_config.vocab_size,
        tune="",
    )


# Keys of a config.json that do not change what is trained: where it was read from, the
# transformers that wrote it, the dtype it was saved in (runs build in --master-dtype).
_UNTRAINED_KEYS = ("_name_or_path", "transformers_version", "dtype", "torch_dtype",
                   "_commit_hash", "_attn_implementation_autoset")  # fmt: skip


def config_fingerprint(model_dir) -> str:
    """A short SHA-256 of a model dir's ``config.json`` as written (``_UNTRAINED_KEYS``
    aside; not of transformers' config object, whose defaults move with its version): what a
    resume compares, so that a moved copy of a model dir resumes and an edited one does not."""
    written = json.loads((Path(model_dir) / "config.json").read_text())
    settings = {k: v for k, v in written.items() if k not in _UNTRAINED_KEYS}
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
