"""Llama-2-7B shapes trained with FSDP2 on every GPU of one host, seq 2048: per-GPU peak
memory and tokens/s per GPU of ``bf16`` and ``coat`` at each micro-batch, up to each mode's
largest that fits.

Run on 2 GPUs (any N works)::

    P=packages; export PYTHONPATH=$P/fp8-quant/src:$P/fp8-optim/src
    export PYTHONPATH=$PYTHONPATH:$P/fp8-activations/src:$P/coat-models/src
    BENCH_OUT=bench_fsdp.json torchrun --standalone --nproc-per-node 2 \\
        packages/coat-models/benchmarks/bench_fsdp.py

Both modes: ``shard_model`` (``fully_shard`` per decoder layer, then the root) with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, fp32 master weights, gradient
clipping at 1.0, no activation checkpointing (``--activation-checkpointing`` turns it on),
each layer resharded after its forward (``--no-reshard-after-forward`` keeps it gathered until
its backward, as coat-train's flag of that name does).

* ``bf16``: ``torch.optim.AdamW(fused=True)``, fp32 moments (8 B/param).
* ``coat``: ``apply_coat`` (FP8 activations, FP8 GEMMs) and ``CoatAdamW`` (FP8 moments,
  2.08 B/param; each rank updates its DTensor shards).

Per (mode, micro-batch) in ``--micro-batches`` order (default 1,2,4,8): ``--warmup`` steps,
then ``--steps`` timed steps (forward, backward, clip, optimizer step, zero_grad) between two
CUDA synchronizations. Peak = ``torch.cuda.max_memory_allocated`` over the timed steps (the
optimizer states exist by then), the max over ranks, in GiB (2^30 bytes). Tokens/s per GPU =
micro-batch x seq x steps / time of the slowest rank. A mode's search stops at its first
out-of-memory micro-batch (caught on every rank; the ranks then agree before going on). A
trial that would start after ``--budget-s`` seconds is skipped, so the run ends in time
(default 420 s: under the 8-minute slot with model builds included). Rank 0 prints a table
and, if ``BENCH_OUT`` is set, writes JSON there after every trial.

Not a pytest-benchmark suite (pytest collects nothing here): it needs one process per GPU.
On CPU (``--preset tiny --seq-len 128``, gloo) it runs the same code as a smoke test.
"""

from __future__ import annotations

import gc
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

# Fewer fragments: both modes reach larger micro-batches. Must be set before CUDA starts.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

GIB = 2**30


MODES = ("bf16", "coat")


def parse_args(argv=None):
    from coat_models.train.args import (
        OneLineParser,
        UsageError,
        float_in,
        int_in,
        int_list,
        name_list,
        writable_file,
    )
    from coat_models.train.presets import PRESETS

    p = OneLineParser(prog="bench_fsdp.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama2-7b", choices=PRESETS)
    p.add_argument("--seq-len", type=int_in(1), default=2048)
    p.add_argument("--micro-batches", type=int_list(1), default=[1, 2, 4, 8])
    p.add_argument("--modes", type=name_list(MODES), default=list(MODES))
    p.add_argument("--steps", type=int_in(1), default=3, help="timed steps per micro-batch")
    p.add_argument("--warmup", type=int_in(0), default=2, help="untimed steps per micro-batch")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--no-reshard-after-forward", dest="reshard", action="store_false")
    p.add_argument("--budget-s", type=float_in(0, exclusive=True), default=420.0)
    args = p.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        p.error("runs under torchrun: torchrun --standalone --nproc-per-node N bench_fsdp.py")
    try:
        writable_file(os.environ.get("BENCH_OUT"), "BENCH_OUT")
    except UsageError as e:
        p.error(str(e))
    return args


def build(mode: str, args, device: torch.device):
    """(model, optimizer) of ``mode``, sharded over all ranks."""
    from coat_models import apply_coat, create_optimizer
    from coat_models.distributed import shard_model
    from coat_models.train.presets import build_model, preset_config

    config = preset_config(args.preset, data_vocab=256, max_seq=args.seq_len)
    model = build_model(config, device=device, master_dtype=torch.float32, seed=0)
    if mode == "coat":
        apply_coat(model)
    shard_model(
        model,
        mp_policy="bf16",
        activation_checkpointing=args.activation_checkpointing,
        reshard_after_forward=args.reshard,
    )
    if mode == "coat":
        optimizer = create_optimizer(model, lr=1e-4)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(
            groups, lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda"
        )
    return model, optimizer


def train_step(model, optimizer, ids: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def trial(model, optimizer, micro_batch: int, args, device, vocab: int) -> dict:
    """Warm up, then time ``args.steps`` steps at ``micro_batch``; raises on OOM."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)

    def ids():
        return torch.randint(0, vocab, (micro_batch, args.seq_len), generator=gen).to(device)

    for _ in range(args.warmup):
        train_step(model, optimizer, ids())
    batches = [ids() for _ in range(args.steps)]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    t0 = time.perf_counter()
    for b in batches:
        loss = train_step(model, optimizer, b)
    loss = float(loss)  # syncs the device
    elapsed = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else -1
    return {"elapsed_s": elapsed, "peak_bytes": peak, "loss": loss}


def agree(ok: bool, device) -> bool:
    """True only if every rank's trial succeeded (all ranks call this after each trial)."""
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def reduce_max(x: float, device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def row_line(r: dict) -> str:
    ok = r["status"] == "ok"
    peak = f"{r['peak_bytes'] / GIB:.2f}" if ok and r["peak_bytes"] >= 0 else "-"
    tps = f"{r['tokens_per_s_per_gpu']:.0f}" if ok else "-"
    step = f"{r['step_s']:.3f}" if ok else "-"
    loss = f"{r['loss']:.3f}" if ok else "-"
    return (
        f"{r['mode']:<6} {r['micro_batch']:>11} {r['status']:<9} {peak:>12} {tps:>10} "
        f"{step:>8} {loss:>7}"
    )


def table(results: list[dict], world: int, seq: int) -> str:
    lines = [
        f"FSDP2 on {world} ranks, seq {seq}: per-GPU peak memory (GiB = 2^30 B, max over "
        "ranks) and tokens/s per GPU (slowest rank)",
        f"{'mode':<6} {'micro-batch':>11} {'status':<9} {'peak GiB/GPU':>12} "
        f"{'tok/s/GPU':>10} {'step s':>8} {'loss':>7}",
        *(row_line(r) for r in results),
    ]
    for mode in dict.fromkeys(r["mode"] for r in results):
        fits = [r for r in results if r["mode"] == mode and r["status"] == "ok"]
        if fits:
            best = fits[-1]
            peak = f"{best['peak_bytes'] / GIB:.2f} GiB/GPU" if best["peak_bytes"] >= 0 else "n/a"
            lines.append(
                f"{mode}: largest micro-batch {best['micro_batch']}, "
                f"{best['tokens_per_s_per_gpu']:.0f} tok/s/GPU, {peak}"
            )
    return "\n".join(lines)


def write_json(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)


def main(argv=None) -> None:
    from coat_models.distributed import init_distributed

    args = parse_args(argv)
    t_start = time.perf_counter()
    # An out-of-memory error that hits one rank only would leave the other waiting in a
    # collective: fail after 3 minutes instead of torch's 10.
    device = init_distributed(timeout=timedelta(minutes=3))
    rank, world = dist.get_rank(), dist.get_world_size()
    modes = args.modes
    micro_batches = args.micro_batches
    meta = {
        "preset": args.preset, "seq_len": args.seq_len, "world_size": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "steps": args.steps, "warmup": args.warmup,
        "activation_checkpointing": args.activation_checkpointing,
        "reshard_after_forward": args.reshard,
        "mp_policy": "param bf16, reduce fp32", "master_weights": "fp32",
    }  # fmt: skip
    results: list[dict] = []
    out = os.environ.get("BENCH_OUT")
    for mode in modes:
        if time.perf_counter() - t_start > args.budget_s:
            results.append({"mode": mode, "micro_batch": micro_batches[0], "status": "skipped"})
            continue
        model, optimizer = build(mode, args, device)
        vocab = model.config.vocab_size
        free(device)
        for micro_batch in micro_batches:
            row = {"mode": mode, "micro_batch": micro_batch}
            if time.perf_counter() - t_start > args.budget_s:
                results.append({**row, "status": "skipped"})
                continue
            try:
                got, ok = trial(model, optimizer, micro_batch, args, device, vocab), True
            except torch.OutOfMemoryError:
                got, ok = None, False
                optimizer.zero_grad(set_to_none=True)
                free(device)
            if not agree(ok, device):
                results.append({**row, "status": "oom"})
                break
            elapsed = reduce_max(got["elapsed_s"], device)
            results.append({
                **row, "status": "ok",
                "peak_bytes": int(reduce_max(got["peak_bytes"], device)),
                "tokens_per_s_per_gpu": micro_batch * args.seq_len * args.steps / elapsed,
                "step_s": elapsed / args.steps, "loss": got["loss"],
            })  # fmt: skip
            if rank == 0:
                print(row_line(results[-1]), flush=True)
                if out:
                    write_json(out, {"meta": meta, "results": results})
        del model, optimizer
        free(device)
    meta["wall_s"] = time.perf_counter() - t_start
    if rank == 0:
        print(table(results, world, args.seq_len))
        if not args.reshard:
            print("(--no-reshard-after-forward: each layer gathered from forward to backward)")
        if out:
            write_json(out, {"meta": meta, "results": results})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
