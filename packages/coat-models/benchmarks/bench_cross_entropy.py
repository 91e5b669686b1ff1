"""``ops/cross_entropy.py`` against PyTorch on Llama-2-7B's head (vocabulary 32000, hidden
4096, bf16): the kernels alone on one chunk of logits, and the whole head + loss as
``coat_models.loss.linear_cross_entropy`` runs them, forward + backward.

* ``chunk``: one chunk of ``CHUNK_ELEMENTS // 32000`` = 2097 rows of bf16 logits; forward's
  per-row log-sum-exp and target logit (``lse_rows``) plus backward's gradient written over
  the logits (``cross_entropy_grad_``), Triton (``kernel``) against the references' PyTorch
  ops (``torch``: an fp32 copy and several passes).
* ``loss``: 8192 tokens (batch 4 x seq 2048) through ``linear_cross_entropy`` with the
  kernels (``kernel``) and with the reference passes (``torch_passes``), against
  ``F.cross_entropy(F.linear(h, W))`` eager (``eager``) and compiled (``compile``).

Per case: device ms per call (``fp8_quant.timing.cuda_ms_per_call``, calls back to back
behind a GPU sleep), host ms per call (enqueue time, no sync) and, for ``loss``, the peak
bytes allocated above the inputs (``max_memory_allocated``). Prints a table at the end;
``BENCH_OUT=path.json`` also writes it as JSON.

    cd packages/coat-models/benchmarks
    pytest -o python_files='bench_*.py' --benchmark-only bench_cross_entropy.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp8_quant.timing import cuda_ms_per_call, host_ms_per_call

TOKENS, HIDDEN, VOCAB = 8192, 4096, 32000


def _describe(table) -> None:
    table.title = f"cross entropy, vocab {VOCAB}, bf16, forward + backward"
    table.meta = {"tokens": TOKENS, "hidden": HIDDEN, "vocab": VOCAB}


def _time(fn) -> tuple[float, float]:
    """(device ms, host ms) per call of ``fn``."""
    for _ in range(3):  # compile, autotune
        fn()
    torch.cuda.synchronize()
    device_ms = cuda_ms_per_call(fn, calls=10, rounds=5, sleep_cycles=100_000_000)
    return device_ms, host_ms_per_call(fn, 10)


@pytest.mark.parametrize("variant", ["kernel", "torch"])
def test_chunk(benchmark, table, variant):
    from coat_models.loss import CHUNK_ELEMENTS
    from coat_models.ops import cross_entropy as ce

    rows = CHUNK_ELEMENTS // VOCAB
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(rows, VOCAB, device="cuda", generator=g) * 4).bfloat16()
    targets = torch.randint(0, VOCAB, (rows,), device="cuda", generator=g)
    coef = torch.full((rows,), 1 / TOKENS, device="cuda")
    lse, diff = torch.empty(2, rows, device="cuda")
    backend = "triton" if variant == "kernel" else "reference"
    work = logits.clone()

    def step():
        ce.lse_rows(logits, targets, lse, diff, backend)
        work.copy_(logits)  # the backward pass overwrites its logits
        ce.cross_entropy_grad_(work, targets, lse, coef, backend)

    device_ms, host_ms = _time(step)
    benchmark.pedantic(lambda: (step(), torch.cuda.synchronize()), rounds=10, iterations=1)
    _describe(table)
    table.add(f"chunk {rows} rows, {variant}", device_ms=device_ms, host_ms=host_ms)


@pytest.mark.parametrize("variant", ["kernel", "torch_passes", "eager", "compile"])
def test_loss(benchmark, table, peak_bytes, monkeypatch, variant):
    from coat_models import loss as loss_mod
    from coat_models.ops import cross_entropy as ce

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda", generator=g).bfloat16()
    hidden.requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=g) * 0.02).bfloat16()
    weight.requires_grad_()
    targets = torch.randint(0, VOCAB, (TOKENS,), device="cuda", generator=g)

    def plain(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t)

    if variant == "torch_passes":  # the loss's chunking with the reference passes
        monkeypatch.setattr(loss_mod, "lse_rows", lambda *a: ce.lse_rows(*a, "reference"))
        monkeypatch.setattr(
            loss_mod, "cross_entropy_grad_", lambda *a: ce.cross_entropy_grad_(*a, "reference")
        )
    fn = {"eager": plain, "compile": torch.compile(plain)}.get(
        variant, loss_mod.linear_cross_entropy
    )

    def step():
        hidden.grad = weight.grad = None
        fn(hidden, weight, targets).backward()

    device_ms, host_ms = _time(step)
    hidden.grad = weight.grad = None
    peak = peak_bytes(step)
    benchmark.pedantic(lambda: (step(), torch.cuda.synchronize()), rounds=10, iterations=1)
    _describe(table)
    table.add(f"loss {TOKENS} tokens, {variant}", device_ms=device_ms, host_ms=host_ms,
              peak_MiB=peak / 2**20)  # fmt: skip
