"""A layer's weights cast together (``cast_weights`` -> ``weight_cast=`` / ``weight_casts=``):
the same outputs and gradients, bit for bit, as letting each linear cast its own weight, with
one multi-tensor launch per direction instead of one per weight; with the weight cache, the
stale copies refreshed in one launch; bad handles refused."""

from __future__ import annotations

import fp8_activations as fa
import fp8_quant.ops
import pytest
import torch
from fp8_activations import FP8ActivationConfig
from fp8_activations.ops import linear as lin

K = 64


def _leaf(*shape, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).requires_grad_()


def _block(cfg, casts, x, up, norm_w, ws):
    """Norm -> two linears, a linear, SwiGLU -> linear (a decoder layer's weight uses)."""
    c = casts or [None] * 4
    q, k = fa.rms_norm_linear(x, norm_w, 1e-6, ws[:2], None, cfg, weight_casts=casts and c[:2])
    o = fa.fp8_linear(q + k.sum(-1, keepdim=True), ws[2], None, cfg, weight_cast=c[2])
    return fa.swiglu_linear(o, up, ws[3], None, cfg, weight_cast=c[3])


def _step(cfg, with_casts, leaves, ws):
    for t in leaves:
        t.grad = None
    for w in ws:  # as an optimizer step would: every weight is cast again
        with torch.no_grad():
            w.mul_(1)
    casts = fa.cast_weights(ws, cfg) if with_casts else None
    out = _block(cfg, casts, *leaves[:3], ws)
    out.float().square().sum().backward()
    return casts, [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "on-the-fly"])
def test_same_bits_and_one_launch_per_direction(cache, monkeypatch):
    cfg = FP8ActivationConfig(weight_cache=cache, backend="triton")
    x, up, norm_w = _leaf(4, 8, K, seed=1), _leaf(4, 8, K, seed=2), _leaf(K, seed=3)
    shapes = ((32, K), (16, K), (K, 32), (K, K))
    ws = [_leaf(*s, scale=0.1, seed=4 + i) for i, s in enumerate(shapes)]
    leaves = [x, up, norm_w, *ws]
    _, want = _step(cfg, False, leaves, ws)

    multi, grad_multi, per_weight = [], [], []
    real_multi, real_quantize, real_t = (
        fp8_quant.ops.quantize_per_tensor_multi, lin.quantize, lin.quantize_t
    )  # fmt: skip
    weight_ptrs = {w.data_ptr() for w in ws}

    def spy_multi(xs, *a):
        # The weights' casts, or (rms_norm_linear's backward) its outputs' gradients.
        seen = multi if xs[0].data_ptr() in weight_ptrs else grad_multi
        seen.append((len(xs), *a[2:]))
        return real_multi(xs, *a)

    monkeypatch.setattr(fp8_quant.ops, "quantize_per_tensor_multi", spy_multi)

    def spy(real):
        def call(t, *a):
            if t.data_ptr() in weight_ptrs:
                per_weight.append(tuple(t.shape))
            return real(t, *a)

        return call

    monkeypatch.setattr(lin, "quantize", spy(real_quantize))
    monkeypatch.setattr(lin, "quantize_t", spy(real_t))
    casts, got = _step(cfg, True, leaves, ws)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if cache:
        assert casts is None and multi == [(4, True, True)]  # the cache refreshed in one launch
        assert all(fa.weight_cache_fresh([w], cfg) for w in ws)
    else:
        assert [c.weight for c in casts] == ws
        assert multi == [(4, True, False), (4, False, True)]  # forward's, backward's
    assert per_weight == []  # no weight was cast on its own
    assert grad_multi == [(2, True, True)]  # the norm's two linears' dy, both layouts


NO_CACHE = FP8ActivationConfig(weight_cache=False)


def test_cast_weights_declines_what_it_cannot_take():
    ws = [_leaf(32, K), _leaf(16, K)]
    assert fa.cast_weights([ws[0].t()], NO_CACHE) is None  # not contiguous
    assert fa.cast_weights([_leaf(K)], NO_CACHE) is None  # not 2-D
    assert fa.cast_weights([torch.empty(0, K)], NO_CACHE) is None
    assert len(fa.cast_weights(ws, NO_CACHE)) == 2
    assert fa.cast_weights(ws) is None  # the default config caches: the cache holds them
    with pytest.raises(TypeError, match="non-empty list"):
        fa.cast_weights([])
    with pytest.raises(ValueError, match="weight_amaxes"):
        fa.cast_weights(ws, weight_amaxes=fa.weight_amaxes(ws[:1]))


def test_a_cast_of_another_weight_is_refused():
    ws = [_leaf(32, K), _leaf(32, K, seed=1)]
    casts = fa.cast_weights(ws, NO_CACHE)
    x = _leaf(4, K, seed=2)
    with pytest.raises(TypeError, match="weight_cast must be the item of cast_weights"):
        fa.fp8_linear(x, ws[0], None, weight_cast=casts[1])
    with pytest.raises(TypeError, match="weight_casts\\[0\\] must be"):
        fa.rms_norm_linear(x, None, 1e-6, ws, weight_casts=[casts[1], casts[0]])
    with pytest.raises(ValueError, match="weight_casts"):
        fa.rms_norm_linear(x, None, 1e-6, ws, weight_casts=casts[:1])
    with pytest.raises(TypeError, match="weight_cast must be"):
        fa.swiglu_linear(x, x, ws[0], weight_cast=object())


def test_backward_twice_through_a_retained_graph():
    """``backward(retain_graph=True)`` then another backward through the same layer: each
    backward gets the weights' transposed casts (the second re-casts each weight from its
    saved max, as the per-weight path does), the same bits as without ``cast_weights``."""
    x, up, norm_w = _leaf(4, 8, K, seed=1), _leaf(4, 8, K, seed=2), _leaf(K, seed=3)
    shapes = ((32, K), (16, K), (K, 32), (K, K))
    ws = [_leaf(*s, scale=0.1, seed=4 + i) for i, s in enumerate(shapes)]
    leaves = [x, up, norm_w, *ws]
    cfg = FP8ActivationConfig(weight_cache=False, backend="triton")

    def twice(with_casts):
        for t in leaves:
            t.grad = None
        casts = fa.cast_weights(ws, cfg) if with_casts else None
        loss = _block(cfg, casts, x, up, norm_w, ws).float().square().sum()
        loss.backward(retain_graph=True)
        first = [t.grad.clone() for t in leaves]
        loss.backward()  # accumulates a second, equal gradient
        return first + [t.grad for t in leaves]

    want = twice(False)
    for a, b in zip(twice(True), want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_cast_serves_one_forward_of_the_weights_it_was_made_from():
    """An item used a second time, or after its weight changed in place, is refused with the
    remedy (never a crash or a stale FP8 weight)."""
    ws = [_leaf(32, K), _leaf(16, K, seed=1)]
    x = _leaf(4, K, seed=2)
    casts = fa.cast_weights(ws, NO_CACHE)
    fa.fp8_linear(x, ws[0], None, NO_CACHE, weight_cast=casts[0])
    with pytest.raises(ValueError, match="already used by a forward.*call cast_weights again"):
        fa.fp8_linear(x, ws[0], None, NO_CACHE, weight_cast=casts[0])
    with torch.no_grad():
        ws[1].mul_(2)  # e.g. an optimizer step between cast_weights and the forward
    with pytest.raises(ValueError, match="changed in place after cast_weights"):
        fa.rms_norm_linear(x, None, 1e-6, ws[1:], None, NO_CACHE, weight_casts=casts[1:])
    casts = fa.cast_weights(ws, NO_CACHE)  # cast after the update: accepted
    y = fa.rms_norm_linear(x, None, 1e-6, ws, None, NO_CACHE, weight_casts=casts)
    want = fa.rms_norm_linear(x, None, 1e-6, ws, None, NO_CACHE)
    for a, b in zip(y, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "on-the-fly"])
@pytest.mark.slow
def test_traced_casts_forward_in_one_launch_same_bits(cache, monkeypatch):
    """Under ``torch.compile`` (aot_eager: the traced ops as they are) ``cast_weights`` casts
    forward's copies of all the weights in one launch inside the graph and backward re-casts
    the transposed copies (that layout only) of each fused linear's weights in one launch,
    the other weights' alone: eager's bits. The weight cache, Python state, is not used
    traced."""
    torch._dynamo.reset()
    cfg = FP8ActivationConfig(weight_cache=cache, backend="triton")
    x, up, norm_w = _leaf(4, 8, K, seed=1), _leaf(4, 8, K, seed=2), _leaf(K, seed=3)
    shapes = ((32, K), (16, K), (K, 32), (K, K))
    ws = [_leaf(*s, scale=0.1, seed=4 + i) for i, s in enumerate(shapes)]
    leaves = [x, up, norm_w, *ws]
    _, want = _step(FP8ActivationConfig(weight_cache=False, backend="triton"), True, leaves, ws)

    def block(x, up, norm_w, *ws):
        return _block(cfg, fa.cast_weights(list(ws), cfg), x, up, norm_w, ws)

    multi, per_weight = [], []
    weight_ptrs = {w.data_ptr() for w in ws}
    real_multi = fp8_quant.ops.quantize_per_tensor_multi

    def spy_multi(xs, *a):
        if xs[0].data_ptr() in weight_ptrs:
            multi.append((len(xs), *a[2:]))
        return real_multi(xs, *a)

    def spy(real):
        def call(t, *a, **kw):
            if t.data_ptr() in weight_ptrs:
                per_weight.append(tuple(t.shape))
            return real(t, *a, **kw)

        return call

    monkeypatch.setattr(fp8_quant.ops, "quantize_per_tensor_multi", spy_multi)
    for name in ("quantize_per_tensor", "quantize_per_tensor_transpose"):
        monkeypatch.setattr(fp8_quant.ops, name, spy(getattr(fp8_quant.ops, name)))
    for t in leaves:
        t.grad = None
    out = torch.compile(block, backend="aot_eager", fullgraph=True)(*leaves[:3], *ws)
    out.float().square().sum().backward()
    for a, b in zip([out.detach()] + [t.grad for t in leaves], want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # forward's; backward's: the down and o weights alone, then the norm's two linears'
    assert multi == [(4, True, False)] + [(1, False, True)] * 2 + [(2, False, True)]
    assert per_weight == []  # nor cast by a per-tensor kernel
    assert not any(fa.weight_cache_fresh([w], cfg) for w in ws)


def test_cached_weight_casts_hand_out_the_cache_as_tensors(monkeypatch):
    """``cached_weight_casts``: the cache's copies as items of tensors only (what a compiled
    region takes as inputs), the stale ones refreshed in one launch first; the linears given
    them cast nothing and give the cache path's bits. None without the cache."""
    cfg = FP8ActivationConfig(weight_cache=True, backend="triton")
    x, up, norm_w = _leaf(4, 8, K, seed=1), _leaf(4, 8, K, seed=2), _leaf(K, seed=3)
    shapes = ((32, K), (16, K), (K, 32), (K, K))
    ws = [_leaf(*s, scale=0.1, seed=4 + i) for i, s in enumerate(shapes)]
    leaves = [x, up, norm_w, *ws]
    _, want = _step(cfg, False, leaves, ws)  # the linears fill and read the cache
    assert fa.cached_weight_casts(ws, NO_CACHE) is None
    multi, weight_ptrs = [], {w.data_ptr() for w in ws}
    real_multi = fp8_quant.ops.quantize_per_tensor_multi

    def spy_multi(xs, *a):
        if xs[0].data_ptr() in weight_ptrs:  # not the gradients rms_norm_linear casts
            multi.append((len(xs), *a[2:]))
        return real_multi(xs, *a)

    monkeypatch.setattr(fp8_quant.ops, "quantize_per_tensor_multi", spy_multi)
    for t in leaves:
        t.grad = None
    with torch.no_grad():
        ws[1].mul_(1)  # one stale copy
    casts = fa.cached_weight_casts(ws, cfg)
    assert multi == [(1, True, True)]  # the stale one alone
    assert [c.weight for c in casts] == ws and all(c.layer is None for c in casts)
    for c, w in zip(casts, ws, strict=True):
        assert all(a is b for a, b in zip(c.tensors, lin.cached_weight_fp8(w), strict=True))
    assert fa.cached_weight_casts(ws, cfg)[0].tensors[0] is casts[0].tensors[0]  # fresh
    out = _block(cfg, casts, x, up, norm_w, ws)
    out.float().square().sum().backward()
    assert multi == [(1, True, True)]  # nothing cast by the linears
    for a, b in zip([out.detach()] + [t.grad for t in leaves], want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():
        ws[2].mul_(2)  # e.g. an optimizer step after cached_weight_casts
    with pytest.raises(ValueError, match="weight_cast is stale.*call cached_weight_casts"):
        _block(cfg, casts, x, up, norm_w, ws)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_quantize_cols_writes_quantize_t_transposed_copy(backend):
    """``quantize_cols`` (a traced backward's weight re-cast): ``quantize_t``'s ``q_t`` and
    scale bit for bit, from the same max, for odd shapes, one row, and a transposed view."""
    for shape, transposed in (
        ((48, 64), False),
        ((13, 67), False),
        ((1, 9), False),
        ((64, 48), True),
    ):
        w = _leaf(*shape, scale=0.3).detach()
        w = w.t() if transposed else w
        amax = w.abs().amax().float()
        q_t, scale = lin.quantize_cols(w, "e4m3", amax, backend)
        _, want_t, want_s = lin.quantize_t(w.contiguous(), "e4m3", amax, backend)
        assert torch.equal(q_t.view(torch.uint8), want_t.view(torch.uint8))
        assert torch.equal(scale, want_s)


def test_a_cast_in_another_format_is_refused():
    """A cast made under one config's forward format, given to an op whose config has
    another, is a one-line error (it was used as it was: the op computed with E4M3 weights
    under an E5M2 config)."""
    e4 = fa.FP8ActivationConfig(weight_cache=False)
    e5 = e4.replace(fwd_format="e5m2")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 64, generator=g), torch.randn(32, 64, generator=g)
    (c,) = fa.cast_weights([w], e4)
    with pytest.raises(ValueError, match="weight_cast was cast to e4m3 but this op's config"):
        fa.fp8_linear(x, w, config=e5, weight_cast=c)
    cached = fa.cached_weight_casts([w, w.flip(0)], e4.replace(weight_cache=True))
    with pytest.raises(ValueError, match=r"weight_casts\[0\] was cast to e4m3"):
        fa.rms_norm_linear(x, None, 1e-6, [w, w.flip(0)], config=e5, weight_casts=cached)
    (c,) = fa.cast_weights([w], e5)
    torch.testing.assert_close(
        fa.fp8_linear(x, w, config=e5, weight_cast=c), fa.fp8_linear(x, w, config=e5),
        rtol=0, atol=0,
    )  # fmt: skip
