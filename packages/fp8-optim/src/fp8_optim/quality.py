"""How far a compressed-state AdamW's updates are from fp32 AdamW's: the measurement the
tests and the benchmark share.

``heavy_tailed_grads`` is a gradient stream that stresses per-group scaling: rows whose
scales differ by orders of magnitude (10^-6..1), Student-t noise, rare 100x spikes and some
exact zeros. ``update_errors`` feeds the same stream to a reference fp32 AdamW and to the
optimizer under test (weight decay 0, parameters starting at 0, so the parameter is the sum
of the updates) and returns, per step, ``||u - u_fp32|| / ||u_fp32||`` of the updates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch


def heavy_tailed_grads(
    shape: tuple[int, int] = (256, 512), steps: int = 100, seed: int = 0, device="cpu"
) -> Iterator[torch.Tensor]:
    """Yield ``steps`` fp32 gradients of ``shape`` (rows, cols); deterministic for a seed."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape
    row_scale = 10.0 ** (-6.0 * torch.rand(rows, 1, generator=gen))
    col_scale = 10.0 ** (-1.0 * torch.rand(1, cols, generator=gen))
    for _ in range(steps):
        # Student-t with 3 degrees of freedom: normal / sqrt(chi2_3 / 3).
        chi2 = torch.randn(3, rows, cols, generator=gen).square().sum(0) / 3
        g = torch.randn(rows, cols, generator=gen) / chi2.sqrt() * row_scale * col_scale
        spikes = torch.rand(rows, cols, generator=gen) < 1e-3
        g = torch.where(spikes, g * 100.0, g)
        g = torch.where(torch.rand(rows, cols, generator=gen) < 0.01, torch.zeros_like(g), g)
        yield g.to(device)


def update_errors(
    make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    shape: tuple[int, int] = (256, 512),
    steps: int = 100,
    seed: int = 0,
    device="cpu",
    lr: float = 1e-3,
) -> list[float]:
    """Per-step relative error of ``make_optimizer``'s updates against fp32 AdamW's.

    ``make_optimizer(params)`` must build the optimizer under test with ``lr`` and no weight
    decay. The fp32 baseline is ``torch.optim.AdamW(lr=lr, weight_decay=0, foreach=False)``.
    """
    p_ref = torch.zeros(shape, device=device, requires_grad=True)
    p = torch.zeros(shape, device=device, requires_grad=True)
    ref = torch.optim.AdamW([p_ref], lr=lr, weight_decay=0.0, foreach=False)
    opt = make_optimizer([p])
    errors = []
    for g in heavy_tailed_grads(shape, steps, seed, device):
        before_ref, before = p_ref.detach().clone(), p.detach().clone()
        p_ref.grad, p.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
        u_ref = p_ref.detach() - before_ref
        u = p.detach() - before
        errors.append(((u - u_ref).norm() / u_ref.norm()).item())
    return errors
