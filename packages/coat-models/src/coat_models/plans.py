"""Launch plans: a COAT decoder layer's training step replayed from a record of its kernels.

Eagerly, most of a COAT layer's host time goes to Python, autograd, allocations and views
around its ~30 Triton launches and 21 FP8 GEMMs; at a few thousand tokens per GPU the GPU
then waits for the host. CUDA graphs (``graphs``) remove that host time but need inputs and
parameters at fixed addresses. A launch plan removes most of it and takes each call's
tensors where they are: with ``enable_launch_plans(model)`` the first training forward of a
COAT layer at a new key (the shapes, strides and dtypes of its input, RoPE tables and
parameters, which of them require grad, the layer's FP8 config) records one forward +
backward of the layer on stand-ins (every ATen op below autograd and every Triton launch, in
order) and turns the record into a plan:

* buffers the step allocates and does not hand out get fixed addresses: those backward reads
  in an arena of the layer's own, the others (temporaries of one direction) in one scratch
  buffer per device, packed by lifetime; their views are made once; the zero-filled ones
  (the kernels' counters) get bytes of their own, zeroed by one fill as each forward starts;
* views, detaches and those allocations (the zero-filled ones too) are dropped; every other
  ATen op (the GEMMs, attention and its backward, small reductions) is called again, the
  same overload with the same arguments; each Triton launch goes straight to the compiled
  launcher that its eager launch found, with the arguments' addresses;
* the layer input, RoPE tables, attention mask (a padded batch's; a mask is part of the key,
  so a step without one has a plan of its own), parameters and incoming gradient are the
  call's own tensors (their addresses may change between calls), as are the outputs of the
  ops called again; the output, input gradient and parameter gradients are fresh tensors
  each call.

Later calls at that key run the plan in one autograd node: the same kernels on the same
arguments in the same order, so the eager path's bits (as under CUDA graphs, the layer
output carries no FP8 hand-over; the next layer quantizes it itself, to the same bits). A
call a plan does not cover runs eagerly:

* a KV cache holding tokens, extra attention keywords, gradient checkpointing, RoPE tables
  or an attention mask that require grad, ``torch.compile`` tracing;
* a key past the ``max_plans_per_layer`` keys the layer tried (8 by default; each plan
  keeps an arena): the first such call adds one refusal line per layer, and warns;
* a forward while the layer's previous planned forward still waits for its backward (the
  arena holds that step's saved activations); a backward whose arena was overwritten since
  (``retain_graph=True`` and a later forward) raises, as does a second backward of one
  planned step (``retain_graph=True``);
* a record that reads a tensor from outside the step (a Python-side cache, a constant made
  before it), or that no replay on its own inputs reproduces bit for bit in 3 tries (a
  kernel the record missed: each check starts from 0xFF bytes in all the memory the step
  allocates, 0x7F in its zero-filled buffers, so a missed write or fill shows even where
  that memory held the right values), is not
  turned into a plan: the layer stays eager at that key, and ``launch_plan_refusals(model)``
  says why. CUDA's attention backwards add dQ up with atomics, so their results may differ
  from run to run: the check's replays compare their floating-point inputs with the
  recorded ones bit for bit and take their recorded results (they are ATen ops the plan
  calls again; no missed kernel hides in them). Any other nondeterministic kernel can make
  one replay differ: one equal replay of up to 3 suffices (those that differed first are
  counted in ``launch_plan_check_retries(model)``; with deterministic algorithms on, one
  replay is all).

``torch.save(model)`` and ``copy.deepcopy(model)`` give a model without plans (the COAT
layers' pickling leaves them out), which runs eagerly until ``enable_launch_plans`` is called
on it.

The FP8 weight cache must be off (``FP8ActivationConfig(weight_cache=False)``): whether a
weight is cast is a Python-side decision a record cannot hold. The arenas stay allocated
between steps (CUDA graphs' memory pool does the same); ``disable_launch_plans(model)`` frees
them. Recording patches ``fp8_quant.ops``' launcher for its duration: not thread-safe.
Under FSDP2 (parameters gathered at other addresses each time) and DDP (gradients reduced
by hooks on the parameters) plans are tested bit for bit against eager under the same
wrapper: on two CPU ranks (the reference kernels), in one process on CPU (Triton's
interpreter) and on one GPU rank.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
import weakref

import torch
from fp8_quant.ops import launch, recorded_launches, triton_interpreting
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Allocation ops: their output is a buffer the plan places itself (no op called again).
_ALLOCS = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_like.default,
        aten.empty_strided.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
    }
)
# Ops whose results may differ from run to run (CUDA's attention backwards add dQ up with
# atomics): the check's replays compare their floating-point inputs with the recorded ones
# and take their recorded results (see _replay_differs).
_NONDETERMINISTIC = frozenset(
    getattr(aten, name)
    for name in (
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention_backward",
        "_flash_attention_backward",
        "_efficient_attention_backward",
    )
    if hasattr(aten, name)
)
# The public bindings of ops a plan calls again: each takes the overload's arguments and runs
# that overload, and parses them faster than the overload's schema-driven call (on a CPU: an
# empty with keyword dtype and device 7.3 us against 20.4, amax 4.6 against 8.0, a small
# _scaled_mm 43 against 59). Other ops are called through the overload's C++ handle
# (``_op``, what ``OpOverload.__call__`` calls).
_PUBLIC = {
    aten.empty.memory_format: torch.empty,
    aten.empty_strided.default: torch.empty_strided,
    aten.empty_like.default: torch.empty_like,
    aten.zeros.default: torch.zeros,
    aten.amax.default: torch.amax,
    aten.mm.default: torch.mm,
    aten._scaled_mm.default: torch._scaled_mm,
    aten._scaled_dot_product_flash_attention.default: torch._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention.default: (
        torch._scaled_dot_product_efficient_attention
    ),
    aten._scaled_dot_product_cudnn_attention.default: torch._scaled_dot_product_cudnn_attention,
}
# Ops that allocate a buffer of zeros (the kernels' counters and maxima): the plan places the
# buffer itself and zeroes all of them with one fill at the start of the step.
_ZEROS = frozenset({aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default})
_ALIGN = 256  # arena offsets: the caching allocator's alignment (Triton specializes on 16)

_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PLANS = "_coat_launch_plans"  # on each layer: key -> _Plan or the reason there is none
_OWNER = "_coat_plan_owner"  # on each layer: a weak reference to the model its state is on
# What a layer holds for its plans: not copied by pickling or deepcopy (the COAT layer's
# __reduce_ex__ leaves these out, as graphs.LAYER_KEYS): a copy runs eagerly until plans are
# enabled on it.
LAYER_KEYS = (_PLANS, _OWNER)


class _NoPlan(Exception):
    """A record that cannot be replayed; the message says why."""


# ------------------------------------------------------------------------------ recording
def _interpreted(device: torch.device) -> bool:
    """Whether launches on ``device`` go through Triton's own path (its interpreter)."""
    return triton_interpreting() or device.type != "cuda"


def _base_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _view_meta(t: torch.Tensor) -> tuple:
    return (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class _Recorder(TorchDispatchMode):
    """Describes every ATen op below autograd as it runs (and every Triton launch, through
    ``_recording_launches``), by the storages it reads and writes: no tensor of the step is
    kept alive by the record. Each storage is a buffer: an input (given per call), the output
    of an op called again (per call), or allocated by the step (``"alloc"``, and ``"zeros"``
    for a zero-filled one: placed by the plan, or per call where it is handed out). A
    storage freed and reused by a later allocation is a new buffer from there on. Ops run
    inside a launch (the interpreter's own) are not recorded."""

    def __init__(self, interpreted: bool):
        super().__init__()
        self.interpreted = interpreted  # launches through Triton's own path (no launcher)
        self.phase = "fwd"
        self.quiet = 0
        self.program: dict[str, list] = {"fwd": [], "bwd": []}
        self.by_ptr: dict[int, int] = {}
        self.kind: list[str] = []  # "in", "op", "alloc" or "zeros"
        self.nbytes: list[int] = []
        self.first: list[str] = []  # the phase that made it ("in" for inputs)
        self.phases: list[set] = []  # the phases that read or write it
        self.meta: list[tuple] = []  # the view its producer (or the caller) gave
        self.start: list[int] = []  # index of the op that made it, in its phase
        self.last: list[int] = []  # index of the last op of its phase that used it
        # (phase, op index) -> a nondeterministic op's float inputs and results (copies)
        self.kept: dict[tuple, tuple[list, list]] = {}

    def add(self, t: torch.Tensor, kind: str, phase: str) -> int:
        b = len(self.kind)
        self.by_ptr[_base_ptr(t)] = b
        self.kind.append(kind)
        self.nbytes.append(t.untyped_storage().nbytes())
        self.first.append(phase)
        self.phases.append(set())
        self.meta.append(_view_meta(t))
        self.start.append(len(self.program.get(phase, ())))
        self.last.append(self.start[-1])
        return b

    def ref(self, t: torch.Tensor, phase: str):
        if t.untyped_storage().nbytes() == 0:  # (no data: address 0, shared by all such)
            return ("k", torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device))
        b = self.by_ptr.get(_base_ptr(t))
        if b is not None and self.nbytes[b] != t.untyped_storage().nbytes():
            b = None  # a storage made outside the step at a freed buffer's address
        if b is None:
            raise _NoPlan(
                f"the step reads a {tuple(t.shape)} {t.dtype} tensor made outside it (a "
                "Python-side cache or constant)"
            )
        self.phases[b].add(phase)
        if phase in self.program:
            self.last[b] = len(self.program[phase])
        return ("t", b, _view_meta(t))

    def describe(self, value, phase: str):
        if isinstance(value, torch.Tensor):
            return self.ref(value, phase)
        if isinstance(value, (list, tuple)):
            return ("seq", type(value), [self.describe(v, phase) for v in value])
        return ("lit", value)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.quiet or func.is_view:
            # A view is metadata: its consumers are described by its buffer and view.
            return out
        phase = self.phase
        described = (self.describe(list(args), phase),
                     {k: self.describe(v, phase) for k, v in kwargs.items()})  # fmt: skip
        outs = out if isinstance(out, (list, tuple)) else [out]
        rets = func._schema.returns
        if len(rets) == 1 and str(rets[0].type) in ("List[Tensor]", "Tensor[]"):  # _foreach_norm
            rets = rets * len(outs)
        if len(outs) > len(rets):
            raise _NoPlan(f"{func} returned more than its schema says")
        produced = []
        for ret, o in zip(rets, outs, strict=False):
            if (
                isinstance(o, torch.Tensor)
                and ret.alias_info is None
                and o.untyped_storage().nbytes()
            ):
                kind = "alloc" if func in _ALLOCS else "zeros" if func in _ZEROS else "op"
                produced.append(self.add(o, kind, phase))
            else:
                produced.append(None)  # in place, a view, or no data: no new buffer
        seq = isinstance(out, (list, tuple))
        if func.overloadpacket in _NONDETERMINISTIC:
            self.kept[(phase, len(self.program[phase]))] = (
                [_kept_copy(a) for a in _float_inputs((args, kwargs))],
                [o.clone() if isinstance(o, torch.Tensor) else None for o in outs],
            )
        self.program[phase].append(("op", func, described, produced, seq))
        return out

    def launch(self, kernel, grid, args, meta, launcher) -> None:
        phase = self.phase
        described = [self.describe(a, phase) for a in args]
        self.program[phase].append(("launch", kernel, tuple(grid), described, dict(meta), launcher))


def _recording_launches(rec: _Recorder):
    """``recorded_launches`` adding each launch to ``rec`` (the ops a launch runs itself,
    the interpreter's, are not recorded)."""

    @contextlib.contextmanager
    def quietly():
        rec.quiet += 1
        try:
            yield
        finally:
            rec.quiet -= 1

    def record(kernel, grid, args, meta, launcher):
        if launcher is None and not rec.interpreted:
            raise _NoPlan(f"a launch of {kernel} went through Triton's own path (launch hooks?)")
        rec.launch(kernel, grid, args, meta, launcher)

    return recorded_launches(record, quietly)


def _record(body, inputs: dict, params: list, grad: torch.Tensor) -> tuple:
    """Run ``body(**inputs)`` (one output tensor) and its backward under the recorder.
    ``inputs``: name -> tensor (their gradients are asked for where they require grad);
    ``params``: the parameters' stand-ins (leaves sharing the parameters' storage);
    ``grad``: the incoming gradient (made before). Returns ``(recorder, names, escaping)``:
    names of the inputs' buffers (``param<i>`` for the parameters, ``grad``) and the
    descriptions of what the step hands out (``out``, ``d<input name>``)."""
    rec = _Recorder(_interpreted(grad.device))
    names = {}
    for name, t in [
        *inputs.items(),
        ("grad", grad),
        *((f"param{i}", p) for i, p in enumerate(params)),
    ]:
        if _base_ptr(t) in rec.by_ptr:
            raise _NoPlan(f"{name} shares its storage with another input or parameter")
        names[name] = rec.add(t, "in", "in")
    wrt = {n: t for n, t in inputs.items() if t.requires_grad}
    wrt.update((f"param{i}", p) for i, p in enumerate(params) if p.requires_grad)
    with _recording_launches(rec), rec:
        out = body(**inputs)
        if not out.requires_grad:
            raise _NoPlan("nothing in the step requires grad")
        rec.phase = "bwd"
        grads = torch.autograd.grad(out, list(wrt.values()), grad, allow_unused=True)
        rec.phase = "out"
        escaping = {"out": rec.ref(out, "out")}
        results = {"out": out.detach()}
        for name, g in zip(wrt, grads, strict=True):
            escaping["d" + name] = None if g is None else rec.ref(g, "out")
            results[name] = g
    return rec, names, escaping, results


# ------------------------------------------------------------------------------ the plan
def _pack(sizes: dict[int, int], spans: dict[int, tuple[int, int]]) -> tuple[dict, int]:
    """Offsets for buffers live over ``spans`` (first, last op index, inclusive), two
    buffers sharing bytes only where their spans do not meet: ``({buffer: offset}, total)``."""
    placed: list[tuple[int, int, int, int]] = []  # (offset, end offset, first, last)
    offsets, total = {}, 0
    for b in sorted(sizes, key=lambda b: (spans[b][0], -sizes[b])):
        size = -(-sizes[b] // _ALIGN) * _ALIGN
        first, last = spans[b]
        busy = sorted((o, e) for o, e, f, l_ in placed if not (l_ < first or last < f))
        offset = 0
        for o, e in busy:
            if offset + size <= o:
                break
            offset = max(offset, e)
        placed.append((offset, offset + size, first, last))
        offsets[b] = offset
        total = max(total, offset + size)
    return offsets, total


class _Plan:
    """A recorded layer step: ``forward(inputs, params) -> (out, saved)`` and
    ``backward(saved, grad) -> {name: gradient}``. ``scratch_bytes`` is what it needs of the
    model's shared scratch buffer, given by ``place(scratch)`` before the first call."""

    def __init__(self, rec: _Recorder, names: dict, escaping: dict, device):
        self.device, self.names, self.escaping = device, names, escaping
        self.interpreted = rec.interpreted
        self.meta = rec.meta
        escaped = {d[1] for d in escaping.values() if d is not None and d[0] == "t"}
        kind, phases = rec.kind, rec.phases
        placed = ("alloc", "zeros")
        self.per_call = {b for b, k in enumerate(kind) if k not in placed or b in escaped}
        # What backward reads of the inputs and of forward's per-call buffers: saved by ctx.
        self.saved = sorted(
            b for b in self.per_call
            if "bwd" in phases[b] and rec.first[b] in ("in", "fwd") and b != names["grad"]
        )  # fmt: skip
        # The step's own buffers: those backward reads in the layer's arena, the others
        # (temporaries of one direction) in the shared scratch, packed by lifetime.
        # The zero-filled buffers get bytes of their own, all zeroed by one fill as each
        # forward starts (those of the backward too: nothing else writes them in between).
        arena, scratch, spans, zeroed = {}, {}, {}, {}
        for b, k in enumerate(kind):
            if k not in placed or b in self.per_call:
                continue
            if k == "zeros":
                zeroed[b] = rec.nbytes[b]
                continue
            used = phases[b] | {rec.first[b]}
            if used == {rec.first[b]}:
                scratch[b] = rec.nbytes[b]
                base = 0 if rec.first[b] == "fwd" else len(rec.program["fwd"])
                spans[b] = (base + rec.start[b], base + rec.last[b])
            else:
                arena[b] = rec.nbytes[b]
        self.arena_offsets, arena_total = _pack(arena, {b: (0, 0) for b in arena})
        self.scratch_offsets, self.scratch_bytes = _pack(scratch, spans)
        self.arena = torch.empty(arena_total, dtype=torch.uint8, device=device)
        self.zeroed_offsets, zeroed_total = _pack(zeroed, {b: (0, 0) for b in zeroed})
        self.zeroed = torch.empty(zeroed_total, dtype=torch.uint8, device=device)
        self.program = rec.program
        self.fwd = self.bwd = None  # made by place()
        self.gen = 0  # forwards run; a backward checks that its own is the last
        self.pending = None  # weakref to the output of a forward whose backward has not run
        # What the check's replays change (_replay_differs): each per-call allocation starts
        # as 0xFF bytes; each nondeterministic op, given the recorded inputs (else the check
        # notes it in ``diverged``), hands on the recorded results (kept).
        self.checking, self.kept, self.diverged = False, rec.kept, None

    def place(self, scratch: torch.Tensor) -> None:
        """Make the static views on the arena and ``scratch`` and compile both directions."""
        self.scratch, self.static = scratch, {}
        for b, off in self.arena_offsets.items():
            self.static[b] = (self.arena, off)
        for b, off in self.zeroed_offsets.items():
            self.static[b] = (self.zeroed, off)
        for b, off in self.scratch_offsets.items():
            self.static[b] = (scratch, off)
        self.fwd = [self._compile(op, ("fwd", i)) for i, op in enumerate(self.program["fwd"])]
        self.bwd = [self._compile(op, ("bwd", i)) for i, op in enumerate(self.program["bwd"])]

    # ---- argument getters: ("c", value) constant, ("v", buffer, meta) per call, ("s", ...)
    def _static_view(self, b: int, meta: tuple) -> torch.Tensor:
        base, off = self.static[b]
        offset, shape, stride, dtype = meta
        start = off + offset * dtype.itemsize
        if start % dtype.itemsize:
            raise _NoPlan(f"a {dtype} view at an odd byte offset")
        flat = base.view(dtype) if base.dtype is not dtype else base
        return flat.as_strided(shape, stride, start // dtype.itemsize)

    def _getter(self, d, for_launch: bool):
        kind = d[0]
        if kind == "k":  # an empty tensor
            return ("c", d[1].data_ptr() if for_launch and not self.interpreted else d[1])
        if kind == "t":
            _, b, meta = d
            if b in self.static:
                view = self._static_view(b, meta)
                return ("c", view.data_ptr() if for_launch and not self.interpreted else view)
            rec = self.meta[b]
            delta = meta[0] * meta[3].itemsize - rec[0] * rec[3].itemsize
            return ("v", b, meta, meta == rec, delta)
        if kind == "seq":
            parts = [self._getter(x, for_launch) for x in d[2]]
            if all(p[0] == "c" for p in parts):
                return ("c", d[1](p[1] for p in parts))
            return ("s", d[1], parts)
        return ("c", d[1])

    def _compile(self, op, at: tuple):
        if op[0] == "launch":
            _, kernel, grid, described, meta, launcher = op
            getters = [self._getter(d, True) for d in described]
            if self.interpreted:
                return ("ilaunch", kernel, grid, meta, getters)
            template = [g[1] if g[0] == "c" else None for g in getters]
            dynamic = []
            for i, g in enumerate(getters):
                if g[0] == "v":
                    dynamic.append((i, g[1], g[4], launcher.aligned[i]))
                elif g[0] == "s":
                    raise _NoPlan("a launch argument is a sequence")
            g1 = grid[1] if len(grid) > 1 else 1
            g2 = grid[2] if len(grid) > 2 else 1
            head = (grid[0], g1, g2)
            run, function, packed, tail = (
                launcher.run, launcher.function, launcher.packed, launcher.tail
            )  # fmt: skip
            return ("launch", run, function, packed, tail, head, template, dynamic)
        _, func, (args, kwargs), produced, seq = op
        if (func in _ALLOCS or func in _ZEROS) and not (set(produced) & self.per_call):
            return None  # placed by the plan (and zeroed as the step starts)
        kind = "alloc" if func in _ALLOCS else "nondet" if at in self.kept else "op"
        # The arguments as a list of their constants with the per-call ones to fill in
        # (index, getter), the keywords as a dict of constants and per-call (name, getter).
        args = self._getter(args, False)
        parts = [args] if args[0] == "c" else args[2]
        template = (
            list(args[1]) if args[0] == "c" else [p[1] if p[0] == "c" else None for p in parts]
        )
        fill = () if args[0] == "c" else tuple((i, p) for i, p in enumerate(parts) if p[0] != "c")
        kwargs = {k: self._getter(v, False) for k, v in kwargs.items()}
        constant = {k: g[1] for k, g in kwargs.items() if g[0] == "c"}
        per_call = tuple((k, g) for k, g in kwargs.items() if g[0] != "c")
        return (
            kind, _PUBLIC.get(func, func._op), (template, fill), (constant, per_call),
            produced, seq, at, func,
        )  # fmt: skip

    def _value(self, g, env):
        kind = g[0]
        if kind == "c":
            return g[1]
        if kind == "v":
            t = env[g[1]]
            return t if g[3] else self._view(t, g[2], g[4])
        return g[1](self._value(x, env) for x in g[2])

    @staticmethod
    def _view(t: torch.Tensor, meta: tuple, delta: int) -> torch.Tensor:
        """The view ``meta`` of a buffer held as ``t``, ``delta`` bytes from where ``t``
        starts (as recorded)."""
        offset, shape, stride, dtype = meta
        if dtype is t.dtype:
            return t.as_strided(shape, stride, t.storage_offset() + delta // dtype.itemsize)
        start = t.storage_offset() * t.dtype.itemsize + delta
        return torch.empty(0, dtype=dtype, device=t.device).set_(
            t.untyped_storage(), start // dtype.itemsize, shape, stride
        )

    def _handed_out(self, g, env) -> torch.Tensor:
        """What the step hands out (its output, a gradient): the buffer's tensor itself,
        or a tensor of its own on that storage, not a view (as eagerly: FSDP2 warns of a
        layer returning a view, whose in-place change would skip its backward hook)."""
        t = self._value(g, env)
        if t._base is None:
            return t
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(
            t.untyped_storage(), t.storage_offset(), t.shape, t.stride()
        )

    @staticmethod
    def _misaligned() -> None:
        raise RuntimeError(
            "launch plan: a tensor's address lost the 16-byte alignment its kernel was "
            "compiled for; call coat_models.plans.disable_launch_plans(model)"
        )

    def _run(self, steps, env: dict) -> None:
        stream, checking = None, self.checking
        if not self.interpreted:
            stream = torch._C._cuda_getCurrentRawStream(self.device.index)
        for step in steps:
            if step is None:
                continue
            kind = step[0]
            if kind == "launch":
                _, run, function, packed, tail, head, template, dynamic = step
                args = template.copy()
                for i, b, delta, aligned in dynamic:
                    ptr = env[b].data_ptr() + delta
                    if aligned and ptr & 15:
                        self._misaligned()
                    args[i] = ptr
                run(*head, stream, function, packed, None, None, None, *args, *tail)
            elif kind == "op" or kind == "alloc" or kind == "nondet":
                _, call, (args, fill), (kwargs, per_call), produced, seq, at, func = step
                if fill:
                    args = args.copy()
                    for i, g in fill:
                        if g[0] == "v":  # (inlined _value: a per-call buffer)
                            t = env[g[1]]
                            args[i] = t if g[3] else self._view(t, g[2], g[4])
                        else:
                            args[i] = self._value(g, env)
                if per_call:
                    kwargs = {**kwargs, **{k: self._value(g, env) for k, g in per_call}}
                out = call(*args, **kwargs)
                outs = out if seq else (out,)
                for b, o in zip(produced, outs, strict=False):
                    if b is not None:
                        env[b] = o
                if checking and kind == "alloc":
                    for o in outs:
                        _fill_bytes(o)
                elif checking and kind == "nondet":
                    inputs, results = self.kept[at]
                    got = _float_inputs((args, kwargs))
                    if len(got) != len(inputs) or not all(map(torch.equal, got, inputs)):
                        self.diverged = self.diverged or f"an input of {func}"
                    for o, kept in zip(outs, results, strict=False):
                        if kept is not None:
                            o.copy_(kept)
            else:  # the interpreter: Triton's own launch path, on tensors
                _, kernel, grid, meta, getters = step
                launch(kernel, grid, *(self._value(g, env) for g in getters), **meta)

    # ---- the two directions
    def compile(self) -> None:
        self.out_getter = self._getter(self.escaping["out"], False)
        self.grad_getters = {
            name[1:]: None if d is None else self._getter(d, False)
            for name, d in self.escaping.items()
            if name != "out"
        }

    def forward(self, inputs: dict, params) -> tuple:
        names = self.names
        env = {names[k]: t for k, t in inputs.items()}
        for i, p in enumerate(params):
            env[names[f"param{i}"]] = p
        if self.zeroed.numel():
            self.zeroed.zero_()
        with torch._C._DisableAutocast():  # (torch.autocast(enabled=False), 6x cheaper)
            self._run(self.fwd, env)
        return self._handed_out(self.out_getter, env), [env[b] for b in self.saved]

    def backward(self, saved, grad: torch.Tensor) -> dict:
        env = dict(zip(self.saved, saved, strict=True))
        env[self.names["grad"]] = grad
        with torch._C._DisableAutocast():  # (torch.autocast(enabled=False), 6x cheaper)
            self._run(self.bwd, env)
        grads = self.grad_getters.items()
        return {k: None if g is None else self._handed_out(g, env) for k, g in grads}


class _Replay(torch.autograd.Function):
    """One planned layer step: ``(plan, hidden, cos, sin, mask, *params) -> out`` (``mask``:
    the attention mask, or None)."""

    @staticmethod
    def forward(ctx, plan, hidden, cos, sin, mask, *params):
        inputs = {"hidden": hidden, "cos": cos, "sin": sin}
        if mask is not None:
            inputs["mask"] = mask
        out, saved = plan.forward(inputs, params)
        plan.gen += 1
        ctx.plan, ctx.gen, ctx.done = plan, plan.gen, False
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        plan = ctx.plan
        if ctx.done or ctx.gen != plan.gen:
            raise RuntimeError(
                "launch-planned COAT layer: this backward belongs to a forward whose saved "
                "activations were overwritten (by a later forward of the layer, or by this "
                "backward running twice); run each backward once, before the layer's next "
                "forward, or call coat_models.plans.disable_launch_plans(model)"
            )
        ctx.done = True
        plan.pending = None
        if grad.stride() != plan.grad_stride or grad.data_ptr() & 15:
            grad = grad.clone(memory_format=torch.contiguous_format)  # (fresh: aligned)
        grads = plan.backward(ctx.saved_tensors, grad)
        params = [grads.get(f"param{i}") for i in range(plan.n_params)]
        return None, grads.get("hidden"), None, None, None, *params


# ------------------------------------------------------------------------------ the layers
def enable_launch_plans(model: nn.Module, *, max_plans_per_layer: int = 8) -> nn.Module:
    """Let the COAT decoder layers of ``model`` (after ``apply_coat``, weight cache off) run
    their training steps from launch plans (see the module docstring). Returns ``model``.

    Each layer tries at most ``max_plans_per_layer`` keys (each plan holds an arena; each try
    records the step); a call at a further key (batches padded to ever new lengths, say) runs
    eagerly, and the first such call of each layer adds one refusal line (and, for the
    model, warns)."""
    from . import graphs

    if isinstance(max_plans_per_layer, bool) or not isinstance(max_plans_per_layer, int):
        raise TypeError(f"max_plans_per_layer must be an int, got {max_plans_per_layer!r}")
    if max_plans_per_layer < 1:
        raise ValueError(f"max_plans_per_layer must be at least 1, got {max_plans_per_layer}")

    layers = graphs.replayable_layers(model, "enable_launch_plans", "launch plans")
    for layer in layers:
        impl = layer.self_attn.config._attn_implementation
        if impl not in ("sdpa", "eager"):  # (others may start kernels a record cannot see)
            raise ValueError(
                f"enable_launch_plans supports attn_implementation 'sdpa' or 'eager', got {impl!r}"
            )
    if graphs.cuda_graphs_enabled(model):
        raise ValueError(
            "enable_launch_plans: CUDA graphs are on (enable_cuda_graphs); both take over the "
            "layers' steps: use one of them"
        )
    disable_launch_plans(model)
    _STATES[model] = {
        "scratch": {}, "plans": [], "refusals": [], "replays": 0, "eager": 0, "retries": 0,
        "max_plans": max_plans_per_layer, "capped": set(),
    }  # fmt: skip
    for layer in layers:
        # In __dict__, not as attributes: nn.Module would register the model as a child.
        layer.__dict__[_OWNER] = weakref.ref(model)
        layer.__dict__[_PLANS] = {}
    return model


def drop_plans(layer: nn.Module) -> None:
    """Forget ``layer``'s plans (``.to()``, ``.cuda()``...: their arenas and recorded
    addresses belong to the old tensors); the next planned call records again."""
    plans = layer.__dict__.get(_PLANS)
    if plans:
        ref = layer.__dict__.get(_OWNER)
        state = _STATES.get(ref()) if ref is not None and ref() is not None else None
        if state is not None:
            dropped = {id(p) for p in plans.values() if isinstance(p, _Plan)}
            state["plans"] = [p for p in state["plans"] if id(p) not in dropped]
            used = {p.device for p in state["plans"]}
            for device in [d for d in state["scratch"] if d not in used]:
                del state["scratch"][device]  # (the other layers' plans hold theirs)
        plans.clear()


def disable_launch_plans(model: nn.Module) -> nn.Module:
    """Drop the plans and their arenas; the layers run eagerly again (also through a
    wrapper such as DDP's)."""
    from . import graphs

    for m in model.modules():
        _STATES.pop(m, None)
    for layer in graphs._coat_layers(model):
        for key in LAYER_KEYS:
            layer.__dict__.pop(key, None)
    return model


def _states(model: nn.Module) -> list[dict]:
    """The plan states of ``model``, or of the models inside a wrapper (DDP's, a task's)."""
    state = _STATES.get(model)
    if state is not None:
        return [state]
    return [_STATES[m] for m in model.modules() if m in _STATES]


def launch_plan_replays(model: nn.Module) -> int:
    """Layer steps of ``model`` (or of the models it wraps) run from launch plans since
    ``enable_launch_plans``."""
    return sum(state["replays"] for state in _states(model))


def launch_plan_eager_steps(model: nn.Module) -> int:
    """Training steps of COAT layers of ``model`` (or of the models it wraps) that ran eagerly
    although plans were on (a KV cache holding tokens, a refused plan, ...; see the module
    docstring). Layer steps without gradients (evaluation) and under compile tracing are not
    counted."""
    return sum(state["eager"] for state in _states(model))


def launch_plan_check_retries(model: nn.Module) -> int:
    """Replays of their records that differed bit for bit before an equal one, over the
    plans of ``model`` (or of the models it wraps) that were made: nonzero only with a
    nondeterministic kernel in a layer step. (A refused plan counts none: the refusal says
    it.)"""
    return sum(state["retries"] for state in _states(model))


def launch_plan_bytes(model: nn.Module) -> int:
    """Bytes the launch plans of ``model`` (or of the models it wraps) keep allocated: every
    plan's arena (what its backward reads) and zero-filled counters, and the shared scratch
    buffers."""
    return sum(
        sum(plan.arena.nbytes + plan.zeroed.nbytes for plan in state["plans"])
        + sum(scratch.nbytes for scratch in state["scratch"].values())
        for state in _states(model)
    )


def launch_plan_refusals(model: nn.Module) -> list[str]:
    """Why layers of ``model`` (or of the models it wraps) stayed eager at a key (one line
    per layer and key; one per layer at its cap of keys, ``max_plans_per_layer``)."""
    return [why for state in _states(model) for why in state["refusals"]]


def _tensor_key(t: torch.Tensor) -> tuple:
    # 16-byte alignment: the Triton kernels are specialized on it (a plan's launches
    # keep their specialization).
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad, t.data_ptr() & 15)


def _sdpa_switches() -> tuple:
    """What SDPA chooses its backend and the math backend's precision from: the backends'
    switches, their priority order (``sdpa_kernel(..., set_priority=True)``) and whether the
    math backend may reduce in fp16/bf16. (Called once per planned layer step: torch's own
    getters, which the public ones wrap, take half the host time.)"""
    return (_flash_on(), _efficient_on(), _math_on(), _cudnn_on(), _fa3_on(),
            tuple(_sdpa_priority()), _math_reduces_low())  # fmt: skip


# torch's SDPA getters: private in torch 2.11-2.13 (the public wrapper where one is missing;
# the priority order and FA3's switch have none).
_cuda = torch.backends.cuda
_flash_on = getattr(torch._C, "_get_flash_sdp_enabled", _cuda.flash_sdp_enabled)
_efficient_on = getattr(torch._C, "_get_mem_efficient_sdp_enabled", _cuda.mem_efficient_sdp_enabled)
_math_on = getattr(torch._C, "_get_math_sdp_enabled", _cuda.math_sdp_enabled)
_cudnn_on = getattr(torch._C, "_get_cudnn_sdp_enabled", _cuda.cudnn_sdp_enabled)
_fa3_on = getattr(torch._C, "_get_fa3_sdp_enabled", lambda: False)
_sdpa_priority = getattr(torch._C, "_get_sdp_priority_order", lambda: ())
_math_reduces_low = getattr(
    torch._C,
    "_get_math_sdp_allow_fp16_bf16_reduction",
    _cuda.fp16_bf16_reduction_math_sdp_allowed,
)


_CHECKS = 3  # replays of the record before a plan is refused (see _make_plan)


def _float_inputs(tree) -> list[torch.Tensor]:
    """The floating-point tensors of an op's arguments: the data a nondeterministic op reads.
    (Not its random-number state: without dropout, CUDA's attention leaves those tensors
    unwritten, so they hold whatever the allocator hands out.)"""
    leaves = torch.utils._pytree.tree_leaves(tree)
    return [x for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()]


def _unbroadcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its broadcast dimensions (stride 0, kept at size 1): what
    ``.expand(t.shape)`` makes ``t`` again."""
    return t[tuple(slice(0, 1) if st == 0 else slice(None) for st in t.stride())]


def _kept_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that keeps its broadcast dimensions (stride 0) broadcast: an attention
    mask expanded over the heads is kept at the mask's size, not H times it (what ``clone``
    would make)."""
    if all(st != 0 or n <= 1 for n, st in zip(t.shape, t.stride(), strict=True)):
        return t.clone()
    return _unbroadcast(t).clone().expand(t.shape)


def _fill_bytes(t: torch.Tensor) -> None:
    """Every byte of ``t``'s storage set to 0xFF (NaN in each float format of a step)."""
    torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).fill_(255)


def _replay_differs(plan, inputs, stand_ins, grad, recorded, devices) -> str | None:
    """The first recorded result a replay of ``plan`` on the record's inputs does not
    reproduce bit for bit, or None. Every buffer the step allocates starts as 0xFF bytes
    (NaN; the zero-filled ones as 0x7F, below): a write the plan misses shows even where
    that memory held the recorded values (an allocation that reuses the record's freed
    memory, as the CPU's allocator may). The nondeterministic ops (attention backwards) hand
    on their recorded results: they are ATen ops the plan calls again, so no missed kernel
    hides in them, and their run-to-run differences (CUDA's dQ atomics) would otherwise make
    every later result differ; their floating-point inputs must equal the recorded ones bit
    for bit (what feeds them is checked there)."""
    for buffer in (plan.arena, plan.scratch):
        buffer.fill_(255)
    # The zero-filled buffers (counters, maxima) at 0x7F bytes: a large positive value in
    # each int and float format, which a sum or a maximum kept there shows if the plan's
    # fill misses them (0xFF is -1 as an int: a maximum of non-negative values hides it).
    # (A minimum kept there would hide it: no kernel of a COAT layer keeps one.)
    plan.zeroed.fill_(0x7F)
    plan.checking, plan.diverged = True, None
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            out, saved = plan.forward(inputs, stand_ins)
            got = {"out": out, **plan.backward(saved, grad)}
    finally:
        plan.checking = False
    if plan.diverged:
        return plan.diverged
    for name, want in recorded.items():
        have = got.get(name)
        if (want is None) != (have is None) or (want is not None and not torch.equal(want, have)):
            return name
    return None


def _make_plan(layer, state: dict, hidden, cos, sin, mask, params):
    from . import graphs

    body = graphs._LayerBody(layer)
    stand_ins = [p.detach().requires_grad_(p.requires_grad) for p in params]
    # Stand-ins with the input's layout (the plan's views are the recorded ones).
    h = torch.empty_strided(hidden.shape, hidden.stride(), dtype=hidden.dtype, device=hidden.device)
    h.copy_(hidden.detach()).requires_grad_(hidden.requires_grad)
    c, s = cos.detach(), sin.detach()
    devices = [h.device] if h.device.type == "cuda" else []
    inputs = {"hidden": h, "cos": c, "sin": s}
    if mask is not None:
        inputs["mask"] = mask.detach()
    # Making a plan leaves the random state as it was (the eager run's draws stay the same).
    # (from a generator of its own: the check below starts from the record's random state)
    gen = torch.Generator(device=h.device).manual_seed(0)
    grad = torch.randn(h.shape, dtype=h.dtype, device=h.device, generator=gen) * 0.02
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        with torch.autocast(h.device.type, enabled=False):
            rec, names, escaping, recorded = _record(
                lambda hidden, cos, sin, mask=None: body(hidden, cos, sin, *stand_ins, mask=mask),
                inputs, stand_ins, grad,
            )  # fmt: skip
    plan = _Plan(rec, names, escaping, h.device)
    plan.n_params, plan.grad_stride = len(params), grad.stride()
    scratch = state["scratch"].get(h.device)  # one per device (layers may be spread)
    if scratch is None or scratch.numel() < plan.scratch_bytes:
        scratch = torch.empty(plan.scratch_bytes, dtype=torch.uint8, device=h.device)
        state["scratch"][h.device] = scratch
        for other in state["plans"]:  # their static views move to the larger scratch
            if other.device == h.device:
                other.place(scratch)
    plan.place(scratch)
    plan.compile()
    # The plan replays the recorded step on the same inputs, bit for bit, or it is not
    # used: a kernel that neither ATen nor fp8_quant's launch started (a C extension
    # writing a tensor the record saw allocated) would differ in every replay; one equal
    # replay shows the plan reproduces its record. A nondeterministic kernel other than
    # those in _NONDETERMINISTIC (whose inputs the check compares and whose recorded results
    # it takes) can make a single replay differ, hence up to _CHECKS of them, counted in
    # launch_plan_check_retries.
    checks = 1 if torch.are_deterministic_algorithms_enabled() else _CHECKS
    try:
        for tries in range(1, checks + 1):
            differs = _replay_differs(plan, inputs, stand_ins, grad, recorded, devices)
            if differs is None:
                state["retries"] += tries - 1
                break
    finally:
        plan.kept.clear()  # (the recorded inputs and results, also the record's: check done)
    if differs is not None:
        raise _NoPlan(
            f"its replay did not reproduce the recorded step bit for bit ({differs} differs, "
            f"{checks} replay{'s' * (checks != 1)}): a kernel started outside ATen and "
            "fp8_quant's launch, or a nondeterministic one"
        )
    state["plans"].append(plan)
    return plan


def _capped(layer: nn.Module, state: dict) -> None:
    """The first call of ``layer`` past its plans' cap: one refusal line (and one warning
    for the model)."""
    if id(layer) in state["capped"]:
        return
    n = state["max_plans"]
    why = (
        f"{type(layer).__name__} {layer.self_attn.layer_idx}: at its cap of {n} key"
        f"{'s' * (n != 1)} (max_plans_per_layer): calls at other keys (shapes, mask, "
        "settings) run eagerly"
    )
    state["refusals"].append(why)
    if not state["capped"]:
        warnings.warn(
            f"launch plans: {why}; pad batches to a few fixed lengths, or pass a larger "
            "enable_launch_plans(max_plans_per_layer=) (each plan keeps an arena allocated)",
            stacklevel=_callers_level(),
        )
    state["capped"].add(id(layer))


def _callers_level() -> int:
    """``warnings.warn``'s stacklevel, called from the function that calls this, of the first
    frame outside the libraries a training step runs through (the user's line)."""
    names = ("torch", "transformers", "accelerate", "peft", "fp8_activations", "fp8_quant",
             __package__)  # fmt: skip
    packages = [sys.modules.get(name) for name in names]
    ours = tuple(os.path.dirname(m.__file__) + os.sep for m in packages if m and m.__file__)
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(ours):
        frame, level = frame.f_back, level + 1
    return level


def run_planned(layer: nn.Module, hidden, cos_sin, attention_mask, cache, kwargs, checkpointing):
    """The layer's output from its launch plan, or None when this call runs eagerly."""
    ref = layer.__dict__.get(_OWNER)
    owner = None if ref is None else ref()
    state = None if owner is None else _STATES.get(owner)
    if state is None or torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return None
    out = _planned(layer, state, hidden, cos_sin, attention_mask, cache, kwargs, checkpointing)
    if out is None:  # a training step a plan did not cover
        state["eager"] += 1
    else:
        state["replays"] += 1
    return out


def _planned(layer, state, hidden, cos_sin, attention_mask, cache, kwargs, checkpointing):
    """``run_planned`` for a training step: the plan's output, or None (eager)."""
    from . import graphs

    if checkpointing or not graphs._cache_unused(layer, cache):
        return None
    mask = attention_mask  # (a tensor the step reads, given per call as the input is)
    if mask is not None and (
        not isinstance(mask, torch.Tensor) or mask.requires_grad or mask.device != hidden.device
    ):
        return None
    if set(kwargs) - graphs._NEUTRAL_KWARGS or len(cos_sin) != 2:
        return None
    cos, sin = cos_sin
    if cos.requires_grad or sin.requires_grad or cos.device != hidden.device:
        return None
    params = graphs._layer_params(layer)
    attn = layer.self_attn
    key = (
        _tensor_key(hidden), _tensor_key(cos), _tensor_key(sin),
        None if mask is None else _tensor_key(mask), layer.coat_config,
        id(layer.coat_ops), tuple(_tensor_key(p) for p in params),
        # What the recorded step's Python chose from: the attention's settings, SDPA's
        # backend choice and math precision (_sdpa_switches), deterministic algorithms.
        attn.config._attn_implementation, attn.training, attn.attention_dropout,
        _sdpa_switches(), torch.are_deterministic_algorithms_enabled(),
    )  # fmt: skip
    plans = layer.__dict__[_PLANS]
    plan = plans.get(key)
    if plan is None and len(plans) >= state["max_plans"]:  # (refused keys count: each tried)
        _capped(layer, state)
        return None  # (not remembered: the keys past the cap may be endless)
    if plan is None:
        try:
            plan = _make_plan(layer, state, hidden, cos, sin, mask, params)
        except (_NoPlan, torch.OutOfMemoryError) as e:
            why = str(e) if isinstance(e, _NoPlan) else "out of memory while making the plan"
            plan = why.splitlines()[0]
            state["refusals"].append(f"{type(layer).__name__} {attn.layer_idx}: {plan}")
        plans[key] = plan
    if isinstance(plan, str):
        return None
    if plan.pending is not None and plan.pending() is not None:
        return None  # the previous planned forward still waits for its backward
    out = _Replay.apply(plan, hidden, cos, sin, mask, *params)
    plan.pending = weakref.ref(out.grad_fn) if out.grad_fn is not None else None
    return out
