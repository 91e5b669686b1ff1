"""``compile_layers(model)``: ``torch.compile`` on each decoder layer, the supported way to
compile a COAT model.

Under ``torch.compile`` a COAT layer is traced: its FP8 kernels are ``torch.library.triton_op``
operators, so Inductor sees the Triton kernels themselves and calls them from its generated
code, and the layer's forward and backward each run as one compiled graph with one autograd
node, instead of one Python call and autograd node per op. A layer's weights are cast in
one launch inside the graph (``fp8_activations.cast_weights`` traced); with the FP8 weight
cache (``FP8ActivationConfig.weight_cache``) the compiled forward casts none: the cache is
read before the call, its stale copies refreshed in one launch, and the copies go in as
inputs, so micro-batches after the first of an optimizer step reuse them as eager layers do.
What tracing gives up: an op's output hands no FP8 copy to the next op (the next op
quantizes its input again: the same bits, one quantization launch more).

One compiled graph serves every layer of a model (the layers have the same code and shapes),
so compilation costs about one layer's worth whatever the depth; compiling the whole model
(``torch.compile(model)``) also works but traces every layer, with graph breaks (the COAT
classes' argument binding; ``fullgraph=True`` raises there). Only training
forwards (``layer.training`` with gradients on) run compiled: eval and generate fill
transformers' KV cache, indexed by the layer's number, which would trace a graph per layer
(and past dynamo's recompile limit, 8, raise under ``fullgraph=True``); they run the layers'
own forward.

Activation checkpointing, FSDP2 and DDP stay outside the compiled forward: transformers'
checkpointing runs it inside ``torch.utils.checkpoint`` (recomputed in backward), FSDP2's and
DDP's hooks run around it, as they run around an eager layer.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from . import blocks, graphs, llama

COMPILED = "_coat_compiled"  # on each layer compile_layers compiled: True

# Inductor keeps fused bf16 intermediates in fp32 unless told to round them as eager does:
# told, the compiled layer's element-wise glue (casts, the residual gradients' sums) writes
# eager's bits. (Inductor's static launcher for COAT's own kernels,
# ``static_launch_user_defined_triton_kernels``, gives coat-train's compiled 125m step no
# measurable speed: BENCHMARKS.md.)
_INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


def text_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer layers of a Hugging Face model's text decoder (``get_decoder()``;
    ``model`` itself when it has none), COAT or not: the modules whose class is a
    ``GradientCheckpointingLayer``, transformers' base of decoder layers. A LLaVA model's
    vision tower is left out: its layers run transformers' output-capturing hooks, which
    dynamo cannot trace in one graph. (``distributed.decoder_layers``, what FSDP shards,
    takes the tower's layers too.)"""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    root = decoder if isinstance(decoder, nn.Module) else model
    return [m for m in root.modules() if isinstance(m, GradientCheckpointingLayer)]


def compile_layers(model: nn.Module, **compile_kwargs) -> nn.Module:
    """Compile each layer of ``model``'s text decoder in place (``torch.compile`` of its
    forward; the layers: ``text_decoder_layers``) and return ``model``. ``compile_kwargs``
    go to ``torch.compile``; the defaults are ``fullgraph=True`` (a layer that cannot be
    traced in one piece raises, naming why) and ``dynamic=False`` (one graph per sequence
    length and batch size, also with ``dynamic=True``: training shapes are fixed; a call
    past ``torch._dynamo.config.recompile_limit`` (8) shapes raises ``RuntimeError`` saying
    so). With the default backend (Inductor) and no ``mode``,
    bf16 intermediates are rounded as eager rounds them
    (``options={"emulate_precision_casts": True}``, merged with ``options`` given).

    Training forwards run compiled, others the layer's own forward (see the module
    docstring). Call it after ``apply_coat`` (a layer converted or reverted later has its new
    class's forward compiled when it next trains), before or after
    ``enable_activation_checkpointing``, and before ``shard_model`` /
    ``wrap_ddp`` (coat-train's order, the one tested). Raises ``TypeError`` when ``model``
    has no such layer, ``ValueError`` when its layers are already compiled or replay CUDA
    graphs (``disable_cuda_graphs`` first).
    """
    layers = text_decoder_layers(model)
    if not layers:
        raise TypeError(
            f"{type(model).__name__} has no transformer layers (transformers' "
            "GradientCheckpointingLayer) to compile: compile it with torch.compile instead"
        )
    if any(graphs.layer_graphed(layer) for layer in layers):
        # (by layer: the graphs may have been enabled on a wrapper of this model)
        raise ValueError(
            "compile_layers: the model's COAT layers replay CUDA graphs; both take over the "
            "layers: call disable_cuda_graphs on the model they were enabled on first"
        )
    if any(getattr(layer, COMPILED, False) for layer in layers):
        raise ValueError("compile_layers: the model's layers are compiled already")
    kwargs = {"fullgraph": True, "dynamic": False, **compile_kwargs}
    if kwargs.get("backend", "inductor") == "inductor" and kwargs.get("mode") is None:
        kwargs["options"] = {**_INDUCTOR_OPTIONS, **(kwargs.get("options") or {})}
    for layer in layers:
        layer.forward = CompiledForward(layer, kwargs, vars(layer).get("forward"))
        setattr(layer, COMPILED, True)
    return model


# transformers >= 5.2x checkpoints a layer inside its class's forward (a wrapper made by
# GradientCheckpointingLayer.__init_subclass__); earlier versions in __call__, around forward.
_CHECKPOINTING_WRAPPER = "forward_with_checkpointing"


def _plain_forward(layer: nn.Module):
    """``(forward, checkpointed)``: the class's forward bound to ``layer``, without
    transformers' checkpointing wrappers (one per subclass: apply_coat's, FSDP2's), and
    whether any was taken off. Traced, the wrapper's warning (a logger call) would break the
    graph; the checkpointing itself is done around the compiled forward (``CompiledForward``)."""
    fn, checkpointed = type(layer).forward, False
    # The wrapper carries the name of what it wraps (functools.wraps), its code its own.
    while getattr(getattr(fn, "__code__", None), "co_name", "") == _CHECKPOINTING_WRAPPER:
        fn, checkpointed = fn.__wrapped__, True
    return fn.__get__(layer), checkpointed


# Dynamo's error for a call past the recompile limit under fullgraph=True.
_RECOMPILE_LIMIT = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())

# What transformers' checkpointing sets for a checkpointed layer: nothing is cached.
_NO_CACHE = {"use_cache": False}
_CACHE_NAMES = ("cache", "past_key_values", "layer_past")


class CompiledForward:
    """A layer's forward after ``compile_layers`` (set on the layer as ``forward``): the
    compiled forward in training with gradients (inside ``torch.utils.checkpoint`` as
    transformers does it when the layer's checkpointing is on and ``_plain_forward`` took its
    wrapper off), the layer's own forward otherwise.

    ``own_forward``: a forward set on the instance before (compiled instead of the class's).
    A copy of the layer (``copy.deepcopy``, pickling) gets a ``CompiledForward`` of its own,
    compiled again for the copy when first called: a shared one would run the original
    layer's weights. Without ``own_forward``, the forward is the one of the layer's class
    when called: ``apply_coat``, ``revert_coat`` and FSDP2 change the class.
    """

    # apply_coat accepts a layer whose instance forward is this (it runs the class's).
    coat_compiled_forward = True

    def __init__(self, layer: nn.Module, compile_kwargs: dict, own_forward=None):
        self.layer, self.compile_kwargs, self.own_forward = layer, compile_kwargs, own_forward
        self.cls = self.code = None
        if own_forward is None:
            self._bind()
        else:
            self.checkpointed, self.eager = False, own_forward
            self.compiled = torch.compile(own_forward, **compile_kwargs)

    def _bind(self) -> None:
        # The class's forward now. Compiled again only for other code: FSDP2's subclass adds
        # a checkpointing wrapper (transformers 5.2x) around the same forward.
        layer = self.layer
        self.cls = type(layer)
        inner, self.checkpointed = _plain_forward(layer)
        self.eager = self.cls.forward.__get__(layer)
        if inner.__func__ is not self.code:
            self.code = inner.__func__
            self.compiled = torch.compile(inner, **self.compile_kwargs)

    def __call__(self, *args, **kwargs):
        layer = self.layer
        if self.cls is not None and type(layer) is not self.cls:
            # Converted, reverted or sharded since: the old class's forward would train
            # plain after apply_coat, raise after revert_coat.
            self._bind()
        if not (layer.training and torch.is_grad_enabled()):
            return self.eager(*args, **kwargs)
        ops = getattr(layer, "coat_ops", None)
        if ops is not None:
            llama.check_coat_layer(layer)  # (what the traced check cannot read, eagerly)
            kwargs[llama.CHECKED] = True
            # The FP8 weight cache, read here (Python state a graph cannot read): the layer's
            # copies go in as inputs, refreshed in one launch when the weights changed.
            casts = blocks.layer_weight_casts(ops, layer, llama.layer_config(layer))
            if casts is not None:
                kwargs[blocks.WEIGHT_CASTS] = casts
        if self.checkpointed and layer.gradient_checkpointing:
            if "use_cache" in kwargs:
                kwargs.update(_NO_CACHE)
            if not getattr(layer, "_can_checkpoint_with_cache", False):
                kwargs.update({k: None for k in _CACHE_NAMES if k in kwargs})
            run = functools.partial(self._run, **kwargs)
            return layer._gradient_checkpointing_func(run, *args)
        return self._run(*args, **kwargs)

    def _run(self, *args, **kwargs):
        try:
            return self.compiled(*args, **kwargs)
        except _RECOMPILE_LIMIT as e:
            limit = torch._dynamo.config.recompile_limit
            raise RuntimeError(
                f"compile_layers: the layers' forward was compiled {limit} times "
                "(torch._dynamo.config.recompile_limit) and this call needs another graph: "
                "each sequence length and batch size compiles one (also with dynamic=True), "
                "and so does each layer when a KV cache holding tokens is passed. Pad or "
                "bucket inputs to a few lengths, or raise torch._dynamo.config."
                "recompile_limit (dynamo's log names the guard that failed)"
            ) from e

    def __deepcopy__(self, memo):
        layer = memo.get(id(self.layer))
        if layer is None:  # copied without its layer: it still serves the original
            return self
        own = copy.deepcopy(self.own_forward, memo)
        return CompiledForward(layer, self.compile_kwargs, own)

    def __reduce__(self):
        return CompiledForward, (self.layer, self.compile_kwargs, self.own_forward)
