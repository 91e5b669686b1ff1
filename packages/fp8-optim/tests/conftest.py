"""Shared fixtures of the fp8-optim tests (pytest runs with --import-mode=importlib, so the
helpers reach the tests as the ``h`` fixture, not by import).

The Triton kernel runs on CPU through the interpreter (``TRITON_INTERPRET=1``, set by nox and
the dev command before triton is imported); ``needs_triton`` skips otherwise. Interpreter
programs are slow (~0.15 s each), so kernel tests use a few small tensors and few steps.
"""

import os
import types

import pytest
import torch
from fp8_optim import CoatAdamW, CoatAdamWConfig

# Sizes that are not multiples of the group (128) nor of 16: partial last groups, a
# 1-element tensor, a 2-D tensor.
ODD_SHAPES = ((37, 41), (1,), (3000,), (2, 64))


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's bits (for bit-exact comparisons of any float dtype)."""
    t = t.detach().contiguous()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    diff = (bits(a) != bits(b)).sum().item()
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ"


def assert_same_state(opt_a, params_a, opt_b, params_b) -> None:
    for i, (pa, pb) in enumerate(zip(params_a, params_b, strict=True)):
        assert_same_bits(pa, pb, f"param {i}")
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert_same_bits(sa[k].cpu(), sb[k].cpu(), f"param {i} state {k}")


def make_params(shapes=ODD_SHAPES, dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=dtype))
        for s in shapes
    ]


def heavy_grads(params, step: int, seed=0, dtype=None):
    """Gradients whose rows differ in scale by orders of magnitude, with spikes and zeros."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    out = []
    for p in params:
        g = torch.randn(p.shape, generator=gen)
        if g.dim() > 1:
            rows = (g.shape[0],) + (1,) * (g.dim() - 1)
            g = g * 10.0 ** torch.randint(-5, 1, rows, generator=gen)
        else:
            g = g * 10.0 ** torch.randint(-5, 1, g.shape, generator=gen)
        g = torch.where(torch.rand(g.shape, generator=gen) < 0.05, torch.zeros_like(g), g)
        g = torch.where(torch.rand(g.shape, generator=gen) < 0.005, g * 1000.0, g)
        out.append(g.to(device=p.device, dtype=dtype or p.dtype))
    return out


def run_steps(params, opt, steps: int, seed=0, grad_dtype=None):
    for s in range(steps):
        for p, g in zip(params, heavy_grads(params, s, seed, grad_dtype), strict=True):
            if g.dtype != p.dtype:
                if not hasattr(p, "grad_dtype"):
                    pytest.skip("this torch cannot give a parameter a gradient of another dtype")
                p.grad_dtype = g.dtype
            p.grad = g
        opt.step()


@pytest.fixture
def make_pair():
    """Two identical (params, optimizer) setups that differ only in the config backend."""

    def make(
        backend_a,
        backend_b,
        shapes=ODD_SHAPES,
        dtype=torch.float32,
        device="cpu",
        opt_kwargs=None,
        **cfg,
    ):
        out = []
        for backend in (backend_a, backend_b):
            params = make_params(shapes, dtype, device=device)
            opt = CoatAdamW(
                params, **(opt_kwargs or {}), config=CoatAdamWConfig(backend=backend, **cfg)
            )
            out.append((params, opt))
        return out

    return make


@pytest.fixture
def needs_triton():
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1")


@pytest.fixture
def h():
    return types.SimpleNamespace(
        ODD_SHAPES=ODD_SHAPES,
        bits=bits,
        assert_same_bits=assert_same_bits,
        assert_same_state=assert_same_state,
        make_params=make_params,
        heavy_grads=heavy_grads,
        run_steps=run_steps,
    )
