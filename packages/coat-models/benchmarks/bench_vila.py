"""VILA1.5-7B shapes, one stage-3 SFT step (vision tower frozen; projector, LM and head
trained): peak memory and step time of BF16 against COAT on one GPU.

- bf16: bf16 autocast, torch AdamW (fused) with fp32 master weights and states;
- coat: ``apply_coat_vlm(freeze_vision=True)`` (fused COAT Llama blocks, FP8 projector) and
  ``create_optimizer`` (CoatAdamW, FP8 states), fp32 master weights, bf16 autocast.

Batches of the shapes-caption task (``coat_models.vl_data``) at 384 x 384 (729 image tokens
each), every sequence padded to 2048 tokens: cases ``SEQSxIMAGES`` = sequences x images per
sequence, by default 1x1, 1x2 (2048 tokens) and 2x2 (4 images, 2 x 2048 tokens). Per case one
warm-up step, then ``BENCH_VILA_STEPS`` (3) timed steps; peak = ``torch.cuda.max_memory_allocated``
over the timed steps (weights, gradients, optimizer state and activations all live).
Target: COAT peak >= 1.4x lower and steps faster than BF16.

    pytest -s -o python_files='bench_*.py' --benchmark-only \
        packages/coat-models/benchmarks/bench_vila.py
    python packages/coat-models/benchmarks/bench_vila.py    # the same without pytest

Prints a table; writes JSON to ``$BENCH_OUT`` when set. ``BENCH_VILA_CASES=1x1,1x2`` picks
cases. Skips without CUDA. About 3 minutes on an H200 (two 7 B models built one after the
other).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time

import pytest
import torch
from coat_models.vila import vila7b_config
from coat_models.vl_data import ShapesCaptions, num_image_tokens
from coat_models.vl_train import build_vlm, prepare_vlm, vlm_loss

MODES = ("bf16", "coat")
SEQ_LEN = 2048
TARGET_MEMORY_RATIO = 1.4


def _cases() -> list[tuple[int, int]]:
    spec = os.environ.get("BENCH_VILA_CASES", "1x1,1x2,2x2")
    return [tuple(int(n) for n in case.split("x")) for case in spec.split(",")]


def _step(model, optimizer, batch, device) -> float:
    """One SFT step (forward, backward, clip, optimizer); returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    loss = vlm_loss(model, batch, device)
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
    """Measure every case in both modes; returns ``{"cases": [...], ...}`` (see the table)."""
    config = config or vila7b_config()
    cases = cases or _cases()
    steps = steps or int(os.environ.get("BENCH_VILA_STEPS", "3"))
    device = torch.device(device)
    image_tokens = num_image_tokens(config)
    results = {
        f"{s}x{i}": {"sequences": s, "images": s * i, "tokens": s * SEQ_LEN} for s, i in cases
    }
    params = {}
    for mode in MODES:
        model = build_vlm(config, device=device, seed=0)
        model, optimizer = prepare_vlm(model, mode, lr=2e-5, freeze_vision=True)
        params = {
            "params": sum(p.numel() for p in model.parameters()),
            "trained_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        }
        for seqs, images in cases:
            task = ShapesCaptions(config.vision_config.image_size, image_tokens,
                                  config.image_token_id, images_per_sample=images,
                                  seq_len=SEQ_LEN)  # fmt: skip
            batch = task.batch(0, seqs)
            try:
                results[f"{seqs}x{images}"][mode] = _measure(model, optimizer, batch, device, steps)
            except torch.OutOfMemoryError:
                results[f"{seqs}x{images}"][mode] = None  # larger cases would not fit either
                optimizer.zero_grad(set_to_none=True)
                break
        del model, optimizer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for r in results.values():
        b, c = r.get("bf16"), r.get("coat")
        if b and c and b["peak_bytes"]:
            r["memory_ratio"] = b["peak_bytes"] / c["peak_bytes"]
            r["speedup"] = b["step_s"] / c["step_s"]
            r["target_met"] = r["memory_ratio"] >= TARGET_MEMORY_RATIO and r["speedup"] > 1
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        **params,
        "timed_steps": steps,
        "cases": results,
    }


def format_table(out: dict) -> str:
    gb = lambda r: "OOM" if r is None else f"{(r['peak_bytes'] or 0) / 1e9:.1f}"
    ms = lambda r: "OOM" if r is None else f"{r['step_s'] * 1e3:.0f}"
    head = ("case", "images", "tokens", "bf16 GB", "coat GB", "memory", "bf16 ms", "coat ms",
            "speedup", "target")  # fmt: skip
    rows = [head]
    for name, r in out["cases"].items():
        b, c = r.get("bf16"), r.get("coat")
        rows.append((name, str(r["images"]), str(r["tokens"]), gb(b), gb(c),
                     f"{r['memory_ratio']:.2f}x" if "memory_ratio" in r else "",
                     ms(b), ms(c), f"{r['speedup']:.2f}x" if "speedup" in r else "",
                     {True: "met", False: "MISSED"}.get(r.get("target"), "")))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(
        [f"VILA1.5-7B shapes, stage-3 SFT step (tower frozen), {out['device']}, torch "
         f"{out['torch']}; peak = max_memory_allocated, GB = 1e9 bytes; median of "
         f"{out['timed_steps']} steps", *lines,
         f"target: memory >= {TARGET_MEMORY_RATIO}x lower and speedup > 1x"]
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
    for r in out["cases"].values():
        assert r.get("coat") is not None, "COAT ran out of memory"


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("bench_vila needs a CUDA GPU")
    report(run())
