"""Tile-shape sweep of the backward re-form kernels (``rms_norm_reform_t``, ``swiglu_reform_t``)
at the Llama-2-7B layer shapes (8192 tokens; hidden 4096, MLP 11008; 1 x 16 E4M3 inputs).

Every shape of ``CONFIGS`` (``ops._common.TLaunch``, handed to ``ops._common.t_launch``) runs
the ops' own kernels, launched here as the ops launch them; each is checked bit for bit
against the op itself (which runs the default ``T_LAUNCH``), then timed with
``triton.testing.do_bench`` (median); TB/s is from the bytes each call must move (FP8 codes
and group scales in, the transposed FP8 out). A bf16 copy of the same size is timed for
scale.

    PYTHONPATH=packages/fp8-quant/src:packages/fp8-activations/src \\
        python3 packages/fp8-activations/benchmarks/sweep_reform_t.py [--out FILE]
    TRITON_INTERPRET=1 ... sweep_reform_t.py --smoke   # tiny shapes on CPU, timings meaningless
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from fp8_activations.ops import rms_norm_linear, swiglu_linear
from fp8_activations.ops._common import TLaunch, t_launch
from fp8_quant import quantize_per_group
from fp8_quant.ops import hw_cast_supported, launch

CONFIGS = [
    TLaunch(),
    TLaunch(bm=128, bn=64),
    TLaunch(bm=64, bn=128),
    TLaunch(bm=128, bn=128, num_warps=8),
    TLaunch(bm=128, bn=128, num_warps=4),
    TLaunch(bm=32, bn=128),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        ap.error(f"--out {args.out}: its folder does not exist")  # (before the sweep, not after)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    dev = "cuda" if cuda else "cpu"
    tokens, hidden, mlp = (8192, 4096, 11008) if cuda else (96, 64, 80)
    gen = torch.Generator(device=dev).manual_seed(0)

    def q(rows, cols):
        x = torch.randn(rows, cols, device=dev, generator=gen).to(torch.bfloat16)
        return quantize_per_group(x, 16, "e4m3")

    x_q, x_s = q(tokens, hidden)
    rstd = torch.rand(tokens, device=dev, generator=gen) + 0.5
    w = torch.randn(hidden, device=dev, generator=gen).to(torch.bfloat16)
    g_q, g_s = q(tokens, mlp)
    u_q, u_s = q(tokens, mlp)
    amax = torch.tensor(4.0, device=dev)
    hw_cast = hw_cast_supported(torch.device(dev))
    y_dtype = torch.empty(1, device=dev, dtype=torch.bfloat16)  # cast_out reads it off this

    def reform_t(kernel, inputs, m, n, tile):
        """``kernel`` launched as the ``*_reform_t`` ops launch it, with ``tile``."""
        out = torch.empty((n, m), device=dev, dtype=torch.float8_e4m3fn)
        grid, meta = t_launch(m, n, 16, tile)
        launch(kernel, grid, *inputs, amax, out.view(torch.uint8), y_dtype, m, n,
               FMT="e4m3", HW_CAST=hw_cast, **meta)  # fmt: skip
        return out

    # name -> (the op at its default tile, the kernel at a given tile, bytes moved)
    rms_in, swiglu_in = (x_q, x_s, rstd, w), (g_q, g_s, u_q, u_s)
    calls = {
        "rms_norm_reform_t": (
            lambda: rms_norm_linear.rms_norm_reform_t(
                *rms_in, amax, 16, torch.bfloat16, "e4m3", "triton"
            ),
            lambda t: reform_t(rms_norm_linear._reform_t_kernel, rms_in, tokens, hidden, t),
            tokens * hidden * (1 + 4 / 16 + 1),
        ),
        "swiglu_reform_t": (
            lambda: swiglu_linear.swiglu_reform_t(
                *swiglu_in, amax, 16, torch.bfloat16, "e4m3", "triton"
            ),
            lambda t: reform_t(swiglu_linear._reform_t_kernel, swiglu_in, tokens, mlp, t),
            tokens * mlp * (2 * (1 + 4 / 16) + 1),
        ),
    }
    lines = []

    def say(s):
        print(s, flush=True)
        lines.append(s)

    if cuda:
        from triton.testing import do_bench

        say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        a = torch.empty(tokens * mlp, device=dev, dtype=torch.bfloat16)
        b = torch.empty_like(a)
        ms = do_bench(lambda: b.copy_(a), return_mode="median")
        say(f"bf16 copy of {tokens}x{mlp}: {ms:.4f} ms, {2 * a.nbytes / ms / 1e9:.3f} TB/s")
    else:
        do_bench = None
    ref = {name: op().view(torch.uint8) for name, (op, _, _) in calls.items()}
    say(f"{'config':<28}" + "".join(f"{n:>30}" for n in calls) + "  bits")
    for cfg in CONFIGS:
        row, same = f"{cfg.bm}x{cfg.bn} w{cfg.num_warps}", True
        row = f"{row:<28}"
        for name, (_, kernel_at, nbytes) in calls.items():
            fn = lambda kernel_at=kernel_at, cfg=cfg: kernel_at(cfg)  # noqa: E731
            same &= torch.equal(fn().view(torch.uint8), ref[name])
            if do_bench is not None:
                ms = do_bench(fn, return_mode="median")
                row += f"{ms:>14.4f} ms {nbytes / ms / 1e9:>8.3f} TB/s"
            else:
                row += f"{'-':>30}"
        say(row + ("  ok" if same else "  DIFFERENT"))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
