"""GPU diagnostic of CoatAdamW's non-finite policy: for a few buckets, put NaNs into chosen
gradient elements and print how many groups ``nonfinite_groups()`` counts against the groups
whose parameters actually stayed unchanged (BENCHMARKS.md, CoatAdamW run 7).

    PYTHONPATH=packages/fp8-quant/src:packages/fp8-optim/src python3 scripts/diag_nonfinite_gpu.py
"""

import math
import sys

import torch
from fp8_optim import CoatAdamW, CoatAdamWConfig, reference
from fp8_optim.ops import AdamWLaunch, adamw

sys.path.insert(0, "packages/fp8-optim/tests")
import conftest as h  # noqa: E402  (the tests' parameter and gradient makers)


def run(shapes, nans, launch=None, hp=False):
    adamw.LAUNCH = launch
    params = h.make_params(shapes, device="cuda")
    opt = CoatAdamW(params, config=CoatAdamWConfig(high_precision_states=hp))
    h.run_steps(params, opt, 2)
    before = [p.detach().clone() for p in params]
    grads = h.heavy_grads(params, 5)
    for i, j in nans:  # (tensor, flat element)
        grads[i].view(-1)[j] = math.nan
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt.step()
    skipped = []
    for p, p0 in zip(params, before, strict=True):
        f, f0 = p.detach().reshape(-1), p0.reshape(-1)
        groups = range(reference.num_groups(p.numel(), 128))
        skipped.append([g for g in groups if torch.equal(f[g * 128 : (g + 1) * 128],
                                                         f0[g * 128 : (g + 1) * 128])])  # fmt: skip
    print(shapes, nans, launch, "count", opt.nonfinite_groups(), "skipped", skipped, flush=True)


if __name__ == "__main__":
    run(((128,),), [(0, 5)])
    run(((1024,),), [(0, 5)])
    run(((1024,),), [(0, 130)])
    run(((1024,),), [(0, 5), (0, 300)])
    run(((2048,),), [(0, 5)])
    run(((5, 128), (300,)), [(0, 135)])
    run(((128,), (128,)), [(0, 5)])
    run(((1024,),), [(0, 5)], AdamWLaunch(block_g=4))
    run(((1024,),), [(0, 5)], AdamWLaunch(group_threads=32))
    run(((1024,),), [(0, 5)], hp=True)
