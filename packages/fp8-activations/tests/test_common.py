"""What the non-linear ops' kernels share (``fp8_activations.ops._common`` and the casts of
``kernel_utils``): scoped launch tunables, the GPU's own bf16 rounding, the hardware FP8 cast
from sm_90. Each op's own checks are in its file (``test_rms_norm.py``, ``test_silu.py``,
...)."""

from __future__ import annotations

import os

import fp8_activations as fa
import pytest
import torch
from fp8_activations import FP8ActivationConfig
from fp8_quant.ops import hw_cast_supported


@pytest.mark.gpu
def test_cuda_bf16_rounding_matches_torch():
    """Kernels round fp32 -> bf16 with the GPU's own conversion (the interpreter emulates
    round-to-nearest-even instead): a bf16 residual add is then bit-identical to torch's,
    including ties, subnormals, overflow to inf, inf and NaN."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(256, 4096, device="cuda", generator=g) * 3).to(torch.bfloat16)
    r = (torch.randn(256, 4096, device="cuda", generator=g) * 3).to(torch.bfloat16)
    big, tiny = torch.finfo(torch.bfloat16).max, torch.finfo(torch.bfloat16).smallest_normal
    special = [big, big, -big, tiny / 4, -tiny / 8, float("inf"), float("-inf"), float("nan")]
    x.view(-1)[: len(special)] = torch.tensor(special, dtype=torch.bfloat16)
    r.view(-1)[: len(special)] = torch.tensor(special[::-1], dtype=torch.bfloat16)
    x.view(-1)[len(special)] = r.view(-1)[len(special)] = big  # overflows to inf
    y = fa.residual_add(x, r, FP8ActivationConfig(backend="triton"))
    torch.testing.assert_close(y, x + r, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
def test_cuda_hw_cast_is_on_from_sm90():
    """Each op's test_cuda_fp8_codes_match_reference exercises the hardware cast on sm_90+
    (unless switched off)."""
    cc = torch.cuda.get_device_capability()
    off = os.environ.get("FP8_QUANT_HW_CAST") == "0"
    assert hw_cast_supported(torch.device("cuda")) is (cc >= (9, 0) and not off)


def test_launch_tunables_are_scoped():
    """``_common.tunables``: the sweeps' way to try launch configs; the table comes back
    unchanged (also after an error), unknown names are refused, and launches inside see it."""
    from fp8_activations.ops import _common

    before = dict(_common.CONFIG)
    x = torch.empty(64, 256)
    default = _common.elementwise_launch("silu_fwd", x, 16)
    with _common.tunables(silu_fwd=(512, 2)):
        assert _common.CONFIG["silu_fwd"] == (512, 2)
        grid, meta = _common.elementwise_launch("silu_fwd", x, 16)
        assert (grid, meta) != default and meta["num_warps"] == 2
    assert _common.CONFIG == before
    with pytest.raises(RuntimeError), _common.tunables(silu_bwd=(256, 1)):
        raise RuntimeError
    assert _common.CONFIG == before
    with pytest.raises(KeyError, match="no launch tunables named"):
        with _common.tunables(nope=(1, 1)):
            pass
