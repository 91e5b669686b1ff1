"""coat-train's memory breakdown: live bytes of weights, gradients, optimizer state and
tensors saved for backward (``MemoryTracker``), next to the allocator's measured peak on CUDA
(``PeakMeter``); ``memory_report`` joins the two."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


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


def _flat_tensors(obj) -> list[torch.Tensor]:
    """Tensors in ``obj``, looking into tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _flat_tensors(o)]
    return []


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
    """Live bytes of weights, gradients, optimizer state and tensors saved for backward, and
    their values at the moment their sum peaked.

    - weights: parameters and buffers (constant);
    - gradients: ``.grad`` tensors, counted when autograd first writes them in a step;
    - optimizer state: tensors in ``optimizer.state``, counted after each step;
    - activations: tensors autograd saves for backward (``saved_tensors_hooks``), each storage
      once, parameters excluded, counted until autograd frees them;
    - weight_copies: saved tensors that are a cast or view of a parameter (autocast's bf16
      copies of fp32 weights), and tensors kept as attributes of parameters (COAT's FP8
      weight caches), found when backward starts and after each optimizer step and counted
      until they are freed.
    It sees tensors only through these routes: temporaries that are not saved (e.g. the fp32
    logits inside the loss) and caches kept elsewhere are in ``measured - tracked``.

    ``grad_hooks=False`` counts gradients only in ``count_grads`` after backward: for FSDP2,
    which calls the hooks of its sharded parameters with views of one reduce-scatter output
    per layer (a hook would count the whole output for each parameter).

    Counting costs host time, a Python call per saved tensor and per parameter: the tiny
    preset (4 layers, bf16) saves 165 tensors per step, and a counted step took 9.3 ms on
    CPU against 7.5 ms uncounted (batch 1 x 16 tokens, where host time is all there is). A trainer
    therefore counts only some steps: ``stop()`` between steps ends counting, ``start
    (optimizer)`` before a step resumes it (``active`` says which). The peak and its
    breakdown are then those of the counted steps.
    """

    KINDS = ("weights", "gradients", "optimizer_state", "activations", "weight_copies")

    def __init__(self, model: torch.nn.Module, grad_hooks: bool = True):
        self.live = dict.fromkeys(self.KINDS, 0)
        self.at_peak = dict(self.live)
        self.peak = 0
        tensors = list(model.parameters()) + list(model.buffers())
        self._param_keys = {k for t in tensors for k, _ in _storages(t)}
        self.live["weights"] = tensor_bytes(tensors)
        self._params = list(model.parameters())
        self._saved: dict = {}  # storage key -> [refs, bytes, kind]
        self._attached: dict = {}  # storage key -> [live tensors, bytes]
        self._watched: set[int] = set()  # ids of live tensors attached to parameters
        self._scan_pending = False
        self._grads_seen: set[int] = set()
        self._grad_hooks = grad_hooks
        self._handles: list = []
        self.active = False
        self.start()

    def start(self, optimizer: torch.optim.Optimizer | None = None):
        """Count from here on (call between steps): the gradient hooks go back on, and what
        changed while stopped is counted again: ``optimizer``'s state (created at its first
        step) and tensors kept on parameters (FP8 weight caches)."""
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
        """Stop counting (between steps, after ``grads_dropped``): the gradient hooks come
        off; tensors already counted are still released when freed. Use ``saving()`` only
        while active."""
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
            ref = self._saved.get(key)
            if ref is None:
                kind = "weight_copies" if _is_weight_copy(t) else "activations"
                self._saved[key] = ref = [0, nbytes, kind]
                self.live[kind] += nbytes
            ref[0] += 1
            keys.append(key)
        self._update()
        # Keep t detached: t itself may be an output of the node saving it, and a Python
        # object held by the node that refers back to the node through t.grad_fn is a
        # cycle that Python's gc cannot see. Then a graph whose backward never runs (an
        # out-of-memory error in forward or backward) would never be freed, parameters and
        # activations with it. Autograd restores the history on unpack.
        return _Saved(t.detach(), keys, self._release)

    def _unpack(self, saved):
        if self._scan_pending:  # the first unpack of a backward: the forward is complete
            self._scan_pending = False
            self.scan_attached()
        return saved.tensor

    def scan_attached(self):
        """Count tensors kept as attributes of parameters (e.g. FP8 weight caches made in
        forward) as weight copies until they are freed; one saved for backward moves there."""
        for p in self._params:
            for t in _flat_tensors(list(p.__dict__.values())):
                if id(t) in self._watched:
                    continue
                self._watched.add(id(t))
                keys = []
                for key, nbytes in _storages(t):
                    ref = self._attached.get(key)
                    if ref is None:
                        self._attached[key] = ref = [0, nbytes]
                        self.live["weight_copies"] += nbytes
                        saved = self._saved.get(key)
                        if saved is not None:  # already counted as saved: count it once
                            self.live[saved[2]] -= saved[1]
                            saved[1] = 0
                    ref[0] += 1
                    keys.append(key)
                weakref.finalize(t, self._drop_attached, id(t), keys)
        self._update()

    def _drop_attached(self, tensor_id, keys):
        self._watched.discard(tensor_id)
        for key in keys:
            ref = self._attached[key]
            ref[0] -= 1
            if ref[0] == 0:
                self.live["weight_copies"] -= ref[1]
                del self._attached[key]

    def _release(self, keys):
        for key in keys:
            ref = self._saved[key]
            ref[0] -= 1
            if ref[0] == 0:
                self.live[ref[2]] -= ref[1]
                del self._saved[key]

    def _on_grad(self, p):
        if id(p) not in self._grads_seen:
            self._grads_seen.add(id(p))
            self.live["gradients"] += tensor_bytes([p.grad])
            self._update()

    def count_grads(self):
        """Count the gradients no hook counted (all of them with ``grad_hooks=False``), each
        storage once; call after backward."""
        new = [p for p in self._params if p.grad is not None and id(p) not in self._grads_seen]
        self._grads_seen.update(id(p) for p in new)
        self.live["gradients"] += tensor_bytes([p.grad for p in new])
        self._update()

    def after_optimizer_step(self, optimizer):
        """Call after ``optimizer.step()``, before the gradients are dropped."""
        self.live["optimizer_state"] = optimizer_state_bytes(optimizer)
        self.scan_attached()

    def grads_dropped(self):
        self.live["gradients"] = 0
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
    ``None`` on CPU, where torch keeps no allocator statistics (the tests compare the tracked
    bytes with the process's resident-set growth instead, see README)."""

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
