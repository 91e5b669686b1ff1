"""Where the time of one Llama-2-7B decoder layer's forward+backward goes (the shape of
``bench_llama_layer.py``): GPU kernel time per kernel name under ``torch.profiler``, for each
variant given (default: coat and bf16_eager; torchao_float8_compile when torchao imports).

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python packages/coat-models/benchmarks/profile_layer.py --out layer_profile.txt

A diagnostic for finding slow kernels, not a benchmark: the totals include profiler overhead
and are not the numbers to report (bench_llama_layer.py's are).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_llama_layer import BATCH, HIDDEN, SEQ, _bump_versions, _layer  # noqa: E402


def profile(variant: str, rounds: int = 5) -> str:
    forward, layer, _ = _layer(variant)
    x = torch.randn(BATCH, SEQ, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def step():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        if variant == "coat":
            _bump_versions(layer)  # as an optimizer step would: weights are re-cast
        forward(x).backward(grad)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(rounds):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) / rounds / 1e3
    lines = [
        f"== {variant}: GPU kernel time per fwd+bwd {total:.3f} ms (profiled, {rounds} rounds)"
    ]
    lines.append(f"{'ms/round':>9} {'calls':>6}  kernel")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:40]:
        ms = e.self_device_time_total / rounds / 1e3
        lines.append(f"{ms:9.3f} {e.count // rounds:6d}  {e.key[:110]}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="coat,bf16_eager,torchao_float8_compile")
    p.add_argument("--out", help="also write the tables here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("profile_layer: needs a CUDA GPU", file=sys.stderr)
        return 2
    tables = []
    for v in args.variants.split(","):
        if v.startswith("torchao") and importlib.util.find_spec("torchao") is None:
            continue
        tables.append(profile(v))
        print(tables[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n\n".join(tables) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
