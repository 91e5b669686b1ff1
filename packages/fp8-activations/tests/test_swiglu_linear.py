"""swiglu_linear: SwiGLU + FP8 linear that re-forms the linear's input in backward.

Same output, input and bias gradients as ``fp8_linear(swiglu(...))`` bit for bit; the
weight gradient uses ``silu(g) * u`` re-formed from the FP8 gate/up, so it is compared with
float64 autograd (floor 20 dB like the linear's; measured 23.1-23.7 dB over three seeds,
the unfused 24.4-24.8)."""

from __future__ import annotations

import fp8_activations as fa
import pytest
import torch
import torch.nn.functional as F
from fp8_activations import FP8ActivationConfig
from fp8_activations.ops.linear import cached_weight_fp8

FLOORS = {"out": 24, 0: 18, 1: 18, 2: 20, 3: 45}
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]


def _inputs(dtype, m=64, f=96, n=64):
    g, u = torch.randn(4, m // 4, f), torch.randn(4, m // 4, f)
    g.view(-1)[::101] *= 8
    w, b = torch.randn(n, f) / f**0.5, 0.1 * torch.randn(n)
    return [t.to(dtype) for t in (g, u, w, b)]


def _unfused(g, u, w, b, cfg=None):
    return fa.fp8_linear(fa.swiglu(g, u, cfg), w, b, cfg)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "on-the-fly"])
def test_sqnr_vs_float64_autograd(dtype, cache, check_sqnr):
    cfg = FP8ActivationConfig(weight_cache=cache)
    check_sqnr(
        lambda g, u, w, b: fa.swiglu_linear(g, u, w, b, cfg),
        lambda g, u, w, b: F.linear(F.silu(g) * u, w, b),
        _inputs(dtype),
        FLOORS,
    )


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "on-the-fly"])
def test_matches_unfused_and_saves_less(cache, saved):
    """Output, gate/up and bias gradients: the unfused bits. Saved: the unfused ops'
    tensors minus the linear's x^T (1 B/elem of silu(g) * u, plus 4 bytes for its scale;
    the fused op keeps s's scale and max, 8 bytes)."""
    inputs = _inputs(torch.bfloat16)
    dy = torch.randn(4, 16, 64, dtype=torch.bfloat16)
    runs = []
    for fn in (fa.swiglu_linear, _unfused):
        ts = [t.detach().clone().requires_grad_() for t in inputs]
        rec = type(saved)()
        with rec.record():
            y = fn(*ts, FP8ActivationConfig(weight_cache=cache))
        y.backward(dy)
        w = ts[2]
        cached = cached_weight_fp8(w) if cache else ()
        runs.append(([y, ts[0].grad, ts[1].grad, ts[3].grad], rec.activation_bytes(w, *cached)))
    (fused, fused_bytes), (ref, ref_bytes) = runs
    for a, b in zip(fused, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    s_elems = inputs[0].numel()
    assert fused_bytes == ref_bytes - (s_elems + 4) + 8


def test_no_grad_and_frozen_weight():
    g, u, w, b = _inputs(torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(
            fa.swiglu_linear(g, u, w, b), _unfused(g, u, w, b), rtol=0, atol=0
        )
    g.requires_grad_()
    fa.swiglu_linear(g, u, w, b).sum().backward()  # frozen weight: no re-forming needed
    assert g.grad is not None and w.grad is None


def test_bad_shapes():
    g = torch.randn(4, 32)
    with pytest.raises(ValueError, match="in_features"):
        fa.swiglu_linear(g, g, torch.randn(16, 48))
    with pytest.raises(ValueError, match="shape"):
        fa.swiglu_linear(g, torch.randn(4, 16), torch.randn(16, 32))


def test_compiles_fullgraph_and_matches_eager():
    torch._dynamo.reset()
    inputs = _inputs(torch.float32)

    def run(fn):
        ts = [t.detach().clone().requires_grad_() for t in inputs]
        y = fn(*ts)
        y.backward(torch.ones_like(y))
        return [y, *(t.grad for t in ts)]

    fn = lambda g, u, w, b: fa.swiglu_linear(g, u, w, b, FP8ActivationConfig(weight_cache=False))  # noqa: E731
    eager = run(fn)
    compiled = run(torch.compile(fn, backend="aot_eager", fullgraph=True))
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _check_reform_kernel(m, n, dtype, device):
    """The Triton re-form kernel against reference.swiglu_reform_t: partial groups and
    tiles, a zero group, saturation (amax below the true max), subnormals. Both quantize with
    the same scale; sigmoid differs in the last fp32 bit between Triton and torch, so a
    rounding to s's dtype may land one step apart: codes are equal or adjacent (and rarely
    so: none differed in 131072 elements on CPU)."""
    from fp8_activations import reference
    from fp8_activations.ops.swiglu_linear import swiglu_reform_t
    from fp8_quant import FP8Format, quantize_per_group

    gen = torch.Generator().manual_seed(m * n)
    g, u = torch.randn(m, n, generator=gen) * 3, torch.randn(m, n, generator=gen)
    u.view(-1)[::31] *= 1e-4
    g[0, :16] = 0
    g, u = g.to(device, dtype), u.to(device, dtype)
    parts = (*quantize_per_group(g, 16, backend="reference"),
             *quantize_per_group(u, 16, backend="reference"))  # fmt: skip
    s_max = (F.silu(g.float()) * u.float()).abs().amax()
    for amax in (s_max, 0.5 * s_max):
        args = (*parts, amax, 16, dtype)
        got = swiglu_reform_t(*args, "e4m3", "triton").view(torch.uint8).int()
        want = reference.swiglu_reform_t(*args, FP8Format.E4M3).view(torch.uint8).int()
        assert got.shape == (n, m)
        assert (got - want).abs().max() <= 1 and (got != want).float().mean() <= 0.01


@pytest.mark.parametrize(
    "m, n", [(37, 67), (130, 48), (1, 16)], ids=["M37-N67", "M130-N48", "M1-N16"]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reform_kernel_matches_reference(m, n, dtype, triton_available):
    _check_reform_kernel(m, n, dtype, "cpu")  # the interpreter


@pytest.mark.gpu
@pytest.mark.parametrize("m, n", [(37, 67), (8192, 11008)], ids=["M37-N67", "M8192-N11008"])
def test_cuda_reform_kernel_matches_reference(m, n):
    _check_reform_kernel(m, n, torch.bfloat16, "cuda")


def _check_reform_codes(m, n, dtype, device):
    """The re-form kernel's FP8 codes bit for bit: the reference per-tensor quantization of
    ``s`` as Triton computes it (its sigmoid: the SwiGLU forward kernel on the dequantized
    gate and up), so that only the quantization is compared. Same inputs as
    ``_check_reform_kernel`` (zero group, saturation, subnormals)."""
    from fp8_activations.ops.swiglu import swiglu_fwd
    from fp8_activations.ops.swiglu_linear import swiglu_reform_t
    from fp8_quant import FP8Format
    from fp8_quant import reference as qref

    gen = torch.Generator().manual_seed(m * n)
    g, u = torch.randn(m, n, generator=gen) * 3, torch.randn(m, n, generator=gen)
    u.view(-1)[::31] *= 1e-4
    g[0, :16] = 0
    g_q, g_s = qref.quantize_per_group(g.to(device, dtype), 16)
    u_q, u_s = qref.quantize_per_group(u.to(device, dtype), 16)
    g_d, u_d = (
        qref.dequantize_per_group(q, s, 16).contiguous() for q, s in ((g_q, g_s), (u_q, u_s))
    )
    # fp32 in, fp32 out: the kernel's own rounding of s to dtype is torch's (nearest even).
    s = swiglu_fwd(g_d, u_d, 16, "e4m3", False, False, "none", "triton")[0].to(dtype)
    s_max = s.float().abs().amax()
    for amax in (s_max, 0.5 * s_max):
        got = swiglu_reform_t(g_q, g_s, u_q, u_s, amax, 16, dtype, "e4m3", "triton")
        want = qref.quantize_per_tensor(s, FP8Format.E4M3, amax)[0].t()
        assert got.shape == (n, m)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("m, n", [(37, 67), (130, 48)], ids=["M37-N67", "M130-N48"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reform_codes_match_reference(m, n, dtype, triton_available):
    _check_reform_codes(m, n, dtype, "cpu")  # the interpreter


@pytest.mark.gpu
@pytest.mark.parametrize("m, n", [(37, 67), (8192, 11008)], ids=["M37-N67", "M8192-N11008"])
def test_cuda_reform_codes_match_reference(m, n):
    """With the hardware cast on sm_90+ (``hw_cast_supported``)."""
    _check_reform_codes(m, n, torch.bfloat16, "cuda")


@pytest.mark.parametrize("fused", [True, False], ids=["swiglu_linear", "swiglu"])
def test_grad_group_amax_handed_to_gate_up_linears(fused, monkeypatch, triton_available):
    """SwiGLU's backward hands its gradients' group maxima to gate_proj / up_proj (through
    the callers' reshapes, which autograd passes on as views): their dy scales come from
    them, not from a second read of dy, with the same bits as without the hand-over."""
    import fp8_activations.ops.linear as lin
    import fp8_activations.ops.rms_norm_linear as rnl
    import fp8_activations.tensor as ft

    torch.manual_seed(0)
    x = torch.randn(2, 24, 64, dtype=torch.bfloat16)
    nw = 1 + 0.1 * torch.randn(64, dtype=torch.bfloat16)
    wg, wu = (torch.randn(96, 64, dtype=torch.bfloat16) / 8 for _ in range(2))
    wd = torch.randn(64, 96, dtype=torch.bfloat16) / 10
    dy = torch.randn(2, 24, 64, dtype=torch.bfloat16)
    cfg = FP8ActivationConfig(backend="triton")

    def run():
        ts = [t.detach().clone().requires_grad_() for t in (x, nw, wg, wu, wd)]
        gate, up = fa.rms_norm_linear(ts[0], ts[1], 1e-6, ts[2:4], None, cfg)
        y = fa.swiglu_linear(gate, up, ts[4], None, cfg) if fused else \
            fa.fp8_linear(fa.swiglu(gate, up, cfg), ts[4], None, cfg)  # fmt: skip
        y.backward(dy)
        return [t.grad for t in ts]

    taken = []
    real = lin.grad_amax

    def spy(t):
        a = real(t)
        taken.append(a is not None)
        return a

    monkeypatch.setattr(rnl, "grad_amax", spy)
    with_hand_over = run()
    assert taken == [True, True]  # up, then gate
    monkeypatch.setattr(ft, "take_group_amax", lambda t: None)
    monkeypatch.setattr(lin, "take_group_amax", lambda t: None)
    taken.clear()
    without = run()
    assert taken == [False, False]
    for a, b in zip(with_hand_over, without, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("group", [32768, 65536])
def test_groups_longer_than_the_row_are_one_group_per_row(group, triton_available):
    """A group longer than the row is one group per row, as a group of the row's length is:
    the same bits forward and backward (the backward's re-form kernel had sized its tile by
    the group, 64 x 32768, past Triton's 2**20 elements, and failed inside the launch)."""
    torch.manual_seed(0)
    gate, up = torch.randn(6, 40), torch.randn(6, 40)
    w = torch.randn(16, 40)
    results = []
    for g in (64, group):
        cfg = FP8ActivationConfig(backend="triton", group_size=g, weight_cache=False)
        leaves = [t.clone().requires_grad_() for t in (gate, up, w)]
        y = fa.swiglu_linear(leaves[0], leaves[1], leaves[2], None, cfg)
        y.square().sum().backward()
        results.append([y.detach(), *(t.grad for t in leaves)])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
