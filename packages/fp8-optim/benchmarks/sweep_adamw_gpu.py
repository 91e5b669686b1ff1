"""Launch-shape sweep of the CoatAdamW step against torch.optim.AdamW(fused=True).

The 1.20 B-parameter Llama-1B-shaped list of ``bench_adamw.py`` (147 fp32 tensors, fp32
grads, E4M3+E4M3 with DRE). Target: CoatAdamW >= 1.75x faster than torch's fused AdamW in
the same run. Every launch shape in ``CONFIGS``
(``ops.adamw.AdamWLaunch``) is first checked bit for bit against the default shape (one step
from the same saved parameters and states: every parameter and state tensor), then timed in
rounds, each round measuring torch's fused AdamW right before each shape:

* ``bench``: ``triton.testing.do_bench`` median of ``step()`` (L2 flushed by a memset before
  each call), as ``bench_adamw.py``: any host time of ``step()`` before its first launch that
  exceeds the memset shows up as device time, for both optimizers;
* ``stream``: CUDA events around ``--iters`` back-to-back ``step()`` calls started behind a
  device sleep: the device time of a step when the host runs ahead, as in training.

    python packages/fp8-optim/benchmarks/sweep_adamw_gpu.py --out DIR [--budget-s 75]
    TRITON_INTERPRET=1 python packages/fp8-optim/benchmarks/sweep_adamw_gpu.py --smoke --out DIR

Writes ``DIR/sweep_adamw.json`` and ``DIR/sweep_adamw.txt`` (the table, also printed).
``--smoke``: a few small tensors on CPU through the interpreter (timings meaningless).
"""

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

import torch
import triton
from fp8_optim import CoatAdamW
from fp8_optim.ops import AdamWLaunch
from fp8_quant.timing import check_sweep_options, cuda_ms_per_call, gpu_state

L = AdamWLaunch
# (name, launch): the default first, then by expected value; names are
# groups x threads/group, then w<warps>, r<maxnreg>.
CONFIGS = [
    ("default-8x16", L()),
    ("4x16", L(block_g=4)),
    ("16x16", L(block_g=16)),
    ("8x32", L(group_threads=32)),
    ("8x16-r48", L(maxnreg=48)),
]
T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def llama_1b_shapes(layers=16, hidden=2048, mlp=8192, vocab=32000):
    """bench_adamw.py's list: 147 tensors, 1.20 B parameters."""
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4 + [(mlp, hidden)] * 2 + [(hidden, mlp)]
        shapes += [(hidden,), (hidden,)]
    return shapes + [(hidden,), (vocab, hidden)]


class Timer:
    """``bench`` (do_bench median) and ``stream`` (back-to-back events), ms per call."""

    def __init__(self, cuda: bool, iters: int, rep_ms: int):
        self.cuda, self.iters, self.rep_ms = cuda, iters, rep_ms
        self.sleep_cycles = 0

    def bench(self, fn) -> float:
        if not self.cuda:
            return self.host_ms(fn)
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=self.rep_ms, return_mode="median")

    def stream(self, fn) -> float:
        if not self.cuda:
            return self.host_ms(fn)
        # The host queues every step during the sleep.
        return cuda_ms_per_call(fn, self.iters, sleep_cycles=self.sleep_cycles, warmup=False)

    def host_ms(self, fn) -> float:
        """Host time of one call (median of 5), launches only (device kept busy on GPU)."""
        out = []
        for _ in range(5):
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda._sleep(40_000_000)  # >= 20 ms: the call below only queues
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        if self.cuda:
            torch.cuda.synchronize()
        return statistics.median(out)


def set_launch(opt: CoatAdamW, launch: AdamWLaunch) -> None:
    opt._launch = launch
    opt._plans.clear()  # plans take the launch shape when they are built


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (or a .json path)")
    ap.add_argument("--budget-s", type=float, default=75.0, help="wall-clock budget (s)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (repeats) per shape")
    ap.add_argument("--iters", type=int, default=8, help="steps per stream measurement")
    ap.add_argument("--rep-ms", type=int, default=50, help="do_bench rep (ms)")
    ap.add_argument("--only", default="", help="comma-separated config names (default: all)")
    ap.add_argument("--smoke", action="store_true", help="tiny tensors, CPU interpreter is fine")
    args = ap.parse_args()
    check_sweep_options(ap, args, [c[0] for c in CONFIGS])

    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    cuda = torch.cuda.is_available() and not interpret
    if args.smoke:
        args.rounds, args.iters = 1, 1
        shapes = [(37, 41), (300,), (16, 64)]
    elif not cuda:
        print("needs a CUDA GPU without TRITON_INTERPRET (or --smoke)", file=sys.stderr)
        return 2
    else:
        shapes = llama_1b_shapes()
    device = "cuda" if cuda else "cpu"
    configs = [c for c in CONFIGS if not args.only or c[0] in args.only.split(",")]
    if configs[0][0] != "default-8x16":
        configs.insert(0, CONFIGS[0])  # the reference for the bit checks
    timer = Timer(cuda, args.iters, args.rep_ms)
    meta = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "args": vars(args),
        "gpu_state_before": gpu_state() if cuda else None,
    }
    log(f"{meta['device']}, torch {torch.__version__}, triton {triton.__version__}")
    if cuda:
        log(meta["gpu_state_before"])

    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, device=device, generator=gen) * 0.02)
        p.grad = torch.randn(s, device=device, generator=gen) * 1e-3
        params.append(p)
    n_params = sum(p.numel() for p in params)
    meta["n_params"], meta["n_tensors"] = n_params, len(params)
    log(f"{len(params)} tensors, {n_params / 1e9:.3f} B params")
    coat = CoatAdamW(params, lr=1e-4)
    fused = torch.optim.AdamW(params, lr=1e-4, fused=cuda)

    # ---- bit checks: one step of each shape from the same saved params and states
    set_launch(coat, configs[0][1])
    coat.step()  # creates the state (zeros), compiles the default
    coat.step()  # non-trivial states
    if cuda:
        torch.cuda.synchronize()
    saved_p = [p.detach().clone() for p in params]
    saved_s = [{k: v.clone() for k, v in coat.state[p].items()} for p in params]

    def restore():
        for p, sp, ss in zip(params, saved_p, saved_s, strict=True):
            p.data.copy_(sp)
            for k, v in ss.items():
                coat.state[p][k].copy_(v)

    def snapshot():
        out = [p.detach().clone() for p in params]
        for p in params:
            out += [v.clone() for v in coat.state[p].values()]
        return out

    def n_diff(a, b):
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
        return sum(
            int((x.view(ints[x.element_size()]) != y.view(ints[y.element_size()])).sum())
            for x, y in zip(a, b, strict=True)
        )

    results = {}
    expected = None
    for name, launch in configs:
        if elapsed() > 0.65 * args.budget_s:  # leave time for the timing rounds
            log(f"budget: skipping {name}")
            continue
        t0 = time.perf_counter()
        r = {"name": name, "launch": dataclasses.asdict(launch)}
        try:
            set_launch(coat, launch)
            restore()
            coat.step()  # compiles this shape
            if cuda:
                torch.cuda.synchronize()
            got = snapshot()
            if expected is None:
                expected = got
            r["bits_diff_vs_default"] = n_diff(got, expected)
            r["compile_check_s"] = round(time.perf_counter() - t0, 2)
        except Exception as e:  # a shape this Triton cannot build: record, go on
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        results[name] = r
        log(
            f"{name:14s} compile+check {time.perf_counter() - t0:5.2f}s "
            + (r.get("error") or f"bits differing from default: {r['bits_diff_vs_default']}")
        )
    saved_p = saved_s = expected = None  # free the snapshots
    set_launch(coat, configs[0][1])
    fused.step()  # creates torch's state
    host = {"coat": timer.host_ms(coat.step), "torch_fused": timer.host_ms(fused.step)}
    meta["host_ms_per_step"] = host
    log(f"host ms per step: {host}")
    # device sleep before a stream measurement: twice the host time of its steps (<= 2 GHz)
    timer.sleep_cycles = int(2 * args.iters * max(host.values()) * 2e6) + 200_000

    # ---- timing rounds: torch fused, then the shape, for every ready shape
    ready = [n for n, r in results.items() if "error" not in r]
    launches = dict(configs)
    done_rounds = 0
    for rnd in range(args.rounds):
        t_round = time.perf_counter()
        for name in ready:
            set_launch(coat, launches[name])
            coat.step()  # rebuilds the plan outside the timing
            r = results[name]
            for method in ("bench", "stream"):
                measure = getattr(timer, method)
                t_ms = measure(fused.step)
                c_ms = measure(coat.step)
                r.setdefault(method, []).append(
                    {"ms": c_ms, "torch_fused_ms": t_ms, "speedup": t_ms / c_ms}
                )
        done_rounds += 1
        dt = time.perf_counter() - t_round
        log(f"round {rnd + 1}/{args.rounds} done in {dt:.1f}s")
        if elapsed() + dt > args.budget_s and rnd + 1 < args.rounds:
            log(f"budget: stopping after {done_rounds} rounds")
            break
    meta["rounds_done"] = done_rounds
    meta["gpu_state_after"] = gpu_state() if cuda else None
    meta["elapsed_s"] = round(elapsed(), 1)

    # ---- summary
    floor = 16.08 * n_params  # bytes moved by one step at fp32 params and grads
    lines = [
        f"CoatAdamW step, {n_params / 1e9:.3f} B params in {len(params)} tensors, on "
        f"{meta['device']} (torch {torch.__version__}, triton {triton.__version__}), "
        f"{done_rounds} rounds; medians over rounds; speedup = torch fused ms / CoatAdamW ms "
        "measured next to each other (target >= 1.75x); spread = max - min of the speedup",
        f"{'config':14s} {'bench ms':>9s} {'torch ms':>9s} {'speedup':>8s} {'spread':>7s} "
        f"{'stream ms':>9s} {'torch ms':>9s} {'speedup':>8s} {'spread':>7s} {'TB/s':>6s} bits",
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"{name:14s} FAILED {r['error'][:100]}")
            continue
        cols = []
        for method in ("bench", "stream"):
            rows = r.get(method, [])
            if not rows:
                cols.append(f"{'-':>9s} {'-':>9s} {'-':>8s} {'-':>7s}")
                continue
            ms = statistics.median(x["ms"] for x in rows)
            tms = statistics.median(x["torch_fused_ms"] for x in rows)
            sp = [x["speedup"] for x in rows]
            r[f"{method}_median_ms"], r[f"{method}_median_torch_ms"] = ms, tms
            r[f"{method}_median_speedup"] = statistics.median(sp)
            r[f"{method}_spread_speedup"] = max(sp) - min(sp)
            cols.append(
                f"{ms:9.3f} {tms:9.3f} {statistics.median(sp):7.3f}x {max(sp) - min(sp):6.3f}x"
            )
        tbps = floor / r["stream_median_ms"] / 1e9 if "stream_median_ms" in r else float("nan")
        bits = "ok" if r["bits_diff_vs_default"] == 0 else f"DIFF {r['bits_diff_vs_default']}"
        lines.append(f"{name:14s} {cols[0]} {cols[1]} {tbps:6.2f} {bits}")
    for method in ("bench", "stream"):
        ok = [
            (r[f"{method}_median_speedup"], n)
            for n, r in results.items()
            if f"{method}_median_speedup" in r and r["bits_diff_vs_default"] == 0
        ]
        if ok:
            best = max(ok)
            lines.append(f"best bit-exact by {method}: {best[1]} {best[0]:.3f}x")
    lines.append(f"host ms per step (launch only): {host}")
    lines.append(f"gpu before: {meta['gpu_state_before']}")
    lines.append(f"gpu after:  {meta['gpu_state_after']}")
    lines.append(f"elapsed {meta['elapsed_s']} s")
    table = "\n".join(lines)
    print(table)

    out = args.out
    if not out.endswith(".json"):
        os.makedirs(out, exist_ok=True)
        out = os.path.join(out, "sweep_adamw.json")
    with open(out, "w") as f:
        json.dump({"meta": meta, "results": list(results.values())}, f, indent=1, default=str)
    with open(out[: -len(".json")] + ".txt", "w") as f:
        f.write(table + "\n")
    bad = [n for n, r in results.items() if r.get("error") or r["bits_diff_vs_default"]]
    if bad:
        print(f"shapes with different bits or errors: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
