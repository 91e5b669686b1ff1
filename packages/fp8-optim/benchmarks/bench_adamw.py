"""CoatAdamW step time, state bytes/param and update error against torch.optim.AdamW(fused=True)
(and bitsandbytes AdamW8bit / torchao AdamWFp8 when importable), on the 1.20 B-parameter
Llama-1B-shaped list (the COAT paper's optimizer benchmark shape): 16 layers, hidden 2048,
MLP 8192, vocab 32000, untied head, 147 fp32 tensors with fp32 gradients.

    pytest -o python_files='bench_*.py' --benchmark-only -s packages/fp8-optim/benchmarks

Step time is the median of ``triton.testing.do_bench`` (CUDA events, L2 flushed between
calls) of one ``optimizer.step()``, host overhead included. The table is printed at the end;
``BENCH_OUT=path.json`` also writes it as JSON. Targets (H200): <= 6.0 ms, <= 2.08 B/param.
"""

import json
import os
import statistics
import time

import pytest
import torch
from fp8_optim import CoatAdamW, CoatAdamWConfig
from fp8_optim.quality import update_errors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

RESULTS: dict[str, dict] = {}
HOST_MS: dict[int, float] = {}
# Launch shapes are swept by sweep_adamw_gpu.py; this file times the default one.


def llama_1b_shapes(layers=16, hidden=2048, mlp=8192, vocab=32000):
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4 + [(mlp, hidden)] * 2 + [(hidden, mlp)]
        shapes += [(hidden,), (hidden,)]
    return shapes + [(hidden,), (vocab, hidden)]


@pytest.fixture(scope="module")
def params():
    shapes = llama_1b_shapes()
    assert len(shapes) == 147
    gen = torch.Generator(device="cuda").manual_seed(0)
    ps = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen) * 0.02)
        p.grad = torch.randn(s, device="cuda", generator=gen) * 1e-3
        ps.append(p)
    yield ps
    _report()


def _n(ps):
    return sum(p.numel() for p in ps)


def _state_bytes(opt) -> int:
    return sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )


def _time(benchmark, opt) -> float:
    from triton.testing import do_bench

    opt.step()  # compiles, creates the state
    torch.cuda.synchronize()
    ms = do_bench(opt.step, warmup=25, rep=200, return_mode="median")
    host = []
    for _ in range(5):  # host time of step() alone (launches are asynchronous)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        host.append((time.perf_counter() - t0) * 1e3)
    HOST_MS[id(opt)] = statistics.median(host)

    def step_and_sync():
        opt.step()
        torch.cuda.synchronize()

    benchmark.pedantic(step_and_sync, rounds=10, iterations=1, warmup_rounds=1)
    return ms


def _record(name, opt, ms, ps, **extra):
    RESULTS[name] = dict(
        step_ms=round(ms, 3),
        host_ms=round(HOST_MS.get(id(opt), float("nan")), 3),
        state_bytes_per_param=_state_bytes(opt) / _n(ps),
        **extra,
    )


def test_copy_bandwidth(benchmark, params):
    # Device copy (read + write) of 4 GiB: the ceiling of a memory-bound step. CoatAdamW's
    # floor at fp32 params/grads: 16.08 bytes per parameter moved.
    from triton.testing import do_bench

    src = torch.empty(2**30, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    benchmark.pedantic(lambda: (dst.copy_(src), torch.cuda.synchronize()), rounds=5)
    tbps = 2 * src.numel() * 4 / ms / 1e9
    RESULTS["copy"] = dict(
        tb_per_s=round(tbps, 3), coat_floor_ms=round(16.08 * _n(params) / tbps / 1e9, 3)
    )


def test_step_torch_adamw_fused(benchmark, params):
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    _record("torch AdamW fused", opt, _time(benchmark, opt), params)


def test_step_coat_adamw(benchmark, params):
    from fp8_optim.ops import adamw

    opt = CoatAdamW(params, lr=1e-4)
    ms = _time(benchmark, opt)
    launch = adamw.current_launch()
    _record("CoatAdamW (E4M3+E4M3, DRE)", opt, ms, params, launch=str(launch))


def test_step_coat_adamw_e5m2_v(benchmark, params):
    opt = CoatAdamW(params, lr=1e-4, config=CoatAdamWConfig(v_format="e5m2"))
    _record("CoatAdamW (E4M3+E5M2, DRE)", opt, _time(benchmark, opt), params)


def test_step_coat_adamw_bf16_params(benchmark, params):
    # bf16 master weights and gradients, stochastic rounding: 2 + 2 + 2.08 B/param of
    # training state instead of 16.
    ps = []
    for p in params:
        q = torch.nn.Parameter(p.detach().to(torch.bfloat16))
        q.grad = p.grad.to(torch.bfloat16)
        ps.append(q)
    opt = CoatAdamW(ps, lr=1e-4)
    _record("CoatAdamW (bf16 params+grads, SR)", opt, _time(benchmark, opt), ps)


def test_step_coat_adamw_odd_tensor(benchmark, params):
    # The list plus one tensor whose size is not a multiple of 16 (a 50257-entry bias):
    # only that tensor's last chunk leaves the 16-byte-access kernel.
    odd = torch.nn.Parameter(torch.randn(50257, device="cuda") * 0.02)
    odd.grad = torch.randn_like(odd) * 1e-3
    ps = [*params, odd]
    opt = CoatAdamW(ps, lr=1e-4)
    _record("CoatAdamW (+ one 50257-entry tensor)", opt, _time(benchmark, opt), ps)


def test_step_coat_adamw_all_odd(benchmark, params):
    # Every chunk on the non-EVEN kernel (as if no gradient were aligned): the price of
    # unaligned or odd-sized tensors, for the record.
    opt = CoatAdamW(params, lr=1e-4)
    opt.step()
    for *_, plan in opt._plans.values():
        plan.grads_aligned = False
    _record("CoatAdamW (every chunk non-EVEN)", opt, _time(benchmark, opt), params)


def test_step_bitsandbytes_adamw8bit(benchmark, params):
    bnb = pytest.importorskip("bitsandbytes")
    opt = bnb.optim.AdamW8bit(params, lr=1e-4)
    _record("bitsandbytes AdamW8bit", opt, _time(benchmark, opt), params)


def test_step_torchao_adamw_fp8(benchmark, params):
    optim = pytest.importorskip("torchao.optim")
    opt = optim.AdamWFp8(params, lr=1e-4)
    _record("torchao AdamWFp8", opt, _time(benchmark, opt), params)


def _error_makers():
    makers = {
        "CoatAdamW E4M3+E4M3 DRE": lambda ps: CoatAdamW(ps, lr=1e-3, weight_decay=0.0),
        "CoatAdamW E4M3+E4M3 plain": lambda ps: CoatAdamW(
            ps, lr=1e-3, weight_decay=0.0, config=CoatAdamWConfig(m_dre=False, v_dre=False)
        ),
        "CoatAdamW E4M3+E5M2 DRE": lambda ps: CoatAdamW(
            ps, lr=1e-3, weight_decay=0.0, config=CoatAdamWConfig(v_format="e5m2")
        ),
        "CoatAdamW E4M3+E5M2 plain": lambda ps: CoatAdamW(
            ps,
            lr=1e-3,
            weight_decay=0.0,
            config=CoatAdamWConfig(v_format="e5m2", m_dre=False, v_dre=False),
        ),
    }
    try:
        import bitsandbytes as bnb

        makers["bitsandbytes AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(
            ps, lr=1e-3, weight_decay=0.0
        )
    except ImportError:
        pass
    try:
        from torchao.optim import AdamWFp8

        makers["torchao AdamWFp8"] = lambda ps: AdamWFp8(ps, lr=1e-3, weight_decay=0.0)
    except ImportError:
        pass
    return makers


def test_update_error_heavy_tailed(benchmark, params):
    # Mean over 100 steps of ||u - u_fp32|| / ||u_fp32|| on a 256 x 512 heavy-tailed stream.
    errors = {}

    def measure():
        for name, make in _error_makers().items():
            errors[name] = statistics.mean(update_errors(make, steps=100, device="cuda"))

    benchmark.pedantic(measure, rounds=1, iterations=1)
    RESULTS["update error (heavy-tailed stream)"] = {k: round(v, 5) for k, v in errors.items()}


def _report():
    if not RESULTS:
        return
    dev = torch.cuda.get_device_name()
    lines = [
        f"\nAdamW step, 1.20 B params in 147 tensors, on {dev} (torch {torch.__version__})",
        f"{'optimizer':40s} {'step ms':>9s} {'host ms':>9s} {'state B/param':>14s}",
    ]
    for name, r in RESULTS.items():
        if "step_ms" in r:
            lines.append(
                f"{name:40s} {r['step_ms']:9.3f} {r['host_ms']:9.3f} "
                f"{r['state_bytes_per_param']:14.4f}"
            )
    if "copy" in RESULTS:
        c = RESULTS["copy"]
        lines.append(f"copy {c['tb_per_s']} TB/s; 16.08 B/param floor: {c['coat_floor_ms']} ms")
    for name, r in RESULTS.items():
        if "launch" in r:
            lines.append(f"{name} launch: {r['launch']}")
    errs = RESULTS.get("update error (heavy-tailed stream)", {})
    if errs:
        lines.append("mean relative update error vs fp32 AdamW (heavy-tailed stream):")
        lines += [f"  {k:32s} {v:.5f}" for k, v in errs.items()]
    print("\n".join(lines))
    out = os.environ.get("BENCH_OUT")
    if out:
        with open(out, "w") as f:
            json.dump(dict(device=dev, torch=torch.__version__, results=RESULTS), f, indent=2)
