"""``launch(kernel, grid, *args, **meta)``: ``kernel[grid](*args, **meta)`` with less host time.

Triton's ``JITFunction.run`` spends several times the host time of the compiled kernel's own
launcher on every launch (binding keyword arguments, specializing every argument, building a
cache key from strings, asking torch for the current device and stream, checking globals;
``bench_llama_layer.py host`` of coat-models shows it). A COAT decoder layer makes 29
Triton launches per forward and backward (beside its 21 FP8 GEMMs and attention), and a
host-bound step waits for each of them.

Here the first launch of each *specialization* goes through ``kernel[grid]``, which compiles
(or finds) the kernel and returns it; later launches of the same specialization call its
launcher directly. The specialization key is what Triton specializes on, or finer: per
tensor argument its dtype and whether its address is 16-byte aligned; per integer whether it
is 1, a multiple of 16 and fits in 32 bits; the type of other arguments; the values of the
keyword arguments (constexprs and launch options). So a launch never runs a kernel compiled
for other arguments: at worst a key is finer than Triton's, and then Triton's own cache
answers the first call. The direct launch passes each tensor as its address (an int), which
spares the launcher two calls per tensor (``data_ptr()`` and a driver query).

The interpreter (``TRITON_INTERPRET=1``) takes the ordinary path on every call, and so does
a kernel whose first launch found Triton's launch hooks set (its profiler): set them before
the first launch to see every launch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
import triton

from .fp8_round import triton_interpreting

_INTERPRETING = triton_interpreting()
# (kernel, number of positional args, keyword items, device) -> [(arg keys, entry)]
_CACHE: dict[tuple, dict[tuple, tuple]] = {}
# Depth of ``ordinary_launches()`` contexts: while > 0, every launch is ``kernel[grid]``.
_ORDINARY = 0
# Depth of ``traced_launches()`` contexts: while > 0, every launch is ``wrap_triton``'s.
_TRACED = 0


@contextlib.contextmanager
def ordinary_launches():
    """Within this context every ``launch`` is ``kernel[grid](...)`` (Triton's own path; the
    direct launches' cache is neither read nor filled): to check that the fast path changes
    no bit, or to see every launch in a profiler hooked in later. Not thread-local."""
    global _ORDINARY
    _ORDINARY += 1
    try:
        yield
    finally:
        _ORDINARY -= 1


@contextlib.contextmanager
def traced_launches():
    """Within this context every ``launch`` goes through ``torch.library.wrap_triton``: the
    body of a ``torch.library.triton_op``, which ``torch.compile`` traces (the kernel then
    becomes part of the compiled graph) and runs eagerly otherwise. Not thread-local."""
    global _TRACED
    _TRACED += 1
    try:
        yield
    finally:
        _TRACED -= 1


@dataclasses.dataclass(frozen=True)
class Launcher:
    """One specialization's compiled launcher, as ``launch`` calls it: ``run(grid0, grid1,
    grid2, stream, function, packed, None, None, None, *args, *tail)`` starts the kernel,
    ``args`` being the positional arguments with each tensor as its address (an int).
    ``aligned[i]``: whether argument ``i`` is a tensor whose address the kernel was
    specialized as 16-byte aligned (another address must be so too to run it)."""

    run: Callable
    function: int
    packed: object
    tail: tuple
    aligned: tuple

    def __call__(self, grid: tuple[int, ...], stream: int, args) -> None:
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        self.run(grid[0], g1, g2, stream, self.function, self.packed, None, None, None,
                 *args, *self.tail)  # fmt: skip


@contextlib.contextmanager
def recorded_launches(record: Callable, during: Callable = contextlib.nullcontext):
    """Within this context every ``launch`` runs as usual, inside ``during()``, and then
    calls ``record(kernel, grid, args, meta, launcher)``: ``launcher`` is the ``Launcher``
    of the launch's specialization (cached by this launch if it was the first), or None
    where launches take Triton's own path (the interpreter, ``ordinary_launches``,
    ``traced_launches``, Triton's launch hooks set at the first launch). A record of the
    launches a step makes (coat_models' launch plans). Not thread-local."""
    global _dispatch
    real = _dispatch

    def dispatch(kernel, grid, args, meta, interpreting, cache):
        with during():
            real(kernel, grid, args, meta, interpreting, cache)
        launcher = None
        if not (interpreting or _ORDINARY or _TRACED):
            key, _ = _keys(args)
            site = (id(kernel), len(args), tuple(meta.items()), torch._C._cuda_getDevice())
            entry = cache.get(site, {}).get(key)
            if entry is not None:
                aligned = tuple(type(k) is tuple and k[1] is True and isinstance(k[0], torch.dtype)
                                for k in key)  # fmt: skip
                launcher = Launcher(*entry, aligned)
        record(kernel, grid, args, meta, launcher)

    _dispatch = dispatch
    try:
        yield
    finally:
        _dispatch = real


def launches_traced() -> bool:
    """Whether launches are ``wrap_triton``'s now (inside ``traced_launches()``)."""
    return _TRACED > 0


def scalar_out(device) -> torch.Tensor:
    """An uninitialized 0-dim fp32 tensor on ``device`` for a kernel to write (a scale).

    Traced (``traced_launches``), a 0-dim view of a 1-element buffer: Inductor lowers a
    0-dim ``empty`` as a kernel that writes zero into it (its allocation of a sized ``empty``
    launches nothing), one launch per scale, 25 per Llama decoder layer's forward and
    backward; eagerly a plain 0-dim tensor (one torch call less)."""
    if _TRACED:
        return torch.empty(1, device=device, dtype=torch.float32).view(())
    return torch.empty((), device=device, dtype=torch.float32)


def _keys(args) -> tuple[tuple, list]:
    """``(key, launch_args)``. The key, per argument: a tensor's dtype, 16-byte alignment and
    whether it is on a GPU; an int's == 1, multiple of 16 and 32-bit range; the type of
    anything else. ``launch_args``: ``args`` with each tensor replaced by its address, which
    the compiled launcher takes as is (given a tensor, it calls ``data_ptr()`` itself and
    asks the driver whether the address is a device one: two calls per tensor, 40 tensors
    in a multi-tensor cast; a tensor that is not on a GPU gets a key of its own, so it is
    refused by ``kernel[grid]`` as before). One loop, no call per argument but
    ``data_ptr()``: a launch has ~10-64 arguments. Ints are told first:
    ``isinstance(x, torch.Tensor)`` goes through the tensor metaclass's instance check,
    several times slower for an int than ``type(x) is int``."""
    key, out = [], []
    add_key, add_arg = key.append, out.append
    for a in args:
        if type(a) is int:
            add_key((a == 1, not a & 15, -2147483648 <= a <= 2147483647))
            add_arg(a)
        elif isinstance(a, torch.Tensor):
            ptr = a.data_ptr()
            add_key((a.dtype, not ptr & 15, a.is_cuda))
            add_arg(ptr)
        else:
            add_key(type(a))
            add_arg(a)
    return tuple(key), out


def _hook_set(hook) -> bool:
    # Triton 3.6+ keeps launch hooks in always-present chains (empty: no hook).
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set() -> bool:
    rt = triton.knobs.runtime
    return _hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook)


def launch(kernel, grid: tuple[int, ...], *args, **meta) -> None:
    """Launch the ``@triton.jit`` ``kernel`` on ``grid`` (a tuple of 1 to 3 ints) with
    positional ``args`` (tensors, ints, floats, bools) and keyword ``meta`` (constexprs and
    launch options such as ``num_warps``): the same kernel and bits as
    ``kernel[grid](*args, **meta)``. Launches on the current device's current stream."""
    _dispatch(kernel, grid, args, meta, _INTERPRETING, _CACHE)


def _dispatch(kernel, grid, args: tuple, meta: dict, interpreting: bool, cache: dict) -> None:
    """``launch``'s body, with whether the interpreter runs and the direct launches' cache
    passed in (a test drives the direct path on CPU with a stand-in kernel and its own
    cache; ``launch`` passes the module's)."""
    if _TRACED:
        torch.library.wrap_triton(kernel)[grid](*args, **meta)
        return
    if interpreting or _ORDINARY:
        kernel[grid](*args, **meta)
        return
    device = torch._C._cuda_getDevice()
    # id(): kernels are module-level objects; hashing a JITFunction hashes its source key.
    site = (id(kernel), len(args), tuple(meta.items()), device)
    entries = cache.get(site)
    key, direct_args = _keys(args)
    entry = None if entries is None else entries.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **meta)
        if compiled is not None and not _hooks_set():
            names = [p.name for p in kernel.params][len(args) :]
            defaults = {p.name: p.default for p in kernel.params}
            tail = tuple(meta[n] if n in meta else defaults[n] for n in names)
            cache.setdefault(site, {})[key] = (
                compiled.run, compiled.function, compiled.packed_metadata, tail
            )  # fmt: skip
        return
    run, function, packed, tail = entry
    stream = torch._C._cuda_getCurrentRawStream(device)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    run(grid[0], g1, g2, stream, function, packed, None, None, None, *direct_args, *tail)
