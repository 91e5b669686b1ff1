"""Shared pytest setup for every package's tests.

GPU tests are marked ``gpu`` and skipped where CUDA is absent. Triton kernels run on CPU
through the interpreter: nox sets TRITON_INTERPRET=1 before anything imports triton. There
every load, store and atomic of a kernel is checked against the memory of the launch's tensor
arguments (``_bounds_guard``): on the CPU the interpreter works on the tensors' own memory,
so an access past a mask would corrupt the heap in silence, as it would a GPU's memory.
"""

import inspect
import os

import numpy as np
import pytest
import torch

# Kernels whose addresses come from a table of offsets (fp8-optim's multi-tensor AdamW) reach
# memory that is not among their arguments; the guard leaves those launches unchecked.
_TABLE_ARG = "table_ptr"


class _BoundsGuard:
    """Wraps Triton's interpreter: each launch notes the byte ranges its tensor arguments'
    views span; each masked load/store/atomic must fall inside one of them."""

    def __init__(self, interpreter):
        self.interpreter = interpreter
        self.launches = []  # (kernel name, [(start, end)] or None), innermost last

    def ranges(self, args):
        out = []
        stack = list(args)
        while stack:
            a = stack.pop()
            if isinstance(a, (tuple, list)):
                stack.extend(a)
            elif hasattr(a, "block_shape") and hasattr(a, "base"):  # a TensorDescriptor
                stack.append(a.base)
            elif isinstance(a, torch.Tensor) or hasattr(a, "data_ptr"):
                t = self.interpreter._unwrap_tensor(a)
                if t.numel():
                    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
                    out.append((t.data_ptr(), t.data_ptr() + span * t.element_size()))
        return out

    def check(self, kind, ptrs, mask):
        if not self.launches or self.launches[-1][1] is None:
            return
        name, ranges = self.launches[-1]
        p = np.asarray(ptrs.data).reshape(-1)
        if mask is not None:
            p = p[np.broadcast_to(np.asarray(mask.data, dtype=bool).reshape(-1), p.shape)]
        if not p.size:
            return
        size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        inside = np.zeros(p.shape, dtype=bool)
        for start, end in ranges:
            inside |= (p >= start) & (p + size <= end)
        if not inside.all():
            raise AssertionError(
                f"Triton kernel {name}: {int((~inside).sum())} of {p.size} addresses of {kind} "
                "lie outside its tensor arguments (a mask misses them)"
            )

    def install(self):
        executor, builder = self.interpreter.GridExecutor, self.interpreter.InterpreterBuilder
        call = executor.__call__
        load, store = builder.create_masked_load, builder.create_masked_store
        rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas
        guard = self

        def launch(executor_self, *args, **kwargs):
            fn = executor_self.fn
            name = getattr(fn, "__name__", repr(fn))
            table = _TABLE_ARG in inspect.signature(fn).parameters
            guard.launches.append((name, None if table else guard.ranges([args, kwargs])))
            try:
                return call(executor_self, *args, **kwargs)
            finally:
                guard.launches.pop()

        def masked_load(self, ptrs, mask, *rest, **kw):
            guard.check("a load", ptrs, mask)
            return load(self, ptrs, mask, *rest, **kw)

        def masked_store(self, ptrs, value, mask, *rest, **kw):
            guard.check("a store", ptrs, mask)
            return store(self, ptrs, value, mask, *rest, **kw)

        def atomic_rmw(self, op, ptr, val, mask, *rest, **kw):
            guard.check("an atomic", ptr, mask)
            return rmw(self, op, ptr, val, mask, *rest, **kw)

        def atomic_cas(self, ptr, cmp, val, *rest, **kw):
            guard.check("an atomic", ptr, None)
            return cas(self, ptr, cmp, val, *rest, **kw)

        executor.__call__ = launch
        builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
        builder.create_atomic_rmw, builder.create_atomic_cas = atomic_rmw, atomic_cas


_bounds_guard = None


def pytest_configure(config):
    global _bounds_guard
    if os.environ.get("TRITON_INTERPRET") == "1" and _bounds_guard is None:
        import triton.runtime.interpreter as interpreter

        _bounds_guard = _BoundsGuard(interpreter)
        _bounds_guard.install()
    _share_the_cores()


def _share_the_cores():
    """Under pytest-xdist each worker gets its share of the cores, not all of them: two workers
    of two threads each on 2 cores made the suite 1.3x slower (OpenMP threads spin-waiting for
    a core another worker holds). OMP_NUM_THREADS passes the share on to the processes the
    tests start; one set by the caller is kept."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
