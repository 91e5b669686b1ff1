"""fp8_quant.timing: the CUDA-event timer the benchmarks share."""

from __future__ import annotations

import math

import pytest
import torch
from fp8_quant.timing import cuda_ms_per_call, host_ms_per_call


def test_bad_counts_are_refused_before_any_call():
    calls = []
    with pytest.raises(ValueError, match="calls and rounds must be >= 1"):
        cuda_ms_per_call(lambda: calls.append(1), 0)
    assert not calls


@pytest.mark.gpu
def test_counts_calls_and_measures_device_time():
    x = torch.zeros(2**20, device="cuda")
    calls = []

    def fn():
        calls.append(1)
        x.add_(1.0)

    ms = cuda_ms_per_call(fn, 4, rounds=3, sleep_cycles=1_000_000)
    assert len(calls) == 1 + 4 * 3  # the warm-up call, then calls x rounds
    assert torch.all(x == 13)
    assert math.isfinite(ms) and ms > 0  # a measurement came back (its size is not tested)


def test_host_ms_per_call_waits_before_each_call_and_times_the_call():
    """The device is waited for before every call and once after the last, never inside a
    timed call; the median of the calls' times comes back."""
    events = []
    ms = host_ms_per_call(lambda: events.append("call"), 3, sync=lambda: events.append("sync"))
    assert events == ["sync", "call"] * 3 + ["sync"]
    assert math.isfinite(ms) and ms >= 0
    with pytest.raises(ValueError, match="calls must be >= 1"):
        host_ms_per_call(lambda: None, 0)


def test_sweep_options_are_checked_before_a_sweep(tmp_path):
    """An unknown --only name (one ran nothing, another everything) and an --out whose folder
    cannot be made (the results were lost at the sweep's end) stop at once, exit 2."""
    import argparse

    from fp8_quant.timing import check_sweep_options

    parser = argparse.ArgumentParser(prog="sweep")
    out = tmp_path / "made" / "r.json"
    check_sweep_options(parser, argparse.Namespace(only="a", out=str(out)), ["a", "b"])
    assert out.parent.is_dir() and not out.exists()
    (tmp_path / "file").write_text("")
    for only, where in [("a,c", tmp_path), ("", tmp_path / "file" / "r.json")]:
        with pytest.raises(SystemExit) as e:
            check_sweep_options(parser, argparse.Namespace(only=only, out=str(where)), ["a", "b"])
        assert e.value.code == 2
