"""Device time per call from CUDA events, and the GPU's clocks and throttle state: the helpers
every package's benchmarks and profiles use (``fp8_quant`` is the package they all depend on).

``triton.testing.do_bench`` times one call at a time and flushes L2 between calls; a
training step runs its kernels back to back from a warm L2 with the host queueing ahead.
``cuda_ms_per_call`` measures that: ``calls`` calls between two CUDA events.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable

import torch

__all__ = ["cuda_ms_per_call", "gpu_state", "host_ms_per_call", "check_sweep_options"]


def cuda_ms_per_call(
    fn: Callable[[], object],
    calls: int = 10,
    *,
    rounds: int = 1,
    sleep_cycles: int = 0,
    warmup: bool = True,
) -> float:
    """Device milliseconds per call of ``fn``, run ``calls`` times back to back on the
    current CUDA stream between two CUDA events; the median of ``rounds`` such runs.

    ``sleep_cycles``: before each run the GPU sleeps that many cycles
    (``torch.cuda._sleep``) while the host queues the calls, so that the events measure the
    device's work and not the host's launch rate (about 2e6 cycles per ms on an H200).
    Without it a host-bound call reads as its host time. ``warmup``: one call first,
    outside the timing (Triton compiles on the first call).

    >>> ms = cuda_ms_per_call(lambda: x.mul_(1.0), calls=20, rounds=5, sleep_cycles=20_000_000)
    """
    if calls < 1 or rounds < 1:
        raise ValueError(f"calls and rounds must be >= 1, got {calls} and {rounds}")
    if warmup:
        fn()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)  # (an even count: the mean of the two middle runs)


def host_ms_per_call(fn: Callable[[], object], calls: int = 10, *, sync=None) -> float:
    """Median host milliseconds to run ``fn`` once, the device idle at the start of each call
    and never waited for inside it: the time to enqueue the call's work (for a host-bound
    call, what a training step pays). ``sync``: how to wait for the device between calls
    (default ``torch.cuda.synchronize`` when CUDA is available, nothing otherwise).

    >>> ms = host_ms_per_call(lambda: layer(x).sum().backward(), calls=20)
    """
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    if sync is None:
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    sync()
    return statistics.median(times)


def gpu_state() -> str:
    """Clocks, power, temperature and throttle reasons of the GPUs, one read-only
    ``nvidia-smi`` query (older drivers lack the throttle field: asked again without it),
    for a benchmark to print beside its numbers; a line saying why when nvidia-smi fails."""
    base = "name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu"
    for fields in (base + ",clocks_event_reasons.active", base):
        try:
            r = subprocess.run(
                ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"nvidia-smi unavailable: {e}"
        if r.returncode == 0:
            return f"{fields}: {r.stdout.strip()}"
    return f"nvidia-smi failed: {r.stderr.strip()[:200]}"


def check_sweep_options(parser, args, names) -> None:
    """For a sweep script: its ``--only`` (comma-separated) names only configs of ``names``,
    and its ``--out`` (a folder, or a ``.json`` file in one) can be written (the folder is
    made): checked before the sweep, which otherwise ran everything (an unknown name: none)
    and lost its results to a bad path at its end. Else ``parser.error`` (exit 2)."""
    unknown = set(filter(None, args.only.split(","))) - set(names)
    if unknown:
        bad, known = ", ".join(sorted(unknown)), ", ".join(names)
        parser.error(f"--only: unknown {bad}: choose from {known}")
    folder = os.path.dirname(os.path.abspath(args.out)) if args.out.endswith(".json") else args.out
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        parser.error(f"--out {args.out}: {e.strerror or e}")
