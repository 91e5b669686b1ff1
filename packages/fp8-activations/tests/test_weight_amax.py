"""Precomputed weight maxima (``weight_amaxes`` -> ``weight_amax=`` / ``weight_amaxes=``):
the same outputs and gradients, bit for bit, as letting each linear reduce its own weight,
with and without the weight cache; bad values are refused."""

from __future__ import annotations

import fp8_activations as fa
import pytest
import torch
from fp8_activations import FP8ActivationConfig
from fp8_quant.ops import triton_interpreting

K = 64


def _leaf(*shape, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).requires_grad_()


def _run(fn, leaves):
    for t in leaves:
        t.grad = None
    outs = fn()
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum(o.float().square().sum() for o in outs).backward()
    return [o.detach() for o in outs] + [t.grad for t in leaves]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_weight_amaxes_are_exact(backend):
    """torch's multi-tensor norm (reference) and fp8_quant's one-launch kernel (triton):
    each weight's max |w|, exactly."""
    if backend == "triton" and not triton_interpreting():
        pytest.skip("the Triton kernel runs on a CPU only under TRITON_INTERPRET=1")
    ws = [_leaf(32, K, seed=1), _leaf(16, K, scale=1e-3, seed=2), _leaf(48, 40, seed=3)]
    config = FP8ActivationConfig(backend=backend)
    got = fa.weight_amaxes(ws, config)
    # Traced (one operator for the Triton launch; torch's norm for the reference): the same.
    torch._dynamo.reset()
    traced = torch.compile(fa.weight_amaxes, backend="aot_eager", fullgraph=True)(ws, config)
    torch._dynamo.reset()
    for a, b, w in zip(got, traced, ws, strict=True):
        assert a.dtype == torch.float32 and a.dim() == 0
        assert torch.equal(a, w.detach().abs().max().float()) and torch.equal(b, a)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_weight_amaxes_of_float64_weights(backend):
    """A float64 model trained until its first weight maximum (torch's norm refuses to
    narrow with dtype=float32): the fp32 max, as for any other dtype."""
    if backend == "triton" and not triton_interpreting():
        pytest.skip("the Triton kernel runs on a CPU only under TRITON_INTERPRET=1")
    ws = [torch.randn(16, K, dtype=torch.float64), torch.randn(8, K) * 3]
    got = fa.weight_amaxes(ws, FP8ActivationConfig(backend=backend))
    for a, w in zip(got, ws, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, w.abs().max().float())


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "on-the-fly"])
@pytest.mark.parametrize("op", ["fp8_linear", "rms_norm_linear", "swiglu_linear"])
def test_same_bits_as_reducing_in_the_op(op, cache):
    cfg = FP8ActivationConfig(weight_cache=cache)
    x, up = _leaf(4, 8, K, seed=4), _leaf(4, 8, K, seed=5)
    ws = [_leaf(32, K, scale=0.1, seed=6), _leaf(16, K, scale=0.02, seed=7)]
    norm_w = _leaf(K, seed=8)

    def call(amaxes):
        if op == "fp8_linear":
            kw = {} if amaxes is None else {"weight_amax": amaxes[0]}
            return fa.fp8_linear(x, ws[0], None, cfg, **kw)
        if op == "swiglu_linear":
            kw = {} if amaxes is None else {"weight_amax": amaxes[0]}
            return fa.swiglu_linear(x, up, ws[0], None, cfg, **kw)
        kw = {} if amaxes is None else {"weight_amaxes": amaxes}
        return fa.rms_norm_linear(x, norm_w, 1e-6, ws, None, cfg, **kw)

    leaves = [x, up, norm_w, *ws]
    want = _run(lambda: call(None), leaves)
    for w in ws:  # a fresh cache entry for the second run too
        with torch.no_grad():
            w.mul_(1)
    got = _run(lambda: call(fa.weight_amaxes(ws)), leaves)
    for a, b in zip(got, want, strict=True):
        if a is None or b is None:
            assert a is None and b is None
        else:
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_bad_weight_amax_is_refused():
    x, w = _leaf(4, K), _leaf(32, K)
    with pytest.raises(TypeError, match="0-dim float tensor"):
        fa.fp8_linear(x, w, weight_amax=torch.ones(1))
    with pytest.raises(TypeError, match="0-dim float tensor"):
        fa.fp8_linear(x, w, weight_amax=1.0)
    with pytest.raises(ValueError, match="2 weights but 1 weight_amaxes"):
        fa.rms_norm_linear(x, None, 1e-6, [w, w], weight_amaxes=[torch.ones(())])
    with pytest.raises(TypeError, match="non-empty list"):
        fa.weight_amaxes(w)


def test_weight_cache_fresh_tracks_versions():
    """``weight_cache_fresh``: False before the first cast and after an in-place update
    (an optimizer step bumps ``_version``), True in between; always False without the cache."""
    w = _leaf(32, K, seed=11)
    x = _leaf(4, K, seed=12)
    cfg = FP8ActivationConfig()
    assert not fa.weight_cache_fresh([w], cfg)
    fa.fp8_linear(x, w, None, cfg).float().sum().backward()
    assert fa.weight_cache_fresh([w], cfg)
    assert not fa.weight_cache_fresh([w], FP8ActivationConfig(weight_cache=False))
    with torch.no_grad():
        w.mul_(1)
    assert not fa.weight_cache_fresh([w], cfg)


def test_weight_cache_stays_out_of_saved_and_copied_models():
    """The weight cache's FP8 copies stay out of ``torch.save(model)`` after a forward (it
    wrote them, 1.5x the bytes), pickles and copies: a copy or a reloaded model holds no
    copy and answers with the original's bits. Parameters still swap (``swap_tensors``
    refuses a tensor with a weak reference: an earlier store keyed by them broke
    ``load_state_dict`` and ``.to()`` under swap-on-conversion)."""
    import copy
    import io

    from fp8_activations.ops import cached_weight_fp8
    from torch import nn

    torch.manual_seed(0)
    model = fa.convert_to_fp8_activations(nn.Sequential(nn.Linear(K, K), nn.Linear(K, K)))
    x = torch.randn(4, K)

    def saved() -> bytes:
        buf = io.BytesIO()
        torch.save(model, buf)
        return buf.getvalue()

    before = saved()
    y = model(x).detach()  # a training forward (with gradients: under no_grad, the originals)
    assert all(cached_weight_fp8(m.weight) for m in model)
    assert len(saved()) < len(before) + 1024  # (two empty slots; the copies were 8 KiB each)
    loaded = torch.load(io.BytesIO(saved()), weights_only=False)
    for other in (loaded, copy.deepcopy(model)):
        assert not any(cached_weight_fp8(m.weight) for m in other)
        torch.testing.assert_close(other(x).detach(), y, rtol=0, atol=0)
    # Parameters pickled themselves (keep_vars, named_parameters) load with torch.load's
    # default, weights_only, as a plain model's do, in a process without this package: the
    # slot's class made the load refuse them. The loaded slot is ignored.
    buf = io.BytesIO()
    torch.save(dict(model.named_parameters()), buf)
    assert b"fp8_activations" not in buf.getvalue()
    params = torch.load(io.BytesIO(buf.getvalue()))
    assert all(torch.equal(params[k], v) for k, v in model.named_parameters())
    assert cached_weight_fp8(params["0.weight"]) == ()
    twin = fa.convert_to_fp8_activations(nn.Sequential(nn.Linear(K, K), nn.Linear(K, K)))
    for i, m in enumerate(twin):
        m.weight, m.bias = params[f"{i}.weight"], params[f"{i}.bias"]
    torch.testing.assert_close(twin(x).detach(), y, rtol=0, atol=0)  # (the cache refilled)
    assert all(cached_weight_fp8(m.weight) for m in twin)
    state = copy.deepcopy(model.state_dict())
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.load_state_dict(state)
        model.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert model[0].weight.dtype == torch.float64
