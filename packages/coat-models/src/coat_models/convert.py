"""``apply_coat`` / ``revert_coat``: the one entry point above ``llama`` and ``vila``.

A LLaVA model holds a Llama-shaped language model, so ``vila`` builds on ``llama``; the
choice between them lives here, above both, so that neither imports the other back.
"""

from __future__ import annotations

from fp8_activations import FP8ActivationConfig, revert_fp8_activations
from fp8_activations.ops import drop_cached_weight_fp8
from torch import nn

from . import graphs, llama, vila
from .llama import FilterFn


def _is_vlm(model: nn.Module) -> bool:
    """A LLaVA-style model (``coat_models.vila``): vision tower, projector, language model."""
    parts = ("vision_tower", "multi_modal_projector", "language_model")
    return any(
        isinstance(inner, nn.Module) and all(hasattr(inner, p) for p in parts)
        for inner in (model, getattr(model, "model", None))
    )


def apply_coat(
    model: nn.Module,
    *,
    config: FP8ActivationConfig | None = None,
    module_filter_fn: FilterFn | None = None,
    fused_loss: bool = True,
) -> nn.Module:
    """Convert a Llama-shaped Hugging Face model to COAT FP8 training, in place.

    While ``model.training`` and autograd is on, each decoder layer runs the three COAT
    blocks (``coat_models.blocks``) with FP8 GEMMs and FP8 activations saved for backward;
    ``model.eval()`` or ``torch.no_grad()`` runs the original code, bit for bit. The
    embedding, final norm and LM head stay in the model's dtype. Parameters, buffers and the
    state dict are untouched: ``save_pretrained`` writes a standard checkpoint and
    ``from_pretrained`` weights can be loaded before or after conversion.

    Args:
        model: ``LlamaForCausalLM``, ``LlamaModel`` or another Llama-shaped model (Mistral,
            Qwen2, ...) of transformers 5.17+, on any device and in any float dtype. A
            LLaVA-style model (``LlavaForConditionalGeneration``) goes to
            ``coat_models.vila.apply_coat_vlm`` (language model and projector).
        config: keyword-only, ``fp8_activations.FP8ActivationConfig`` (group size, formats, weight
            cache, backend); ``None`` takes its defaults.
        module_filter_fn: ``(module, fqn) -> bool``, with ``fqn`` the module's name in
            ``model.named_modules()`` (e.g. ``"model.layers.3"``). Called once for each
            decoder layer (for a LLaVA model also, top down, for every module under the
            projector, and under the tower with ``vision=True``); those for which it
            returns False stay plain. ``None``:
            convert all.
        fused_loss: for ``*ForCausalLM`` models, compute the training loss (when ``labels``
            are passed) chunk by chunk from the hidden states instead of building the full
            ``(batch, seq, vocab)`` logits and their fp32 copy; such calls return
            ``logits=None``.

    Returns the same ``model``. Raises ``TypeError`` naming what is supported otherwise,
    and for a model with adapters (PEFT's LoRA) around its layers: COAT would bypass them.
    A projection wrapped after conversion makes that layer raise when it would train.
    Calling it again re-applies with the new arguments (one whose ``module_filter_fn``
    raises leaves the model as it was, but for a LLaVA model's CUDA graphs).

    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=256, ...))
    >>> apply_coat(model, module_filter_fn=lambda m, fqn: fqn != "model.layers.0").train()
    >>> model(input_ids, labels=input_ids).loss.backward()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_coat takes a torch.nn.Module, got {type(model).__name__}")
    if isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's wrapper
        raise TypeError(
            "apply_coat takes the model, not torch.compile's wrapper of it (the wrapper's "
            "compiled forward would bypass the fused loss): call apply_coat(model) first, "
            "then torch.compile, or coat_models.compile_layers(model)"
        )
    llama.check_flags(fused_loss=fused_loss)
    if _is_vlm(model):  # (converted before: with the tower options it was given then)
        options = getattr(model, "_coat_vlm", {}).get("options", {})
        return vila.apply_coat_vlm(
            model, config=config, module_filter_fn=module_filter_fn, fused_loss=fused_loss,
            **options,
        )  # fmt: skip
    problem = llama._adapter_problem(model)
    if problem is not None:
        raise TypeError(f"apply_coat cannot convert {type(model).__name__}: {problem}")
    return llama.convert_llama(
        model, config=config, module_filter_fn=module_filter_fn, fused_loss=fused_loss
    )


def revert_coat(model: nn.Module) -> nn.Module:
    """Undo ``apply_coat`` in place: every module gets its original class back (a LLaVA
    model also its FP8-activation modules and its tower's ``requires_grad``)."""
    graphs.disable_cuda_graphs(model)
    # Wherever apply_coat left a LLaVA conversion: on the model, or on a part of it that was
    # converted alone (apply_coat(m.model), then revert_coat(m): its projector stayed FP8).
    for module in list(model.modules()):
        if vila.is_coat_vlm(module):
            vila.revert_coat_vlm(module)

    # and the FP8-activation modules that apply_coat of a model above this one made here
    # (apply_coat(m), then revert_coat(m.model): its projector stayed FP8); not a user's own
    def made_by_apply(m, fqn):
        return m.__dict__.get(vila.PART_MODULE, False)

    for name, child in list(model.named_children()):
        reverted = revert_fp8_activations(child, module_filter_fn=made_by_apply)
        if reverted is not child:
            setattr(model, name, reverted)
    drop_cached_weight_fp8(model.parameters())  # (they would hold them while they live)
    return llama.revert_classes(model)
