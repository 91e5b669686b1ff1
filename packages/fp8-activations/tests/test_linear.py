"""FP8 linear: precision vs float64 autograd, GEMM and quantizer paths against the
reference, what is saved, the weight cache.

SQNR floors (dB), bf16/fp32 x of shape (4, 16, 128) ~N(0, 1) with outliers, weight (96, 128):
* output: x and weight are both per-tensor E4M3 (~31 dB each on normal data; the two errors
  add) [measured 28.9-29.2 over three seeds] -> floor 24.
* dx = dy_q @ w_q and dweight = dy_q.T @ x_q: dy is per-tensor E5M2 (2 mantissa bits,
  ~25 dB) on top of an E4M3 operand [24.5-24.8] -> floor 20.
* dbias = sum(dy) in fp32, no FP8 involved [55.0-55.8 bf16] -> floor 45.
"""

from __future__ import annotations

import fp8_activations as fa
import pytest
import torch
import torch.nn.functional as F
from fp8_activations import FP8ActivationConfig
from fp8_activations.ops.linear import cached_weight_fp8, scaled_mm_supported

FLOORS = {"out": 24, 0: 20, 1: 20, 2: 45}
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
needs_cpu_scaled_mm = pytest.mark.skipif(
    not scaled_mm_supported(torch.device("cpu")),
    reason="torch._scaled_mm does not run on CPU with this torch",
)


def _inputs(dtype, m=64, k=128, n=96, lead=(4,)):
    x = torch.randn(*lead, m // lead[0] if lead else m, k)
    x.view(-1)[::101] *= 20
    return [x.to(dtype), (torch.randn(n, k) / k**0.5).to(dtype), (0.1 * torch.randn(n)).to(dtype)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "on-the-fly"])
def test_sqnr_vs_float64_autograd(dtype, cache, check_sqnr):
    cfg = FP8ActivationConfig(weight_cache=cache)
    check_sqnr(lambda x, w, b: fa.fp8_linear(x, w, b, cfg), F.linear, _inputs(dtype), FLOORS)


def _run(inputs, cfg, saved=None, bias=True):
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    if not bias:
        xs[2] = None
    if saved is not None:
        with saved.record():
            y = fa.fp8_linear(*xs, cfg)
    else:
        y = fa.fp8_linear(*xs, cfg)
    torch.manual_seed(1)
    y.backward(torch.randn_like(y))
    return [y] + [t.grad for t in xs if t is not None]


@needs_cpu_scaled_mm
@pytest.mark.parametrize("m", [48, 37], ids=["M48", "M37-padded"])
def test_scaled_mm_matches_emulated(m):
    """torch._scaled_mm (here on CPU) vs the emulated GEMM: same FP8 operands, fp32
    accumulation in another order -> within 1 bf16 ulp. M = 37 exercises the zero padding
    of the weight-gradient GEMM's inner dim."""
    inputs = _inputs(torch.bfloat16, m=m, lead=())
    fast = _run(inputs, FP8ActivationConfig(gemm="scaled_mm"))
    ref = _run(inputs, FP8ActivationConfig(gemm="emulated"))
    for a, b in zip(fast, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-3)


def test_triton_quantizer_matches_reference(triton_available, saved):
    """fp8_quant's Triton kernels (interpreter on CPU) vs its reference: the saved x_t and
    scale are bit-identical, so every output and gradient is too."""
    inputs = _inputs(torch.bfloat16, m=24, k=32, n=16, lead=())
    tri_saved = type(saved)()
    tri = _run(inputs, FP8ActivationConfig(backend="triton"), tri_saved)
    ref = _run(inputs, FP8ActivationConfig(backend="reference"), saved)
    for a, b in zip(tri, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(tri_saved[0].view(torch.uint8), saved[0].view(torch.uint8))


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "on-the-fly"])
def test_saves_only_fp8_transposed_input(cache, saved):
    """Saved: x^T in E4M3 (1 B/elem, the layout the weight-gradient GEMM wants) + a 4-byte
    scale; never x (BF16 nn.Linear saves 2 B/elem). The weight Parameter (model state) and
    the cached FP8 weight (held by the cache anyway) are not activation memory; without a
    cache the weight's 4-byte amax is saved, so backward re-casts it without a reduction."""
    x, w, b = _inputs(torch.bfloat16)
    x.requires_grad_()
    w.requires_grad_()
    with saved.record():
        fa.fp8_linear(x, w, b, FP8ActivationConfig(weight_cache=cache))
    cached = cached_weight_fp8(w) or (None, None, None)
    assert (cached[0] is not None) == cache
    assert saved.activation_bytes(w, *cached) == x.numel() + 4 + (0 if cache else 4)
    x_t = saved[0]
    assert x_t.dtype == torch.float8_e4m3fn and x_t.shape == (x.shape[-1], x.numel() // x.shape[-1])
    for t in saved:  # no high-precision copy of x in any layout
        assert not (t.is_floating_point() and t.element_size() > 1 and t.numel() == x.numel())
    base = type(saved)()
    with base.record():
        F.linear(x, w, b)
    assert saved.activation_bytes(w, *cached) <= 0.51 * base.activation_bytes(w)


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "on-the-fly"])
def test_linears_on_one_input_share_its_fp8_copy(cache, saved, monkeypatch):
    """Q/K/V (or gate/up) on one x: x is quantized once and its x^T saved once (one copy
    for the three GEMMs), with the same bits as three separate quantizations."""
    x, _, _ = _inputs(torch.bfloat16)
    ws = [(torch.randn(n, x.shape[-1]) / 11).requires_grad_() for n in (96, 32, 32)]
    runs = {}
    for flow in (True, False):
        x.grad = None
        for w in ws:
            w.grad = None
        # A fresh activation (nothing attached yet; not a leaf, which a fused optimizer could
        # update in place unseen: a copy is never kept on one).
        leaf = x.detach().requires_grad_()
        x_ = leaf * 1
        rec = type(saved)()
        cfg = FP8ActivationConfig(weight_cache=cache, precision_flow=flow)
        with rec.record():
            ys = [fa.fp8_linear(x_, w, None, cfg) for w in ws]
        sum(y.float().square().sum() for y in ys).backward()
        cached = [t for w in ws for t in cached_weight_fp8(w)] if cache else []
        runs[flow] = ys, [leaf.grad, *(w.grad for w in ws)], rec.activation_bytes(*ws, *cached)
    (ys, grads, shared), (ys0, grads0, separate) = runs[True], runs[False]
    for a, b in zip([*ys, *grads], [*ys0, *grads0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    amaxes = 0 if cache else 4 * len(ws)  # no cache: each weight's amax, for backward
    assert shared == x.numel() + 4 + amaxes  # x^T in E4M3 and its scale, once
    assert separate == 3 * (x.numel() + 4) + amaxes

    import fp8_activations.ops.linear as lin

    calls = []
    real = lin.quantize_per_tensor_transpose
    monkeypatch.setattr(
        lin,
        "quantize_per_tensor_transpose",
        lambda t, *a, **k: calls.append(t.shape) or real(t, *a, **k),
    )
    x_ = x.detach().requires_grad_() * 1  # an activation
    cfg = FP8ActivationConfig(weight_cache=True)
    for w in ws:
        fa.fp8_linear(x_, w, None, cfg)
    assert calls.count(x.reshape(-1, x.shape[-1]).shape) == 1  # x quantized once
    with torch.no_grad():
        x_.mul_(1)  # in place: bumps _version, the attached copy is stale
    calls.clear()
    fa.fp8_linear(x_, ws[0], None, cfg)
    # Another key: another format. (The backend in the key is the resolved one: "auto" and
    # "reference" on a CPU tensor run the same kernels and share the copy.)
    fa.fp8_linear(x_, ws[1], None, cfg.replace(fwd_format="e5m2"))
    assert calls.count(x.reshape(-1, x.shape[-1]).shape) == 2


def test_weight_cache_one_cast_per_version():
    """Micro-batches reuse the FP8 weight; an optimizer step (in-place, bumps _version)
    invalidates it; cached and on-the-fly casts give identical results."""
    x, w, _ = _inputs(torch.float32)
    w = torch.nn.Parameter(w)
    cfg = FP8ActivationConfig()
    fa.fp8_linear(x, w, None, cfg).sum().backward()
    first = cached_weight_fp8(w)
    fa.fp8_linear(x, w, None, cfg).sum().backward()
    assert cached_weight_fp8(w)[0] is first[0]  # no re-cast within a step
    torch.optim.SGD([w], lr=0.1).step()
    y = fa.fp8_linear(x, w, None, cfg)
    assert cached_weight_fp8(w)[0] is not first[0]
    fresh = fa.fp8_linear(x, w, None, FP8ActivationConfig(weight_cache=False))
    torch.testing.assert_close(y, fresh, rtol=0, atol=0)


def test_weight_cache_follows_the_storage_not_only_its_address():
    """``.data =`` keeps a weight's version; two such swaps can bring it back to the address
    its copy was cast from with other values (``model.half(); model.float()`` when the
    caching allocator hands the freed block back; seen on an H100). Here made
    certain: two storages over one buffer, the same address. The copy is cast again."""
    x, w0, _ = _inputs(torch.float32)
    buf = bytearray(w0.numel() * 4)
    w = torch.nn.Parameter(torch.frombuffer(buf, dtype=torch.float32).view(w0.shape))
    w.data.copy_(w0)
    cfg = FP8ActivationConfig()
    fa.fp8_linear(x, w, None, cfg)
    assert fa.weight_cache_fresh([w], cfg)
    other = torch.frombuffer(buf, dtype=torch.float32).view(w0.shape)  # a second storage
    w.data = other
    other.mul_(-2)  # new values, written through the new storage
    assert w.data_ptr() == other.data_ptr() and w._version == 0  # address and version kept
    assert not fa.weight_cache_fresh([w], cfg)
    got = fa.fp8_linear(x, w, None, cfg)
    want = fa.fp8_linear(x, w, None, FP8ActivationConfig(weight_cache=False))
    assert torch.equal(got, want)


def test_weight_cache_of_a_shallow_copy_is_its_own():
    """``copy.copy`` of a Parameter shares its ``__dict__`` entries (the cache slot among
    them) and its storage, with a version counter of its own: a write through the copy (its
    version 1) and one through the original (its version 1 too) must not hand either the
    other's FP8 copy."""
    import copy

    x, w0, _ = _inputs(torch.float32)
    w = torch.nn.Parameter(w0.clone())
    cfg = FP8ActivationConfig()
    fa.fp8_linear(x, w, None, cfg)  # w gets its cache slot, which the copy then shares
    twin = copy.copy(w)
    assert twin.__dict__["_fp8_weight_cache"] is w.__dict__["_fp8_weight_cache"]
    with torch.no_grad():
        twin.mul_(-2)  # twin's version 1
    fa.fp8_linear(x, twin, None, cfg)  # cached in the shared slot
    with torch.no_grad():
        w.add_(1)  # w's version 1, the storage written again
    assert not fa.weight_cache_fresh([w], cfg)
    got = fa.fp8_linear(x, w, None, cfg)
    assert torch.equal(got, fa.fp8_linear(x, w, None, FP8ActivationConfig(weight_cache=False)))


@pytest.mark.parametrize("shape", [(3, 20, 30), (5, 33)], ids=["K30-N20", "K33-N5"])
def test_dims_not_multiple_of_16_work(shape):
    """_scaled_mm needs multiples of 16; such layers fall back to the emulated GEMM (same
    math) instead of failing, whatever gemm says."""
    *lead, k = (4, shape[-1])
    n = shape[0]
    x = torch.randn(*lead, k, requires_grad=True)
    w = torch.randn(n, k, requires_grad=True)
    gemm = "scaled_mm" if scaled_mm_supported(torch.device("cpu")) else "auto"
    y = fa.fp8_linear(x, w, None, FP8ActivationConfig(gemm=gemm))
    y.sum().backward()
    assert y.shape == (4, n) and x.grad.shape == x.shape and w.grad.shape == w.shape
    assert (10 * torch.log10(F.linear(x, w).pow(2).sum() / (y - F.linear(x, w)).pow(2).sum())) > 25


def test_mixed_dtypes_and_frozen_weight():
    """bf16 activations with fp32 master weights (no autocast needed); a frozen weight gets
    no gradient and the dweight GEMM is skipped."""
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(32, 64)
    b = torch.zeros(32, requires_grad=True)
    y = fa.fp8_linear(x, w, b)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert b.grad.dtype == torch.float32 and w.grad is None


def test_emulated_gemm_is_fp32_under_autocast():
    """The emulated GEMM computes what ``torch._scaled_mm`` does, an fp32 product, also when
    called under autocast (it was a bf16 product there in forward and an fp32 one in
    backward; a compiled backward is traced under the forward's autocast state): output and
    gradients are those of the same call without autocast, bit for bit."""
    cfg = FP8ActivationConfig(gemm="emulated")
    inputs = _inputs(torch.float32)
    want = _run(inputs, cfg)
    with torch.autocast("cpu", torch.bfloat16):
        got = _run(inputs, cfg)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_no_grad_forward_matches():
    x, w, b = _inputs(torch.bfloat16)
    with torch.no_grad():
        y0 = fa.fp8_linear(x, w, b)
    torch.testing.assert_close(y0, fa.fp8_linear(x, w, b).detach(), rtol=0, atol=0)


def _sqnr(a, b):
    return (
        10 * torch.log10(a.double().pow(2).sum() / (a.double() - b.double()).pow(2).sum())
    ).item()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m, k, n", [(8192, 4096, 11008), (8192, 11008, 4096), (37, 64, 48)],
    ids=["4096x11008", "11008x4096", "M37-padded"],
)  # fmt: skip
def test_cuda_scaled_mm_matches_emulated(m, k, n):
    """torch._scaled_mm (FP8 tensor cores; fast accumulation in forward) vs the emulated
    GEMM on the same FP8 operands: every output and gradient >= 40 dB apart, i.e. ~10x
    below the FP8 quantization noise itself (~25-29 dB)."""
    torch.manual_seed(0)
    inputs = [t.cuda() for t in _inputs(torch.bfloat16, m=m, k=k, n=n, lead=())]
    fast = _run(inputs, FP8ActivationConfig(gemm="scaled_mm"))
    ref = _run(inputs, FP8ActivationConfig(gemm="emulated"))
    dbs = [_sqnr(b, a) for a, b in zip(fast, ref, strict=True)]
    assert min(dbs) >= 40, dbs


@pytest.mark.gpu
def test_cuda_sqnr_vs_float64_autograd(check_sqnr):
    inputs = [t.cuda() for t in _inputs(torch.bfloat16, m=1024, k=1024, n=512, lead=())]
    check_sqnr(lambda x, w, b: fa.fp8_linear(x, w, b), F.linear, inputs, FLOORS)


@pytest.mark.parametrize(
    "op", ["linear", "rms_norm", "rms_norm_linear", "swiglu_linear", "residual_add"]
)
def test_nd_outputs_are_the_function_outputs(op):
    """An op on (batch, seq, features) returns its Function's own output in that shape (no
    view node after it in the autograd graph), which the caller may change in place; values
    and gradients are those of the same op on the rows (batch * seq, features)."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 64)
    w = torch.randn(32, 64) / 8
    ops = {
        "linear": lambda t: fa.fp8_linear(t, w),
        "rms_norm": lambda t: fa.rms_norm(t, None, 1e-6),
        "rms_norm_linear": lambda t: fa.rms_norm_linear(t, None, 1e-6, [w])[0],
        "swiglu_linear": lambda t: fa.swiglu_linear(t, t * 0.5, w),
        "residual_add": lambda t: fa.residual_add(t, t * 0.5),
    }
    results = []
    for shape in ((2, 8, 64), (16, 64)):
        xi = x.reshape(shape).clone().requires_grad_()
        y = ops[op](xi)
        assert y.shape[:-1] == shape[:-1]
        assert type(y.grad_fn).__name__.endswith("FunctionBackward")
        y.mul_(3)  # in place on the output: allowed (not a view made inside a Function)
        y.square().sum().backward()
        results.append((y.detach().reshape(16, -1), xi.grad.reshape(16, -1)))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["maxima reduced", "some given"])
def test_quantize_t_many_is_quantize_t_per_tensor(triton_available, case):
    """``quantize_t_many`` (one launch for the missing maxima, one for every tensor's two
    layouts) gives each tensor ``quantize_t``'s bits, its maxima reduced or handed over."""
    from fp8_activations.ops.linear import quantize_t, quantize_t_many

    g = torch.Generator().manual_seed(5)
    shapes = [(64, 96), (64, 32), (48, 96)]
    xs = [(torch.randn(s, generator=g) * 3).to(torch.bfloat16) for s in shapes]
    xs[0].view(-1)[::37] *= 50  # outliers set the scale
    amaxes = [None] * 3
    if case == "some given":  # a handed-over max larger than the tensor's own: it is used
        amaxes[1] = torch.tensor(64.0)
    got = quantize_t_many(xs, "e5m2", amaxes, "triton")
    for x, a, (q, q_t, s) in zip(xs, amaxes, got, strict=True):
        want_q, want_t, want_s = quantize_t(x, "e5m2", a, "triton")
        assert q.view(torch.uint8).equal(want_q.view(torch.uint8))
        assert q_t.view(torch.uint8).equal(want_t.view(torch.uint8))
        assert s.equal(want_s) and s.dim() == 0 and s.dtype == torch.float32
    if case == "some given":
        assert got[1][2].item() != quantize_t(xs[1], "e5m2", None, "triton")[2].item()
