"""CUDA graphs for COAT decoder layers: a training step without the host time of ~55 launches
per layer.

A COAT layer issues ~55 kernels per forward+backward, each costing the host tens of
microseconds (Python, autograd, Triton's launcher). At a few thousand tokens per step the GPU
finishes them faster than the host issues them, and the step is host-bound. With
``enable_cuda_graphs(model)`` the first training forward at a given shape records every COAT
layer's forward and backward as CUDA graphs (``torch.cuda.make_graphed_callables``, one
memory pool for all layers); later calls at that shape replay them: one launch per layer and
direction. Anything else (another shape, an attention mask, a KV cache, gradient
checkpointing, eval) runs the eager COAT path as before.

What a replay computes is what was recorded, so:

* a KV cache that transformers passes to a training forward (``use_cache`` defaults to True)
  is left empty instead of being filled with keys and values nobody reads;
* the FP8 weight cache must be off (``FP8ActivationConfig(weight_cache=False)``, what coat-train
  uses): each replay then casts the current weights, which optimizers update in place (a cache
  would be a Python-side decision, frozen at capture);
* parameters must keep their storage (in-place optimizer updates do; ``load_state_dict``
  copies in place too); ``disable_cuda_graphs(model)`` drops the graphs (re-enable to record
  again);
* forward and backward alternate, as in the usual training loop: a forward while an earlier
  graphed forward still waits for its backward runs eagerly, and a backward whose recordings
  were overwritten (a second backward with ``retain_graph=True``) raises instead of returning
  wrong gradients; gradients taken with ``torch.autograd.grad`` are the graphs' buffers,
  valid until the next replay;
* after the first micro-batch of a step a parameter's ``.grad`` is the graph's own output
  buffer (``AccumulateGrad`` takes it over), valid until the next replay: every further
  replay (the next micro-batch of a gradient accumulation, or a step after
  ``zero_grad(set_to_none=False)``) first gives such parameters a copy of their own, which
  the replay's gradients are added to in place. Every micro-batch replays;

Under ``DistributedDataParallel`` (enable the graphs on the model, then wrap it; parameters
keep their storage there): the gradients' all-reduce stays outside the graphs, started by
DDP's hooks as each replayed backward hands its gradients over; under ``no_sync()`` the
micro-batch's gradients accumulate as above, and at the synchronised one DDP takes them into
its buckets (with ``gradient_as_bucket_view=True``, ``wrap_ddp``'s, the bucket views become
the ``.grad``s; without it DDP copies the result back into ``.grad``, which the next replay's
``_own_grads`` then copies as above). With ``zero_grad(set_to_none=False)`` under DDP the
layers' gradients are copied once per step.

The layer output carries no FP8 hand-over for the next layer (which quantizes its input
itself: the same bits, one quantization more). Layer outputs (e.g. with
``output_hidden_states=True``) are the graphs' buffers too: valid until the next replay.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref

import torch
from torch import nn

from . import blocks

# Per model: enabled, the recorded key, its layers, the forward generation, the pending
# forward. Kept beside the model, not on it, so that pickling and deepcopy never see it.
_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GRAPHED = "_coat_graphed"  # on each layer: the graphed callable, or None


class _Body(nn.Module):
    """``blocks.decoder_layer`` on ``(hidden, cos, sin)`` in the compute dtype, no cache,
    with the attention ``mask`` given (launch plans; CUDA graphs record no mask): the eager
    path's arguments for that case."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, hidden, cos, sin, mask=None):
        with torch.autocast(hidden.device.type, enabled=False):
            return blocks.decoder_layer(
                self.layer.coat_ops,
                self.layer,
                hidden,
                attention_mask=mask,
                position_embeddings=(cos, sin),
                cache=None,
                config=self.layer.coat_config,
                attn_kwargs={},
                hand_over_output=False,
            )


class _LayerBody:
    """What is recorded: ``_Body`` as a function of ``(hidden, cos, sin, *params)``, the
    layer's parameters (``_layer_params``) passed as arguments and put in place for the call.

    The recording gets stand-ins of them (the same storage, new leaves), replays get the
    parameters themselves (the same addresses: nothing is copied), whose gradients then
    arrive through the replay's autograd node. Recorded with the parameters themselves,
    the recording's backward would meet their gradient accumulators, and one made on
    another stream (DDP makes them when it wraps the model, on the default stream) breaks
    the capture (cudaErrorStreamCaptureImplicit). A plain callable, not a module: a
    module's parameters would be recorded as themselves."""

    def __init__(self, layer: nn.Module):
        self.body = _Body(layer)
        self.names = ["layer." + n for n, _ in layer.named_parameters()]

    def __call__(self, hidden, cos, sin, *params, mask=None):
        given = dict(zip(self.names, params, strict=True))
        return torch.func.functional_call(self.body, given, (hidden, cos, sin, mask))


_PARAMS = "_coat_graph_params"  # on each layer: its parameters as the graphs take them


def _layer_params(layer: nn.Module) -> tuple:
    """The layer's parameters in ``named_parameters()`` order (tied ones once), without
    making their names (a launch-planned step asks for them each call: 14 us against 41 on
    a CPU)."""
    params, seen_modules, seen = [], set(), set()

    def walk(m: nn.Module) -> None:  # named_modules' pre-order, each module once
        seen_modules.add(m)
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:  # (Tensor.__hash__ is Python's)
                seen.add(id(p))
                params.append(p)
        for child in m._modules.values():
            if child is not None and child not in seen_modules:
                walk(child)

    walk(layer)
    return tuple(params)


def _coat_layers(model: nn.Module) -> list[nn.Module]:
    # By the class-level marker of ``llama._CoatDecoderLayer``: ``llama`` imports this module,
    # so this one does not import it back.
    return [m for m in model.modules() if getattr(type(m), "_coat_decoder_layer", False) is True]


def replayable_layers(model: nn.Module, name: str, what: str) -> list[nn.Module]:
    """The COAT decoder layers of ``model`` for ``name`` (``enable_cuda_graphs`` or
    ``enable_launch_plans``), which replays ``what`` was recorded: raises ``ValueError``
    for a model without COAT layers, a layer appearing twice, compiled layers, or a layer
    with the FP8 weight cache on (a Python-side decision a recording cannot hold)."""
    layers = _coat_layers(model)
    if not layers:
        raise ValueError(f"{name} needs a model converted with apply_coat first")
    if len({id(layer) for layer in layers}) != len(layers):
        raise ValueError(f"{name}: a decoder layer appears twice in the model")
    # compiling.COMPILED (that module imports this one): both would take over the layers.
    if any(getattr(layer, "_coat_compiled", False) for layer in layers):
        raise ValueError(
            f"{name}: the decoder layers are compiled (compile_layers); {what} and compiled "
            "layers both take over the layers: use one of them"
        )
    for layer in layers:
        cfg = layer.coat_config
        if cfg is None or cfg.weight_cache:
            raise ValueError(
                f"{what} replay what was recorded, so the FP8 weight cache (a Python-side "
                "decision) must be off: "
                "apply_coat(model, config=FP8ActivationConfig(weight_cache=False))"
            )
    return layers


def enable_cuda_graphs(model: nn.Module) -> nn.Module:
    """Let the COAT decoder layers of ``model`` (after ``apply_coat``) run their training
    forward and backward as CUDA graphs, recorded at the first training forward of each new
    input shape (see the module docstring for the conditions). Returns ``model``."""
    layers = replayable_layers(model, "enable_cuda_graphs", "CUDA graphs")
    for layer in layers:
        if any(type(p.data) is not torch.Tensor for p in layer.parameters()):
            raise ValueError(
                "enable_cuda_graphs needs plain parameters that keep their storage (FSDP and "
                "other tensor subclasses re-gather or move them): use it on one process or "
                "under DDP"
            )
        impl = layer.self_attn.config._attn_implementation
        if impl != "sdpa":
            raise ValueError(
                f"enable_cuda_graphs supports attn_implementation='sdpa', got {impl!r}"
            )
    devices = {p.device for layer in layers for p in layer.parameters()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(
            f"enable_cuda_graphs needs every decoder layer on one CUDA device, got {devices}"
        )
    disable_cuda_graphs(model)
    _install(model, layers)
    return model


def _state(model: nn.Module) -> dict | None:
    """The graphs' state of ``model``, or of the model a DDP wrapper holds as ``.module``
    when the graphs were enabled on that one (inward only: enabled on the wrapper, the
    wrapped model answers for itself)."""
    state = _STATES.get(model)
    inner = getattr(model, "module", None)
    if state is None and isinstance(inner, nn.Module):
        state = _STATES.get(inner)
    return state


def cuda_graphs_enabled(model: nn.Module) -> bool:
    """Whether ``enable_cuda_graphs(model)`` is in force (not undone by
    ``disable_cuda_graphs``); ``model`` may be the DDP wrapper of the model it was given."""
    state = _state(model)
    return state is not None and state["enabled"]


def _owner_state(layer: nn.Module) -> tuple:
    """``(owner, state)``: the model (or wrapper) that ``enable_cuda_graphs`` gave ``layer``
    to and its graphs' state, each None where there is none."""
    ref = layer.__dict__.get("_coat_graph_owner")
    owner = None if ref is None else ref()
    return owner, None if owner is None else _STATES.get(owner)


def _layer_state(layer: nn.Module) -> dict | None:
    return _owner_state(layer)[1]


def layer_graphed(layer: nn.Module) -> bool:
    """Whether ``layer`` belongs to a model (or a wrapper of it) whose CUDA graphs are on."""
    state = _layer_state(layer)
    return state is not None and state["enabled"]


def cuda_graph_replays(model: nn.Module) -> int:
    """Training forwards of ``model`` (or of the model its DDP wrapper holds) that ran its COAT
    layers from CUDA graphs since ``enable_cuda_graphs`` (0 when graphs are off, or every
    call ran eagerly)."""
    state = _state(model)
    return 0 if state is None else state["gen"]


def _install(model: nn.Module, layers: list[nn.Module]) -> None:
    _STATES[model] = {"enabled": True, "key": None, "layers": layers, "gen": 0}
    for layer in layers:
        # In __dict__, not as attributes: nn.Module would register the model as a child.
        layer.__dict__["_coat_graph_owner"] = weakref.ref(model)
        layer.__dict__[_GRAPHED] = None


def disable_cuda_graphs(model: nn.Module) -> nn.Module:
    """Drop the recorded graphs (and their memory pool); the layers run eagerly again.
    ``model``: the one given to ``enable_cuda_graphs``, or its DDP wrapper."""
    _STATES.pop(model, None)
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module):
        _STATES.pop(inner, None)
    enabled = False
    for layer in _coat_layers(model):
        for attr in LAYER_KEYS:
            enabled |= layer.__dict__.pop(attr, None) is not None
    if enabled:
        gc.collect()  # each graphed body and its layer reference each other
    return model


# What a layer holds for its graphs (not copied by pickling or deepcopy: the graphs belong
# to the original model's tensors).
LAYER_KEYS = (_GRAPHED, "_coat_graph_owner", _PARAMS)


def drop_recording(layer: nn.Module) -> None:
    """Drop the recording of the model that ``layer`` belongs to (one memory pool holds all
    its layers' graphs), keeping the graphs enabled: the next graphed training forward
    records again. A recording holds stand-ins sharing the parameters' storage, so
    ``model.to(...)`` (``nn.Module._apply``, which a COAT layer forwards here first) would
    otherwise keep every layer's old weights alive until then."""
    state = _layer_state(layer)
    if state is None or state["key"] is None:
        return
    state["key"] = None
    for each in state["layers"]:
        each.__dict__[_GRAPHED] = None
        each.__dict__.pop(_PARAMS, None)


def _signature(layers: list[nn.Module]) -> tuple:
    """What a recording depends on besides the input shapes: every parameter (the object,
    by id: the recording keeps the objects alive in ``_PARAMS``, so an id is not reused
    while it stands), its storage, dtype and requires_grad (``.to()``, ``.data =``, a new
    Parameter, unfreezing record again) and each layer's FP8 config and op set, the objects
    themselves: compared by value and kept alive by the key."""
    return tuple(
        (layer.coat_config, layer.coat_ops, *((id(p), p.data_ptr(), p.dtype, p.requires_grad)
                                  for p in layer.parameters()))
        for layer in layers
    )  # fmt: skip


def _key(hidden, cos, sin) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in (hidden, cos, sin))


def _record(model: nn.Module, key: tuple, hidden, cos, sin) -> None:
    state = _STATES[model]
    layers = state["layers"]
    state["key"] = None  # a failed recording records again next time
    for layer in layers:
        layer.__dict__[_GRAPHED] = None  # a previous shape's graphs go first (their memory:
    gc.collect()  # each graphed body and its layer reference each other)
    device = hidden.device
    torch.cuda.synchronize(device)
    # Recording runs each layer a few times on random inputs: leave the RNG as it was.
    with torch.random.fork_rng(devices=[device]), torch.cuda.device(device):
        samples = []
        for layer in layers:
            h = torch.randn(hidden.shape, device=device, dtype=hidden.dtype) * 0.02
            stand_ins = (p.detach().requires_grad_(p.requires_grad) for p in _layer_params(layer))
            samples.append((h.requires_grad_(), cos.detach().clone(), sin.detach().clone(),
                            *stand_ins))  # fmt: skip
        # The recording differentiates stand-ins of the parameters (_LayerBody), never the
        # parameters' own gradient accumulators (DDP makes those when it wraps the model).
        with torch.autocast("cuda", enabled=False), torch.enable_grad(), _quiet_mismatch():
            graphed = torch.cuda.make_graphed_callables(
                tuple(_LayerBody(layer) for layer in layers), tuple(samples)
            )
    for layer, fn in zip(layers, graphed, strict=True):
        layer.__dict__[_GRAPHED] = fn
        layer.__dict__[_PARAMS] = _layer_params(layer)
    state["key"] = key


@contextlib.contextmanager
def _quiet_mismatch():
    """Without torch's warning that a gradient accumulator's stream differs from its
    producer's, which ``make_graphed_callables`` set off once per process (torch 2.11, an
    H100): it differentiates the samples and stand-ins with ``torch.autograd.grad`` on
    streams of its own (warm-up, then capture), which accumulates nothing, while torch
    checks the streams of every gradient reaching an accumulator node. The training
    backward's accumulators are not silenced (outside this context)."""
    get = getattr(torch._C, "_warn_on_accumulate_grad_stream_mismatch", None)
    set_ = getattr(torch._C, "_set_warn_on_accumulate_grad_stream_mismatch", None)
    if get is None or set_ is None:  # (a torch without the switch: filter the warning)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream")
            yield
        return
    was = get()
    set_(False)
    try:
        yield
    finally:
        set_(was)


def _cache_unused(layer: nn.Module, cache) -> bool:
    """No KV cache, or an empty one: transformers hands a training forward a fresh
    ``DynamicCache`` unless ``use_cache=False``; the eager path fills it with every layer's
    keys and values, which a training step never reads. A graphed step leaves it empty (the
    keys and values are not kept alive with it); a cache holding tokens runs eagerly."""
    if cache is None:
        return True
    length = getattr(cache, "get_seq_length", None)
    return length is not None and length(layer.self_attn.layer_idx) == 0


class _Guard(torch.autograd.Function):
    """Identity on the last graphed layer's output, whose backward comes before any layer's
    backward replay: it refuses a backward that would run on overwritten recordings (a
    later graphed forward replayed since, or this one's backward already ran once)."""

    @staticmethod
    def forward(ctx, x, state, gen):
        ctx.state, ctx.gen, ctx.done = state, gen, False
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.done or ctx.state.get("gen") != ctx.gen:
            raise RuntimeError(
                "CUDA-graphed COAT layers: this backward belongs to a forward whose recorded "
                "activations were overwritten (by a later forward, or by this backward "
                "running twice); run each backward once, before the next forward, or call "
                "coat_models.disable_cuda_graphs(model)"
            )
        ctx.done = True
        ctx.state["pending"] = None
        return grad, None, None


# Layer-call keyword arguments that do not change a training forward of the recorded case.
_NEUTRAL_KWARGS = {"position_ids", "cache_position", "num_items_in_batch"}


_OWN = "_coat_own_grad"  # on a .grad tensor that is no graph's output buffer


def _own_grads(layers: list[nn.Module]) -> None:
    """Give every graphed layer parameter that holds a ``.grad`` one of its own.

    A replayed backward writes the weight gradients into the graph's output buffers, and
    ``AccumulateGrad`` takes such a buffer over as ``.grad`` when the parameter has none
    (the first micro-batch after ``zero_grad(set_to_none=True)``): the next replay would
    overwrite it. So before a replay, a ``.grad`` that may be such a buffer is replaced by a
    copy (once per step: the copy is marked), and the replay's gradient is then added to it
    in place, as in eager accumulation. The same values; one copy of the layers' gradients
    per optimizer step with gradient accumulation, none without."""
    for layer in layers:
        for p in layer.parameters():
            g = p.grad
            if g is not None and not getattr(g, _OWN, False):
                g = g.clone()
                setattr(g, _OWN, True)
                p.grad = g


def _may_replay(state: dict, layers: list[nn.Module]) -> bool:
    """Decided at the first layer of each forward: graphs replay unless the previous graphed
    forward still waits for its backward (its recordings must not be overwritten); the
    layers' gradients are then made their own (``_own_grads``)."""
    pending = state.get("pending")
    if pending is not None and pending() is not None:
        return False
    _own_grads(layers)
    return True


def _on_gpu(hidden) -> bool:
    return hidden.is_cuda


def run_graphed(layer: nn.Module, hidden, cos_sin, attention_mask, cache, kwargs, checkpointing):
    """The layer's output from its graph, or None when this call must run eagerly."""
    owner, state = _owner_state(layer)
    if state is None or not state["enabled"]:
        return None
    layers = state["layers"]
    first, last = layer is layers[0], layer is layers[-1]
    if first:
        state["replay"] = False  # decided below, for this forward only
    if attention_mask is not None or checkpointing or not _cache_unused(layer, cache):
        return None
    if set(kwargs) - _NEUTRAL_KWARGS or len(cos_sin) != 2:
        return None
    cos, sin = cos_sin
    if not (_on_gpu(hidden) and torch.is_grad_enabled()):
        return None
    shapes = _key(hidden, cos, sin)
    if first:
        state["replay"] = _may_replay(state, layers)
        if state["replay"]:
            key = (shapes, _signature(layers))
            if state["key"] != key:
                _record(owner, key, hidden, cos, sin)
            state["gen"] += 1
    if not state["replay"]:
        return None
    fn = layer.__dict__.get(_GRAPHED)
    if fn is None or state["key"] is None or state["key"][0] != shapes:
        return None
    out = fn(hidden, cos, sin, *layer.__dict__[_PARAMS])
    if last:
        out = _Guard.apply(out, state, state["gen"])
        # Pending until its backward runs or its autograd graph is dropped.
        state["pending"] = weakref.ref(out.grad_fn)
    return out
