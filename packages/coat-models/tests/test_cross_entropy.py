"""``coat_models.ops.cross_entropy``: ``linear_cross_entropy``'s per-chunk kernels (forward's
log-sum-exp, backward's in-place logits gradient) against their PyTorch references, and the
loss and its gradients through them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from coat_models import linear_cross_entropy, reference
from coat_models.ops.cross_entropy import (
    cross_entropy_grad_,
    cross_entropy_grad_reference,
    lse_reference,
    lse_rows,
)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _problem(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    """Logits (spread like a trained head's), targets (both ends of the vocabulary among
    them), their log-sum-exp and per-row weights (some zero: ignored rows)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(DEVICE, dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[0], targets[-1] = 0, vocab - 1
    coef = torch.rand(rows, generator=g)
    coef[::5] = 0
    lse = logits.float().logsumexp(-1)
    return logits, targets.to(DEVICE), lse, coef.to(DEVICE)


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit on a GPU (libdevice's expf is PyTorch's). The interpreter's exp is NumPy's,
    which may differ in the last fp32 bit: fp32 to within that, bf16/fp16 after rounding."""
    if DEVICE == "cuda" or want.dtype != torch.float32:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2**-22, atol=2**-30)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,vocab", [(37, 5000), (1, 4096), (3, 17)], ids=str)
def test_kernel_equals_reference(dtype, rows, vocab):
    """One launch over (row, 4096-logit block) programs, blocks whole, partial and alone;
    the kernel writes over its input and returns it."""
    logits, targets, lse, coef = _problem(rows, vocab, dtype)
    want = cross_entropy_grad_reference(logits, targets, lse, coef)
    buf = logits.clone()
    got = cross_entropy_grad_(buf, targets, lse, coef, backend="triton")
    assert got.data_ptr() == buf.data_ptr()
    _check(got, want)
    # The rows' sums are 1 - 1 = 0 (a softmax minus a one-hot), scaled by coef.
    torch.testing.assert_close(
        want.float().sum(-1), torch.zeros(rows, device=DEVICE), atol=1e-2, rtol=0
    )


def test_reference_backend_and_other_dtypes_take_the_reference():
    """``backend="reference"``, fp64 and a non-contiguous chunk run the reference's ops and
    copy them back: the same values, in place."""
    logits, targets, lse, coef = _problem(6, 40, torch.float32)
    want = cross_entropy_grad_reference(logits, targets, lse, coef)
    got = cross_entropy_grad_(logits.clone(), targets, lse, coef, backend="reference")
    assert torch.equal(got, want)
    d64 = logits.double()
    got64 = cross_entropy_grad_(d64, targets, lse, coef, backend="triton")
    assert got64 is d64 and torch.equal(got64, want.double())
    wide = torch.zeros(6, 80, device=DEVICE)
    wide[:, :40] = logits
    view = wide[:, :40]  # rows 80 apart: not contiguous
    cross_entropy_grad_(view, targets, lse, coef, backend="triton")
    assert torch.equal(wide[:, :40], want) and not wide[:, 40:].any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,vocab", [(37, 5000), (1, 4096), (3, 17)], ids=str)
def test_lse_kernel_equals_reference(dtype, rows, vocab):
    """A row's log-sum-exp (its max, then its sum of exponentials) and that minus the target's
    logit, to fp32 rounding of the sums, which run in another order than torch.logsumexp's."""
    logits, targets, _, _ = _problem(rows, vocab, dtype)
    want_lse, want_diff = lse_reference(logits, targets)
    out = torch.full((2, rows), float("nan"), device=DEVICE)
    lse_rows(logits, targets, out[0], out[1], backend="triton")
    torch.testing.assert_close(out[0], want_lse, rtol=2e-6, atol=0)
    torch.testing.assert_close(out[1], want_diff, rtol=0, atol=2e-6 * want_lse.abs().max().item())


def test_lse_kernel_infinities_and_nan_as_torch():
    """+inf in a row gives an infinite log-sum-exp and -inf everywhere gives -inf (the max
    taken as 0 when infinite, as torch.logsumexp does); a NaN gives NaN."""
    logits = torch.randn(4, 300, device=DEVICE)
    logits[0, 5] = float("inf")
    logits[1] = float("-inf")
    logits[2, 7] = float("nan")
    targets = torch.tensor([1, 2, 3, 4], device=DEVICE)
    want = lse_reference(logits, targets)
    out = torch.empty(2, 4, device=DEVICE)
    lse_rows(logits, targets, out[0], out[1], backend="triton")
    for got, ref in zip(out, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=0, equal_nan=True)


def test_lse_kernel_reads_nothing_outside_the_row_for_a_target_outside_the_vocabulary():
    """Its own guard (callers check targets): such a row's difference is NaN. It read the
    memory at that offset (a wrong loss, or a crash for a far one)."""
    logits = torch.randn(4, 37, device=DEVICE)
    targets = torch.tensor([37, -5, 10**12, 4], device=DEVICE)
    out = torch.zeros(2, 4, device=DEVICE)
    lse_rows(logits, targets, out[0], out[1], backend="triton")
    want_lse, want_diff = lse_reference(logits, targets.clamp(0, 36))
    torch.testing.assert_close(out[0], want_lse, rtol=2e-6, atol=0)
    assert out[1, :3].isnan().all()
    torch.testing.assert_close(out[1, 3], want_diff[3], rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_a_target_outside_the_vocabulary_on_a_gpu_is_a_device_side_assert():
    """As F.cross_entropy's (it was checked on CPU only: on a GPU a wrong loss)."""
    code = (
        "import torch; from coat_models import linear_cross_entropy as f; "
        "h = torch.randn(4, 16, device='cuda'); w = torch.randn(37, 16, device='cuda'); "
        "f(h, w, torch.tensor([1, 2, 37, 3], device='cuda')); torch.cuda.synchronize(); "
        "print('no error')"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert r.returncode != 0 and "no error" not in r.stdout, r.stdout + r.stderr
    assert "device-side assert" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_loss_and_gradients_through_the_kernels(dtype, monkeypatch):
    """``linear_cross_entropy`` with the kernels (``FP8_QUANT_BACKEND=triton``) against the
    same loss on PyTorch's ops and against the fp64 oracle, ignored targets and several
    chunks included: the loss to fp32 rounding, the gradients to one rounding of their
    dtype (a log-sum-exp differing in its last bit can move an exp across a bf16 tie)."""
    torch.manual_seed(0)
    h = torch.randn(50, 32, device=DEVICE, dtype=dtype)
    w = torch.randn(300, 32, device=DEVICE, dtype=dtype) * 0.3
    t = torch.randint(0, 300, (50,), device=DEVICE)
    t[::7] = -100

    def run():
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_cross_entropy(hh, ww, t, chunk_rows=16)
        loss.backward()
        return loss, hh.grad, ww.grad

    monkeypatch.setenv("FP8_QUANT_BACKEND", "reference")
    want = run()
    monkeypatch.setenv("FP8_QUANT_BACKEND", "triton")
    got = run()
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=0)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-20
    for a, b in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=ulp, atol=ulp * b.abs().max().item())
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    oracle = reference.linear_cross_entropy(h64, w64, t)
    torch.testing.assert_close(got[0].double(), oracle, rtol=1e-2 if ulp > 1e-3 else 1e-6, atol=0)


def _head(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(4)
    h = torch.randn(40, 32, generator=g).to(DEVICE, dtype).requires_grad_()
    w = (torch.randn(300, 32, generator=g) * 0.3).to(DEVICE, dtype).requires_grad_()
    t = torch.randint(0, 300, (40,), generator=g).to(DEVICE)
    t[::6] = -100
    return h, w, t


def _grads(h, w, t, factor, early=None):
    """Gradients of ``factor * linear_cross_entropy(h, w, t)`` (chunks of 16 rows); ``early``
    forces where they are made (True: in forward, False: in backward)."""
    from coat_models.loss import _LinearCrossEntropy

    h.grad = w.grad = None
    if early is None:
        loss = linear_cross_entropy(h, w, t, chunk_rows=16)
    else:
        loss = _LinearCrossEntropy.apply(h, w, t, -100, None, 16, early, (True, True))
    (loss * factor).backward()
    return h.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gradients_made_in_forward_are_backwards_bits(dtype):
    """Made in forward and scaled by the upstream gradient in backward: for a power of two
    (gradient accumulation's 1 / 4) the bits of the gradients made in backward from the
    scaled per-row weights; for another factor (1 / 3) one more rounding, in fp32, of the
    unit-scale gradients: no rounding of the factor to the gradients' dtype first."""
    h, w, t = _head(dtype)
    for factor in (1.0, 0.25, 2.0**-20):
        for got, want in zip(_grads(h, w, t, factor), _grads(h, w, t, factor, early=False),
                             strict=True):  # fmt: skip
            assert torch.equal(got, want)
    unit = _grads(h, w, t, 1.0)
    got = _grads(h, w, t, 1 / 3)
    assert torch.equal(got[0], (unit[0].float() * (1 / 3)).to(dtype))
    # The weight's is scaled before its one rounding from the fp32 sum.
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-22  # two roundings of the values compared
    torch.testing.assert_close(got[1].float(), unit[1].float() / 3, rtol=ulp, atol=0)


def test_fp32_states_under_autocast_get_the_autocast_gemms_gradients():
    """fp32 hidden states and head under bf16 autocast: the GEMMs run on their bf16 copies,
    so the hidden states' gradient is the bf16 run's exactly (written into the fp32 rows)
    and the head's, summed in fp32, rounds to the bf16 run's; made in forward or in
    backward, the same bits."""
    h16, w16, t = _head(torch.bfloat16)
    h, w = (x.detach().float().requires_grad_() for x in (h16, w16))
    want = _grads(h16, w16, t, 0.25)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got = _grads(h, w, t, 0.25)
        late = _grads(h, w, t, 0.25, early=False)
    assert got[0].dtype == got[1].dtype == torch.float32
    assert torch.equal(got[0], want[0].float())
    assert torch.equal(got[1].to(torch.bfloat16), want[1])
    for a, b in zip(got, late, strict=True):
        assert torch.equal(a, b)


def test_fp16_gradients_are_made_in_backward_under_a_loss_scale():
    """fp16: the gradients are made in backward from the loss-scaled per-row weights (at unit
    scale many would underflow to zero first): GradScaler's 65536 gives finite gradients,
    the reference's times 65536, and no exact zeros where the reference has none."""
    h, w, t = (x.half() if x.is_floating_point() else x for x in _head())
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    scale = 65536.0
    got = _grads(h, w, t, scale)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (reference.linear_cross_entropy(h64, w64, t) * scale).backward()
    for g, want in zip(got, (h64.grad, w64.grad), strict=True):
        assert torch.isfinite(g).all()
        assert ((g == 0) & (want != 0)).sum() == 0
        torch.testing.assert_close(g.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max())


def test_only_the_wanted_gradients_are_made():
    """A frozen head (LoRA, a frozen tied embedding) keeps no fp32 weight gradient from
    forward to backward, and frozen hidden states no hidden-state gradient."""
    h, w, t = _head()
    for frozen in ("weight", "hidden"):
        hh = h.detach().requires_grad_(frozen != "hidden")
        ww = w.detach().requires_grad_(frozen != "weight")
        kept = []
        pack = kept.append
        with torch.autograd.graph.saved_tensors_hooks(lambda x, p=pack: p(x) or x, lambda x: x):
            loss = linear_cross_entropy(hh, ww, t, chunk_rows=16)
        assert sum(x.nbytes for x in kept if x is not None) == (
            hh.nbytes if frozen == "weight" else ww.numel() * 4
        )
        loss.backward()
        assert (hh.grad is None) == (frozen == "hidden")
        assert (ww.grad is None) == (frozen == "weight")


def test_no_gradient_work_without_autograd(monkeypatch):
    """Under no_grad (or with no input requiring grad) the loss is the same and the gradient
    pass over the logits never runs; with autograd, a retained graph gives the same
    gradients on every backward (the saved gradients are not scaled in place)."""
    import coat_models.loss as loss_mod

    h, w, t = _head()
    passes = []
    real = loss_mod.cross_entropy_grad_
    monkeypatch.setattr(loss_mod, "cross_entropy_grad_", lambda *a: passes.append(1) or real(*a))
    with torch.no_grad():
        quiet = linear_cross_entropy(h, w, t, chunk_rows=16)
    frozen = linear_cross_entropy(h.detach(), w.detach(), t, chunk_rows=16)
    assert passes == [] and not frozen.requires_grad
    loss = linear_cross_entropy(h, w, t, chunk_rows=16)
    assert len(passes) == 3  # one per chunk of 16 rows
    assert torch.equal(loss.detach(), quiet) and torch.equal(frozen, quiet)
    (loss * 0.5).backward(retain_graph=True)
    first = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    (loss * 0.5).backward()
    assert torch.equal(h.grad, first[0]) and torch.equal(w.grad, first[1])


@pytest.mark.parametrize("early", [True, False], ids=["grads-in-forward", "grads-in-backward"])
@pytest.mark.parametrize("num_items", [None, 0, "tensor0"])
def test_all_targets_ignored_give_zero_gradients(early, num_items):
    """Every target ignore_index (an SFT batch whose prompt fills the sequence): the loss is
    NaN as transformers' is, the gradients zero as F.cross_entropy's are (they were NaN:
    valid / 0 in every row, which made every weight NaN at the next optimizer step)."""
    from coat_models.loss import _LinearCrossEntropy

    h, w, t = _head(torch.float32)
    t = torch.full_like(t, -100)
    n = torch.zeros((), dtype=torch.int64) if num_items == "tensor0" else num_items
    loss = _LinearCrossEntropy.apply(h, w, t, -100, n, 16, early, (True, True))
    assert loss.isnan()
    loss.backward()
    assert torch.equal(h.grad, torch.zeros_like(h)) and torch.equal(w.grad, torch.zeros_like(w))


def test_a_non_finite_row_whose_target_is_ignored_stays_out_of_the_loss():
    """F.cross_entropy leaves ignored rows out; (diff * valid).sum() took 0 * NaN in: a
    NaN or inf hidden row at an ignored position made the loss NaN."""
    from coat_models import linear_cross_entropy

    torch.manual_seed(0)
    hidden, weight = torch.randn(6, 16), torch.randn(40, 16)
    targets = torch.tensor([3, -100, 7, 1, -100, 5])
    hidden[1], hidden[4, 2] = float("nan"), float("inf")
    want = torch.nn.functional.cross_entropy(hidden @ weight.T, targets)
    got = linear_cross_entropy(hidden, weight, targets)
    assert torch.isfinite(want) and torch.allclose(got, want, rtol=1e-6, atol=0)
