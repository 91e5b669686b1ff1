"""The FP8 precision flow: a producer hands its output's FP8 form (or group maxima) to the
next op, which saves exactly that and skips its own quantization pass. Results must be
bit-identical to the same chain without the hand-over, and the BF16 output freeable."""

from __future__ import annotations

import gc
import weakref

import fp8_activations as fa
import pytest
import torch
from fp8_activations import FP8ActivationConfig
from fp8_activations.tensor import handed_over

N = 64


def _leaves(*shapes, dtype=torch.bfloat16):
    return [torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes]


def _grads(ts):
    return [t.grad.clone() for t in ts]


def _llama_mlp_half(cfg, x, r, w_norm, w_gate, w_up, w_down):
    """residual add -> RMSNorm -> gate/up linears -> SwiGLU -> down linear."""
    h = fa.residual_add(x, r, cfg)
    n = fa.rms_norm(h, w_norm, 1e-6, cfg)
    s = fa.swiglu(fa.fp8_linear(n, w_gate, None, cfg), fa.fp8_linear(n, w_up, None, cfg), cfg)
    return fa.fp8_linear(s, w_down, None, cfg)


def test_chain_bit_identical_with_and_without_hand_over(saved):
    leaves = _leaves((2, 8, N), (2, 8, N), (N,), (96, N), (96, N), (N, 96))
    outs, grads, records = [], [], []
    for flow in (True, False):
        rec = type(saved)()
        with rec.record():
            y = _llama_mlp_half(FP8ActivationConfig(precision_flow=flow), *leaves)
        y.backward(torch.ones_like(y))
        outs.append(y)
        grads.append(_grads(leaves))
        records.append(rec)
        for t in leaves:
            t.grad = None
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The hand-over replaces passes; the only change in what is kept: gate and up share one
    # saved per-tensor x^T (16 x 64 E4M3 + its fp32 scale) instead of one each.
    params = leaves[2:]
    shared = 16 * N + 4
    assert records[0].activation_bytes(*params) == records[1].activation_bytes(*params) - shared


def test_norm_saves_the_handed_over_tensor(saved):
    x, r, w = _leaves((4, N), (4, N), (N,))
    h = fa.residual_add(x, r)
    fp8 = handed_over(h).fp8
    assert fp8 is not None and fp8.group_size == 16 and fp8.data.shape == h.shape
    with saved.record():
        fa.rms_norm(h, w, 1e-6)
    ptrs = {t.data_ptr() for t in saved}
    assert fp8.data.data_ptr() in ptrs and fp8.scale.data_ptr() in ptrs


@pytest.mark.parametrize("producer", ["rms_norm", "swiglu", "gelu"])
def test_linear_uses_handed_over_group_maxima(producer, monkeypatch):
    """The linear's per-tensor scale comes from the producer's per-group maxima: the
    quantizer is called with amax given (no reduction pass over x)."""
    x, w_lin = _leaves((4, N), (32, N))
    make = {
        "rms_norm": lambda: fa.rms_norm(x, None, 1e-6),
        "swiglu": lambda: fa.swiglu(x, x * 2),
        "gelu": lambda: fa.gelu(x),
    }[producer]
    y = make()
    group_amax = handed_over(y).group_amax
    assert group_amax.shape == (4, N // 16)
    torch.testing.assert_close(group_amax.amax(), y.detach().abs().amax().float(), rtol=0, atol=0)
    import fp8_activations.ops.linear as lin

    seen = []
    real = lin.quantize_per_tensor_transpose
    monkeypatch.setattr(
        lin,
        "quantize_per_tensor_transpose",
        lambda t, f, amax, backend: seen.append(amax) or real(t, f, amax=amax, backend=backend),
    )
    fa.fp8_linear(y, w_lin, None, FP8ActivationConfig(weight_cache=False))
    # x: amax handed over; the weight (no cache) is cast row-major only, by quantize_per_tensor
    assert len(seen) == 1 and seen[0] is not None


def test_in_place_change_or_other_config_falls_back(saved):
    x, r, w = _leaves((4, N), (4, N), (N,))
    h = fa.residual_add(x, r)
    with torch.no_grad():
        h.mul_(2)  # bumps _version: the attached FP8 copy is stale
    assert handed_over(h) is None
    h2 = fa.residual_add(x, r)
    assert handed_over(h2).fp8 is not None
    with saved.record():
        fa.rms_norm(h2, w, 1e-6, FP8ActivationConfig(group_size=32))  # wants 1x32 groups: quantizes
    assert handed_over(h2).fp8.data.data_ptr() not in {t.data_ptr() for t in saved}


def test_bf16_output_is_freed_after_its_consumers():
    """Nothing keeps the high-precision intermediates alive: only FP8 copies are saved."""
    x, r, w, w_lin = _leaves((8, N), (8, N), (N,), (32, N))
    h = fa.residual_add(x, r)
    n = fa.rms_norm(h, w, 1e-6)
    y = fa.fp8_linear(n, w_lin)
    refs = [weakref.ref(h), weakref.ref(n)]
    del h, n
    gc.collect()
    assert all(ref() is None for ref in refs)
    y.sum().backward()  # the graph still works from the FP8 copies alone
    assert x.grad is not None and w.grad is not None and w_lin.grad is not None


def test_a_saved_output_carries_no_hand_over():
    """torch.save of an op's output (a hidden state) carried its FP8 hand-over: the copies
    (more bytes) and a class that torch.load's default (weights_only) refused.
    It now loads as a plain tensor's would, and the loaded one hands nothing over."""
    import io

    x, r = _leaves((4, N), (4, N))
    y = fa.residual_add(x, r)
    assert handed_over(y) is not None
    buf, plain = io.BytesIO(), io.BytesIO()
    torch.save(y, buf)
    torch.save(y.detach().clone(), plain)
    assert b"fp8_activations" not in buf.getvalue()
    assert len(buf.getvalue()) < len(plain.getvalue()) + 256  # (an empty set, no copies)
    loaded = torch.load(io.BytesIO(buf.getvalue()))
    assert torch.equal(loaded, y) and handed_over(loaded) is None


@pytest.mark.parametrize("kind", ["parameter", "plain-leaf", "view-of-parameter"])
def test_a_trained_input_is_read_afresh_after_a_fused_optimizer_step(kind):
    """A linear's per-tensor FP8 copy of its input was kept on a trained leaf fed to it (a
    learned query: a Parameter, a plain tensor that requires grad, or a view of either); a
    fused optimizer updates its tensors in place without bumping their version, so the next
    forward reused the copy of the old value (a plain leaf and a view: only Parameters
    themselves were skipped)."""
    torch.manual_seed(0)
    leaf = torch.randn(4, N, requires_grad=True)
    if kind != "plain-leaf":
        leaf = torch.nn.Parameter(leaf.detach())
    query = leaf[:, :] if kind == "view-of-parameter" else leaf  # (one view, kept)
    w = torch.nn.Parameter(torch.randn(N, N) / 8)
    opt = torch.optim.AdamW([leaf, w], lr=0.1, fused=True)
    for _ in range(3):
        y = fa.fp8_linear(query, w, None)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
    fresh = fa.fp8_linear(query.detach().clone(), w.detach(), None)
    assert torch.equal(fa.fp8_linear(query, w, None).detach(), fresh)
