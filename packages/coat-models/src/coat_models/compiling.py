"""``compile_layers(model)``: ``torch.compile`` on each decoder layer, the supported way to
compile a COAT model.

Under ``torch.compile`` a COAT layer is traced: its FP8 kernels are ``torch.library.triton_op``
operators, so Inductor sees the Triton kernels themselves and calls them from its generated
code, and the layer's forward and backward each run as one compiled graph with one autograd
node, instead of one Python call and autograd node per op. What tracing gives up: an op's
output hands no FP8 copy to the next op (the next op quantizes its input again: the same
bits, one quantization launch more), and the FP8 weight cache is not used (each micro-batch
casts the weights again).

One compiled graph serves every layer of a model (the layers have the same code and shapes),
so compilation costs about one layer's worth whatever the depth; compiling the whole model
(``torch.compile(model)``) also works but traces every layer into one graph. Only training
forwards (``layer.training`` with gradients on) run compiled: eval and generate fill
transformers' KV cache, indexed by the layer's number, which would trace a graph per layer
(and past dynamo's recompile limit, 8, raise under ``fullgraph=True``); they run the layers'
own forward.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from . import graphs

COMPILED = "_coat_compiled"  # on each layer compile_layers compiled: True

# Inductor keeps fused bf16 intermediates in fp32 unless told to round them as eager does:
# told, the compiled layer's element-wise glue (casts, the residual gradients' sums) writes
# eager's bits.
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
    length: training shapes are fixed). With the default backend (Inductor) and no ``mode``,
    bf16 intermediates are rounded as eager rounds them
    (``options={"emulate_precision_casts": True}``, merged with ``options`` given).

    Training forwards run compiled, others the layer's own forward (see the module
    docstring). Call it after ``apply_coat`` (the compiled forward is the one the layer has
    then). Raises ``TypeError`` when ``model`` has no such layer, ``ValueError`` when its
    layers are already compiled or replay CUDA graphs (``disable_cuda_graphs`` first).
    """
    layers = text_decoder_layers(model)
    if not layers:
        raise TypeError(
            f"{type(model).__name__} has no transformer layers (transformers' "
            "GradientCheckpointingLayer) to compile: compile it with torch.compile instead"
        )
    if graphs.cuda_graphs_enabled(model):
        raise ValueError(
            "compile_layers: the model's COAT layers replay CUDA graphs; both take over the "
            "layers: call disable_cuda_graphs(model) first"
        )
    if any(getattr(layer, COMPILED, False) for layer in layers):
        raise ValueError("compile_layers: the model's layers are compiled already")
    kwargs = {"fullgraph": True, "dynamic": False, **compile_kwargs}
    if kwargs.get("backend", "inductor") == "inductor" and kwargs.get("mode") is None:
        kwargs["options"] = {**_INDUCTOR_OPTIONS, **(kwargs.get("options") or {})}
    for layer in layers:
        layer.forward = _training_compiled(layer, torch.compile(layer.forward, **kwargs))
        setattr(layer, COMPILED, True)
    return model


def _training_compiled(layer: nn.Module, compiled):
    """The layer's forward: ``compiled`` (of the layer's own forward) in training with
    gradients, the layer's own forward otherwise."""
    eager = layer.forward

    def forward(*args, **kwargs):
        if layer.training and torch.is_grad_enabled():
            return compiled(*args, **kwargs)
        return eager(*args, **kwargs)

    return forward
