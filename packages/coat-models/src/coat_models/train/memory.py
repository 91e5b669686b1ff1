"""coat-train's memory breakdown: live bytes of weights, gradients, optimizer state and
tensors saved for backward (``MemoryTracker``), next to the allocator's measured peak on CUDA
(``PeakMeter``); ``memory_report`` joins the two."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..loss import SAVED_GRADIENT


def is_oom(e: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the RuntimeError of the CPU allocator / a CUDA kernel."""
    text = str(e) if isinstance(e, RuntimeError) else ""
    oom = isinstance(e, torch.OutOfMemoryError)
    return oom or "can't allocate memory" in text or "out of memory" in text


def _storages(t: torch.Tensor):
    """[(key, bytes)] of the memory a tensor holds; wrapper subclasses (FP8 data + scales,
    FSDP2's DTensor shards) are opened up into their inner tensors."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, n) for n in names]  # DTensor also names its DeviceMesh
        return [s for i in inner if isinstance(i, torch.Tensor) for s in _storages(i)]
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return [(("tensor", id(t)), t.nelement() * t.element_size())]
    return [((st.device.type, st.device.index, st.data_ptr()), st.nbytes())]


def _flat_tensors(obj, depth: int = 0) -> list[torch.Tensor]:
    """Tensors in ``obj``, looking into tuples, lists, dicts and the slots of an object with
    ``__slots__`` (fp8_activations keeps a weight's FP8 cache in one: it went uncounted)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 8:
        return []
    if isinstance(obj, dict):
        obj = list(obj.values())
    elif not isinstance(obj, (tuple, list)):
        slots = getattr(type(obj), "__slots__", ())
        slots = (slots,) if isinstance(slots, str) else slots
        obj = [getattr(obj, name, None) for name in slots]
    return [t for o in obj for t in _flat_tensors(o, depth + 1)]


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (shared storage counted once)."""
    return sum(dict(s for t in tensors for s in _storages(t)).values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(
        v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
    )


_COPY_OR_VIEW = {  # autograd nodes of casts and views
    "ToCopyBackward0",
    "TBackward0",
    "TransposeBackward0",
    "PermuteBackward0",
    "ViewBackward0",
    "UnsafeViewBackward0",
    "ExpandBackward0",
    "CloneBackward0",
    "AliasBackward0",
}


def _is_weight_copy(t: torch.Tensor) -> bool:
    """True for a cast or view of a parameter (e.g. autocast's bf16 copy of an fp32 weight),
    or a parameter the model does not hold (FSDP2's all-gathered copy of a sharded one)."""
    if isinstance(t, torch.nn.Parameter):
        return True
    fn = t.grad_fn
    for _ in range(4):
        if fn is None:
            return False
        if type(fn).__name__ == "AccumulateGrad":
            return isinstance(fn.variable, torch.nn.Parameter)
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if type(fn).__name__ not in _COPY_OR_VIEW or len(nxt) != 1:
            return False
        fn = nxt[0]
    return False


class _Saved:
    """What autograd keeps for a saved tensor while the tracker is active: the tensor
    (detached, no copy) and a callback that returns its bytes when autograd frees it."""

    __slots__ = ("tensor", "keys", "release")

    def __init__(self, tensor, keys, release):
        self.tensor, self.keys, self.release = tensor, keys, release

    def __del__(self):
        self.release(self.keys)


class MemoryTracker:
    """Live bytes of weights (parameters and buffers), gradients, optimizer state, tensors
    saved for backward (activations, each storage once until freed) and weight copies (saved
    casts or views of a parameter, and tensors kept as attributes of parameters: COAT's FP8
    weight caches), the launch plans' buffers (``plan_bytes()``, e.g. ``plans.launch_plan_bytes``
    of the model: arenas holding what planned layers' backward reads, and scratch; read with
    the weight copies, after each forward and optimizer step), and their values when their
    sum peaked. Unsaved temporaries are in
    ``measured - tracked``; a saved tensor marked ``loss.SAVED_GRADIENT`` (the loss's
    gradients, made in forward) is a gradient. ``grad_hooks=False`` counts gradients in
    ``count_grads`` only (FSDP2 calls the hooks of sharded parameters with views of one
    reduce-scatter output).
    Counting costs host time: ``stop()`` between steps, ``start(optimizer)`` before one."""

    KINDS = ("weights", "gradients", "optimizer_state", "activations", "weight_copies",
             "plan_buffers")  # fmt: skip

    def __init__(
        self,
        model: torch.nn.Module,
        grad_hooks: bool = True,
        plan_bytes: Callable[[], int] | None = None,
    ):
        self.live = dict.fromkeys(self.KINDS, 0)
        self._plan_bytes = plan_bytes
        self.at_peak = dict(self.live)
        self.peak = 0
        tensors = list(model.parameters()) + list(model.buffers())
        self._param_keys = {k for t in tensors for k, _ in _storages(t)}
        self.live["weights"] = tensor_bytes(tensors)
        self._params = list(model.parameters())
        self._saved: dict = {}  # storage key -> [refs, bytes, kind]
        self._attached: dict = {}  # storage key -> [live tensors, bytes, "weight_copies"]
        self._watched: set[int] = set()  # ids of live tensors attached to parameters
        self._scan_pending = False
        self._grads_seen: set[int] = set()
        self._param_grads = 0  # bytes of the parameters' gradients counted in "gradients"
        self._grad_hooks = grad_hooks
        self._handles: list = []
        self.active = False
        self.start()

    def start(self, optimizer: torch.optim.Optimizer | None = None):
        """Count from here on (between steps), recounting what changed while stopped:
        ``optimizer``'s state, tensors kept on parameters and the launch plans' buffers."""
        if self._grad_hooks and not self._handles:
            self._handles = [
                p.register_post_accumulate_grad_hook(self._on_grad)
                for p in self._params
                if p.requires_grad
            ]
        if optimizer is not None:
            self.live["optimizer_state"] = optimizer_state_bytes(optimizer)
        self.active = True
        self.scan_attached()

    def stop(self):
        """Stop counting (between steps); tensors already counted are released when freed."""
        self.close()
        self.active = False

    def close(self):
        for h in self._handles:
            h.remove()
        self._handles = []

    def saving(self):
        """Context manager: count tensors saved for backward by the code inside."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t):
        self._scan_pending = True
        keys = []
        for key, nbytes in _storages(t):
            if key in self._param_keys or key in self._attached:
                continue
            if key not in self._saved:
                kind = "weight_copies" if _is_weight_copy(t) else "activations"
                if getattr(t, SAVED_GRADIENT, False):  # e.g. the loss's, made in forward
                    kind = "gradients"
                self._hold(self._saved, key, nbytes, kind)
            self._saved[key][0] += 1
            keys.append(key)
        self._update()
        # Detached: t may be an output of the node saving it, and t.grad_fn back to the node
        # is a cycle gc cannot see, so a graph whose backward never runs (an OOM) would never
        # be freed. Autograd restores the history on unpack.
        return _Saved(t.detach(), keys, lambda keys: self._release(self._saved, keys))

    def _unpack(self, saved):
        if self._scan_pending:  # the first unpack of a backward: the forward is complete
            self._scan_pending = False
            self.scan_attached()
        return saved.tensor

    def scan_attached(self):
        """Count tensors kept as attributes of parameters (e.g. FP8 weight caches made in
        forward) as weight copies until they are freed; one saved for backward moves there.
        Read the launch plans' buffers (made by a forward that recorded; not saved for
        backward: the tensors a planned layer saves are counted as activations)."""
        if self._plan_bytes is not None:
            self.live["plan_buffers"] = self._plan_bytes()
        for p in self._params:
            for t in _flat_tensors(list(p.__dict__.values())):
                if id(t) in self._watched:
                    continue
                self._watched.add(id(t))
                keys = []
                for key, nbytes in _storages(t):
                    if key not in self._attached:
                        self._hold(self._attached, key, nbytes, "weight_copies")
                        saved = self._saved.get(key)
                        if saved is not None:  # already counted as saved: count it once
                            self.live[saved[2]] -= saved[1]
                            saved[1] = 0
                    self._attached[key][0] += 1
                    keys.append(key)
                weakref.finalize(t, self._drop_attached, id(t), keys)
        self._update()

    def _hold(self, table: dict, key, nbytes: int, kind: str):
        """A new storage in ``table`` (``_saved`` or ``_attached``), live as ``kind``."""
        table[key] = [0, nbytes, kind]
        self.live[kind] += nbytes

    def _drop_attached(self, tensor_id, keys):
        self._watched.discard(tensor_id)
        self._release(self._attached, keys)

    def _release(self, table: dict, keys):
        """One reference fewer to each storage ``keys`` names in ``table`` (``_saved`` or
        ``_attached``); one with none left is no longer live."""
        for key in keys:
            ref = table[key]
            ref[0] -= 1
            if ref[0] == 0:
                self.live[ref[2]] -= ref[1]
                del table[key]

    def _on_grad(self, p):
        # (None: the hook fires for a parameter reached by no gradient, e.g. a LLaVA tower's
        # unused last norm under DDP, whose output sink hands on None)
        self._count_grads([p])

    def count_grads(self):
        """Count the gradients no hook counted (all of them with ``grad_hooks=False``), each
        storage once; call after backward."""
        self._count_grads(self._params)

    def _count_grads(self, params):
        new = [p for p in params if p.grad is not None and id(p) not in self._grads_seen]
        self._grads_seen.update(id(p) for p in new)
        nbytes = tensor_bytes([p.grad for p in new])
        self._param_grads += nbytes
        self.live["gradients"] += nbytes
        self._update()

    def after_optimizer_step(self, optimizer):
        """Call after ``optimizer.step()``, before the gradients are dropped."""
        self.live["optimizer_state"] = optimizer_state_bytes(optimizer)
        self.scan_attached()

    def grads_dropped(self):
        # The parameters' gradients; a gradient saved for backward is released when freed.
        self.live["gradients"] -= self._param_grads
        self._param_grads = 0
        self._grads_seen.clear()

    def _update(self):
        total = sum(self.live.values())
        if total > self.peak:
            self.peak, self.at_peak = total, dict(self.live)

    def reset_peak(self):
        self.peak, self.at_peak = 0, dict(self.live)
        self._update()


class PeakMeter:
    """Measured peak memory since ``reset``: ``torch.cuda.max_memory_allocated`` on CUDA;
    ``None`` on CPU, where torch keeps no allocator statistics."""

    def __init__(self, device: torch.device):
        self.device = device
        self.label = "cuda max_memory_allocated" if device.type == "cuda" else None

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None


def memory_report(tracker: MemoryTracker, meter: PeakMeter) -> dict:
    """The breakdown at the tracked peak and, where measured (CUDA), ``other = measured -
    tracked``: temporaries inside ops and caches, which the tracker cannot see."""
    measured = meter.peak()
    return {
        "device": meter.device.type,
        "measured_by": meter.label,
        "measured_peak": measured,
        "tracked_peak": tracker.peak,
        **tracker.at_peak,
        "other": None if measured is None else measured - tracker.peak,
    }
