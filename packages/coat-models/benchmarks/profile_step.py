"""Where the time of one training step goes (bench_e2e.py's step: Llama-2-7B shapes, seq 2048),
per variant, at a small micro-batch where COAT's step is slower than bf16's.

For each variant: ``Trainer.run_step`` wall time; the step split into forward, backward and
clip + optimizer step, each as host time (until the call returns) and wall time (until the GPU
is done), with and without the memory tracker's saved-tensor hooks; ``cProfile``'s top
functions over two steps; the GPU kernel time of one step (``torch.profiler``, top kernels),
last: once it has run, Triton's launches pay for its launch hook.

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python packages/coat-models/benchmarks/profile_step.py --variants bf16,coat --micro-batch 1

A diagnostic, not a benchmark (bench_e2e.py's numbers are the ones to report).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from coat_models.train.data import load_data
from coat_models.train.presets import build_model, preset_config
from coat_models.train.trainer import MASTER_DTYPES, TrainConfig, Trainer

sys.path.insert(0, str(Path(__file__).parent))
from bench_e2e import VARIANTS, free  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _phases(trainer: Trainer, rounds: int, hooks: bool) -> dict:
    """Median host and wall ms of forward, backward and clip + optimizer step."""
    model, opt, cfg = trainer.model, trainer.optimizer, trainer.cfg
    ids = trainer.task.sampler.batch(1, 0).to(trainer.device)
    names = ("forward", "backward", "optimizer")
    host = {n: [] for n in names}
    wall = {n: [] for n in names}

    def timed(name, fn):
        _sync(trainer.device)
        t0 = time.perf_counter()
        out = fn()
        host[name].append(time.perf_counter() - t0)
        _sync(trainer.device)
        wall[name].append(time.perf_counter() - t0)
        return out

    def forward():
        with trainer.tracker.saving() if hooks else contextlib.nullcontext():
            with torch.autocast(trainer.device.type, dtype=torch.bfloat16):
                return model(input_ids=ids, labels=ids).loss

    def optimizer():
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(rounds):
        loss = timed("forward", forward)
        timed("backward", loss.backward)
        timed("optimizer", optimizer)
    med = lambda v: statistics.median(v) * 1e3  # noqa: E731
    return {n: (med(host[n]), med(wall[n])) for n in names}


def profile(name: str, config, data, mb: int, seq: int, rounds: int, top: int, device) -> str:
    mode, master, cache = VARIANTS[name]
    model = build_model(config, device=device, master_dtype=MASTER_DTYPES[master], seed=0)
    cfg = TrainConfig(mode=mode, master_dtype=master, weight_cache=cache, batch_size=mb,
                      seq_len=seq, lr=1e-4, steps=10**6, warmup=10, eval_batches=1)  # fmt: skip
    trainer = Trainer(model, data, cfg, device=device, progress=False)
    lines = [f"== {name}, micro-batch {mb} x seq {seq}"]
    try:
        for _ in range(2):
            trainer.run_step()
        steps = [trainer.run_step()["step_time_s"] * 1e3 for _ in range(rounds)]
        lines.append(
            f"run_step wall: median {statistics.median(steps):.1f} ms "
            f"({', '.join(f'{s:.0f}' for s in steps)})"
        )
        for hooks in (True, False):
            ph = _phases(trainer, rounds, hooks)
            cells = ", ".join(f"{n} {h:.1f}/{w:.1f}" for n, (h, w) in ph.items())
            lines.append(f"phases host/wall ms, tracker hooks {'on' if hooks else 'off'}: {cells}")
        prof_c = cProfile.Profile()
        prof_c.enable()
        for _ in range(2):
            trainer.run_step()
        prof_c.disable()
        for key in ("tottime", "cumtime"):
            buf = io.StringIO()
            pstats.Stats(prof_c, stream=buf).sort_stats(key).print_stats(top)
            lines.append(f"cProfile over 2 steps, by {key}:")
            lines += [ln for ln in buf.getvalue().splitlines() if ln.strip()]
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        _sync(device)
        with torch.profiler.profile(activities=acts[: 1 + (device.type == "cuda")]) as prof:
            trainer.run_step()
            _sync(device)
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.self_device_time_total for e in events) / 1e3
        lines.append(f"GPU kernel time of one step: {total:.1f} ms; top kernels (ms, calls):")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
            lines.append(f"  {e.self_device_time_total / 1e3:8.2f} {e.count:6d}  {e.key[:100]}")
    finally:
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.close()
        del trainer, model
        free()
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama2-7b")
    p.add_argument("--variants", default="bf16,coat")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out", help="also write the report here")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script only")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("profile_step: needs a CUDA GPU", file=sys.stderr)
        return 2
    data = load_data()
    config = preset_config(args.preset, data.vocab_size, max_seq=args.seq_len)
    parts = []
    for v in args.variants.split(","):
        parts.append(
            profile(v, config, data, args.micro_batch, args.seq_len, args.rounds, args.top, device)
        )
        print(parts[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n\n".join(parts) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
