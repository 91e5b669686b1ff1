"""Where the time of fp8_activations' ops goes on a GPU (Llama-2-7B shapes: 8192 tokens,
hidden 4096, MLP 11008, bf16): forward and backward separately, host (Python + launches)
against device (kernels), this package against eager BF16 PyTorch and, with ``--baseline``,
against another copy of the package (measured in a process of its own, run with DIR first on
its PYTHONPATH: this process's imports stay as they are); ``--sweep`` tries the launch configs of
``fp8_activations.ops._common.CONFIG``; the FP8 linear's kernels are broken out.

    PYTHONPATH=packages/fp8-quant/src:packages/fp8-activations/src \\
        python3 packages/fp8-activations/benchmarks/profile_ops.py [--baseline DIR] [--sweep]

It first runs ``pytest -m gpu`` on the package's tests (``--no-pytest`` skips that).
``--baseline DIR``: DIR holds a package ``fp8_activations_base``, a copy of fp8_activations
whose ``fp8_activations::`` op names were renamed ``fp8_activations_base::``; for commit C:

    B=packages/fp8-activations/build/baseline; mkdir -p /tmp/fa_base $B
    git archive C packages/fp8-activations/src/fp8_activations | tar -x -C /tmp/fa_base
    cp -r /tmp/fa_base/packages/fp8-activations/src/fp8_activations $B/fp8_activations_base
    grep -rl fp8_activations:: $B | xargs sed -i s/fp8_activations::/fp8_activations_base::/

(``build/`` is git-ignored; pass it to a device run with ``carry``.)

Columns (ms):
  fwd+bwd   ``triton.testing.do_bench`` median of forward + backward (what a step sees)
  fwd, bwd  the same for the forward alone, and the backward alone (``retain_graph``)
  host f/b  wall time to issue one forward / backward: best of 3 runs of 20 calls with no
            sync (the GPU lags behind), i.e. Python + launch time
  gpu f/b   kernel time of one forward / backward (``torch.profiler``, CUPTI; L2 flushed
            before each call), and for the fp8 variants the bandwidth that implies (TB/s)
            from the bytes the op must move (``BYTES``)
A call is host-bound where host >= gpu: do_bench then measures the host.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from fp8_quant.ops import hw_cast_supported
from fp8_quant.timing import cuda_ms_per_call

TOKENS, HIDDEN, MLP = 8192, 4096, 11008

# Bytes per element each fp8 op must move: bf16 in and out, 1 B/elem FP8 copies plus a 4 B
# scale or group max per 16 elements; (forward, backward), per element of one input.
BYTES = {
    "rms_norm": (2 + 2 + 1.25 + 0.25, 2 + 1.25 + 2),
    "layer_norm": (2 + 2 + 1.25 + 0.25, 2 + 1.25 + 2),
    "silu": (2 + 2 + 1.25 + 0.25, 2 + 1.25 + 2),
    "gelu": (2 + 2 + 1.25 + 0.25, 2 + 1.25 + 2),
    "swiglu": (4 + 2 + 2.5 + 0.25, 2 + 2.5 + 4),
    "residual_add": (4 + 2 + 1.25, 0.0),
}
# Launch configs tried by --sweep per kernel (op, CONFIG key, direction), most important
# first: element-wise (elements per program, warps); norms (elements per thread,) forward
# and (elements per thread, programs per SM) backward.
_EW = [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (1024, 4), (2048, 8), (1024, 2)]
_NORM_FWD = [(32,), (16,), (8,), (64,)]
_NORM_BWD = [(16, 2), (32, 2), (8, 1), (16, 1), (32, 3), (64, 2)]
SWEEP = [
    ("rms_norm", "rms_norm_fwd", "f", _NORM_FWD),
    ("rms_norm", "rms_norm_bwd", "b", _NORM_BWD),
    ("residual_add", "residual_add_fwd", "f", _EW),
    ("swiglu", "swiglu_fwd", "f", _EW),
    ("swiglu", "swiglu_bwd", "b", _EW),
    ("silu", "silu_fwd", "f", _EW),
    ("silu", "silu_bwd", "b", _EW),
    ("gelu", "gelu_fwd", "f", _EW),
    ("gelu", "gelu_bwd", "b", _EW),
    ("layer_norm", "layer_norm_fwd", "f", _NORM_FWD),
    ("layer_norm", "layer_norm_bwd", "b", _NORM_BWD),
]
# fp8_quant's quantize-transpose kernel (the FP8 linear's quantizer): (BM, BN, warps).
QT_TILES = [(128, 128, 8), (64, 128, 4), (128, 64, 4), (64, 64, 4), (128, 128, 4)]


def out(s: str = "") -> None:
    print(s, flush=True)


def _fmt(v: float, w: int = 8, p: int = 4) -> str:
    return f"{v:>{w}.{p}f}" if v == v else f"{'n/a':>{w}}"


def _guard(what: str, fn):
    """Run one measurement; a failure is printed and the run goes on."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - one broken variant must not end a GPU run
        out(f"{what}: FAILED {type(e).__name__}: {str(e)[:300]}")
        return None


class Clock:
    """The three ways of timing a call (see the module docstring)."""

    def __init__(self, dry: bool):
        self.dry = dry
        self.flush = None if dry else torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
        self.flush_names: set[str] = set()
        if not dry:
            self.flush_names = set(self._profile(self.flush.zero_, 1, flush=False)[1])

    def bench(self, fn) -> float:
        if self.dry:
            fn()
            return float("nan")
        from triton.testing import do_bench

        return do_bench(fn, warmup=20, rep=60, return_mode="median")

    def host(self, fn, n: int = 20) -> float:
        fn()
        best = float("inf")
        for _ in range(3):
            self._sync()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t) / n)
        self._sync()
        return best * 1e3

    def gpu(self, fn, iters: int = 5):
        """``(ms per call, {kernel: ms per call})``; ``(nan, {})`` on a dry run or if the
        profiler fails."""
        if self.dry:
            fn()
            return float("nan"), collections.Counter()
        got = _guard("  profiler", lambda: self._profile(fn, iters))
        return got or (self._events(fn), collections.Counter())

    def _events(self, fn, iters: int = 10) -> float:
        """Fallback without CUPTI: CUDA events around back-to-back calls (no L2 flush; a
        host-bound call reads as its host time)."""
        return cuda_ms_per_call(fn, iters)

    def _profile(self, fn, iters, flush=True):
        fn()
        self._sync()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                if flush:
                    self.flush.zero_()
                fn()
            self._sync()
        per: collections.Counter = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in self.flush_names:
                per[e.name] += e.time_range.elapsed_us() / 1e3 / iters
        return sum(per.values()), per

    def _sync(self):
        if not self.dry:
            torch.cuda.synchronize()


class Measure:
    """Every number of one (op, variant): gradients of every input and of ``params``."""

    def __init__(self, clock: Clock, fn, inputs, params=()):
        self.clock, self.fn = clock, fn
        self.leaves = [t.detach().clone().requires_grad_() for t in inputs]
        self.wrt = self.leaves + list(params)
        y = fn(*self.leaves)
        self.dy = torch.randn_like(y, dtype=torch.float32).to(y.dtype)

    def fwd(self):
        return self.fn(*self.leaves)

    def step(self):
        torch.autograd.grad(self.fn(*self.leaves), self.wrt, self.dy)

    def bwd_fn(self):
        y = self.fn(*self.leaves)
        return lambda: torch.autograd.grad(y, self.wrt, self.dy, retain_graph=True)

    def all(self) -> dict:
        c, bwd = self.clock, self.bwd_fn()
        gf, kf = c.gpu(self.fwd)
        gb, kb = c.gpu(bwd)
        return dict(
            step=c.bench(self.step), fwd=c.bench(self.fwd), bwd=c.bench(bwd),
            host_f=c.host(self.fwd), host_b=c.host(bwd), gpu_f=gf, gpu_b=gb, kf=kf, kb=kb,
        )  # fmt: skip


def _rand(*shape, device):
    return torch.randn(*shape, device=device).to(torch.bfloat16)


def _weight(n, device):
    return (1 + 0.1 * torch.randn(n, device=device)).to(torch.bfloat16)


def op_config(fa, dry: bool):
    """The config the ops of package ``fa`` run with: their default (None), or on a dry run
    the Triton backend by name (the interpreter runs Triton only when asked for it)."""
    if not dry or fa is None:
        return None
    # A baseline copied from before the rename knows its config class as FP8Config.
    cls = getattr(fa, "FP8ActivationConfig", None) or fa.FP8Config
    return cls(backend="triton")


def op_table(fa, tokens, hidden, mlp, device, config=None):
    """name -> (fn(*inputs), input factory) for package ``fa`` (or eager torch: fa=None),
    its ops run with ``config``."""
    c = config
    f = {
        "rms_norm": lambda x, w: fa.rms_norm(x, w, 1e-6, config=c),
        "layer_norm": lambda x, w, b: fa.layer_norm(x, hidden, w, b, config=c),
        "silu": lambda x: fa.silu(x, config=c),
        "gelu": lambda x: fa.gelu(x, config=c),
        "swiglu": lambda g, u: fa.swiglu(g, u, config=c),
        "residual_add": lambda x, r: fa.residual_add(x, r, config=c),
    }
    if fa is None:
        f = {
            "rms_norm": lambda x, w: F.rms_norm(x, (hidden,), w, 1e-6),
            "layer_norm": lambda x, w, b: F.layer_norm(x, (hidden,), w, b),
            "silu": F.silu,
            "gelu": F.gelu,
            "swiglu": lambda g, u: F.silu(g) * u,
            "residual_add": torch.add,
        }
    act = lambda n: lambda: _rand(tokens, n, device=device)  # noqa: E731
    w = lambda: _weight(hidden, device)  # noqa: E731
    make = {
        "rms_norm": [act(hidden), w],
        "layer_norm": [act(hidden), w, w],
        "silu": [act(mlp)],
        "gelu": [act(mlp)],
        "swiglu": [act(mlp), act(mlp)],
        "residual_add": [act(hidden), act(hidden)],
    }
    return {k: (f[k], lambda k=k: [m() for m in make[k]]) for k in f}


def _row(name, label, m, tf=float("nan"), tb=float("nan")) -> str:
    return (f"{name:<13}{label:<7}{_fmt(m['step'], 9)}{_fmt(m['fwd'], 9)}{_fmt(m['bwd'], 9)}"
            f"{_fmt(m['host_f'], 9)}{_fmt(m['host_b'], 9)}{_fmt(m['gpu_f'], 9)}"
            f"{_fmt(m['gpu_b'], 9)}{_fmt(tf, 8, 2)}{_fmt(tb, 8, 2)}")  # fmt: skip


def report_ops(clock, variants, shape, names, eager=True):
    tokens, hidden, mlp, _ = shape
    out(f"{'op':<13}{'':<7}{'fwd+bwd':>9}{'fwd':>9}{'bwd':>9}{'host f':>9}{'host b':>9}"
        f"{'gpu f':>9}{'gpu b':>9}{'TB/s f':>8}{'TB/s b':>8}")  # fmt: skip
    kernels = []
    for name in names:
        n = tokens * (mlp if name in ("silu", "gelu", "swiglu") else hidden)
        for label, fa in [*variants, ("eager", None)] if eager else variants:
            fn, make = op_table(fa, *shape, op_config(fa, clock.dry))[name]
            m = _guard(f"{name} {label}", lambda fn=fn, make=make: Measure(clock, fn, make()).all())
            if m is None:
                continue
            tf = tb = float("nan")
            if fa is not None:
                bf, bb = BYTES[name]
                tf = n * bf / (m["gpu_f"] * 1e-3) / 1e12 if m["gpu_f"] > 0 else tf
                tb = n * bb / (m["gpu_b"] * 1e-3) / 1e12 if m["gpu_b"] > 0 and bb else tb
            out(_row(name, label, m, tf, tb))
            kernels.append((name, label, m["kf"], m["kb"]))
    out("\nkernels (ms per call; forward | backward):")
    for name, label, kf, kb in kernels:
        f = ", ".join(f"{k[:44]} {v:.4f}" for k, v in kf.most_common(4))
        b = ", ".join(f"{k[:44]} {v:.4f}" for k, v in kb.most_common(4))
        out(f"  {name} {label}: {f} | {b}")


def sweep(clock, fa, shape, deadline):
    """Launch configs per kernel: gpu time of the direction that kernel runs in."""
    common = importlib.import_module(fa.__name__ + ".ops._common")
    out(f"\nsweep of {fa.__name__}.ops._common.CONFIG (gpu ms of the op's forward or backward):")
    for name, key, direction, options in SWEEP:
        if time.time() > deadline:
            out(f"  {key}: skipped (time budget)")
            continue
        fn, make = op_table(fa, *shape, op_config(fa, clock.dry))[name]
        m = Measure(clock, fn, make())
        call = m.fwd if direction == "f" else None
        res = []
        for cfg in options:
            with common.tunables(**{key: cfg}):
                run = lambda m=m, call=call: clock.gpu(call or m.bwd_fn())[0]  # noqa: E731
                t = _guard(f"  {key} {cfg}", run)
            res.append((cfg, float("nan") if t is None else t))
        ok = [r for r in res if r[1] == r[1]]
        best = min(ok, key=lambda r: r[1])[0] if ok else None
        out(f"  {key:<17}" + "  ".join(f"{c}: {_fmt(t, 6)}" for c, t in res) + f"   best {best}")


def _precompile_job(job):
    """Worker: run one op variant (or linear, or quantize-transpose tile) on small inputs of
    the same kernel specializations, so that its kernels land in Triton's on-disk cache."""
    kind, pkg, name, key, cfg = job
    fa = importlib.import_module(pkg)
    if kind == "qt":
        qtt = importlib.import_module("fp8_quant.ops.quantize_per_tensor_transpose")
        x = _rand(64, HIDDEN, device="cuda")
        q = torch.empty((64, HIDDEN), device="cuda", dtype=torch.uint8)
        qt = torch.empty((HIDDEN, 64), device="cuda", dtype=torch.uint8)
        amax, s = x.abs().amax().float(), torch.empty((), device="cuda")
        bm, bn, w = cfg
        qtt._per_tensor_transpose_kernel[(-(-64 // bm) * -(-HIDDEN // bn),)](
            x, q, qt, amax, s, 64, HIDDEN, x.stride(0), x.stride(1),
            FMT="e4m3", HW_CAST=hw_cast_supported(x.device), BM=bm, BN=bn, num_warps=w,
        )  # fmt: skip
    elif kind == "linear":
        lin = torch.nn.Linear(HIDDEN, MLP, bias=False, device="cuda", dtype=torch.bfloat16)
        mod = fa.FP8Linear.from_float(lin)
        x = _rand(64, HIDDEN, device="cuda").requires_grad_()
        mod(x).sum().backward()
    else:
        common = importlib.import_module(pkg + ".ops._common")
        with common.tunables(**({key: cfg} if key else {})):
            fn, make = op_table(fa, 64, HIDDEN, MLP, "cuda")[name]
            xs = [t.requires_grad_() for t in make()]
            y = fn(*xs)
            torch.autograd.grad(y, xs, torch.ones_like(y))
    torch.cuda.synchronize()


def precompile(variants, do_sweep, do_linear, workers):
    """Compile every kernel the run will launch, in parallel processes (compiling them one by
    one in the timing process would take most of the time budget). The workers inherit this
    process's environment, PYTHONPATH included, so they import the same packages."""
    import multiprocessing as mp

    jobs = []
    for _, fa in variants:
        jobs += [("op", fa.__name__, name, None, None) for name in BYTES]
    new = variants[0][1].__name__
    if do_sweep:
        jobs += [("op", new, n, k, c) for n, k, _, cs in SWEEP for c in cs]
    if do_linear:
        jobs += [("linear", new, None, None, None)]
        jobs += [("qt", new, None, None, c) for c in QT_TILES]
    t = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        errors = [r for r in pool.map(_safe_job, jobs, chunksize=1) if r]
    out(f"precompiled {len(jobs)} variants in {time.time() - t:.0f} s, {len(errors)} failed")
    for e in errors[:5]:
        out(f"  {e[:300]}")


def _safe_job(job):
    try:
        _precompile_job(job)
    except Exception as e:  # noqa: BLE001 - reported here, and by the timing run itself
        return f"{job[:4]}: {type(e).__name__}: {e}"
    return None


def linear_section(clock, variants, shape, deadline, dry, eager=True):
    """FP8 linear forward + backward (weight gradient too) with its kernels broken out, and
    fp8_quant's quantize-transpose kernel alone at a few tile shapes."""
    tokens, hidden, mlp, device = shape
    out("\nfp8_linear (nn.Linear converted by FP8Linear.from_float, weight FP8 cached, no bias):")
    for k, n in [(hidden, mlp), (mlp, hidden)]:
        for label, fa in [*variants, ("bf16", None)] if eager else variants:
            if time.time() > deadline:
                out(f"  {k}->{n} {label}: skipped (time budget)")
                continue
            torch.manual_seed(0)
            lin = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
            mod = lin if fa is None else fa.FP8Linear.from_float(lin, op_config(fa, dry))
            x = _rand(tokens, k, device=device)
            r = _guard(
                f"  {k}->{n} {label}",
                lambda mod=mod, x=x: Measure(clock, mod, [x], [mod.weight]).all(),
            )
            if r is None:
                continue
            out(f"  {k}->{n} {label}: fwd+bwd {_fmt(r['step'])} fwd {_fmt(r['fwd'])} "
                f"bwd {_fmt(r['bwd'])} host f {_fmt(r['host_f'])} host b {_fmt(r['host_b'])} "
                f"gpu f {_fmt(r['gpu_f'])} gpu b {_fmt(r['gpu_b'])}")  # fmt: skip
            if fa is not None and label == "new":
                for tag, ks in (("fwd", r["kf"]), ("bwd", r["kb"])):
                    top = ks.most_common()
                    out(f"    {tag}: " + ", ".join(f"{a[:50]} {v:.4f}" for a, v in top))
    if dry or time.time() > deadline:
        out("  quantize-transpose tiles: skipped")
        return
    qtt = importlib.import_module("fp8_quant.ops.quantize_per_tensor_transpose")
    out("  fp8_quant quantize-transpose kernel alone (amax given), gpu ms and TB/s (4 B/elem):")
    for m_, n_ in [(tokens, hidden), (tokens, mlp)]:
        x = _rand(m_, n_, device=device)
        amax = x.abs().amax().float()
        q = torch.empty((m_, n_), device=device, dtype=torch.uint8)
        qt = torch.empty((n_, m_), device=device, dtype=torch.uint8)
        s = torch.empty((), device=device, dtype=torch.float32)
        res = []
        for bm, bn, w in QT_TILES:
            grid = (-(-m_ // bm) * -(-n_ // bn),)

            def run(bm=bm, bn=bn, w=w, grid=grid, x=x, q=q, qt=qt, amax=amax, s=s, m_=m_, n_=n_):
                qtt._per_tensor_transpose_kernel[grid](
                    x, q, qt, amax, s, m_, n_, x.stride(0), x.stride(1),
                    FMT="e4m3", HW_CAST=hw_cast_supported(x.device), BM=bm, BN=bn, num_warps=w,
                )  # fmt: skip

            t = clock.gpu(run)[0]
            res.append(f"{bm}x{bn}/{w}w {_fmt(t, 6)} {m_ * n_ * 4 / (t * 1e-3) / 1e12:.2f}")
        out(f"    {m_}x{n_}: " + "  ".join(res))


def host_profile(clock, fa, shape, names, calls=200, top=14):
    """cProfile of ``calls`` forwards and backwards (no sync): where the host time goes."""
    import cProfile
    import io
    import pstats

    for name in names:
        fn, make = op_table(fa, *shape, op_config(fa, clock.dry))[name]
        m = Measure(clock, fn, make())
        for tag, call in (("fwd", m.fwd), ("bwd", m.bwd_fn())):
            call()
            clock._sync()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                call()
            prof.disable()
            clock._sync()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime").print_stats(top)
            lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
            out(f"\nhost profile, {name} {tag}, {calls} calls (tottime s, cumtime s):")
            for ln in lines[-top - 1 :]:
                out("  " + ln.strip()[:150])


def run_pytest():
    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", tests]
    r = subprocess.run(cmd, capture_output=True, text=True)
    lines = r.stdout.strip().splitlines()
    for line in lines:
        if line.startswith(("FAILED", "ERROR")):
            out(line)
    out("pytest -m gpu: " + (lines[-1] if lines else r.stderr[-300:]))


def run_baseline(args, deadline: float) -> None:
    """This script on the package ``fp8_activations_base`` of ``args.baseline``, in a process
    whose PYTHONPATH starts with that folder; its tables print here as it goes."""
    path = os.path.abspath(args.baseline)
    if not os.path.isdir(os.path.join(path, "fp8_activations_base")):
        out(f"--baseline {args.baseline}: no package fp8_activations_base there (see --help)")
        return
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, os.path.abspath(__file__), "--package", "fp8_activations_base",
           "--label", "base", "--no-pytest", "--no-eager", "--ops", args.ops,
           "--deadline", str(deadline), "--workers", str(args.workers)]  # fmt: skip
    cmd += ["--no-linear"] * args.no_linear + ["--dry-run"] * args.dry_run
    out(f"\nbaseline: fp8_activations_base from {path} (its own process)")
    r = subprocess.run(cmd, env=env)
    if r.returncode:
        out(f"baseline run failed (exit {r.returncode})")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="folder holding the package fp8_activations_base")
    p.add_argument("--package", default="fp8_activations", help="the package measured")
    p.add_argument("--label", default="new", help="its name in the tables")
    p.add_argument("--no-eager", action="store_true", help="skip the eager BF16 rows")
    p.add_argument("--sweep", action="store_true", help="try the launch configs")
    p.add_argument("--no-pytest", action="store_true", help="skip pytest -m gpu")
    p.add_argument("--no-linear", action="store_true", help="skip the fp8_linear section")
    p.add_argument("--ops", default=",".join(BYTES), help="comma-separated op names")
    p.add_argument("--deadline", type=float, help="unix time to skip optional parts from")
    p.add_argument("--workers", type=int, default=8, help="processes compiling kernels first")
    p.add_argument("--precompile-only", action="store_true", help="compile, then exit")
    p.add_argument("--host-profile", default="", help="ops to cProfile on the host (comma list)")
    p.add_argument("--dry-run", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny")
    args = p.parse_args()
    deadline = args.deadline or time.time() + 200  # default: 200 s from now
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --dry-run: CPU under TRITON_INTERPRET=1, tiny shapes)")
    unknown = [n for n in args.ops.split(",") if n and n not in BYTES]
    if unknown:
        p.error(f"--ops: unknown {', '.join(unknown)}: choose from {', '.join(BYTES)}")
    if args.baseline and not os.path.isdir(args.baseline):
        p.error(f"--baseline {args.baseline}: no such folder")
    shape = (32, 64, 96, "cpu") if dry else (TOKENS, HIDDEN, MLP, "cuda")

    if not args.no_pytest and not dry and not args.precompile_only:
        run_pytest()
    import triton

    fa = importlib.import_module(args.package)
    variants = [(args.label, fa)]
    dev = "cpu (dry run)" if dry else torch.cuda.get_device_name()
    out(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {dev}, torch "
        f"{torch.__version__}, triton {triton.__version__}; tokens {shape[0]}, hidden "
        f"{shape[1]}, mlp {shape[2]}, bf16, 1x16 groups")  # fmt: skip
    if not dry and args.workers > 0:
        jobs = (variants, args.sweep, not args.no_linear, args.workers)
        _guard("precompile", lambda: precompile(*jobs))
    if args.precompile_only:
        return
    torch.manual_seed(0)
    clock = Clock(dry)
    eager = not args.no_eager
    report_ops(clock, variants, shape, [n for n in args.ops.split(",") if n], eager)
    if args.baseline:
        run_baseline(args, deadline)
    if args.sweep:
        sweep(clock, fa, shape, deadline)
    if not args.no_linear:
        linear_section(clock, variants, shape, deadline, dry, eager)
    if args.host_profile and time.time() < deadline:
        host_profile(clock, fa, shape, [n for n in args.host_profile.split(",") if n])
    out(f"done, {deadline - time.time():.0f} s of the budget left")


if __name__ == "__main__":
    main()
