"""VILA1.5-7B shapes, one stage-3 SFT step (vision tower frozen; projector, LM and head
trained): peak memory and step time of BF16 against COAT on one GPU.

- bf16: bf16 autocast, torch AdamW (fused) with fp32 master weights and states;
- coat: ``apply_coat_vlm(freeze_vision=True)`` (fused COAT Llama blocks, FP8 projector) and
  ``create_optimizer`` (CoatAdamW, FP8 states), fp32 master weights, bf16 autocast;
- coat-nocache: the same with ``FP8ActivationConfig(weight_cache=False)`` (no persistent FP8
  weights);
- coat-graphs: coat-nocache with ``coat_models.enable_cuda_graphs`` (the LM's decoder layers
  replayed from CUDA graphs, recorded in the warm-up step: no host time per kernel).

Batches of the shapes-caption task (``coat_models.train.vl_data``) at 384 x 384 (729 image tokens
each), every sequence padded to 2048 tokens: cases ``SEQSxIMAGES`` = sequences x images per
sequence, by default 1x1, 1x2 (2048 tokens) and 2x2 (4 images, 2 x 2048 tokens). Per case
one warm-up step, then ``BENCH_VILA_STEPS`` (3) timed steps; peak is
``torch.cuda.max_memory_allocated`` over the timed steps (weights, gradients, optimizer state
and activations all live). Target: peak >= 1.4x lower than bf16 and faster steps.

    pytest -s -o python_files='bench_*.py' --benchmark-only \
        packages/coat-models/benchmarks/bench_vila.py
    python packages/coat-models/benchmarks/bench_vila.py    # the same without pytest

Prints a table; writes JSON to ``$BENCH_OUT`` when set. ``BENCH_VILA_CASES=1x1,1x2`` picks
cases, ``BENCH_VILA_VARIANTS=coat-nocache,coat-graphs`` variants (bf16 always runs). Skips
without CUDA. The 7 B models are built one after the other (about 1.5 minutes each on an
H200 with three cases).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time

import pytest
import torch
from coat_models import create_optimizer, param_groups
from coat_models.train.presets import build_vlm
from coat_models.train.vl_data import ShapesCaptions, num_image_tokens
from coat_models.vila import _llava_parts, apply_coat_vlm, vila7b_config

SEQ_LEN = 2048
TARGET_MEMORY_RATIO = 1.4


def _variants() -> dict:
    """name -> (mode, FP8ActivationConfig or None). ``coat`` runs the defaults, which keep an
    FP8 copy of every weight in both layouts (``weight_cache``: 2 B/param, 13 GB at 6.6 B
    trained params); ``coat-nocache`` re-casts weights on the fly instead."""
    from fp8_activations import FP8ActivationConfig

    variants = {"bf16": ("bf16", None), "coat": ("coat", None),
                "coat-nocache": ("coat", FP8ActivationConfig(weight_cache=False)),
                "coat-graphs": ("coat", FP8ActivationConfig(weight_cache=False))}  # fmt: skip
    # BENCH_VILA_VARIANTS=bf16,coat-graphs picks some (bf16 is always measured: the baseline).
    picked = os.environ.get("BENCH_VILA_VARIANTS")
    if picked:
        names = {n.strip() for n in picked.split(",") if n.strip()}
        unknown = sorted(names - set(variants))
        if unknown:  # (a misspelt one was dropped: bf16 alone ran)
            raise ValueError(
                f"BENCH_VILA_VARIANTS: unknown {', '.join(unknown)}: pick from "
                f"{', '.join(variants)}"
            )
        variants = {k: v for k, v in variants.items() if k in names | {"bf16"}}
    return variants


def _cases() -> list[tuple[int, int]]:
    """``BENCH_VILA_CASES``: (sequences, images per sequence) pairs, ``BxI`` comma-separated."""
    spec = os.environ.get("BENCH_VILA_CASES", "1x1,1x2,2x2")
    try:
        cases = [tuple(int(n) for n in case.split("x")) for case in spec.split(",")]
    except ValueError:
        cases = []
    if not cases or any(len(c) != 2 or min(c) < 1 for c in cases):
        raise ValueError(
            f"BENCH_VILA_CASES={spec!r}: pass sequences x images per sequence, each >= 1, "
            "e.g. 1x1,1x2,2x2"
        )
    return cases


def _steps() -> int:
    spec = os.environ.get("BENCH_VILA_STEPS", "3")
    if not spec.isdigit() or int(spec) < 1:
        raise ValueError(f"BENCH_VILA_STEPS={spec!r}: pass an integer >= 1")
    return int(spec)


def _prepare(model, mode: str, fp8_config):
    """(model, optimizer) of a stage-3 step, as coat-train prepares the vila-7b preset: the
    tower frozen; coat: ``apply_coat_vlm`` (``fp8_config``, None: its defaults) and
    CoatAdamW; bf16: torch AdamW (fused), decay on matrices only."""
    if mode == "coat":
        apply_coat_vlm(model, config=fp8_config, freeze_vision=True)
        return model, create_optimizer(model, lr=2e-5)
    _llava_parts(model).vision_tower.requires_grad_(False)
    groups = param_groups(model, weight_decay=0.1)
    return model, torch.optim.AdamW(groups, lr=2e-5, betas=(0.9, 0.95), fused=True)


def _step(model, optimizer, batch, device) -> float:
    """One SFT step (forward, backward, clip, optimizer); returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(**batch).loss
    loss.backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(trained, 1.0)
    optimizer.step()
    return loss.item()


def _measure(model, optimizer, batch, device, steps: int) -> dict:
    _step(model, optimizer, batch, device)  # warm-up: optimizer state, kernels, caches
    cuda = device.type == "cuda"  # CPU: a smoke run of the code, no memory statistics
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(_step(model, optimizer, batch, device))  # .item() syncs
        times.append(time.perf_counter() - t0)
    return {
        "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "step_s": statistics.median(times),
        "loss": losses[-1],
    }


def run(config=None, cases=None, steps: int | None = None, device="cuda") -> dict:
    """Measure every case with every variant; returns ``{"rows": [...], ...}``."""
    config = config or vila7b_config()
    cases = cases or _cases()
    steps = steps or _steps()
    device = torch.device(device)
    image_tokens = num_image_tokens(config)
    rows, params = [], {}
    for variant, (mode, fp8_config) in _variants().items():
        model = build_vlm(config, device=device, seed=0)
        model, optimizer = _prepare(model, mode, fp8_config)
        if variant == "coat-graphs":
            from coat_models import enable_cuda_graphs

            enable_cuda_graphs(model)
        params = {
            "params": sum(p.numel() for p in model.parameters()),
            "trained_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        }
        for seqs, images in cases:
            task = ShapesCaptions(config.vision_config.image_size, image_tokens,
                                  config.image_token_id, images_per_sample=images,
                                  seq_len=SEQ_LEN)  # fmt: skip
            row = {"case": f"{seqs}x{images}", "variant": variant, "images": seqs * images,
                   "tokens": seqs * SEQ_LEN}  # fmt: skip
            rows.append(row)
            try:
                row.update(_measure(model, optimizer, task.batch(0, seqs), device, steps))
                if variant == "coat-graphs":  # whether the layers really ran from graphs
                    row["graphed"] = all(
                        m.__dict__.get("_coat_graphed") is not None
                        for m in model.modules() if "_coat_graphed" in m.__dict__
                    )  # fmt: skip
            except torch.OutOfMemoryError:
                row["oom"] = True  # larger cases would not fit either
                optimizer.zero_grad(set_to_none=True)
                break
        del model, optimizer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = {r["case"]: r for r in rows if r["variant"] == "bf16"}
    for r in rows:
        b = base.get(r["case"], {})
        if r["variant"] != "bf16" and r.get("peak_bytes") and b.get("peak_bytes"):
            r["memory_ratio"] = b["peak_bytes"] / r["peak_bytes"]
            r["speedup"] = b["step_s"] / r["step_s"]
            r["target_met"] = r["memory_ratio"] >= TARGET_MEMORY_RATIO and r["speedup"] > 1
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        **params,
        "seq_len": SEQ_LEN,
        "timed_steps": steps,
        "rows": rows,
    }


def format_table(out: dict) -> str:
    head = ("case", "images", "tokens", "variant", "peak GB", "bf16/this", "step ms",
            "speedup", "target")  # fmt: skip
    lines = [head]
    for r in out["rows"]:
        oom = r.get("oom")
        lines.append((
            r["case"], str(r["images"]), str(r["tokens"]),
            r["variant"] + ("" if r.get("graphed", True) else " (NOT graphed)"),
            "OOM" if oom else f"{(r['peak_bytes'] or 0) / 1e9:.2f}",
            f"{r['memory_ratio']:.2f}x" if "memory_ratio" in r else "",
            "OOM" if oom else f"{r['step_s'] * 1e3:.0f}",
            f"{r['speedup']:.2f}x" if "speedup" in r else "",
            {True: "met", False: "MISSED"}.get(r.get("target_met"), ""),
        ))  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    table = ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join(
        [f"VILA1.5-7B shapes ({out['params']:,} params, {out['trained_params']:,} trained), "
         f"stage-3 SFT step, tower frozen; {out['device']}, torch {out['torch']}",
         f"peak = max_memory_allocated over {out['timed_steps']} steps after a warm-up step "
         f"(GB = 1e9 B); step = median; cases SEQSxIMAGES, {out['seq_len']} tokens a sequence",
         *table,
         f"target: peak >= {TARGET_MEMORY_RATIO}x lower than bf16 and speedup > 1x"]
    )  # fmt: skip


def report(out: dict) -> None:
    print(format_table(out))
    path = os.environ.get("BENCH_OUT")
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_vila7b_sft_step_bf16_vs_coat(benchmark):
    out = benchmark.pedantic(run, rounds=1, iterations=1)
    report(out)
    assert not any(r.get("oom") for r in out["rows"] if r["variant"] != "bf16"), "COAT OOM"


if __name__ == "__main__":
    from coat_models.train.args import OneLineParser, UsageError, writable_file

    parser = OneLineParser(
        prog="bench_vila.py",
        description="VILA1.5-7B stage-3 SFT step, bf16 against COAT (settings: the "
        "BENCH_VILA_* and BENCH_OUT variables of this file's docstring)",
    )
    parser.parse_args()
    try:
        _variants(), _cases(), _steps()
        writable_file(os.environ.get("BENCH_OUT"), "BENCH_OUT")
    except (ValueError, UsageError) as e:
        parser.error(str(e))
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    report(run())
