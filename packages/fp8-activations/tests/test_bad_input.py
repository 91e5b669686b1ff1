"""Bad input gets a clear error at the public function; odd but valid input just works."""

from __future__ import annotations

import fp8_activations as fa
import pytest
import torch
from fp8_activations import FP8ActivationConfig, FP8Tensor, Granularity

X = torch.randn(4, 32)
W = torch.randn(16, 32)

UNARY = {
    "silu": lambda x, c=None: fa.silu(x, c),
    "gelu": lambda x, c=None: fa.gelu(x, "none", c),
    "rms_norm": lambda x, c=None: fa.rms_norm(x, None, 1e-6, c),
    "layer_norm": lambda x, c=None: fa.layer_norm(x, x.shape[-1], None, None, 1e-5, c),
    "swiglu": lambda x, c=None: fa.swiglu(x, x, c),
    "residual_add": lambda x, c=None: fa.residual_add(x, x, c),
    "fp8_linear": lambda x, c=None: fa.fp8_linear(x, W, None, c),
}


@pytest.mark.parametrize("op", UNARY)
@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.ones(4, 32, dtype=torch.int32), "must be bfloat16, float16, float32 or float64"),
        (X.to(torch.float8_e4m3fn), "FP8Tensor.dequantize"),
        (X.numpy(), "must be a torch.Tensor"),
        # torch's own "reshape is not implemented for sparse tensors" before
        (X.to_sparse(), r"must be a dense tensor, got layout torch.sparse_coo: pass .to_dense\(\)"),
    ],
    ids=["int32", "fp8", "numpy", "sparse"],
)
def test_wrong_dtype_or_type(op, bad, match):
    with pytest.raises(TypeError, match=match):
        UNARY[op](bad)


@pytest.mark.parametrize("op", UNARY)
def test_wrong_config_type(op):
    with pytest.raises(TypeError, match="FP8ActivationConfig"):
        UNARY[op](X, {"group_size": 16})


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: fa.fp8_linear(X, torch.randn(16, 31)), ValueError, r"weight.shape\[1\] = 31"),
        (lambda: fa.fp8_linear(X, torch.randn(16)), ValueError, "must be 2-D"),
        (lambda: fa.fp8_linear(X, W, torch.randn(15)), ValueError, r"bias must have shape \(16,\)"),
        (lambda: fa.fp8_linear(X, W.to("meta")), ValueError, "weight is on the meta device"),
        (lambda: fa.fp8_linear(X.to("meta"), W.to("meta")), ValueError, "x is on the meta dev"),
        (lambda: fa.rms_norm(X.to("meta"), None, 1e-6), ValueError, "materialize the model"),
        (lambda: fa.rms_norm(X, torch.ones(31), 1e-6), ValueError, r"weight must have shape \(32"),
        (lambda: fa.layer_norm(X, (4, 32)), ValueError, "only the last dim"),
        (lambda: fa.swiglu(X, torch.randn(4, 16)), ValueError, "up shape"),
        (lambda: fa.swiglu(X, X.double()), TypeError, "up dtype"),
        (lambda: fa.residual_add(X, X[:2]), ValueError, "residual shape"),
        (lambda: fa.gelu(X, "erf"), ValueError, "'none' or 'tanh'"),
        (lambda: FP8ActivationConfig(group_size=12), ValueError, "power of two"),
        (lambda: FP8ActivationConfig(backend="cuda"), ValueError, "backend must be one of"),
        (lambda: FP8ActivationConfig(gemm="cublas"), ValueError, "gemm must be one of"),
        (lambda: FP8ActivationConfig(fwd_format="e3m4"), ValueError, "unknown FP8 format"),
        (lambda: FP8ActivationConfig(weight_cache="true"), TypeError, "must be a bool"),
        (lambda: fa.gelu(X, FP8ActivationConfig()), TypeError, "pass the config as config="),
        (lambda: fa.weight_cache_fresh(W), TypeError, "not one tensor"),
        (lambda: fa.weight_cache_fresh([1]), TypeError, "tensors, got a int"),
        (lambda: fa.weight_cache_fresh(w for w in (1,)), TypeError, "tensors, got a int"),
    ],
    ids=[
        "linear-in", "linear-weight-1d", "linear-bias", "linear-device", "linear-meta",
        "rms-meta", "rms-weight",
        "ln-shape", "swiglu-shape", "swiglu-dtype", "residual-shape", "gelu-approx",
        "group-size", "backend", "gemm", "format", "string-bool", "gelu-config",
        "cache-fresh-tensor", "cache-fresh-int", "cache-fresh-generator",
    ],
)  # fmt: skip
def test_clear_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_scaled_mm_requested_where_it_cannot_run(monkeypatch):
    import fp8_activations.ops.linear as lin

    monkeypatch.setitem(lin._SCALED_MM_PROBE, "cpu", False)
    with pytest.raises(ValueError, match="gemm='auto' or gemm='emulated'"):
        fa.fp8_linear(X, W, None, FP8ActivationConfig(gemm="scaled_mm"))


@pytest.mark.parametrize("op", UNARY)
def test_non_contiguous_input_works(op):
    """Transposed/strided inputs give the same bits as their contiguous copies."""
    base = torch.randn(32, 8).t()  # (8, 32), non-contiguous
    a = base.clone().requires_grad_()
    b = base.contiguous().requires_grad_()
    assert not base.is_contiguous()
    xa = a.t().contiguous().t()  # a non-contiguous leaf-derived view
    ya, yb = UNARY[op](xa), UNARY[op](b)
    torch.testing.assert_close(ya, yb, rtol=0, atol=0)
    ya.sum().backward()
    yb.sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


@pytest.mark.parametrize("op", UNARY)
@pytest.mark.parametrize("shape", [(0, 32), (32,), (1, 1, 32)], ids=["empty", "1d", "3d"])
def test_odd_shapes_work(op, shape):
    x = torch.randn(shape, requires_grad=True)
    y = UNARY[op](x)
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_fp8_tensor_validation_and_roundtrip():
    t = FP8Tensor.quantize(X, Granularity.PER_GROUP, "e4m3", 16)
    assert t.scale.shape == (4, 2) and t.nbytes == X.numel() + 4 * 8
    assert (t.dequantize() - X).abs().max() <= X.abs().max() / 16
    p = FP8Tensor.quantize(X, Granularity.PER_TENSOR, "e5m2")
    assert p.scale.dim() == 0 and p.data.dtype == torch.float8_e5m2
    with pytest.raises(ValueError, match="per-group scale must have shape"):
        FP8Tensor(t.data, t.scale[:, :1], Granularity.PER_GROUP, 16, t.fmt)
    with pytest.raises(TypeError, match="data must be"):
        FP8Tensor(t.data, t.scale, Granularity.PER_GROUP, 16, fa.FP8ActivationConfig().grad_format)
    with pytest.raises(ValueError, match="0-dim"):
        FP8Tensor(t.data, t.scale, Granularity.PER_TENSOR, None, t.fmt)


def test_a_weight_with_no_output_features_gives_an_empty_output(backend):
    """A (0, K) weight crashed in the amax reduction (or named x as the empty
    tensor and suggested amax=, which the op does not take); torch gives (..., 0)."""
    cfg = FP8ActivationConfig(backend=backend)
    x = torch.randn(8, 64, requires_grad=True)
    empty = torch.randn(0, 64, requires_grad=True)
    assert fa.fp8_linear(x, empty, config=cfg).shape == (8, 0)
    assert fa.swiglu_linear(x, x, empty, config=cfg).shape == (8, 0)
    outs = fa.rms_norm_linear(x, None, None, [empty, torch.randn(16, 64)], config=cfg)
    assert [tuple(o.shape) for o in outs] == [(8, 0), (8, 16)]
    amaxes = fa.weight_amaxes([torch.zeros(0, 64), torch.full((16, 64), -2.0)], cfg)
    assert [a.item() for a in amaxes] == [0.0, 2.0]


def test_argument_mistakes_are_named():
    """These failed deep inside (or, eps < 0, returned NaN), or named the wrong
    dimension (a linear's bias was said to match x's last dim)."""
    x, w = torch.randn(4, 64), torch.ones(64)
    cfg = FP8ActivationConfig()
    with pytest.raises(ValueError, match=r"bias must have shape \(32,\) to match weight.shape"):
        fa.fp8_linear(x, torch.randn(32, 64), torch.randn(5))
    with pytest.raises(ValueError, match=r"biases\[0\] must have shape \(32,\) to match weights"):
        fa.rms_norm_linear(x, None, None, [torch.randn(32, 64)], biases=[torch.randn(5)])
    with pytest.raises(ValueError, match="x must have at least one dimension"):
        fa.rms_norm_linear(torch.tensor(1.0), None, None, [torch.randn(32, 1)])
    with pytest.raises(
        TypeError, match="eps got an FP8ActivationConfig: pass the config as config="
    ):
        fa.rms_norm(x, w, cfg)
    with pytest.raises(TypeError, match="eps got an FP8ActivationConfig"):
        fa.layer_norm(x, 64, w, w, cfg)
    with pytest.raises(TypeError, match="eps must be a number >= 0, got str"):
        fa.rms_norm(x, w, "a")
    with pytest.raises(ValueError, match="eps must be >= 0, got -1.0"):
        fa.rms_norm(x, w, -1.0)
    for shape in (torch.tensor(64), 64.0):
        with pytest.raises(TypeError, match="normalized_shape must be an int or a tuple of ints"):
            fa.layer_norm(x, shape)
    with pytest.raises(ValueError, match="group_size must be at most 65536"):
        FP8ActivationConfig(group_size=2**40)


def test_fp8_tensor_takes_what_quantize_takes():
    """A format string failed on .torch_dtype, any granularity but the enum was
    taken for per-group, and a group size of 3 was accepted."""
    q = torch.zeros(4, 32, dtype=torch.float8_e4m3fn)
    t = FP8Tensor(q, torch.tensor(1.0), "per_tensor", None, "e4m3")
    assert t.granularity is Granularity.PER_TENSOR and t.fmt.value == "e4m3"
    with pytest.raises(ValueError, match="granularity must be a Granularity or one of"):
        FP8Tensor(q, torch.tensor(1.0), "tensor", None, "e4m3")
    with pytest.raises(ValueError, match="group_size must be a positive power of two, got 3"):
        FP8Tensor(q, torch.ones(4, 11), Granularity.PER_GROUP, 3, "e4m3")


WEIGHT_LIST_FNS = {
    "weight_amaxes": fa.weight_amaxes,
    "cast_weights": fa.cast_weights,
    "cached_weight_casts": fa.cached_weight_casts,
    "weight_cache_fresh": fa.weight_cache_fresh,
}


@pytest.mark.parametrize("fn", WEIGHT_LIST_FNS)
def test_layer_weight_functions_agree_on_empty_and_one_tensor(fn):
    """The four functions over a layer's weights refuse the same inputs with one message
    (``[]`` gave ``[]`` or True from two of them, a TypeError from the other two)."""
    for bad, match in (([], "non-empty list"), ((), "non-empty list"), (W, "not one tensor")):
        with pytest.raises(TypeError, match=match):
            WEIGHT_LIST_FNS[fn](bad)


def test_layer_weight_functions_take_a_generator_as_its_list():
    """A generator over a model's linears gives what the list gives (``weight_amaxes`` and
    the casts raised "object of type 'generator' has no len()")."""
    ws = [torch.randn(16, 32), torch.randn(32, 32)]
    for a, b in zip(fa.weight_amaxes(w for w in ws), fa.weight_amaxes(ws), strict=True):
        assert torch.equal(a, b)
    cfg = FP8ActivationConfig(weight_cache=False)
    x = torch.randn(4, 32)
    got = fa.rms_norm_linear(x, None, 1e-6, ws, config=cfg, weight_casts=fa.cast_weights(
        (w for w in ws), cfg))  # fmt: skip
    want = fa.rms_norm_linear(x, None, 1e-6, ws, config=cfg)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    fresh = [torch.randn(16, 32), torch.randn(32, 32)]
    casts = fa.cached_weight_casts(w for w in fresh)
    assert casts is not None and len(casts) == 2
    assert fa.weight_cache_fresh(w for w in fresh)
    y = fa.rms_norm_linear(x, None, 1e-6, (w for w in fresh), weight_casts=casts)
    assert [t.shape for t in y] == [(4, 16), (4, 32)]


def test_one_bias_tensor_for_several_weights_is_named():
    with pytest.raises(TypeError, match="one bias \\(or None\\) per weight, not one tensor"):
        fa.rms_norm_linear(X, None, 1e-6, [W, W], torch.zeros(16))


_NORMS = {
    "rms_norm": lambda x, w, b, c: fa.rms_norm(x, w, 1e-6, c),
    "layer_norm": lambda x, w, b, c: fa.layer_norm(x, 32, w, b, 1e-5, c),
    "rms_norm_linear": lambda x, w, b, c: fa.rms_norm_linear(
        x, w, 1e-6, [torch.ones(8, 32) / 32], config=c
    )[0],
}


@pytest.mark.parametrize("name", _NORMS)
@pytest.mark.parametrize("view", ["strided", "expanded"])
def test_a_norm_weight_that_is_a_view_gives_the_dense_ones_answer(name, view, backend):
    """The Triton norms read a strided weight (or bias) as if it were dense: wrong outputs
    and input gradients, and an ``expand``ed one read past its storage. Any layout now gives
    the bits of its dense copy, and the weight's gradient reaches the view's base."""
    torch.manual_seed(0)
    x = torch.randn(4, 32)
    cfg = FP8ActivationConfig(backend=backend)
    if view == "strided":
        base_w, base_b = torch.randn(64), torch.randn(64)
        w, b = base_w.requires_grad_()[::2], base_b.requires_grad_()[1::2]
    else:
        base_w, base_b = torch.full((1,), 1.5), torch.full((1,), 0.25)
        w, b = base_w.requires_grad_().expand(32), base_b.requires_grad_().expand(32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    dense_w, dense_b = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    got = _NORMS[name](xa, w, b, cfg)
    want = _NORMS[name](xb, dense_w, dense_b, cfg)
    assert torch.equal(got, want)
    dy = torch.randn_like(got)
    got.backward(dy)
    want.backward(dy)
    assert torch.equal(xa.grad, xb.grad)
    grad_w = dense_w.grad if view == "strided" else dense_w.grad.sum(0, keepdim=True)
    assert torch.allclose(base_w.grad[::2] if view == "strided" else base_w.grad, grad_w)


def test_an_rms_norm_over_several_dims_is_refused_not_normalized_over_the_last():
    """``FP8RMSNorm((4, 8))`` and ``from_float`` of ``nn.RMSNorm((4, 8))`` normalized over the
    last dim alone in training (eval mode ran the original: the two disagreed)."""
    with pytest.raises(ValueError, match="normalizes the last dim only"):
        fa.FP8RMSNorm((4, 8), elementwise_affine=False)
    for affine in (False, True):
        with pytest.raises(ValueError, match=r"last dim only, got a norm over \(4, 8\)"):
            fa.FP8RMSNorm.from_float(torch.nn.RMSNorm((4, 8), elementwise_affine=affine))
    assert fa.FP8RMSNorm.from_float(torch.nn.RMSNorm(8)).normalized_shape == (8,)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_a_row_longer_than_a_norm_kernel_tile_is_a_one_line_error(op, triton_available):
    """The Triton norms hold a row in one tile (at most 2**20 elements: Triton's limit); a
    longer row failed inside the launch with a traceback through Triton."""
    n = (1 << 20) + 16
    x, w = torch.randn(1, n), torch.ones(n)
    cfg = FP8ActivationConfig(backend="triton")
    call = {
        "rms_norm": lambda: fa.rms_norm(x, w, 1e-6, cfg),
        "layer_norm": lambda: fa.layer_norm(x, n, w, None, 1e-5, cfg),
    }[op]
    with pytest.raises(ValueError, match=rf"^{op}: rows of {n} elements .* backend='reference'"):
        call()
