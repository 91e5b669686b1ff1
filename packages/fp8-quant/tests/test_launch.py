"""``ops.launch``: after the first launch of a specialization, later launches call the
compiled kernel's launcher directly; anything Triton specializes on (dtype, 16-byte
alignment, an integer being 1, a multiple of 16 or past 32 bits, constexpr values) gets a
launch through ``kernel[grid]`` first. On CPU with a stand-in kernel (the interpreter never
takes the direct path); the GPU tests run every kernel through it."""

from __future__ import annotations

import inspect

import pytest
import torch
import triton
from fp8_quant.ops import _launch


class _Param:
    def __init__(self, p: inspect.Parameter):
        self.name, self.default = p.name, p.default


class FakeKernel:
    """Records how each launch went: ``("jit", grid, args, meta)`` through ``kernel[grid]``,
    ``("direct", grid, stream, args)`` through the compiled kernel's launcher."""

    def __init__(self):
        def signature(X, Y, n, eps, BLOCK: int, FLAG: bool = True):  # noqa: N803
            pass

        self.params = [_Param(p) for p in inspect.signature(signature).parameters.values()]
        self.log = []
        self.cache = {}  # the direct launches' cache of this kernel's tests

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.log.append(("jit", grid, args, meta))
            compiled = type("Compiled", (), {})()
            compiled.function, compiled.packed_metadata = "fn", "meta"
            compiled.run = lambda *a: self.log.append(("direct", a[:3], a[3], a[9:]))
            return compiled

        return run


@pytest.fixture
def kernel(monkeypatch):
    # torch's CUDA device and stream queries, answered on CPU.
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234, raising=False)
    return FakeKernel()


def launch(kernel: FakeKernel, grid, *args, **meta) -> None:
    """``_launch.launch`` as it runs on a GPU (not interpreting), with ``kernel``'s own
    cache."""
    _launch._dispatch(kernel, grid, args, meta, False, kernel.cache)


def test_ordinary_launches_context(kernel):
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    launch(kernel, (1,), x, y, 4096, 1e-6, BLOCK=64)
    with _launch.ordinary_launches(), _launch.ordinary_launches():
        launch(kernel, (1,), x, y, 4096, 1e-6, BLOCK=64)  # cached, yet kernel[grid]
        with pytest.raises(RuntimeError):
            with _launch.ordinary_launches():
                raise RuntimeError  # the context unwinds on errors too
        launch(kernel, (1,), x, y, 4096, 1e-6, BLOCK=64)
    launch(kernel, (1,), x, y, 4096, 1e-6, BLOCK=64)
    assert [e[0] for e in kernel.log] == ["jit", "jit", "jit", "direct"]
    assert _launch._ORDINARY == 0


def test_traced_launches_context(kernel, monkeypatch):
    """Inside ``traced_launches`` (a triton_op's body) every launch goes through
    ``torch.library.wrap_triton``, which torch.compile traces, cached or not; the context
    nests and unwinds on errors, and afterwards launches take the direct path again."""
    wrapped = []

    def wrap_triton(k):
        wrapped.append(k)
        return k

    monkeypatch.setattr(torch.library, "wrap_triton", wrap_triton)
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    launch(kernel, (1,), x, y, 4096, 1e-6, BLOCK=64)
    with _launch.traced_launches(), _launch.traced_launches():
        launch(kernel, (1,), x, y, 4096, 1e-6, BLOCK=64)  # cached, yet wrapped
        with pytest.raises(RuntimeError):
            with _launch.traced_launches():
                raise RuntimeError
        launch(kernel, (1,), x, y, 4096, 1e-6, BLOCK=64)
    launch(kernel, (1,), x, y, 4096, 1e-6, BLOCK=64)
    assert [e[0] for e in kernel.log] == ["jit", "jit", "jit", "direct"]
    assert wrapped == [kernel, kernel] and _launch._TRACED == 0


def test_direct_after_first_launch(kernel):
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    launch(kernel, (3,), x, y, 4096, 1e-6, BLOCK=64, num_warps=4)
    launch(kernel, (5, 2), x, y, 4096, 1e-5, BLOCK=64, num_warps=4)
    assert [e[0] for e in kernel.log] == ["jit", "direct"]
    # Grid padded to three dims, the current stream, every argument in signature order:
    # positional ones (tensors as their addresses, which the launcher takes as they are),
    # then the constexprs (FLAG from its default).
    want = (x.data_ptr(), y.data_ptr(), 4096, 1e-5, 64, True)
    assert kernel.log[1] == ("direct", (5, 2, 1), 1234, want)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda x, y, n: (x[1:], y, n), id="unaligned-tensor"),
        pytest.param(lambda x, y, n: (x.double(), y, n), id="dtype"),
        pytest.param(lambda x, y, n: (x, y, 1), id="int-is-1"),
        pytest.param(lambda x, y, n: (x, y, 4097), id="int-not-multiple-of-16"),
        pytest.param(lambda x, y, n: (x, y, 2**33), id="int-past-32-bits"),
    ],
)
def test_new_specialization_goes_through_triton(kernel, change):
    x, y = torch.zeros(64), torch.zeros(64)
    launch(kernel, (1,), x, y, 4096, 0.5, BLOCK=64)
    launch(kernel, (1,), *change(x, y, 4096), 0.5, BLOCK=64)
    launch(kernel, (1,), x, y, 4096, 0.5, BLOCK=128)  # another constexpr value
    assert [e[0] for e in kernel.log] == ["jit", "jit", "jit"]


class _OnGPU(torch.Tensor):
    """A CPU tensor that says it is on a GPU: what a launch saw first, before a CPU one."""

    @property
    def is_cuda(self):
        return True


def test_a_cpu_tensor_after_gpu_ones_goes_through_triton(kernel):
    """The direct launch passes addresses, which the launcher cannot check: a tensor that is
    not on a GPU gets a specialization of its own, so ``kernel[grid]`` sees it (and refuses
    it on a GPU build) instead of a kernel reading a host address."""
    x, y = torch.zeros(64), torch.zeros(64)
    gx, gy = x.as_subclass(_OnGPU), y.as_subclass(_OnGPU)
    launch(kernel, (1,), gx, gy, 4096, 0.5, BLOCK=64)
    launch(kernel, (1,), gx, gy, 4096, 0.5, BLOCK=64)
    launch(kernel, (1,), x, gy, 4096, 0.5, BLOCK=64)
    assert [e[0] for e in kernel.log] == ["jit", "direct", "jit"]


def test_hooks_keep_every_launch_on_triton(kernel, monkeypatch):
    rt = triton.knobs.runtime
    hook = rt.launch_enter_hook
    if hasattr(hook, "calls"):  # Triton 3.6+: a chain of hooks
        monkeypatch.setattr(hook, "calls", [print])
    else:
        monkeypatch.setattr(rt, "launch_enter_hook", print)
    x = torch.zeros(64)
    for _ in range(3):
        launch(kernel, (1,), x, x, 16, 0.5, BLOCK=64)
    assert [e[0] for e in kernel.log] == ["jit", "jit", "jit"]


def test_scalar_out_is_sized_when_traced():
    """``scalar_out``: a 0-dim fp32 tensor; inside ``traced_launches`` a view of a 1-element
    buffer (Inductor writes zero into a 0-dim ``empty`` with a kernel of its own, one per
    scale), so the per-tensor quantizers give the same bits either way."""
    from fp8_quant import FP8Format
    from fp8_quant.ops import quantize_per_tensor, quantize_per_tensor_transpose

    plain = _launch.scalar_out("cpu")
    assert plain.shape == () and plain.dtype == torch.float32 and plain._base is None
    with _launch.traced_launches():
        traced = _launch.scalar_out("cpu")
    assert traced.shape == () and traced.dtype == torch.float32
    assert traced._base is not None and traced._base.shape == (1,)
    if not _launch._INTERPRETING:
        return  # the quantizers run on CPU under the interpreter only
    x = torch.randn(48, 80) * 3
    want = [
        quantize_per_tensor(x, FP8Format.E4M3),
        quantize_per_tensor_transpose(x, FP8Format.E4M3),
    ]
    with _launch.traced_launches():  # wrap_triton runs the kernels eagerly here
        got = [
            quantize_per_tensor(x, FP8Format.E4M3),
            quantize_per_tensor_transpose(x, FP8Format.E4M3),
        ]
    for a, b in zip(want, got, strict=True):
        assert all(
            torch.equal(
                p.view(torch.uint8) if p.dim() else p, q.view(torch.uint8) if q.dim() else q
            )
            for p, q in zip(a, b, strict=True)
        )
        assert b[-1].shape == ()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_launch_goes_direct_through_the_module_cache(monkeypatch):
    """On a GPU, ``launch`` fills the module's cache at a specialization's first launch and
    later launches skip ``kernel[grid]``, with the reference's bits."""
    import importlib

    from fp8_quant import reference

    module = importlib.import_module("fp8_quant.ops.tensor_amax_multi")
    kernel = module._multi_amax_kernel
    through_triton = []
    real = type(kernel).__getitem__

    def getitem(self, grid):
        through_triton.append(self)
        return real(self, grid)

    monkeypatch.setattr(type(kernel), "__getitem__", getitem)
    xs = [torch.randn(n, device="cuda") for n in (1000, 4096, 3, 77)]  # (3 take 3 slots)
    module.tensor_amax_multi(xs)  # compiles or finds the kernel, fills the cache
    assert any(site[0] == id(kernel) for site in _launch._CACHE)
    before = len(through_triton)
    got = module.tensor_amax_multi(xs)
    assert len(through_triton) == before  # the direct launch
    assert all(torch.equal(a, b) for a, b in zip(got, reference.tensor_amax_multi(xs), strict=True))


def test_recorded_launches_hand_over_the_launcher_they_went_through(kernel):
    """``recorded_launches``: each launch runs inside ``during`` and is then recorded with
    its specialization's ``Launcher`` (the first launch of one too: it compiled and cached
    it); the Launcher starts the same call from addresses, and says which tensors were
    specialized as 16-byte aligned."""
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    seen, depth = [], []

    class During:
        def __enter__(self):
            depth.append(1)

        def __exit__(self, *exc):
            depth.pop()

    def record(k, grid, args, meta, launcher):
        assert not depth  # after the launch, outside `during`
        seen.append((k, grid, args, meta, launcher))

    with _launch.recorded_launches(record, During):
        launch(kernel, (3,), x, y, 4096, 1e-6, BLOCK=64)
        launch(kernel, (5, 2), x, y[1:], 4096, 1e-5, BLOCK=64)  # y unaligned: jit again
        launch(kernel, (5, 2), x, y, 4096, 1e-5, BLOCK=64)
    launch(kernel, (1,), x, y, 4096, 1e-6, BLOCK=64)  # outside: not recorded
    assert [e[0] for e in kernel.log] == ["jit", "jit", "direct", "direct"]
    assert len(seen) == 3 and all(s[0] is kernel for s in seen)
    first, unaligned, direct = (s[4] for s in seen)
    assert first.aligned == (True, True, False, False) and first == direct
    assert unaligned.aligned == (True, False, False, False)
    kernel.log.clear()
    direct((7,), 99, [x.data_ptr(), y.data_ptr(), 4096, 1e-5])
    want = (x.data_ptr(), y.data_ptr(), 4096, 1e-5, 64, True)
    assert kernel.log == [("direct", (7, 1, 1), 99, want)]
    assert _launch._dispatch.__name__ == "_dispatch"  # restored
