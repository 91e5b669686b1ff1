import math, torch, sys
sys.path.insert(0, "packages/fp8-optim/tests")
from fp8_optim import CoatAdamW, CoatAdamWConfig, reference
from fp8_optim.ops import AdamWLaunch, adamw
import conftest as h

def run(shapes, bads, launch=None, hp=False):
    adamw.LAUNCH = launch
    params = h.make_params(shapes, device="cuda")
    opt = CoatAdamW(params, config=CoatAdamWConfig(high_precision_states=hp))
    h.run_steps(params, opt, 2)
    before = [p.detach().clone() for p in params]
    grads = h.heavy_grads(params, 5)
    for (i, j) in bads:
        grads[i].view(-1)[j] = math.nan
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    skipped = []
    for p, p0 in zip(params, before):
        f, f0 = p.detach().reshape(-1), p0.reshape(-1)
        skipped.append([gi for gi in range(reference.num_groups(p.numel(), 128)) if torch.equal(f[gi*128:(gi+1)*128], f0[gi*128:(gi+1)*128])])
    print(shapes, bads, launch, "count", opt.nonfinite_groups(), "skipped", skipped, flush=True)

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
