"""rms_norm_linear: RMSNorm + FP8 linears that re-form the linears' shared input in backward.

Outputs, the gradients of x, of the norm weight and of the biases are the unfused ops'
(``rms_norm`` then ``fp8_linear`` per weight) bits; the weight gradients use ``y = rms_norm(x)``
re-formed from the norm's FP8 x, so they are compared with float64 autograd. SQNR floors (dB;
x ~N(0, 3^2) with 40x outliers, three weights of 96/32/32 rows as Q/K/V; measured over three
seeds, bf16 and fp32, in brackets):
* outputs: per-tensor E4M3 y and weight, as ``fp8_linear`` [28.7-28.9] -> floor 24.
* dx, dnorm_weight: E5M2 dy through the E4M3 weights (~25 dB), then the norm's backward
  [dx 24.0-24.5, dnorm_weight 22.3-25.1] -> floor 18, as swiglu_linear's input gradients.
* dweight: E5M2 dy with the re-formed E4M3 y, one E4M3 rounding (x's 1 x 16 copy) more than
  the unfused ops [23.8-24.6; unfused 24.1-24.9] -> floor 20, the linear's.
* dbias = sum(dy) in fp32, no FP8 involved [53.4-56.0 bf16] -> floor 45.
"""

from __future__ import annotations

import fp8_activations as fa
import pytest
import torch
import torch.nn.functional as F
from fp8_activations import FP8ActivationConfig
from fp8_activations.ops.linear import cached_weight_fp8
from fp8_activations.tensor import handed_over
from fp8_quant import FP8Format
from fp8_quant import reference as qref

EPS = 1e-6
E4M3 = FP8Format.E4M3
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
OUTS = (96, 32, 32)  # Q, K, V of a GQA layer with hidden 64
FLOORS = {"out": 24, 0: 18, 1: 18, 2: 20, 3: 20, 4: 20, 5: 45}


def _inputs(dtype, rows=48, k=64, seed=0):
    """x, norm weight, three weights, one bias (of the second weight)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows // 2, k, generator=g) * 3
    x.view(-1)[::97] *= 40
    nw = 1 + 0.2 * torch.randn(k, generator=g)
    ws = [torch.randn(n, k, generator=g) / k**0.5 for n in OUTS]
    b = 0.1 * torch.randn(OUTS[1], generator=g)
    return [t.to(dtype) for t in (x, nw, *ws, b)]


def _fused(x, nw, w0, w1, w2, b, cfg=None):
    return fa.rms_norm_linear(x, nw, EPS, [w0, w1, w2], [None, b, None], cfg)


def _unfused(x, nw, w0, w1, w2, b, cfg=None):
    n = fa.rms_norm(x, nw, EPS, cfg)
    return tuple(fa.fp8_linear(n, w, bb, cfg) for w, bb in ((w0, None), (w1, b), (w2, None)))


def _float64(x, nw, w0, w1, w2, b):
    n = F.rms_norm(x, (x.shape[-1],), nw, EPS)
    return torch.cat([F.linear(n, w0), F.linear(n, w1, b), F.linear(n, w2)], -1)


def _run(fn, inputs, cfg, rec=None):
    """Outputs, the gradient of every input and the saved activation bytes (``rec``)."""
    ts = [t.detach().clone().requires_grad_() for t in inputs]
    if rec is not None:
        with rec.record():
            outs = fn(*ts, cfg)
    else:
        outs = fn(*ts, cfg)
    g = torch.Generator().manual_seed(1)
    dys = [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in outs]
    torch.autograd.backward(outs, dys)
    return list(outs), [t.grad for t in ts], ts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "on-the-fly"])
def test_sqnr_vs_float64_autograd(dtype, cache, backend, check_sqnr):
    cfg = FP8ActivationConfig(weight_cache=cache, backend=backend)
    check_sqnr(lambda *ts: torch.cat(_fused(*ts, cfg), -1), _float64, _inputs(dtype), FLOORS)


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "on-the-fly"])
def test_matches_unfused_and_saves_less(cache, backend, saved):
    """Outputs, dx, dnorm_weight and dbias: the unfused bits. Saved: the unfused ops' tensors
    minus the linears' shared y^T (1 B/elem of x plus its 4-byte scale), plus forward's rstd
    (4 B/row) and y's max and scale (8 bytes)."""
    inputs = _inputs(torch.bfloat16)
    cfg = FP8ActivationConfig(weight_cache=cache, backend=backend)
    runs = []
    for fn in (_fused, _unfused):
        rec = type(saved)()
        outs, grads, ts = _run(fn, inputs, cfg, rec)
        cached = [t for w in ts[2:5] for t in cached_weight_fp8(w)]
        runs.append((outs, grads, rec.activation_bytes(*ts[1:], *cached)))
    (f_outs, f_grads, f_bytes), (u_outs, u_grads, u_bytes) = runs
    exact = zip(f_outs + f_grads[:2] + f_grads[5:], u_outs + u_grads[:2] + u_grads[5:], strict=True)
    for a, b in exact:
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    rows, k = inputs[0].numel() // inputs[0].shape[-1], inputs[0].shape[-1]
    assert f_bytes == u_bytes - (rows * k + 4) + 4 * rows + 8


def _on_fp8_grid(rows, k, dtype):
    """x that its 1 x 16 E4M3 copy holds exactly: each group is E4M3 codes whose largest
    magnitude is 448, times a power of two (the group's scale then is that power)."""
    g = torch.Generator().manual_seed(3)
    codes = (torch.randn(rows, k, generator=g) * 100).clamp(-448, 448)
    codes = codes.to(torch.float8_e4m3fn).float().view(rows, k // 16, 16)
    codes[..., 0] = 448.0
    power = 2.0 ** torch.randint(-8, 4, (rows, k // 16, 1), generator=g).float()
    return (codes * power).view(rows, k).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_fp8_input_gives_the_unfused_bits_everywhere(dtype, backend):
    """Where x is exactly its FP8 copy, the re-formed y is forward's y: the weight gradients
    too are the unfused ops' bits."""
    inputs = _inputs(dtype)
    inputs[0] = _on_fp8_grid(48, 64, dtype)
    cfg = FP8ActivationConfig(backend=backend)
    fused, unfused = _run(_fused, inputs, cfg), _run(_unfused, inputs, cfg)
    for a, b in zip(fused[0] + fused[1], unfused[0] + unfused[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _check_reform_kernel(m, n, dtype, device, group=16):
    """The Triton re-form kernel against reference.rms_norm_reform_t, bit for bit: partial
    groups and tiles, a zero group, values that saturate (amax below the true max) and
    values that round into E4M3 subnormals."""
    from fp8_activations import reference
    from fp8_activations.ops.rms_norm_linear import rms_norm_reform_t

    g = torch.Generator().manual_seed(m * n)
    x = torch.randn(m, n, generator=g) * 3
    x.view(-1)[::31] *= 1e-4
    x[0, :16] = 0
    x_q, x_s = (t.to(device) for t in qref.quantize_per_group(x.to(dtype), group, E4M3))
    rstd = (0.5 + torch.rand(m, generator=g)).to(device)
    w = (1 + 0.2 * torch.randn(n, generator=g)).to(device, dtype)
    y = (qref.dequantize_per_group(x_q, x_s, group) * rstd[:, None] * w.float()).to(dtype)
    for amax in (y.abs().amax().float(), 0.5 * y.abs().amax().float()):
        args = (x_q, x_s, rstd, w, amax, group, dtype)
        got = rms_norm_reform_t(*args, "e4m3", "triton")
        want = reference.rms_norm_reform_t(*args, E4M3)
        assert got.shape == (n, m) and got.is_contiguous()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize(
    "m, n", [(37, 67), (130, 48), (1, 16)], ids=["M37-N67", "M130-N48", "M1-N16"]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reform_kernel_matches_reference(m, n, dtype, triton_available):
    _check_reform_kernel(m, n, dtype, "cpu")  # the interpreter


@pytest.mark.parametrize("group, n", [(32, 200), (128, 200), (1024, 1000), (32768, 200),
                                      (65536, 200)])  # fmt: skip
def test_reform_kernel_other_group_sizes(group, n, triton_available):
    # Tiles are whole groups: a group wider than the default tile widens the tile (and takes
    # fewer rows: 16 x 1024); one wider than the row is cut to the row (a 64 x 32768 tile
    # had exceeded Triton's 2**20 elements).
    _check_reform_kernel(70, n, torch.bfloat16, "cpu", group)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m, n", [(37, 67), (8192, 4096), (96, 11008)], ids=["M37-N67", "M8192-N4096", "M96-N11008"]
)
def test_cuda_reform_kernel_matches_reference(m, n):
    _check_reform_kernel(m, n, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "on-the-fly"])
def test_cuda_matches_unfused(cache):
    """Compiled kernels and torch._scaled_mm at a Llama-2-7B layer's width (1024 tokens):
    outputs, dx, dnorm_weight and dbias are the unfused ops' bits; the weight gradients
    within FP8 noise of them."""
    inputs = [t.cuda() for t in _inputs(torch.bfloat16, rows=1024, k=4096)]
    cfg = FP8ActivationConfig(weight_cache=cache)
    (f_outs, f_grads, _), (u_outs, u_grads, _) = (
        _run(_fused, inputs, cfg), _run(_unfused, inputs, cfg)
    )  # fmt: skip
    exact = zip(f_outs + f_grads[:2] + f_grads[5:], u_outs + u_grads[:2] + u_grads[5:], strict=True)
    for a, b in exact:
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(f_grads[2:5], u_grads[2:5], strict=True):
        noise = (a.double() - b.double()).pow(2).sum() / b.double().pow(2).sum()
        assert 10 * torch.log10(noise) < -20  # the two differ by less than FP8's own error


def test_handed_over_input_is_saved_as_is(saved):
    """After residual_add, the fused op saves the handed-over 1 x 16 copy (no quantize)."""
    x, r = torch.randn(8, 64, requires_grad=True), torch.randn(8, 64)
    h = fa.residual_add(x, r)
    fp8 = handed_over(h).fp8
    with saved.record():
        fa.rms_norm_linear(h, None, EPS, [torch.randn(32, 64, requires_grad=True)])
    ptrs = {t.data_ptr() for t in saved}
    assert fp8.data.data_ptr() in ptrs and fp8.scale.data_ptr() in ptrs


def test_unused_output_and_frozen_weights(monkeypatch):
    """An output that takes no part in the loss gets no gradient work; frozen weights skip
    the re-forming."""
    import fp8_activations.ops.rms_norm_linear as rnl

    inputs = _inputs(torch.float32)
    ts = [t.detach().clone().requires_grad_() for t in inputs]
    q, _, v = _fused(*ts)
    (q.sum() + v.sum()).backward()
    assert ts[3].grad is None and ts[5].grad is None  # k's weight and bias: unused
    assert ts[2].grad is not None and ts[4].grad is not None
    calls = []
    real = rnl.rms_norm_reform_t
    monkeypatch.setattr(rnl, "rms_norm_reform_t", lambda *a: calls.append(1) or real(*a))
    x = inputs[0].clone().requires_grad_()
    sum(o.sum() for o in _fused(x, *inputs[1:])).backward()
    assert x.grad is not None and not calls


def test_no_grad_matches_unfused():
    inputs = _inputs(torch.bfloat16)
    with torch.no_grad():
        for a, b in zip(_fused(*inputs), _unfused(*inputs), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_input():
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    with pytest.raises(TypeError, match="non-empty list"):
        fa.rms_norm_linear(x, None, EPS, [])
    with pytest.raises(TypeError, match="non-empty list"):
        fa.rms_norm_linear(x, None, EPS, w)
    with pytest.raises(ValueError, match=r"weights\[1\] must be 2-D \(out_features, 32\)"):
        fa.rms_norm_linear(x, None, EPS, [w, torch.randn(16, 48)])
    with pytest.raises(ValueError, match="1 biases"):
        fa.rms_norm_linear(x, None, EPS, [w, w], [None])
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        fa.rms_norm_linear(x, torch.ones(16), EPS, [w])


def test_compiles_fullgraph_and_matches_eager():
    torch._dynamo.reset()
    inputs = _inputs(torch.float32)
    cfg = FP8ActivationConfig(weight_cache=False)

    def run(fn):
        ts = [t.detach().clone().requires_grad_() for t in inputs]
        y = fn(*ts)
        y.backward(torch.ones_like(y))
        return [y, *(t.grad for t in ts)]

    fn = lambda *ts: torch.cat(_fused(*ts, cfg), -1)  # noqa: E731
    eager = run(fn)
    compiled = run(torch.compile(fn, backend="aot_eager", fullgraph=True))
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_traced_backward_quantizes_and_recasts_in_one_launch_each(monkeypatch):
    """Traced with Triton and a layer cast (``cast_weights``), backward quantizes the three
    output gradients in one multi-tensor launch (after one for their maxima) and re-casts the
    three weights' transposed copies in one, as eager does (it took two launches per
    gradient and one per weight: 9 launches instead of 3 for Q, K, V); the same bits as
    eager."""
    import fp8_quant.ops

    torch._dynamo.reset()
    inputs = _inputs(torch.float32)
    cfg = FP8ActivationConfig(weight_cache=False, backend="triton")
    calls = []
    real = fp8_quant.ops.quantize_per_tensor_multi

    def spy(xs, fmt, amaxes, row, col):
        calls.append((len(xs), row, col))
        return real(xs, fmt, amaxes, row, col)

    monkeypatch.setattr(fp8_quant.ops, "quantize_per_tensor_multi", spy)

    def fn(x, nw, w0, w1, w2, b):
        casts = fa.cast_weights([w0, w1, w2], cfg)
        outs = fa.rms_norm_linear(
            x, nw, EPS, [w0, w1, w2], [None, b, None], cfg, weight_casts=casts
        )
        return torch.cat(outs, -1)

    def run(fn):
        calls.clear()
        ts = [t.detach().clone().requires_grad_() for t in inputs]
        y = fn(*ts)
        y.backward(torch.linspace(-1, 1, y.numel()).view(y.shape))
        return [y, *(t.grad for t in ts)], sorted(calls)

    eager, eager_calls = run(fn)
    compiled, traced_calls = run(torch.compile(fn, backend="aot_eager", fullgraph=True))
    # forward's weight cast; backward's gradients (both layouts) and weight re-casts
    assert eager_calls == traced_calls == [(3, False, True), (3, True, False), (3, True, True)]
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch._dynamo.reset()
