"""``ops/rope.py`` (RoPE of q and k, one Triton kernel each way) against transformers'
``apply_rotary_pos_emb`` run eagerly and under ``torch.compile``, on one Llama-2-7B layer's
q and k (batch 4, seq 2048, 32 heads, head_dim 128, bf16), forward + backward.

Per variant: device ms per forward + backward (``fp8_quant.timing.cuda_ms_per_call``: calls
back to back behind a GPU sleep, so the device's time and not the host's), host ms per call
(the time to enqueue it, no sync), and the bytes a call allocates beyond its outputs
(``max_memory_allocated``). The inputs are the Q/K projections' ``(batch, seq, heads *
head_dim)`` output seen as ``(batch, heads, seq, head_dim)``, as the decoder layer hands them
over. Prints a table at the end; ``BENCH_OUT=path.json`` also writes it as JSON.

    cd packages/coat-models/benchmarks
    pytest -o python_files='bench_*.py' --benchmark-only bench_rope.py
"""

from __future__ import annotations

import pytest
import torch
from fp8_quant.timing import cuda_ms_per_call, host_ms_per_call

BATCH, SEQ, HEADS, DIM = 4, 2048, 32, 128
VARIANTS = ["kernel", "eager", "compile"]


def _inputs():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    g = torch.Generator(device="cuda").manual_seed(0)
    proj = [
        torch.randn(BATCH, SEQ, HEADS * DIM, device="cuda", generator=g).bfloat16()
        for _ in range(2)
    ]
    q, k = (p.view(BATCH, SEQ, HEADS, DIM).transpose(1, 2).requires_grad_() for p in proj)
    config = LlamaConfig(hidden_size=HEADS * DIM, num_attention_heads=HEADS)
    rotary = LlamaRotaryEmbedding(config, device="cuda")
    pos = torch.arange(SEQ, device="cuda")[None]
    cos, sin = rotary(proj[0], pos)
    grads = [torch.randn(BATCH, HEADS, SEQ, DIM, device="cuda", generator=g).bfloat16()] * 2
    return q, k, cos, sin, grads


@pytest.mark.parametrize("variant", VARIANTS)
def test_rope(benchmark, table, peak_bytes, variant):
    from coat_models.ops import rope
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    fn = {
        "kernel": rope.apply_rotary_pos_emb,
        "eager": apply_rotary_pos_emb,
        "compile": torch.compile(apply_rotary_pos_emb),
    }[variant]
    q, k, cos, sin, grads = _inputs()

    def step():
        q.grad = k.grad = None
        torch.autograd.backward(fn(q, k, cos, sin), grads)

    for _ in range(3):  # compile, autotune
        step()
    torch.cuda.synchronize()
    device_ms = cuda_ms_per_call(step, calls=20, rounds=5, sleep_cycles=40_000_000)
    host_ms = host_ms_per_call(step, 20)
    extra = peak_bytes(step)
    benchmark.pedantic(lambda: (step(), torch.cuda.synchronize()), rounds=10, iterations=1)
    table.title = (
        f"RoPE of q and k, batch {BATCH} x seq {SEQ} x {HEADS} heads x {DIM}, bf16, "
        "forward + backward"
    )
    table.meta = {"shape": [BATCH, SEQ, HEADS, DIM]}
    table.add(variant, device_ms=device_ms, host_ms=host_ms, extra_MiB=extra / 2**20)
