"""``ops/quantize_per_tensor.py``: ``quantize_per_tensor`` with its amax given (group
scaling) or not, and how cheaply group scaling gets that amax from ``group_amax``'s maxima;
the harness (timing, the table) is ``conftest.py``. Bytes are the minimal ones: read the
input once (``x.nbytes``), write each output once (FP8 codes 1 B each)."""

import fp8_quant
import pytest
import torch


@pytest.mark.parametrize("given", [True, False], ids=["amax-given", "amax-None"])
def test_quantize_per_tensor(record, x, amax, given):
    nbytes = x.nbytes + x.numel()
    fn = lambda: fp8_quant.quantize_per_tensor(x, amax=amax if given else None)
    if given:
        record("quantize_per_tensor (amax given)", fn, nbytes, "group scaling")
    else:
        record("quantize_per_tensor (amax=None)", fn, nbytes, "reads x twice")


def test_group_scaling_tensor_max(record, x):
    """Per-tensor max from the group maxima (G=16: 16x fewer bytes) vs a full abs-max pass."""
    gmax = fp8_quant.group_amax(x, 16)
    full = record("x.abs().max()", lambda: x.abs().max(), x.nbytes, "full pass")
    group_ms, group_stream_ms = record.time(lambda: gmax.amax())
    speedup = full["stream_ms"] / group_stream_ms
    note = (
        f"{speedup:.1f}x (stream) / {full['ms'] / group_ms:.1f}x (bench) faster "
        "than x.abs().max() (target >= 5x)"
    )
    name = "group_amax(x, 16).amax() (reduction only)"
    nbytes = gmax.nbytes
    record.add(name, group_ms, group_stream_ms, nbytes, note, speedup_vs_abs_max=speedup)
    assert torch.equal(gmax.amax(), x.abs().max().float())
