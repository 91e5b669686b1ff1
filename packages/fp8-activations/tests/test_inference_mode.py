"""Under ``torch.inference_mode()`` (inference tensors have no version counter, which the
FP8 hand-over and the weight cache are keyed on) the ops and converted modules run, with
the bits they give under ``torch.no_grad()`` (they raised "Inference tensors do not track
version counter")."""

import fp8_activations as fa
import torch

K = 32


def _ops(x, w):
    return [
        fa.rms_norm(x, None, 1e-6),
        fa.layer_norm(x, K),
        fa.silu(x),
        fa.gelu(x),
        fa.swiglu(x, x.flip(-1)),
        fa.fp8_linear(x, w),
        *fa.rms_norm_linear(x, None, 1e-6, [w, w.flip(0)]),
        fa.swiglu_linear(x, x.flip(-1), w),
    ]


def test_ops_and_modules_run_under_inference_mode():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, K, generator=g), torch.randn(16, K, generator=g) / K**0.5
    model = torch.nn.Sequential(torch.nn.Linear(K, 64), torch.nn.GELU(), torch.nn.Linear(64, K))
    model = fa.convert_to_fp8_activations(model).train()
    with torch.no_grad():
        want = [*_ops(x, w), model(x)]
    with torch.inference_mode():
        got = [*_ops(x, w), model(x)]
        w_inf = w.clone()  # an inference tensor as the weight: cast, no cache kept
        got_w = fa.fp8_linear(x, w_inf)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(got_w, want[5], rtol=0, atol=0)


def test_a_training_forward_after_one_under_inference_mode_trains():
    """A module in training mode called under ``torch.inference_mode()`` (a validation pass
    without ``.eval()``) leaves no inference tensor in the weight cache or on its input: the
    next training forward saves them for backward (it raised "Inference tensors cannot be
    saved for backward"), with the bits of a model that never ran under inference mode."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, K, generator=g), torch.randn(16, K, generator=g) / K**0.5
    lin = fa.FP8Linear(K, 16)
    fresh = fa.FP8Linear(K, 16)
    with torch.no_grad():
        fresh.weight.copy_(lin.weight)
        fresh.bias.copy_(lin.bias)
    with torch.inference_mode():
        lin(x)
        fa.fp8_linear(x, w)
        fa.rms_norm_linear(x, None, 1e-6, [w, w.flip(0)])
        fa.cast_weights([w, w.flip(0)])
    xs = [x.clone().requires_grad_() for _ in range(2)]
    for m, xi in zip((lin, fresh), xs, strict=True):
        m(xi).square().sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=0, atol=0)
    torch.testing.assert_close(lin.weight.grad, fresh.weight.grad, rtol=0, atol=0)
    wg = w.clone().requires_grad_()
    fa.fp8_linear(x, wg).sum().backward()  # x carries nothing made under inference mode
    assert wg.grad is not None
