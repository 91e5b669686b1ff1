"""The harness of the ``bench_<op>.py`` files: fp8_activations ops vs PyTorch on Llama-2-7B
shapes (8192 tokens, hidden 4096, MLP 11008); each file holds only its op's cases.

Per op and variant: forward+backward time (CUDA-event median, ``triton.testing.do_bench``)
and the activation bytes autograd keeps (``saved_tensors_hooks``; parameters and the
cached FP8 weights excluded). Variants: ``fp8`` (this package), ``eager`` (the BF16 torch
op), ``compile`` (``torch.compile`` of the same BF16 op), and for the linears ``torchao``
(``Float8Linear``, tensorwise, if importable). The fused ops (``rms_norm_linear`` as
norm -> Q/K/V, ``swiglu_linear`` as SwiGLU -> down) run against the same fp8 ops unfused
(``unfused``) and eager BF16. Prints one table of every op run at the end of the session;
writes it as JSON to ``$BENCH_OUT`` if set.

    pytest -o python_files='bench_*.py' --benchmark-only packages/fp8-activations/benchmarks

Fixtures (fixtures, not an imported helper module: pytest imports these files in importlib
mode, with no benchmarks/ folder on ``sys.path``):

* ``llama``: the sizes above (``Shapes``).
* ``rand(*shape, scale=1.0)``: a bf16 CUDA tensor of ``N(0, scale^2)`` values.
* ``norm_weight(n)``: a bf16 norm weight near 1.
* ``measure(name, variant, fn, inputs, params=(), module=None)``: time ``fn(*inputs)``
  forward + backward, count what it saves, add a row to the table; ``params`` are the
  indices of inputs that are parameters, not activations (left out of the saved bytes).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch


@dataclass(frozen=True)
class Shapes:
    """Llama-2-7B: tokens of one step (batch x sequence), hidden size, MLP size."""

    tokens: int = 8192
    hidden: int = 4096
    mlp: int = 11008


@pytest.fixture(scope="session", autouse=True)
def _cuda():
    """Every benchmark here times CUDA kernels; the table and JSON need a device too."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture(scope="session")
def llama() -> Shapes:
    return Shapes()


@pytest.fixture
def rand():
    def make(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)

    return make


@pytest.fixture
def norm_weight():
    return lambda n: (1 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16)


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


@pytest.fixture(scope="session")
def _results() -> list[dict]:
    """The table's rows, in the order the benchmarks ran (file by file)."""
    return []


@pytest.fixture
def measure(benchmark, _results):
    def run(name, variant, fn, inputs, params=(), module=None) -> dict:
        """Time ``fn(*inputs)`` forward + backward (gradients of every input and, for a
        module, of its weight) and count what it saves."""
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
        _results.append(row)
        return row

    return run


@pytest.fixture(scope="session", autouse=True)
def _report(request, _cuda, _results):
    # Session scope: one table of every bench_<op>.py file that ran, printed once at the end.
    yield
    if not _results:
        return
    base = {r["op"]: r for r in _results if r["variant"] in ("eager", "bf16")}
    lines = [f"{'op':<20}{'variant':<10}{'fwd+bwd ms':>12}{'saved MB':>10}{'x eager t':>11}"]
    for r in _results:
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
            json.dump({"device": torch.cuda.get_device_name(), "results": _results}, f, indent=1)
