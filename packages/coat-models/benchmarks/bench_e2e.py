"""End-to-end training benchmark on one GPU: full-parameter training of
Llama-2-7B shapes at seq 2048, per variant (bf16; coat; coat with bf16 master weights; and, on
request, coat-cache: coat keeping the FP8 weight copies between steps, ``--fp8-weight-cache``;
coat-compile: coat with each decoder layer compiled, ``coat_models.compile_layers``, as
``coat-train --compile`` runs it;
torchao: torchao's float8 training, tensorwise scaling, each decoder layer compiled):

- the largest micro-batch that fits (1, 2, 4, 8, ... until CUDA runs out of memory),
- peak memory (``torch.cuda.max_memory_allocated``) and its breakdown at each micro-batch,
- tokens/s at each micro-batch.

Each trial runs as coat-train's loop does: a warm-up step, then one step that counts memory
(the breakdown; its hooks cost host time), then ``--steps`` timed steps queued without
waiting for the GPU and read once at the end (tokens/s over that window). The torchao variant
is the loop a torchao user writes (``torchao_model``, ``torchao_trial``): two warm-up steps
(compilation), the timed window, peak memory without a breakdown (the tracker's hooks cannot
see into compiled layers). torchao is not a dependency of this project: install it to run
that variant (``--variants bf16,coat,torchao``).

All in one process, baseline and ours side by side (~8 minutes on an H200):

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    BENCH_OUT=e2e.json python packages/coat-models/benchmarks/bench_e2e.py

Prints the tables; writes everything as JSON to $BENCH_OUT when set. Not a pytest module:
run it as a script.

``profile``: where the time of one training step goes, per variant, at a small micro-batch
where COAT's step is slower than bf16's (a diagnostic, not the numbers to report):

    python packages/coat-models/benchmarks/bench_e2e.py profile --variants bf16,coat --micro-batch 1

``profile --grad-accum N`` profiles steps of N micro-batches; ``profile --compile`` compiles
every variant's decoder layers (``coat-train --compile``; then no ``_scaled_mm`` timing and
no tracker hooks, which would break or re-trace the graphs). It prints a host probe first
(``host_probe``: ns per Python call, us per small op; ``bench_e2e.py probe`` prints it alone,
the main run in its header) to compare readings across machines. Then for each variant:
``Trainer.run_step`` wall time and the host time until ``queue_step`` returns; the host
time of each ``torch._scaled_mm`` call inside a step; the step split into forward, backward
and clip + optimizer step, each as host time (until the call returns) and wall time (until
the GPU is done), with and without the memory tracker's saved-tensor hooks; ``cProfile``'s
top functions over two steps; the GPU kernel time of one step (``torch.profiler``, top
kernels), last: once it has run, Triton's launches pay for its launch hook. ``--device cpu``
is a smoke test of the script only.
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import gc
import importlib.util
import io
import json
import math
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from coat_models import compile_layers, param_groups
from coat_models.train.args import (
    OneLineParser,
    UsageError,
    float_in,
    int_in,
    int_list,
    writable_file,
)
from coat_models.train.cli import is_oom
from coat_models.train.data import BatchSampler, load_data
from coat_models.train.memory import (
    MemoryTracker,
    memory_report,
    optimizer_state_bytes,
    tensor_bytes,
)
from coat_models.train.presets import PRESETS, build_model, preset_config
from coat_models.train.report import fmt_bytes, format_table
from coat_models.train.trainer import (
    MASTER_DTYPES,
    TrainConfig,
    Trainer,
    frozen_heap,
    lr_scheduler,
    pinned,
)

# name -> (mode, master dtype, FP8 weight cache kept between steps: TrainConfig.weight_cache,
# None as coat-train: on with gradient accumulation); mode "torchao" is no coat-train mode:
# torchao_model/torchao_trial below, fused torch AdamW.
VARIANTS = {
    "bf16": ("bf16", "fp32", False),
    "coat": ("coat", "fp32", None),
    "coat-bf16master": ("coat", "bf16", None),
    "coat-cache": ("coat", "fp32", True),
    "coat-compile": ("coat", "fp32", None),
    "torchao": ("torchao", "fp32", False),
}
# Variants whose decoder layers are compiled in place (``compile_layers``) once the trainer has
# converted the model: each COAT layer's forward and backward run as one compiled graph, its
# FP8 kernels inside; embeddings, final norm, head and loss stay eager.
COMPILED = {"coat-compile"}
DEFAULT_VARIANTS = "bf16,coat,coat-bf16master"
# Targets against bf16: peak memory at the same micro-batch, tokens/s at the best.
TARGETS = {"coat": {"memory": 1.6, "speed": 1.6}, "coat-bf16master": {"memory": 2.2, "speed": 1.6}}


def parse_args(argv=None):
    p = OneLineParser(prog="bench_e2e.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama2-7b", choices=PRESETS)
    p.add_argument("--seq-len", type=int_in(1), default=2048)
    p.add_argument(
        "--steps",
        type=int_in(1),
        default=4,
        help="timed steps per trial (after a warm-up step and a memory-counting step, or two "
        "warm-up steps for torchao)",
    )
    p.add_argument("--max-micro-batch", type=int_in(1), default=32)
    p.add_argument(
        "--lr",
        type=float,
        default=1e-4,
        help="peak lr (the llama2-7b preset's; time and memory "
        "do not depend on it, the logged losses do)",
    )
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"from {', '.join(VARIANTS)}")
    p.add_argument(
        "--micro-batches",
        type=int_list(1),
        help="comma-separated micro-batches to try in order (default: 1, 2, 4, ... up to "
        "--max-micro-batch); each variant stops at its first out-of-memory one",
    )
    p.add_argument(
        "--budget-s", type=float_in(0, exclusive=True), default=480,
        help="stop searching after this",
    )  # fmt: skip
    p.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: a smoke test of this script only (torchao then emulates float8)",
    )
    args = p.parse_args(argv)
    try:
        writable_file(os.environ.get("BENCH_OUT"), "BENCH_OUT")
    except UsageError as e:
        p.error(str(e))
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        p.error(f"unknown variant {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    if "torchao" in names and importlib.util.find_spec("torchao") is None:
        p.error(
            "variant torchao needs torchao, which this project does not depend on: "
            "pip install torchao (or leave torchao out of --variants)"
        )
    args.variants = names
    return args


def free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def peak(memory: dict) -> int:
    """Measured peak (CUDA); the tracked one in a CPU smoke test."""
    measured = memory["measured_peak"]
    return memory["tracked_peak"] if measured is None else measured


def trial(model, data, mode, master, cache, mb, args, device, compiled=False) -> dict:
    """One coat-train variant at micro-batch ``mb``: a warm-up step, a step counting memory,
    ``args.steps`` timed steps read once; peak memory, breakdown and tokens/s. ``compiled``:
    the trainer's model is compiled in place first, and the second step (compilation has
    settled) counts no memory (saved-tensor hooks would recompile): peak memory only."""
    cfg = TrainConfig(
        mode=mode,
        master_dtype=master,
        weight_cache=cache,
        batch_size=mb,
        seq_len=args.seq_len,
        lr=args.lr,
        steps=10**6,
        warmup=10,
        eval_batches=1,
    )
    trainer = None
    try:
        trainer = Trainer(model, data, cfg, device=device, progress=False)
        if compiled:
            compile_layers(trainer.model)
        free()
        trainer.meter.reset()
        trainer.tracker.reset_peak()
        warm = trainer.run_step()  # kernels, autotuning, optimizer state
        # The breakdown: hooks cost host time.
        counted = trainer.run_step(track_memory=not compiled)
        with frozen_heap(device.type == "cuda"):  # as coat-train's fit
            for _ in range(args.steps):
                trainer.queue_step()  # as coat-train between its log points
            timed = trainer.read_steps()
        if not all(math.isfinite(r["loss"]) for r in timed):
            raise RuntimeError(f"bench_e2e: non-finite loss in {mode} at micro-batch {mb}")
        memory = memory_report(trainer.tracker, trainer.meter)
        if compiled:  # no step was counted: the measured peak alone (as torchao's)
            memory |= {"tracked_peak": None, **dict.fromkeys(MemoryTracker.KINDS), "other": None}
        return {
            "micro_batch": mb,
            "fits": True,
            "tokens_per_s": timed[-1]["tokens_per_s"],
            "step_times_s": {
                "warmup": warm["step_time_s"],
                "counting_memory": counted["step_time_s"],
                "timed_mean": timed[-1]["step_time_s"],
            },
            "losses": [warm["loss"], counted["loss"], *(r["loss"] for r in timed)],
            "memory": memory,
        }
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
        # handled below, once this except block has dropped the failed step's frames
    finally:
        if trainer is not None:
            trainer.optimizer.zero_grad(set_to_none=True)
            trainer.close()
            del trainer.optimizer
        trainer = None
        free()
    return {"micro_batch": mb, "fits": False}


def torchao_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """What a torchao user does to a Hugging Face Llama: ``convert_to_float8_training`` with
    the tensorwise recipe (every decoder-layer linear; not the LM head, as torchao's example
    leaves out the last layer; dims must be multiples of 16), then ``torch.compile`` of each
    decoder layer (static shapes: one compilation per micro-batch). In place; on CPU float8
    is emulated (a smoke test: no float8 GEMM there)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name("tensorwise")
    if device.type != "cuda":
        config = dataclasses.replace(config, emulate=True)

    def keep(mod: torch.nn.Module, fqn: str) -> bool:
        if fqn.endswith("lm_head"):
            return False
        return isinstance(mod, torch.nn.Linear) and all(n % 16 == 0 for n in mod.weight.shape)

    convert_to_float8_training(model, module_filter_fn=keep, config=config)
    for layer in model.model.layers:
        layer.compile(dynamic=False)
    return model


def torchao_trial(model, data, mb, args, device) -> dict:
    """``torchao_model`` at micro-batch ``mb`` in a plain loop (bf16 autocast, fp32 master
    weights, fused torch AdamW with coat-train's groups, clip 1.0, its LR schedule): two
    warm-up steps (compilation), ``args.steps`` timed steps synchronized once at the end;
    peak memory (no breakdown: weights and optimizer state only)."""
    cfg = TrainConfig(batch_size=mb, seq_len=args.seq_len, lr=args.lr, steps=10**6, warmup=10)
    optimizer = None
    try:
        optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                                      betas=cfg.betas, fused=device.type == "cuda")  # fmt: skip
        scheduler = lr_scheduler(optimizer, cfg)
        sampler = BatchSampler(data.train, mb, args.seq_len, seed=cfg.seed)
        free()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        def step(i: int) -> torch.Tensor:
            ids = pinned(sampler.batch(i), device).to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        losses, warm = [], []
        for i in (1, 2):  # compile (each layer's forward and backward), then settle
            t0 = time.perf_counter()
            losses.append(step(i).item())
            warm.append(time.perf_counter() - t0)
        with frozen_heap(device.type == "cuda"):  # as the coat-train variants
            t0 = time.perf_counter()
            timed = [step(3 + i) for i in range(args.steps)]
            timed = torch.stack(timed).tolist()  # waits for the window's steps
            window = time.perf_counter() - t0
        if not all(math.isfinite(v) for v in timed):
            raise RuntimeError(f"bench_e2e: non-finite loss in torchao at micro-batch {mb}")
        measured = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        memory = {
            "device": device.type,
            "measured_by": "cuda max_memory_allocated" if measured is not None else None,
            "measured_peak": measured,
            "tracked_peak": None,  # compiled layers: no saved-tensor hooks
            **dict.fromkeys(MemoryTracker.KINDS),
            "weights": tensor_bytes(list(model.parameters()) + list(model.buffers())),
            "optimizer_state": optimizer_state_bytes(optimizer),
            "other": None,
        }
        return {
            "micro_batch": mb,
            "fits": True,
            "tokens_per_s": mb * args.seq_len * args.steps / window,
            "step_times_s": {"warmup": warm, "timed_mean": window / args.steps},
            "losses": [*losses, *timed],
            "memory": memory,
        }
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
    finally:
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        optimizer = None
        free()
    return {"micro_batch": mb, "fits": False}


def run_variant(name, data, config, args, device, t_start) -> list[dict]:
    mode, master, cache = VARIANTS[name]
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    n = sum(p.numel() for p in _meta_model(config).parameters())
    static = n * ((4 if master == "fp32" else 2) * 2 + (2 if mode == "coat" else 8))
    if static > total:
        print(f"[{name}] skipped: weights+grads+optimizer state alone need {fmt_bytes(static)}")
        return []
    model = build_model(config, device=device, master_dtype=MASTER_DTYPES[master], seed=0)
    if mode == "torchao":
        model = torchao_model(model, device)
    rows = []
    if args.micro_batches:
        sizes = args.micro_batches
    else:
        sizes = [
            2**i for i in range(args.max_micro_batch.bit_length()) if 2**i <= args.max_micro_batch
        ]
    for mb in sizes:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"[{name}] stopped at micro-batch {mb}: time budget {args.budget_s:g}s spent")
            break
        t0 = time.perf_counter()
        if mode == "torchao":
            r = torchao_trial(model, data, mb, args, device)
        else:
            r = trial(model, data, mode, master, cache, mb, args, device, name in COMPILED)
        r["wall_s"] = time.perf_counter() - t0
        rows.append(r)
        if not r["fits"]:
            print(f"[{name}] micro-batch {mb}: out of memory ({r['wall_s']:.0f}s)", flush=True)
            break
        print(
            f"[{name}] micro-batch {mb}: {r['tokens_per_s']:,.0f} tok/s, peak "
            f"{fmt_bytes(peak(r['memory']))} ({r['wall_s']:.0f}s)",
            flush=True,
        )
    del model
    free()
    return rows


def _meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


# ------------------------------------------------ profile: where one step's time goes
def host_probe(device: torch.device) -> dict:
    """How fast this machine's host runs what an eager step is made of, to compare readings
    across machines (host-bound eager COAT read up to 40% apart on machines where bf16 read
    the same): ns per Python function call, us of host time per small elementwise op on
    ``device`` (queued: the GPU keeps up with these). Best of 5 rounds each."""

    def f(a, b=1):
        return a + b

    def best(fn, n):
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn(n)
            times.append((time.perf_counter() - t0) / n)
        return min(times)

    def calls(n):
        for i in range(n):
            f(i)

    x = torch.zeros(16, device=device)

    def ops(n):
        for _ in range(n):
            x.add_(1)
        _sync(device)

    ops(100)
    return {"python_call_ns": best(calls, 200_000) * 1e9, "small_op_us": best(ops, 2000) * 1e6}


def _probe_line(probe: dict) -> str:
    return (
        f"host probe: {probe['python_call_ns']:.0f} ns per Python call, "
        f"{probe['small_op_us']:.1f} us per small op"
    )


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
                no_cache = {k: make() for k, make in trainer._cache_kwargs.items()}
                return model(input_ids=ids, labels=ids, **no_cache).loss

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


def _scaled_mm_host(trainer: Trainer) -> str:
    """Host time of each ``torch._scaled_mm`` call inside two queued steps (a step's calls
    cost more than the same call repeated alone: caches are cold between them)."""
    real, times = torch._scaled_mm, []

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = real(*args, **kwargs)
        times.append(time.perf_counter() - t0)
        return out

    torch._scaled_mm = timed
    try:
        for _ in range(2):
            trainer.queue_step()
        trainer.read_steps()
    finally:
        torch._scaled_mm = real
    if not times:
        return "torch._scaled_mm host per call inside a step: no calls"
    us = sorted(t * 1e6 for t in times)
    n = len(us)
    return (
        f"torch._scaled_mm host per call inside a step: median {us[n // 2]:.1f} us, p90 "
        f"{us[int(n * 0.9)]:.1f} us, {n // 2} calls a step, {sum(us) / 2e3:.1f} ms a step"
    )


def profile_step(
    name: str, config, data, mb: int, seq: int, rounds: int, top: int, device, grad_accum: int = 1,
    compile_all: bool = False,
) -> str:  # fmt: skip
    """The report of one variant (see ``profile`` in the module docstring)."""
    mode, master, cache = VARIANTS[name]
    model = build_model(config, device=device, master_dtype=MASTER_DTYPES[master], seed=0)
    cfg = TrainConfig(mode=mode, master_dtype=master, weight_cache=cache, batch_size=mb,
                      seq_len=seq, lr=1e-4, steps=10**6, warmup=10, eval_batches=1,
                      grad_accum=grad_accum, compile=compile_all or name in COMPILED)  # fmt: skip
    trainer = Trainer(model, data, cfg, device=device, progress=False)
    compiled = " (layers compiled)" if cfg.compile else ""
    lines = [f"== {name}{compiled}, micro-batch {mb} x seq {seq} x grad-accum {grad_accum}"]
    try:
        for _ in range(2):
            trainer.run_step()
        steps, hosts = [], []
        with frozen_heap(device.type == "cuda"):  # as coat-train's fit
            for _ in range(rounds):
                _sync(device)
                t0 = time.perf_counter()
                trainer.queue_step()
                hosts.append((time.perf_counter() - t0) * 1e3)
                steps.append(trainer.read_steps()[-1]["step_time_s"] * 1e3)
        lines.append(
            f"run_step wall: median {statistics.median(steps):.1f} ms "
            f"({', '.join(f'{s:.0f}' for s in steps)}); host (until queue_step returns) "
            f"median {statistics.median(hosts):.1f} ms"
        )
        if not cfg.compile:  # (traced, the timing wrapper would break the graph)
            lines.append(_scaled_mm_host(trainer))
        # (compiled layers: saved-tensor hooks would recompile them)
        for hooks in (False,) if cfg.compile else (True, False):
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


def profile_main(argv) -> int:
    p = OneLineParser(
        prog="bench_e2e.py profile", description="Where the time of one training step goes."
    )
    p.add_argument("--preset", default="llama2-7b", choices=PRESETS)
    p.add_argument("--variants", default="bf16,coat", help=f"from {', '.join(VARIANTS)}")
    p.add_argument("--micro-batch", type=int_in(1), default=1)
    p.add_argument("--grad-accum", type=int_in(1), default=1, help="micro-batches a step")
    p.add_argument("--seq-len", type=int_in(1), default=2048)
    p.add_argument("--rounds", type=int_in(1), default=3)
    p.add_argument("--top", type=int_in(1), default=30)
    p.add_argument("--out", help="also write the report here")
    p.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"),
        help="cpu: a smoke test of this script only",
    )  # fmt: skip
    p.add_argument("--compile", action="store_true", help="compile every variant's decoder layers")
    args = p.parse_args(argv)
    try:
        writable_file(args.out, "--out")
    except UsageError as e:
        p.error(str(e))
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    known = [n for n, v in VARIANTS.items() if v[0] != "torchao"]  # coat-train's modes only
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        p.error(f"unknown variant {', '.join(unknown)}: choose from {', '.join(known)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_e2e: needs a CUDA GPU (--device cpu: a smoke test)", file=sys.stderr)
        return 2
    data = load_data()
    config = preset_config(args.preset, data.vocab_size, max_seq=args.seq_len)
    parts = [_probe_line(host_probe(device))]
    print(parts[0], flush=True)
    for v in names:
        mb, seq = args.micro_batch, args.seq_len
        report = profile_step(
            v, config, data, mb, seq, args.rounds, args.top, device, args.grad_accum,
            compile_all=args.compile,
        )  # fmt: skip
        parts.append(report)
        print(parts[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n\n".join(parts) + "\n")
    return 0


def coat_train_table(fitting: dict[str, list[dict]], micro_batch: int, steps: int) -> str:
    """coat-train's compare table of the variants' trials at ``micro_batch`` (for the README
    and BENCHMARKS.md): each trial timed ``steps`` steps, 3 to ``steps + 2``, after a warm-up
    step and a memory-counting one."""
    runs = []
    for name, rows in fitting.items():
        r = next((r for r in rows if r["micro_batch"] == micro_batch), None)
        if r is not None:
            runs.append(
                {
                    "mode": name,
                    "master_dtype": VARIANTS[name][1],
                    "timed_steps": [steps, 3, steps + 2],
                    "train_loss": r["losses"][-1],
                    "train_loss_window": 1,
                    "val_loss": None,
                    "tokens_per_s": r["tokens_per_s"],
                    "memory": r["memory"],
                }
            )
    return format_table(runs)


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["profile"]:
        return profile_main(argv[1:])
    if argv[:1] == ["probe"]:  # the host probe alone (scripts/gpu_bench.sh speed-accum)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(_probe_line(host_probe(device)), f"({device.type})")
        return 0
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_e2e: needs a CUDA GPU (--device cpu: a smoke test)", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    data = load_data()
    config = preset_config(args.preset, data.vocab_size, max_seq=args.seq_len)
    names = args.variants
    probe = host_probe(device)
    print(
        f"bench_e2e: {args.preset}, seq {args.seq_len}, {gpu}, "
        f"torch {torch.__version__}; variants {', '.join(names)}; {_probe_line(probe)}",
        flush=True,
    )
    t_start = time.perf_counter()
    results = {name: run_variant(name, data, config, args, device, t_start) for name in names}
    fitting = {n: [r for r in rows if r["fits"]] for n, rows in results.items()}
    fitting = {n: rows for n, rows in fitting.items() if rows}

    # Per micro-batch table.
    cols = ["measured_peak", "tracked_peak", "weights", "weight_copies", "gradients"]
    cols += ["optimizer_state", "activations", "other"]
    head = ["peak", "tracked", "weights", "w-copies", "grads", "optimizer", "activations", "other"]
    print(f"\n{'variant':<17} micro-batch   tokens/s " + " ".join(f"{h:>11}" for h in head))
    for name, rows in results.items():
        for r in rows:
            if not r["fits"]:
                print(f"{name:<17} {r['micro_batch']:>11}   out of memory")
                continue
            m = r["memory"]
            cells = " ".join(f"{fmt_bytes(m[k]):>11}" for k in cols)
            print(f"{name:<17} {r['micro_batch']:>11} {r['tokens_per_s']:>10,.0f} {cells}")

    summary = {}
    if fitting:
        common = max(
            set.intersection(*[{r["micro_batch"] for r in rows} for rows in fitting.values()]),
            default=None,
        )
        base = fitting.get("bf16")
        print(f"\ncommon micro-batch: {common}")
        for name, rows in fitting.items():
            best = max(rows, key=lambda r: r["tokens_per_s"])
            at_common = next((r for r in rows if r["micro_batch"] == common), None)
            s = {
                "largest_micro_batch": max(r["micro_batch"] for r in rows),
                "best_micro_batch": best["micro_batch"],
                "best_tokens_per_s": best["tokens_per_s"],
                "peak_at_common": at_common and peak(at_common["memory"]),
            }
            if base and name != "bf16":
                b_best = max(base, key=lambda r: r["tokens_per_s"])
                b_common = next(r for r in base if r["micro_batch"] == common)
                b_peak, own = peak(b_common["memory"]), s["peak_at_common"]
                # None where nothing measured it (torchao in the CPU smoke test)
                s["memory_ratio_at_common"] = b_peak / own if b_peak and own else None
                s["speed_ratio_at_best"] = s["best_tokens_per_s"] / b_best["tokens_per_s"]
                s["targets"] = TARGETS.get(name)
            summary[name] = s
        print(
            f"\n{'variant':<17} largest-mb  best-mb  best tok/s  peak@common  "
            f"mem ratio  speed ratio  targets"
        )
        for name, s in summary.items():
            t = s.get("targets") or {}
            mem_ratio = s.get("memory_ratio_at_common", 1)
            mem_ratio = "n/a" if mem_ratio is None else f"{mem_ratio:.2f}x"
            note = "baseline" if name == "bf16" else "no target"
            print(
                f"{name:<17} {s['largest_micro_batch']:>10} {s['best_micro_batch']:>8} "
                f"{s['best_tokens_per_s']:>11,.0f} {fmt_bytes(s['peak_at_common']):>12} "
                f"{mem_ratio:>10} "
                f"{s.get('speed_ratio_at_best', 1):>10.2f}x  "
                + (f">= {t['memory']}x mem, >= {t['speed']}x speed" if t else note)
            )
        print(f"\nat micro-batch {common}:\n" + coat_train_table(fitting, common, args.steps))
    out = os.environ.get("BENCH_OUT")
    if out:
        with open(out, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "device": gpu,
                    "torch": torch.__version__,
                    "host_probe": probe,
                    "trials": results,
                    "summary": summary,
                },
                f,
                indent=1,
            )
        print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
