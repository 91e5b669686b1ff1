"""fp8_activations ops vs PyTorch on Llama-2-7B shapes (8192 tokens, hidden 4096, MLP 11008).

Per op and variant: forward+backward time (CUDA-event median, ``triton.testing.do_bench``)
and the activation bytes autograd keeps (``saved_tensors_hooks``; parameters and the
cached FP8 weights excluded). Variants: ``fp8`` (this package), ``eager`` (the BF16 torch
op), ``compile`` (``torch.compile`` of the same BF16 op), and for the linears ``torchao``
(``Float8Linear``, tensorwise, if importable). The fused ops (``rms_norm_linear`` as
norm -> Q/K/V, ``swiglu_linear`` as SwiGLU -> down) run against the same fp8 ops unfused
(``unfused``) and eager BF16. Prints a table at the end; writes JSON to ``$BENCH_OUT`` if
set.

    pytest -o python_files='bench_*.py' --benchmark-only packages/fp8-activations/benchmarks
"""

from __future__ import annotations

import json
import os

import fp8_activations as fa
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOKENS, HIDDEN, MLP = 8192, 4096, 11008
RESULTS: list[dict] = []


def _rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


def _ops():
    """name -> (fp8 fn, bf16 torch fn, input factory); inputs[0:n_act] are activations."""
    w = lambda n: (1 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16)  # noqa: E731
    return {
        "rms_norm": (
            lambda x, g: fa.rms_norm(x, g, 1e-6),
            lambda x, g: F.rms_norm(x, (HIDDEN,), g, 1e-6),
            lambda: [_rand(TOKENS, HIDDEN), w(HIDDEN)],
        ),
        "layer_norm": (
            lambda x, g, b: fa.layer_norm(x, HIDDEN, g, b),
            lambda x, g, b: F.layer_norm(x, (HIDDEN,), g, b),
            lambda: [_rand(TOKENS, HIDDEN), w(HIDDEN), w(HIDDEN)],
        ),
        "silu": (fa.silu, F.silu, lambda: [_rand(TOKENS, MLP)]),
        "gelu": (fa.gelu, F.gelu, lambda: [_rand(TOKENS, MLP)]),
        "swiglu": (fa.swiglu, lambda g, u: F.silu(g) * u, lambda: [_rand(TOKENS, MLP)] * 2),
        "residual_add": (
            fa.residual_add, torch.add, lambda: [_rand(TOKENS, HIDDEN), _rand(TOKENS, HIDDEN)]
        ),
    }  # fmt: skip


def _norm_qkv_unfused(x, g, *ws):
    n = fa.rms_norm(x, g, 1e-6)
    return tuple(fa.fp8_linear(n, w) for w in ws)


def _norm_qkv_eager(x, g, *ws):
    n = F.rms_norm(x, (HIDDEN,), g, 1e-6)
    return tuple(F.linear(n, w) for w in ws)


def _fused_ops():
    """name -> (fused fp8 fn, the fp8 ops unfused, BF16 torch fn, input factory); each fn
    returns a tuple; the parameters are the inputs after x (norm) or after gate and up."""
    w = lambda n: (1 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16)  # noqa: E731
    lin = lambda n, k: _rand(n, k, scale=k**-0.5)  # noqa: E731
    return {
        "rms_norm_linear qkv": (
            lambda x, g, *ws: fa.rms_norm_linear(x, g, 1e-6, ws),
            _norm_qkv_unfused,
            _norm_qkv_eager,
            lambda: [_rand(TOKENS, HIDDEN), w(HIDDEN), *(lin(HIDDEN, HIDDEN) for _ in range(3))],
        ),
        "swiglu_linear down": (
            lambda g, u, wd: (fa.swiglu_linear(g, u, wd),),
            lambda g, u, wd: (fa.fp8_linear(fa.swiglu(g, u), wd),),
            lambda g, u, wd: (F.linear(F.silu(g) * u, wd),),
            lambda: [_rand(TOKENS, MLP), _rand(TOKENS, MLP), lin(HIDDEN, MLP)],
        ),
    }  # fmt: skip


def _saved_bytes(fn, inputs, exclude=()):
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        fn(*inputs)
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen, total = set(), 0
    for t in kept:
        key = (t.untyped_storage().data_ptr(), t.data_ptr(), tuple(t.shape))
        if key[0] in skip or key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def _outputs(fn, leaves) -> tuple:
    out = fn(*leaves)
    return out if isinstance(out, tuple) else (out,)


def _measure(benchmark, name, variant, fn, inputs, params=(), module=None):
    """Time ``fn(*inputs)`` forward + backward (gradients of every input and, for a module,
    of its weight) and count what it saves."""
    from triton.testing import do_bench

    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    wrt = leaves + ([module.weight] if module is not None else [])
    dys = [torch.randn_like(y.float()).to(torch.bfloat16) for y in _outputs(fn, leaves)]

    def step():
        torch.autograd.grad(_outputs(fn, leaves), wrt, dys)

    ms = do_bench(step, warmup=50, rep=200, return_mode="median")
    benchmark.pedantic(lambda: (step(), torch.cuda.synchronize()), rounds=5, warmup_rounds=1)
    exclude = [leaves[i] for i in params] + ([module.weight] if module is not None else [])
    # Model state, not activations: the weights and their FP8 caches.
    exclude += [t for p in exclude for t in getattr(p, "_fp8_weight_cache", (0, ()))[1]]
    row = {
        "op": name,
        "variant": variant,
        "fwd_bwd_ms": round(ms, 4),
        "saved_MB": round(_saved_bytes(fn, leaves, exclude) / 2**20, 2),
    }
    RESULTS.append(row)
    return row


@pytest.mark.parametrize("variant", ["fp8", "eager", "compile"])
@pytest.mark.parametrize("name", list(_ops()) if torch.cuda.is_available() else [])
def test_op(benchmark, name, variant):
    fp8, plain, make = _ops()[name]
    fn = {"fp8": fp8, "eager": plain, "compile": torch.compile(plain)}[variant]
    inputs = make()
    params = tuple(range(1, len(inputs))) if name.endswith("norm") else ()  # weight, bias
    _measure(benchmark, name, variant, fn, inputs, params)


@pytest.mark.parametrize("variant", ["fp8", "unfused", "eager"])
@pytest.mark.parametrize("name", list(_fused_ops()) if torch.cuda.is_available() else [])
def test_fused(benchmark, name, variant):
    fused, unfused, plain, make = _fused_ops()[name]
    fn = {"fp8": fused, "unfused": unfused, "eager": plain}[variant]
    inputs = make()
    params = tuple(range(1, len(inputs))) if name.startswith("rms_norm") else (2,)
    _measure(benchmark, name, variant, fn, inputs, params)


@pytest.mark.parametrize("variant", ["fp8", "bf16", "torchao"])
@pytest.mark.parametrize("k, n", [(HIDDEN, MLP), (MLP, HIDDEN)], ids=["4096x11008", "11008x4096"])
def test_linear(benchmark, k, n, variant):
    """FP8 linear (weights cast once per version, as between optimizer steps) vs BF16."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    if variant == "fp8":
        mod = fa.FP8Linear.from_float(lin)
    elif variant == "torchao":
        float8 = pytest.importorskip("torchao.float8")
        mod = float8.convert_to_float8_training(torch.nn.Sequential(lin))[0]
    else:
        mod = lin
    _measure(benchmark, f"linear {k}x{n}", variant, mod, [_rand(TOKENS, k)], module=mod)


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    if not RESULTS:
        return
    base = {r["op"]: r for r in RESULTS if r["variant"] in ("eager", "bf16")}
    lines = [f"{'op':<20}{'variant':<10}{'fwd+bwd ms':>12}{'saved MB':>10}{'x eager t':>11}"]
    for r in RESULTS:
        b = base.get(r["op"])
        speed = f"{b['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}" if b else "-"
        lines.append(
            f"{r['op']:<20}{r['variant']:<10}{r['fwd_bwd_ms']:>12.4f}{r['saved_MB']:>10.2f}{speed:>11}"
        )
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n" + "\n".join(lines))
    if os.environ.get("BENCH_OUT"):
        with open(os.environ["BENCH_OUT"], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": RESULTS}, f, indent=1)
