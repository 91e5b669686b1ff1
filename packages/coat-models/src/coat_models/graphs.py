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
* the FP8 weight cache must be off (``FP8Config(weight_cache=False)``, what coat-train uses):
  each replay then casts the current weights, which optimizers update in place (a cache
  would be a Python-side decision, frozen at capture);
* parameters must keep their storage (in-place optimizer updates do; ``load_state_dict``
  copies in place too); ``disable_cuda_graphs(model)`` drops the graphs (re-enable to record
  again);
* forward and backward must alternate (a second forward before the backward would overwrite
  the saved activations), as in the usual training loop;
* a parameter's ``.grad`` is then the graph's own output buffer, valid until the next replay
  of any layer (the graphs share one memory pool): so graphs replay only while no graphed
  layer's parameter has a ``.grad``, i.e. the first micro-batch after
  ``zero_grad(set_to_none=True)``. Further micro-batches of a gradient accumulation run
  eagerly (and add to those buffers in place, correctly); ``zero_grad(set_to_none=False)``
  keeps every step eager.

The layer output carries no FP8 hand-over for the next layer (which quantizes its input
itself: the same bits, one quantization more).
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from . import blocks

_GRAPHS = "_coat_cuda_graphs"  # on the model: {"enabled": bool, "key": shape key | None}
_GRAPHED = "_coat_graphed"  # on each layer: the graphed callable, or None


class _LayerBody(nn.Module):
    """What is recorded: ``blocks.decoder_layer`` on ``(hidden, cos, sin)`` in the compute
    dtype, no mask, no cache (the eager path's arguments for that case)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, hidden, cos, sin):
        with torch.autocast("cuda", enabled=False):
            return blocks.decoder_layer(
                blocks.FP8_OPS,
                self.layer,
                hidden,
                attention_mask=None,
                position_embeddings=(cos, sin),
                cache=None,
                config=self.layer.coat_config,
                attn_kwargs={},
                hand_over_output=False,
            )


def _coat_layers(model: nn.Module) -> list[nn.Module]:
    from .llama import _CoatDecoderLayer

    return [m for m in model.modules() if isinstance(m, _CoatDecoderLayer)]


def enable_cuda_graphs(model: nn.Module) -> nn.Module:
    """Let the COAT decoder layers of ``model`` (after ``apply_coat``) run their training
    forward and backward as CUDA graphs, recorded at the first training forward of each new
    input shape (see the module docstring for the conditions). Returns ``model``."""
    layers = _coat_layers(model)
    if not layers:
        raise ValueError("enable_cuda_graphs needs a model converted with apply_coat first")
    for layer in layers:
        cfg = layer.coat_config
        if cfg is None or cfg.weight_cache:
            raise ValueError(
                "CUDA graphs replay what was recorded, so the FP8 weight cache (a Python-side "
                "decision) must be off: apply_coat(model, FP8Config(weight_cache=False))"
            )
        if not next(layer.parameters()).is_cuda:
            raise ValueError("enable_cuda_graphs needs the model on a CUDA device")
        impl = layer.self_attn.config._attn_implementation
        if impl != "sdpa":
            raise ValueError(
                f"enable_cuda_graphs supports attn_implementation='sdpa', got {impl!r}"
            )
    setattr(model, _GRAPHS, {"enabled": True, "key": None, "layers": layers})
    for layer in layers:
        # In __dict__, not as attributes: nn.Module would register the model as a child.
        layer.__dict__["_coat_graph_owner"] = weakref.ref(model)
        layer.__dict__[_GRAPHED] = None
    return model


def disable_cuda_graphs(model: nn.Module) -> nn.Module:
    """Drop the recorded graphs (and their memory pool); the layers run eagerly again."""
    if hasattr(model, _GRAPHS):
        delattr(model, _GRAPHS)
    for layer in _coat_layers(model):
        for attr in (_GRAPHED, "_coat_graph_owner"):
            layer.__dict__.pop(attr, None)
    gc.collect()  # each graphed body and its layer reference each other
    return model


def _key(hidden, cos, sin) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in (hidden, cos, sin))


def _record(model: nn.Module, key: tuple, hidden, cos, sin) -> None:
    layers = getattr(model, _GRAPHS)["layers"]
    for layer in layers:
        layer.__dict__[_GRAPHED] = None  # a previous shape's graphs go first (their memory:
    gc.collect()  # each graphed body and its layer reference each other)
    torch.cuda.synchronize(hidden.device)
    samples = []
    for _ in layers:
        h = torch.randn(hidden.shape, device=hidden.device, dtype=hidden.dtype) * 0.02
        samples.append((h.requires_grad_(), cos.detach().clone(), sin.detach().clone()))
    with torch.autocast("cuda", enabled=False), torch.enable_grad():
        graphed = torch.cuda.make_graphed_callables(
            tuple(_LayerBody(layer) for layer in layers), tuple(samples)
        )
    for layer, fn in zip(layers, graphed, strict=True):
        layer.__dict__[_GRAPHED] = fn
    getattr(model, _GRAPHS)["key"] = key


def _cache_unused(layer: nn.Module, cache) -> bool:
    """No KV cache, or an empty one: transformers hands a training forward a fresh
    ``DynamicCache`` unless ``use_cache=False``; the eager path fills it with every layer's
    keys and values, which a training step never reads. A graphed step leaves it empty (the
    keys and values are not kept alive with it); a cache holding tokens runs eagerly."""
    if cache is None:
        return True
    length = getattr(cache, "get_seq_length", None)
    return length is not None and length(layer.self_attn.layer_idx) == 0


def run_graphed(layer: nn.Module, hidden, cos_sin, attention_mask, cache, kwargs, checkpointing):
    """The layer's output from its graph, or None when this call must run eagerly."""
    ref = layer.__dict__.get("_coat_graph_owner")
    owner = None if ref is None else ref()
    state = None if owner is None else getattr(owner, _GRAPHS, None)
    if state is None or not state["enabled"]:
        return None
    if attention_mask is not None or checkpointing or not _cache_unused(layer, cache):
        return None
    if set(kwargs) - {"position_ids", "cache_position"} or len(cos_sin) != 2:
        return None
    cos, sin = cos_sin
    if not (hidden.is_cuda and torch.is_grad_enabled()):
        return None
    layers = state["layers"]
    if layer is layers[0]:  # once per forward pass: may the graphs replay in this one?
        state["replay"] = all(p.grad is None for lay in layers for p in lay.parameters())
    if not state.get("replay"):
        return None
    key = _key(hidden, cos, sin)
    if state["key"] != key:
        _record(owner, key, hidden, cos, sin)
    fn = layer.__dict__.get(_GRAPHED)
    if fn is None:
        return None
    out = fn(hidden, cos, sin)
    return out
