"""Where the host (CPU) time of one Llama-2-7B decoder layer's forward+backward goes.

For each variant and batch: the host time to enqueue one fwd+bwd (no sync inside) against
its wall time (enqueue + synchronize), then ``cProfile``'s top functions over a few rounds,
and one round under ``torch.cuda.set_sync_debug_mode("warn")`` so that any hidden
host-device synchronization is reported. When host time >= GPU time the layer is
host-bound: the GPU waits for Python.

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python packages/coat-models/benchmarks/profile_host.py --variants coat --batches 1,4

A diagnostic, not a benchmark (bench_llama_layer.py's numbers are the ones to report).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_llama_layer import HIDDEN, SEQ, _bump_versions, _layer  # noqa: E402


def profile(variant: str, batch: int, rounds: int, top: int) -> str:
    forward, layer, _ = _layer(variant)
    x = torch.randn(batch, SEQ, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def step():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        if variant.startswith("coat"):
            _bump_versions(layer)  # as an optimizer step would: weights are re-cast
        forward(x).backward(grad)

    for _ in range(3):
        step()
    host, wall = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append(t1 - t0)
        wall.append(time.perf_counter() - t0)
    host_ms, wall_ms = statistics.median(host) * 1e3, statistics.median(wall) * 1e3
    lines = [
        f"== {variant}, batch {batch} x seq {SEQ}: host enqueue {host_ms:.3f} ms,"
        f" wall {wall_ms:.3f} ms (medians of {rounds})"
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    syncs = [str(w.message).splitlines()[0][:160] for w in caught]
    lines.append(f"host-device syncs in one fwd+bwd: {len(syncs)}")
    lines += [f"  {s}" for s in syncs[:10]]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(rounds):
        step()
    torch.cuda.synchronize()
    prof.disable()
    for key in ("tottime", "cumtime"):
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf).sort_stats(key)
        stats.print_stats(top)
        lines.append(f"-- cProfile by {key}, {rounds} rounds")
        lines += [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="coat,bf16_eager")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--top", type=int, default=45)
    p.add_argument("--out", help="also write the report here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("profile_host: needs a CUDA GPU", file=sys.stderr)
        return 2
    parts = []
    for v in args.variants.split(","):
        for b in (int(s) for s in args.batches.split(",")):
            parts.append(profile(v, b, args.rounds, args.top))
            print(parts[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n\n".join(parts) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
