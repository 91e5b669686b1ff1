"""The ops' backward runs on their saved FP8 copies and kernels, outside autograd: a backward
with ``create_graph=True`` raises instead of giving second-order gradients without the
input's terms (they came out 16-117% off, silently)."""

import copy

import fp8_activations as fa
import pytest
import torch

K = 32
OPS = {
    "layer_norm": lambda x, w: fa.layer_norm(x, K),
    "rms_norm": lambda x, w: fa.rms_norm(x, None, 1e-6),
    "silu": lambda x, w: fa.silu(x),
    "gelu": lambda x, w: fa.gelu(x),
    "swiglu": lambda x, w: fa.swiglu(x, x.flip(-1)),
    "fp8_linear": lambda x, w: fa.fp8_linear(x, w),
    "rms_norm_linear": lambda x, w: fa.rms_norm_linear(x, None, 1e-6, [w, w])[1],
    "swiglu_linear": lambda x, w: fa.swiglu_linear(x, x.flip(-1), w),
    "fp8_linear+residual": lambda x, w: fa.fp8_linear(x, w, residual=x),
}


@pytest.mark.parametrize("name", OPS)
def test_second_backward_raises(name):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, K, generator=g).requires_grad_()
    w = (torch.randn(K, K, generator=g) / K**0.5).requires_grad_()
    y = OPS[name](x, w)
    with pytest.raises(RuntimeError, match="differentiable once.*create_graph=True"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)
    # One backward, as training runs it, works (and with retain_graph, again the same).
    y = OPS[name](x, w)
    (gx,) = torch.autograd.grad(y.square().sum(), x, retain_graph=True)
    (again,) = torch.autograd.grad(y.square().sum(), x)
    torch.testing.assert_close(again, gx, rtol=0, atol=0)


@pytest.mark.parametrize("name", OPS)
def test_create_graph_with_a_constant_output_gradient_raises(name):
    """A gradient penalty, ``grad(y.sum(), x, create_graph=True)``: the output gradient needs
    no grad, so once_differentiable returned gradients without a graph, and the penalty
    added nothing to the weights' gradients, in silence (100% off for fp8_linear's
    weight). It raises now, naming the way out."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, K, generator=g).requires_grad_()
    w = (torch.randn(K, K, generator=g) / K**0.5).requires_grad_()
    with pytest.raises(RuntimeError, match="differentiable once.*create_graph=True"):
        torch.autograd.grad(OPS[name](x, w).sum(), x, create_graph=True)


def test_residual_add_is_differentiated_twice():
    """``residual_add`` saves nothing FP8: its second-order gradient is exact (the README
    says so), here d2/dx2 of sum((x + 2x)^2) = 18 per element."""
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(1)).requires_grad_()
    (g,) = torch.autograd.grad(fa.residual_add(x, 2 * x).square().sum(), x, create_graph=True)
    torch.testing.assert_close(g, 18 * x, rtol=0, atol=1e-5)
    (gg,) = torch.autograd.grad(g.sum(), x)
    assert torch.equal(gg, torch.full_like(x, 18.0))


TRANSFORMS = {
    "grad": lambda f, x: torch.func.grad(lambda x: f(x).sum())(x),
    "vmap": lambda f, x: torch.vmap(f)(x.view(2, -1, K)),
    "jvp": lambda f, x: torch.func.jvp(f, (x,), (torch.ones_like(x),)),
}


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("name", [*OPS, "residual_add"])
def test_torch_func_transforms_raise_naming_the_way_out(name, transform):
    """Under ``torch.func`` transforms (per-sample gradients, ensembles) the ops raised
    torch's error asking to override ``setup_context`` (a method of this package's
    Functions) or, for ``fp8_linear`` under ``jvp``, "Cannot access data pointer of Tensor
    that doesn't have storage". They raise one line that says what to run instead."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, K, generator=g), torch.randn(K, K, generator=g) / K**0.5
    op = OPS.get(name, lambda x, w: fa.residual_add(x, 2 * x))
    msg = r"^fp8_activations ops cannot run under torch\.func.*eval mode"
    with pytest.raises(RuntimeError, match=msg) as e:
        TRANSFORMS[transform](lambda x: op(x, w), x)
    assert "\n" not in str(e.value)


def test_a_converted_model_under_torch_func_in_eval_mode_runs_its_originals():
    """The remedy the error names: in eval mode a converted model runs its original modules,
    so per-sample gradients (``vmap(grad(...))`` of ``functional_call``) are the plain
    model's, bit for bit."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(K, K), torch.nn.GELU(), torch.nn.LayerNorm(K))
    model = fa.convert_to_fp8_activations(copy.deepcopy(plain))
    params = {k: v.detach() for k, v in plain.named_parameters()}
    x = torch.randn(4, K)

    def per_sample(m):
        def loss(p, xi):
            return torch.func.functional_call(m, p, (xi[None],)).square().sum()

        return torch.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)

    with pytest.raises(RuntimeError, match="torch.func transforms"):
        per_sample(model.train())
    got, want = per_sample(model.eval()), per_sample(plain)
    assert all(torch.equal(got[k], want[k]) for k in want)
