"""Launch-shape sweep of ``quantize_per_group`` (bf16 in, E4M3 out) against a device copy.

Target: >= 75% of a plain copy's bandwidth at G=16 and G=128, repeatably. Single runs of
one kernel vary, so this script measures every launch shape in ``CONFIGS``
(``ops.quantize_per_group.GroupLaunch``) two ways, each interleaved with the copy it is
compared with, in rounds (round r measures every shape once), and reports the median over
rounds and the spread:

* ``bench``: ``triton.testing.do_bench`` median, as the ``bench_*.py`` files (L2 flushed by a
  256 MB memset before every call: up to an L2 of dirty lines is written back *during* the
  timed call, and a host launch slower than the memset shows up as device time);
* ``stream``: CUDA events around ``--iters`` back-to-back calls, started behind a device
  sleep so the host is ahead and the GPU never waits for a launch; no flush (the tensor is
  several times the L2): the steady-state device time.

Shapes named ``int-*`` force the integer ``fp8_encode`` (``FP8_QUANT_HW_CAST=0``); the
others take the default: the hardware FP8 conversion where ``ops.hw_cast_supported`` says so
(sm_90+), the integer encode elsewhere (column ``hw``). Before timing, each shape's output
is checked bit for bit against the default shape's (random data, 8192x8192) and against the
CPU reference (edge inputs): every shape, either encode, must give the same bits. GB/s
counts each op's minimal bytes (input read once, outputs written once); ``of copy`` is that
over the copy's GB/s measured next to it.

    python packages/fp8-quant/benchmarks/sweep_quantize_gpu.py --out DIR [--budget-s 55]
    TRITON_INTERPRET=1 python packages/fp8-quant/benchmarks/sweep_quantize_gpu.py --smoke --out DIR

Writes ``DIR/sweep_quantize.json`` and ``DIR/sweep_quantize.txt`` (the table, also printed).
``--smoke`` runs every code path on tiny CPU tensors through the interpreter (timings are
meaningless there, and every shape takes the integer encode).
"""

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import statistics
import sys
import time

import torch
import triton
from fp8_quant import FP8Format, reference
from fp8_quant.ops import hw_cast_supported
from fp8_quant.ops.fp8_round import HW_CAST_ENV
from fp8_quant.timing import check_sweep_options, cuda_ms_per_call, gpu_state

qpg = importlib.import_module("fp8_quant.ops.quantize_per_group")  # the module, not the op
GroupLaunch = qpg.GroupLaunch
FMT = FP8Format.E4M3
GROUPS = (16, 128)

# (name, launch): the default first; then by expected value. Elements per thread =
# tile / (32 * warps): the default has 64. ``int-``: the integer encode forced, as GPUs
# without the hardware cast run it (its best shape is t8192-w4: 74-85% of copy on an H200).
CONFIGS = [
    ("default", qpg.LAUNCH),  # tile 8192, 4 warps
    ("t4096-w4", GroupLaunch(tile=4096, num_warps=4)),
    ("t8192-w8", GroupLaunch(tile=8192, num_warps=8)),  # GroupLaunch()'s 8-warp rule
    ("t2048-w4", GroupLaunch(tile=2048, num_warps=4)),
    ("int-default", qpg.LAUNCH),
    ("int-t8192-w8", GroupLaunch(tile=8192, num_warps=8)),
]
T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------- timing
class Timer:
    """``bench`` (do_bench median) and ``stream`` (back-to-back events) in ms per call."""

    def __init__(self, device: torch.device, iters: int, rep_ms: int):
        self.cuda = device.type == "cuda"
        self.iters, self.rep_ms = iters, rep_ms
        self.sleep_cycles = 0

    def bench(self, fn) -> float:
        if not self.cuda:
            return self._host(fn, 2)
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=self.rep_ms, return_mode="median")

    def stream(self, fn) -> float:
        if not self.cuda:
            return self._host(fn, 2)
        # The host queues every call during the sleep.
        return cuda_ms_per_call(fn, self.iters, sleep_cycles=self.sleep_cycles)

    def host_us(self, fn) -> float:
        """Host time per call while the device is busy (launches only, no waiting)."""
        if not self.cuda:
            return self._host(fn, 2) * 1e3
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)  # >= 10 ms: every launch below only queues
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        us = (time.perf_counter() - t0) / 50 * 1e6
        torch.cuda.synchronize()
        return us

    @staticmethod
    def _host(fn, n) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e3


# ------------------------------------------------------------------------------ inputs
def edge_input(rows: int, n: int, group: int) -> torch.Tensor:
    """Groups of rounding specials at scale 1, zeros, constants, underflow, near-max, NaN,
    +-inf and random magnitudes (fp32, cast to bf16 by the caller)."""
    g = torch.Generator().manual_seed(1)
    specials = torch.tensor(
        [126.3, -126.3, 232.0, 240.0, 247.9, 248.0, 249.0, 447.0, 0.0, -0.0, 2.0**-9,
         2.0**-10, 3 * 2.0**-10, 7.5 * 2.0**-9, 2.0**-6 - 2.0**-12, 1e-30, -1e-30]
    )  # fmt: skip
    kinds = [
        lambda k: torch.cat([torch.tensor([448.0]), specials[torch.arange(k - 1) % 17]]),
        lambda k: torch.zeros(k),
        lambda k: torch.full((k,), 3.7),
        lambda k: torch.randn(k, generator=g) * 2.0**-100,
        lambda k: 448.0 * (1 - torch.rand(k, generator=g) * 2.0**-6),
        lambda k: (
            torch.randn(k, generator=g) * 10.0 ** float(torch.randint(-6, 6, (), generator=g))
        ),
        lambda k: torch.where(torch.arange(k) == k // 2, float("nan"), torch.randn(k, generator=g)),
        lambda k: torch.where(torch.arange(k) == 0, float("inf"), torch.randn(k, generator=g)),
        lambda k: torch.where(torch.arange(k) == k - 1, -float("inf"), torch.randn(k, generator=g)),
    ]
    ng = rows * n // group
    return torch.cat([kinds[i % len(kinds)](group) for i in range(ng)]).view(rows, n)


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def n_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    """Differing elements: FP8 codes by bits; fp32 scales by bits, any NaN matching any NaN."""
    if a.element_size() == 1:
        return int((bits(a) != bits(b)).sum())
    same = (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())
    return int((~same).sum())


# ------------------------------------------------------------------------------- sweep
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (or a .json path)")
    ap.add_argument("--budget-s", type=float, default=55.0, help="wall-clock budget (s)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (repeats) per shape")
    ap.add_argument("--sizes", default="8192x8192,32768x8192", help="MxN bf16 inputs")
    ap.add_argument("--iters", type=int, default=40, help="calls per stream measurement")
    ap.add_argument("--rep-ms", type=int, default=20, help="do_bench rep (ms)")
    ap.add_argument("--only", default="", help="comma-separated config names (default: all)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, CPU interpreter is fine")
    args = ap.parse_args()
    check_sweep_options(ap, args, [c[0] for c in CONFIGS])

    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if args.smoke:
        args.sizes, args.rounds, args.iters = "64x256", 1, 2
    elif interpret or not torch.cuda.is_available():
        print("needs a CUDA GPU without TRITON_INTERPRET (or --smoke)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() and not interpret else "cpu")
    configs = [c for c in CONFIGS if not args.only or c[0] in args.only.split(",")]
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    timer = Timer(device, args.iters, args.rep_ms)
    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "args": vars(args),
        "gpu_state_before": gpu_state() if device.type == "cuda" else None,
    }
    log(f"{meta['device']}, torch {torch.__version__}, triton {triton.__version__}")
    if meta["gpu_state_before"]:
        log(meta["gpu_state_before"])

    torch.manual_seed(0)
    xs = {s: torch.randn(s, device=device, dtype=torch.bfloat16) for s in sizes}
    ys = {s: torch.empty_like(x) for s, x in xs.items()}
    check_x = xs[sizes[0]]
    edge_n = 16 * 128 if args.smoke else 512 * 128
    edge = {G: edge_input(8, edge_n, G).to(torch.bfloat16) for G in GROUPS}
    edge_ref = {G: reference.quantize_per_group(edge[G], G, FMT) for G in GROUPS}
    edge_dev = {G: e.to(device) for G, e in edge.items()}

    def set_integer(on: bool) -> None:
        # Only on a change: hw_cast_supported is cached, a cleared cache costs host time.
        if (os.environ.get(HW_CAST_ENV) == "0") != on:
            os.environ[HW_CAST_ENV] = "0" if on else "1"
            hw_cast_supported.cache_clear()

    def run(name, cfg, x, G):
        set_integer(name.startswith("int-"))
        # fp8_quant.ops' launcher, as quantize_per_group(backend="triton") runs it, with
        # this launch shape.
        return qpg.quantize_per_group(x, G, FMT, launch=cfg)

    # ---- compile and check every (shape, G) before timing anything
    results = {}  # (name, G) -> dict
    default_out = {}
    for G in GROUPS:
        for name, cfg in configs:
            if elapsed() > 0.65 * args.budget_s:  # leave time for the timing rounds
                log(f"budget: skipping check/compile of {name} G={G}")
                continue
            t0 = time.perf_counter()
            r = {
                "name": name,
                "G": G,
                "launch": dataclasses.asdict(cfg),
            }
            try:
                q, s = run(name, cfg, check_x, G)
                r["hw_cast"] = hw_cast_supported(device)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                r["compile_s"] = round(time.perf_counter() - t0, 2)
                if name == "default":
                    default_out[G] = (q, s)
                ref_q, ref_s = default_out.get(G, (q, s))
                eq, es = run(name, cfg, edge_dev[G], G)
                r["diff_vs_default_random"] = n_diff(q, ref_q) + n_diff(s, ref_s)
                r["diff_vs_reference_edge"] = n_diff(eq.cpu(), edge_ref[G][0]) + n_diff(
                    es.cpu(), edge_ref[G][1]
                )
                if r["diff_vs_reference_edge"]:
                    bad = (bits(eq.cpu()) != bits(edge_ref[G][0])).nonzero()[:4]
                    r["first_edge_diffs"] = [
                        [float(edge[G][tuple(i)]), int(bits(eq.cpu())[tuple(i)]),
                         int(bits(edge_ref[G][0])[tuple(i)])]
                        for i in bad.tolist()
                    ]  # fmt: skip  # [input, got code, reference code]
                r["bits_ok"] = r["diff_vs_default_random"] == 0 == r["diff_vs_reference_edge"]
                r["host_us"] = round(
                    timer.host_us(lambda n=name, c=cfg, G=G: run(n, c, check_x, G)), 1
                )
            except Exception as e:  # a shape this Triton cannot build: record, go on
                r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            results[(name, G)] = r
            log(
                f"G={G:<4d} {name:14s} compile+check {time.perf_counter() - t0:5.2f}s "
                + (r.get("error") or f"bits_ok={r['bits_ok']} host {r['host_us']} us/call")
            )

    # device sleep before a stream measurement: covers the host time of all its launches
    host_max = max((r.get("host_us", 0) for r in results.values()), default=0)
    if device.type == "cuda":  # cycles at <= 2 GHz: twice the host time, or more
        timer.sleep_cycles = int(2 * args.iters * host_max * 2000) + 200_000

    # ---- timing rounds: every ready shape once per round, each next to its own copy
    ready = [k for k, r in results.items() if "error" not in r]
    done_rounds = 0
    for rnd in range(args.rounds):
        t_round = time.perf_counter()
        for key in ready:
            name, G = key
            cfg = dict(configs)[name]
            r = results[key]
            for s in sizes:
                x, y = xs[s], ys[s]
                numel = x.numel()
                kbytes = numel * 3 + numel // G * 4
                cbytes = numel * 4
                row = r.setdefault("sizes", {}).setdefault(
                    f"{s[0]}x{s[1]}", {"bytes": kbytes, "copy_bytes": cbytes}
                )
                for method in ("bench", "stream"):
                    measure = getattr(timer, method)
                    c_ms = measure(lambda x=x, y=y: y.copy_(x))
                    k_ms = measure(lambda n=name, c=cfg, x=x, G=G: run(n, c, x, G))
                    frac = (kbytes / k_ms) / (cbytes / c_ms)
                    row.setdefault(method, []).append(
                        {"ms": k_ms, "copy_ms": c_ms, "of_copy": frac}
                    )
        done_rounds += 1
        dt = time.perf_counter() - t_round
        log(f"round {rnd + 1}/{args.rounds} done in {dt:.1f}s")
        if elapsed() + dt > args.budget_s and rnd + 1 < args.rounds:
            log(f"budget: stopping after {done_rounds} rounds")
            break
    set_integer(False)
    meta["rounds_done"] = done_rounds
    meta["gpu_state_after"] = gpu_state() if device.type == "cuda" else None
    meta["elapsed_s"] = round(elapsed(), 1)

    # ---- summary
    lines = [
        f"quantize_per_group E4M3 on {meta['device']} (torch {torch.__version__}, triton "
        f"{triton.__version__}), {done_rounds} rounds; median over rounds of kernel ms and "
        "of 'of copy' (GB/s over the copy's GB/s next to it); spread = max - min of 'of copy'",
        f"{'G':>4s} {'size':>11s} {'config':14s} {'bench ms':>9s} {'of copy':>8s} "
        f"{'spread':>7s} {'stream ms':>9s} {'of copy':>8s} {'spread':>7s} {'host us':>8s} hw  bits",
    ]
    for (name, G), r in results.items():
        if "error" in r:
            lines.append(f"{G:4d} {'':>11s} {name:14s} FAILED {r['error'][:80]}")
            continue
        bitnote = (
            "ok"
            if r["bits_ok"]
            else (f"DIFF rand {r['diff_vs_default_random']} edge {r['diff_vs_reference_edge']}")
        )
        for size, row in r.get("sizes", {}).items():
            cols = []
            for method in ("bench", "stream"):
                ms = [m["ms"] for m in row[method]]
                fr = [m["of_copy"] for m in row[method]]
                row[f"{method}_median_ms"] = statistics.median(ms)
                row[f"{method}_median_of_copy"] = statistics.median(fr)
                row[f"{method}_spread_of_copy"] = max(fr) - min(fr)
                cols.append(
                    f"{statistics.median(ms):9.4f} {100 * statistics.median(fr):7.1f}% "
                    f"{100 * (max(fr) - min(fr)):6.1f}%"
                )
            lines.append(
                f"{G:4d} {size:>11s} {name:14s} {cols[0]} {cols[1]} {r['host_us']:8.1f} "
                f"{'yes' if r['hw_cast'] else 'no ':3s} {bitnote}"
            )
    for G in GROUPS:
        for method in ("bench", "stream"):
            best = [
                (row[f"{method}_median_of_copy"], name, size)
                for (name, g), r in results.items()
                if g == G and r.get("bits_ok")
                for size, row in r.get("sizes", {}).items()
                if f"{method}_median_of_copy" in row
            ]
            for size in sorted({b[2] for b in best}):
                top = max(b for b in best if b[2] == size)
                dflt = [b for b in best if b[2] == size and b[1] == "default"]
                d = f" (default {100 * dflt[0][0]:.1f}%)" if dflt else ""
                lines.append(
                    f"best bit-exact G={G} {size} by {method}: {top[1]} {100 * top[0]:.1f}%{d}"
                )
    lines.append(f"gpu before: {meta['gpu_state_before']}")
    lines.append(f"gpu after:  {meta['gpu_state_after']}")
    lines.append(f"elapsed {meta['elapsed_s']} s")
    table = "\n".join(lines)
    print(table)

    out = args.out
    if not out.endswith(".json"):
        os.makedirs(out, exist_ok=True)
        out = os.path.join(out, "sweep_quantize.json")
    with open(out, "w") as f:
        json.dump(
            {"meta": meta, "results": [r for r in results.values()]}, f, indent=1, default=str
        )
    with open(out[: -len(".json")] + ".txt", "w") as f:
        f.write(table + "\n")
    bad = [r["name"] for r in results.values() if not r.get("bits_ok")]
    if bad:
        print(f"shapes with different bits or errors: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
