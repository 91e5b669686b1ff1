"""One Llama-2-7B decoder layer (hidden 4096, MLP 11008, 32 heads, batch 4, seq 2048, SDPA,
bf16): activation memory and forward+backward time, side by side.

Variants: BF16 eager, BF16 + torch.compile, torchao float8 tensorwise + torch.compile (when
torchao is importable) and COAT (``apply_coat``). Targets for COAT: activation memory
<= 640 MB and fwd+bwd <= 12.0 ms (MB = 10^6 bytes).

* Activation memory: ``memory_allocated`` after forward minus before it (weights, input
  and, for COAT, the persistent FP8 weight cache already allocated), minus the output. For
  COAT the output also carries its 1x16 FP8 form, handed to the next layer's RMSNorm, which
  saves it instead of quantizing again: that is the next layer's activation, subtracted too
  (and reported). The FP8 weight cache (2 bytes/parameter, kept between steps) is reported
  apart. For COAT the bytes autograd saves (``saved_tensors_hooks``, each storage once;
  parameters, the weight cache, the input and cos/sin excluded) are reported too: the
  number ``tests/test_llama.py::test_llama2_7b_layer_saved_bytes`` counts on CPU.
* Time: median of fwd+bwd with a CUDA synchronize, parameter grads reset in between. For
  COAT each weight's version is bumped before every timed round, as an optimizer step does,
  so the timed forward includes casting the weights to FP8.

Run: ``pytest -o python_files='bench_*.py' --benchmark-only packages/coat-models/benchmarks``;
prints a table; ``BENCH_OUT=path.json`` also writes the results as JSON.

Profiles of the same layer (diagnostics for finding slow kernels and host time, not the
numbers to report: the profilers add overhead), run as a script:

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python packages/coat-models/benchmarks/bench_llama_layer.py kernels --out layer_profile.txt
    python packages/coat-models/benchmarks/bench_llama_layer.py host --variants coat --batches 1,4
    python packages/coat-models/benchmarks/bench_llama_layer.py ops
    python packages/coat-models/benchmarks/bench_llama_layer.py repeat --batch 1

``kernels``: GPU kernel time per kernel name under ``torch.profiler``, per variant (default:
coat, bf16_eager; torchao_float8_compile when torchao imports). ``host``: per variant and
batch, the host time to enqueue one fwd+bwd (no sync inside) against its wall time (enqueue
+ synchronize), the memory a step keeps between steps beyond weights, gradients and inputs (a
weight cache, a plan's arena, the graphs' pool) and its peak above that (``--padded N``: with
a boolean padding mask whose first sequence has N padded positions), ``cProfile``'s top
functions over a few rounds, and one round under ``torch.cuda.set_sync_debug_mode("warn")``
so that any hidden host-device synchronization is reported. When host time >= GPU time the
layer is host-bound: the GPU waits for Python.
``ops``: the host time of one call of each building block (allocations, a view, a tiny
kernel, one fp8_quant quantization, ``torch._scaled_mm`` against ``torch.mm``, an autograd
node), which times the per-layer counts give the layer's host time. ``repeat``: how many of
``--rounds`` repeats of one COAT layer step (as launch plans run it) differ from the first,
per output and gradient, and the same for SDPA's causal backward with deterministic
algorithms off and on (a plan's check compares bits).
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import importlib.util
import io
import json
import os
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

BATCH, SEQ, HIDDEN, MLP, HEADS = 4, 2048, 4096, 11008, 32
DEVICE = "cuda"
TARGET_MB, TARGET_MS = 640.0, 12.0
# coat_compile: torch.compile of the COAT layer (its FP8 kernels traced, torch.library.triton_op);
# coat_cudagraphs: the same with mode="reduce-overhead" (CUDA graphs: no host time per op).
# coat_graphed: COAT with coat_models.enable_cuda_graphs (weight cache off: each call casts
# the weights, as after every optimizer step; fwd+bwd replayed from CUDA graphs, no compile):
# the layer's GPU time without the host time of its ~55 launches.
# coat_planned: COAT with coat_models.plans.enable_launch_plans (weight cache off): fwd+bwd
# replayed from a recorded launch plan, eagerly.
VARIANTS = ["bf16_eager", "bf16_compile", "torchao_float8_compile", "coat", "coat_compile",
            "coat_cudagraphs", "coat_graphed", "coat_planned"]  # fmt: skip
RESULTS: dict[str, dict] = {}

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model(dtype=torch.bfloat16):
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=MLP, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, num_hidden_layers=1, vocab_size=128,
        max_position_embeddings=SEQ, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaModel(config).to(DEVICE, dtype).train()


def _layer(variant: str):
    """``(forward(x) -> out, the layer module, RoPE's (cos, sin))``."""
    model = _model()
    layer = model.layers[0]
    x0 = torch.zeros(1, SEQ, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    pos = model.rotary_emb(x0, torch.arange(SEQ, device=DEVICE)[None])
    if variant.startswith("coat"):
        from coat_models import apply_coat
        from fp8_activations import FP8ActivationConfig

        cache = variant not in ("coat_graphed", "coat_planned")
        apply_coat(model, config=FP8ActivationConfig(weight_cache=cache))
    elif variant == "torchao_float8_compile":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    run = layer
    if variant == "coat_graphed":
        from coat_models import enable_cuda_graphs

        enable_cuda_graphs(model)  # recorded at the first call, replayed after
    elif variant == "coat_planned":
        from coat_models.plans import enable_launch_plans

        enable_launch_plans(model)  # recorded at the first call, replayed after
    if variant.endswith("compile"):
        run = torch.compile(layer)
    elif variant.endswith("cudagraphs"):
        run = torch.compile(layer, mode="reduce-overhead")

    def forward(x, mask=None, model=model):  # keeps the model alive (graphs' state is on it)
        if variant.endswith("cudagraphs"):
            torch.compiler.cudagraph_mark_step_begin()  # a new training step each call
        return run(x, attention_mask=mask, position_embeddings=pos)

    return forward, layer, pos


def _handed_over_bytes(out) -> int:
    from fp8_activations import handed_over

    h = handed_over(out)
    if h is None or h.fp8 is None:
        return 0
    return h.fp8.nbytes


def _weight_cache_bytes(layer) -> int:
    total = 0
    for p in layer.parameters():
        hit = getattr(p, "_fp8_weight_cache", None)
        if hit is not None:
            total += sum(t.numel() * t.element_size() for t in hit[1])
    return total


def _bump_versions(layer):
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(1)  # in place: bumps p._version like optimizer.step()


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if not RESULTS:
        return
    head = f"{'variant':<24}{'act MB':>10}{'act MiB':>10}{'fwd+bwd ms':>12}"
    lines = [head, "-" * len(head)]
    for name, r in RESULTS.items():
        lines.append(f"{name:<24}{r['act_MB']:>10.1f}{r['act_MiB']:>10.1f}{r['fwd_bwd_ms']:>12.3f}")
    if "coat" in RESULTS:
        r = RESULTS["coat"]
        met = lambda ok: "met" if ok else "NOT met"
        lines.append(
            f"coat: saved for backward (hooks) {r['saved_hooks_MB']:.1f} MB, "
            f"handed-over FP8 of the output {r['handed_over_MB']:.1f} MB, FP8 weight cache "
            f"{r['weight_cache_MB']:.1f} MB; target {TARGET_MB} MB: {met(r['act_MB'] <= TARGET_MB)}"
            f" ({met(r['act_MiB'] <= TARGET_MB)} if read as MiB), target {TARGET_MS} ms: "
            f"{met(r['fwd_bwd_ms'] <= TARGET_MS)}"
        )
    for name in ("coat_compile", "coat_cudagraphs", "coat_graphed"):
        if name in RESULTS:
            ok = RESULTS[name]["fwd_bwd_ms"] <= TARGET_MS
            lines.append(f"{name}: target {TARGET_MS} ms: {'met' if ok else 'NOT met'}")
    print("\n" + "\n".join(lines))
    if os.environ.get("BENCH_OUT"):
        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "shape": {"batch": BATCH, "seq": SEQ, "hidden": HIDDEN, "mlp": MLP, "heads": HEADS},
            "targets": {"act_MB": TARGET_MB, "fwd_bwd_ms": TARGET_MS},
        }
        with open(os.environ["BENCH_OUT"], "w") as f:
            json.dump({"meta": meta, "results": RESULTS}, f, indent=2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_llama2_7b_layer(benchmark, variant):
    if variant == "torchao_float8_compile" and importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed")
    forward, layer, pos = _layer(variant)
    x = torch.randn(BATCH, SEQ, HIDDEN, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def step():
        forward(x).backward(grad)
        torch.cuda.synchronize()

    def setup(bump=True):
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        if bump and variant.startswith("coat"):
            _bump_versions(layer)

    for _ in range(3):  # compile, autotune, allocate the weight cache
        setup()
        step()

    # Activation memory; the FP8 weight cache of the last warm-up round is still valid.
    setup(bump=False)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    # Hooks on the eager COAT layer only (compiled graphs would be traced again under them).
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks if variant == "coat" else contextlib.nullcontext():
        out = forward(x)
    torch.cuda.synchronize()
    outside = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), x, *pos)}
    for p in layer.parameters():
        hit = getattr(p, "_fp8_weight_cache", None)
        outside |= {t.untyped_storage().data_ptr() for t in (hit[1] if hit else ())}
    saved = sum(n for ptr, n in storages.items() if ptr not in outside)
    handed = _handed_over_bytes(out)
    act = torch.cuda.memory_allocated() - before - out.numel() * out.element_size() - handed
    if variant.endswith(("cudagraphs", "graphed")):  # saved tensors live in the graphs' pool,
        act = float("nan")  # allocated before this forward: the difference measures nothing
    out.backward(grad)
    del out

    benchmark.pedantic(step, setup=setup, rounds=20, warmup_rounds=2, iterations=1)
    RESULTS[variant] = {
        "act_MB": act / 1e6,
        "act_MiB": act / 2**20,
        "fwd_bwd_ms": benchmark.stats.stats.median * 1e3,
        "handed_over_MB": handed / 1e6,
        "saved_hooks_MB": saved / 1e6,
        "weight_cache_MB": _weight_cache_bytes(layer) / 1e6,
    }


# ---------------------------------------------------------------- profiles (script)
def profile_kernels(variant: str, rounds: int = 5) -> str:
    """GPU kernel time per kernel name of one fwd+bwd under ``torch.profiler``."""
    forward, layer, _ = _layer(variant)
    x = torch.randn(BATCH, SEQ, HIDDEN, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def step():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        if variant.startswith("coat"):
            _bump_versions(layer)  # as an optimizer step would: weights are re-cast
        forward(x).backward(grad)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(rounds):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) / rounds / 1e3
    lines = [
        f"== {variant}: GPU kernel time per fwd+bwd {total:.3f} ms (profiled, {rounds} rounds)"
    ]
    lines.append(f"{'ms/round':>9} {'calls':>6}  kernel")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:40]:
        ms = e.self_device_time_total / rounds / 1e3
        lines.append(f"{ms:9.3f} {e.count // rounds:6d}  {e.key[:110]}")
    return "\n".join(lines)


def padding_mask(batch: int, padded: int) -> torch.Tensor | None:
    """The boolean 4D causal mask of a left-padded batch: the first sequence's first
    ``padded`` positions are padding (no query sees them); None for ``padded=0``."""
    if not padded:
        return None
    q = torch.arange(SEQ, device=DEVICE)
    mask = (q[None, :] <= q[:, None]).expand(batch, 1, SEQ, SEQ).clone()
    mask[0, :, :, :padded] = False
    return mask


def profile_host(variant: str, batch: int, rounds: int, top: int, padded: int = 0) -> str:
    """Host enqueue vs wall time, the peak memory of the timed steps, host-device syncs and
    cProfile's top functions."""
    gc.collect()  # (the previous variant's model, kept by reference cycles)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    forward, layer, _ = _layer(variant)
    x = torch.randn(batch, SEQ, HIDDEN, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    mask = padding_mask(batch, padded)

    def step():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        if variant.startswith("coat"):
            _bump_versions(layer)  # as an optimizer step would: weights are re-cast
        forward(x, mask).backward(grad)

    from layer_host_trees import host_wall  # (this folder: run as a script)

    for _ in range(3):  # (plans and graphs are made in these steps; their memory stays)
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    host, wall = host_wall(step, rounds, warmup=0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    # What the layer keeps between steps besides its weights and gradients, the input, its
    # gradient and the mask: a weight cache, a plan's arena, the graphs' pool's blocks in use.
    tensors = [x, x.grad, grad, mask, *layer.parameters(), *(p.grad for p in layer.parameters())]
    held = (base - before - sum(t.nbytes for t in tensors if t is not None)) / 2**20
    host_ms, wall_ms = statistics.median(host) * 1e3, statistics.median(wall) * 1e3
    shape = f"batch {batch} x seq {SEQ}" + (f", {padded} padded" if padded else "")
    lines = [
        f"== {variant}, {shape}: host enqueue {host_ms:.3f} ms, wall {wall_ms:.3f} ms (medians"
        f" of {rounds}); held between steps beyond weights, gradients, inputs and mask"
        f" {held:,.0f} MiB, a step's peak above that {peak:,.0f} MiB"
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    # torch's first use of the mode warns that it is a prototype: that notice is no sync.
    syncs = [str(w.message).splitlines()[0][:160] for w in caught]
    syncs = [s for s in syncs if "debug mode is a prototype" not in s]
    lines.append(f"host-device syncs in one fwd+bwd: {len(syncs)}")
    lines += [f"  {s}" for s in syncs[:10]]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(rounds):
        step()
    torch.cuda.synchronize()
    prof.disable()
    for key in ("tottime", "cumtime"):
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf).sort_stats(key)
        stats.print_stats(top)
        lines.append(f"-- cProfile by {key}, {rounds} rounds")
        lines += [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    return "\n".join(lines)


def _host_us(fn, calls: int = 3000, rounds: int = 5) -> float:
    """Median over ``rounds`` of the host microseconds per call of ``fn`` in a loop of
    ``calls`` calls with no sync inside (the GPU keeps up: every call here is tiny)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a.view_as(a)

    @staticmethod
    def backward(ctx, g):
        return g


def profile_ops() -> str:
    """Host microseconds per call of what a layer is made of: allocations, views, a tiny
    aten kernel, fp8_quant's per-tensor quantization (one Triton launch, plus the amax
    reduction when not handed over), ``torch._scaled_mm`` against ``torch.mm``, and an
    autograd node (Function or aten op) forward and backward."""
    from fp8_quant import FP8Format
    from fp8_quant import ops as fq

    dev, bf16, e4m3 = DEVICE, torch.bfloat16, torch.float8_e4m3fn
    x = torch.randn(1024, 768, device=dev, dtype=bf16)
    w = torch.randn(768, 768, device=dev, dtype=bf16)
    xq, wq, one = x.to(e4m3), w.to(e4m3), torch.ones((), device=dev)
    fmt, amax = FP8Format("e4m3"), x.abs().amax().float()
    rows = {
        "torch.empty((1024, 768), bf16)": lambda: torch.empty((1024, 768), device=dev, dtype=bf16),
        "torch.empty((), fp32)": lambda: torch.empty((), device=dev),
        "torch.zeros((), fp32)": lambda: torch.zeros((), device=dev),
        "x.view(-1, 768)": lambda: x.view(-1, 768),
        "tiny aten kernel (one.add_(0))": lambda: one.add_(0),
        "quantize_per_tensor_transpose, amax given": lambda: fq.quantize_per_tensor_transpose(
            x, fmt, amax
        ),
        "quantize_per_tensor_transpose, amax reduced": lambda: fq.quantize_per_tensor_transpose(
            x, fmt, None
        ),
        "torch._scaled_mm 1024 x 768 x 768, bf16 out": lambda: torch._scaled_mm(
            xq, wq.t(), one, one, out_dtype=bf16
        ),
        "torch.mm bf16 1024 x 768 x 768": lambda: torch.mm(x, w.t()),
    }
    lines = ["== host microseconds per call (loop of 3000, no sync; median of 5)"]
    lines += [f"  {name:46s} {_host_us(fn):7.2f}" for name, fn in rows.items()]
    # A Llama-2-7B layer's widest GEMM at 1 x 2048 tokens: 20 calls a round, fewer than
    # the launch queue holds, so the host never waits for the GPU inside a round.
    a = torch.randn(SEQ, HIDDEN, device=dev, dtype=bf16)
    b = torch.randn(MLP, HIDDEN, device=dev, dtype=bf16)
    aq, bq = a.to(e4m3), b.to(e4m3)
    big = {
        f"torch._scaled_mm {SEQ} x {HIDDEN} x {MLP}, bf16 out": lambda: torch._scaled_mm(
            aq, bq.t(), one, one, out_dtype=bf16
        ),
        f"torch.mm bf16 {SEQ} x {HIDDEN} x {MLP}": lambda: torch.mm(a, b.t()),
    }
    lines.append("== the same, 20 calls a round (median of 20)")
    lines += [f"  {name:46s} {_host_us(fn, 20, 20):7.2f}" for name, fn in big.items()]
    leaf = torch.randn(64, device=dev, requires_grad=True)
    for name, node in [("autograd.Function node", _Identity.apply), ("aten op node (t * 1.0)",
                       lambda t: t * 1.0)]:  # fmt: skip
        fwd, bwd = [], []
        for i in range(30):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            y = leaf
            for _ in range(50):
                y = node(y)
            t1 = time.perf_counter()
            y.sum().backward()
            t2 = time.perf_counter()
            if i >= 5:
                fwd.append((t1 - t0) / 50 * 1e6)
                bwd.append((t2 - t1) / 50 * 1e6)
        lines.append(
            f"  {name:46s} {statistics.median(fwd):7.2f} forward, "
            f"{statistics.median(bwd):.2f} backward (chain of 50)"
        )
    return "\n".join(lines)


def profile_repeat(batch: int, rounds: int) -> str:
    """How often a step repeats its own bits: the same COAT layer step (fp32 weights, bf16
    autocast, weight cache off, as launch plans run it) ``rounds`` times on one input, each
    output and gradient against the first round's; then SDPA's causal backward alone, with
    deterministic algorithms off and on. A launch plan's check compares bits, so a kernel
    that does not repeat its bits can make one replay differ (the check tries 3 times)."""
    from coat_models import apply_coat
    from fp8_activations import FP8ActivationConfig

    lines = [f"repeat, batch {batch} x seq {SEQ}, {rounds} rounds against the first:"]
    model = apply_coat(_model(torch.float32), config=FP8ActivationConfig(weight_cache=False))
    layer = model.layers[0]
    named = list(layer.named_parameters())
    pos = model.rotary_emb(
        torch.zeros(1, SEQ, HIDDEN, device=DEVICE), torch.arange(SEQ, device=DEVICE)[None]
    )
    x = torch.randn(batch, SEQ, HIDDEN, device=DEVICE, requires_grad=True)
    grad = torch.randn_like(x)

    def step() -> list[torch.Tensor]:
        x.grad = None
        for _, p in named:
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(x, attention_mask=None, position_embeddings=pos)
        out.backward(grad)
        return [out.detach().clone(), x.grad.clone(), *(p.grad.clone() for _, p in named)]

    def count(fn, names: list[str]) -> dict[str, int]:
        first = fn()
        differ = [0] * len(first)
        for _ in range(rounds):
            for i, (a, b) in enumerate(zip(first, fn(), strict=True)):
                differ[i] += not torch.equal(a, b)
        return {n: d for n, d in zip(names, differ, strict=True) if d}

    differ = count(step, ["output", "input grad", *(n for n, _ in named)])
    lines.append(f"  COAT layer: rounds that differ, by tensor: {differ or 'none'}")
    q, k, v = (
        torch.randn(batch, HEADS, SEQ, HIDDEN // HEADS, device=DEVICE, dtype=torch.bfloat16,
                    requires_grad=True)
        for _ in range(3)
    )  # fmt: skip
    g = torch.randn_like(q)

    def sdpa() -> list[torch.Tensor]:
        for t in (q, k, v):
            t.grad = None
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
        return [q.grad.clone(), k.grad.clone(), v.grad.clone()]

    was = torch.are_deterministic_algorithms_enabled()
    for deterministic in (False, True):
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        try:
            got = count(sdpa, ["dq", "dk", "dv"])
        finally:
            torch.use_deterministic_algorithms(was)
        lines.append(
            f"  SDPA causal backward, deterministic algorithms {'on' if deterministic else 'off'}: "
            f"rounds that differ: {got or 'none'}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    """Profiles of the layer benchmarked above (diagnostics, not the numbers to report)."""
    from coat_models.train.args import OneLineParser, int_in  # (its subparsers: its class)

    p = OneLineParser(description="Profile one Llama-2-7B decoder layer (GPU).")
    sub = p.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernels", help="GPU kernel time per kernel name (torch.profiler)")
    k.add_argument("--variants", default="coat,bf16_eager,torchao_float8_compile")
    h = sub.add_parser("host", help="host vs wall time, syncs, cProfile's top functions")
    h.add_argument("--variants", default="coat,bf16_eager")
    h.add_argument("--batches", default="1,4")
    h.add_argument("--rounds", type=int, default=10)
    h.add_argument("--top", type=int, default=45)
    pad_help = "a boolean padding mask: the first sequence's first N positions padded"
    h.add_argument("--padded", type=int_in(0, SEQ - 1), default=0, metavar="N", help=pad_help)
    o = sub.add_parser("ops", help="host time per call of a layer's building blocks")
    r = sub.add_parser("repeat", help="how often a layer step (and SDPA) repeats its bits")
    r.add_argument("--batch", type=int, default=1)
    r.add_argument("--rounds", type=int, default=20)
    for s in (k, h, o, r):
        s.add_argument("--out", help="also write the report here")
    args = p.parse_args(argv)
    graphed = [v for v in getattr(args, "variants", "").split(",") if "graph" in v]
    if getattr(args, "padded", 0) and graphed:
        p.error(f"--padded: {', '.join(graphed)} would run the masked steps eagerly (CUDA graphs "
                "take no attention mask): leave them out")  # fmt: skip
    if not torch.cuda.is_available():
        print("bench_llama_layer: profiling needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.what in ("ops", "repeat"):
        if args.what == "repeat":
            report = profile_repeat(args.batch, args.rounds)
        else:
            report = profile_ops()
        print(report, flush=True)
        if args.out:
            Path(args.out).write_text(report + "\n")
        return 0
    parts = []
    for v in args.variants.split(","):
        if v not in VARIANTS:
            print(f"bench_llama_layer: unknown variant {v}: one of {', '.join(VARIANTS)}",
                  file=sys.stderr)  # fmt: skip
            return 2
        if v.startswith("torchao") and importlib.util.find_spec("torchao") is None:
            continue
        if args.what == "kernels":
            runs = [lambda v=v: profile_kernels(v)]
        else:
            runs = [lambda v=v, b=int(b): profile_host(v, b, args.rounds, args.top, args.padded)
                    for b in args.batches.split(",")]  # fmt: skip
        for run in runs:
            parts.append(run())
            print(parts[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n\n".join(parts) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
