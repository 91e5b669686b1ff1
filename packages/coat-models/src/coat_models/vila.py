"""COAT for VILA / LLaVA-style vision-language models (``LlavaForConditionalGeneration``).

A LLaVA model is a vision tower (SigLIP or CLIP), a multimodal projector (linear, GELU,
linear) and a Llama-shaped language model. ``apply_coat_vlm`` converts it in place:

- the language model gets the fused COAT decoder blocks (``coat_models.apply_coat``);
- the projector, and with ``vision=True`` the vision tower, get FP8 activations
  (``fp8_activations.convert_to_fp8_activations``: linear, LayerNorm, GELU);
- ``freeze_vision=True`` sets ``requires_grad=False`` on the tower, as VILA's stage-3 SFT does;
- the training loss is computed from the LM's hidden states chunk by chunk (no full logits).
``coat_models.apply_coat`` hands LLaVA models to ``apply_coat_vlm`` (``coat_models.convert``).

Parameter names and the state dict do not change, and ``model.eval()`` / ``generate()`` run
the plain path. In transformers 5.17+ the parts live at ``model.model.vision_tower``,
``model.model.multi_modal_projector`` and ``model.model.language_model`` (a ``LlamaModel``);
the LM head is ``model.lm_head``.

No image processor is needed: feed ``pixel_values`` fp32 ``(images, 3, S, S)`` with ``S`` the
tower's ``image_size``, normalized as ``(rgb / 255 - mean) / std``: SigLIP ``mean = std = 0.5``
(values in [-1, 1]); CLIP ``coat_models.train.vl_data.CLIP_MEAN`` / ``CLIP_STD``. Each image takes
``num_image_tokens(config)`` placeholder ids ``config.image_token_id`` in ``input_ids``.
"""

from __future__ import annotations

from fp8_activations import (
    FP8ActivationConfig,
    convert_to_fp8_activations,
    follow_grad_mode,
    revert_fp8_activations,
)
from torch import nn

from . import graphs
from .llama import (
    FilterFn,
    UnsupportedModel,
    _adapter_problem,
    _CoatCausalLM,
    _sharded,
    check_flags,
    check_options,
    convert_llama,
    revert_classes,
    set_fused_loss,
)

SUPPORTED = (
    "LLaVA-style models: transformers' LlavaForConditionalGeneration or LlavaModel (5.17+), or "
    "any module whose .model (or itself) has vision_tower, multi_modal_projector and a "
    "Llama-shaped language_model"
)
_PARTS = ("vision_tower", "multi_modal_projector", "language_model")
# Set on each FP8-activation module apply_coat_vlm made (projector, tower): revert_coat of a
# module inside the converted model (apply_coat(m), revert_coat(m.model)) reverts those, not
# FP8 modules a user made.
PART_MODULE = "_coat_vlm_part"


def _llava_parts(model: nn.Module) -> nn.Module:
    """The module holding ``vision_tower``, ``multi_modal_projector`` and ``language_model``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_coat_vlm takes a torch.nn.Module, got {type(model).__name__}")
    for inner in (model, getattr(model, "model", None)):
        if isinstance(inner, nn.Module) and all(
            isinstance(getattr(inner, p, None), nn.Module) for p in _PARTS
        ):
            return inner
    hint = ""
    if hasattr(model, "layers") or hasattr(getattr(model, "model", None), "layers"):
        hint = "; for a language-only model use coat_models.apply_coat"
    raise TypeError(
        f"apply_coat_vlm: {type(model).__name__} has no "
        f"vision_tower/multi_modal_projector/language_model{hint}. apply_coat_vlm supports "
        f"{SUPPORTED}"
    )


def apply_coat_vlm(
    model: nn.Module,
    *,
    config=None,
    module_filter_fn: FilterFn | None = None,
    vision: bool = False,
    freeze_vision: bool = False,
    fused_loss: bool = True,
) -> nn.Module:
    """Convert a LLaVA-style model to COAT FP8 training, in place; returns ``model``.

    Args:
        model: ``LlavaForConditionalGeneration`` / ``LlavaModel`` (or the same composition)
            with a Llama-shaped language model; any device, any float dtype.
        config: ``FP8ActivationConfig`` for every converted part (``None``: defaults).
        module_filter_fn: ``(module, fqn) -> bool``, ``fqn`` the module's name in
            ``model.named_modules()``; called for each decoder layer of the language model
            and, top down, for each module under the projector (and with ``vision`` the
            tower). A module for which it returns False stays as it is (its children are
            still visited: to leave a whole part plain, test the fqn's prefix).
        vision: also give the vision tower FP8 activations (its linears, LayerNorms, GELUs;
            attention and the patch embedding stay as they are).
        freeze_vision: ``requires_grad=False`` on every vision-tower parameter (undone by
            ``revert_coat_vlm``). A frozen tower saves nothing for backward, so ``vision``
            then only changes its forward numerics.
        fused_loss: training calls with ``labels`` compute the loss chunk by chunk from the
            LM's hidden states (``coat_models.llama.set_fused_loss``: no full logits tensor, no fp32
            copy of it) and return ``logits=None``; eval calls are unaffected.

    Converting an already converted model first reverts it. Raises ``TypeError`` for other
    models (the message names what is supported) or a language model ``apply_coat`` rejects.

    >>> model = LlavaForConditionalGeneration(llava_tiny_config())
    >>> apply_coat_vlm(model, freeze_vision=True).train()
    >>> model(input_ids=ids, pixel_values=pixels, labels=labels).loss.backward()
    """
    parts = _llava_parts(model)
    config = check_options(config, module_filter_fn)  # before an earlier conversion is undone
    check_flags(vision=vision, freeze_vision=freeze_vision, fused_loss=fused_loss)
    names = {id(m): name for name, m in model.named_modules()}
    lm = names[id(parts.language_model)]
    problem = _adapter_problem(model, within=(lm, "lm_head"))  # (FP8 modules leave LoRA be)
    if problem is not None:
        raise TypeError(f"apply_coat_vlm cannot convert {type(model).__name__}: {problem}")
    previous = _applied(model) if is_coat_vlm(model) else None
    _check_unsharded(model, parts, "apply_coat", vision or bool(previous and previous[0]["vision"]))
    if previous is not None:
        revert_coat_vlm(model)
    try:
        return _convert(model, parts, names, config, module_filter_fn, vision, freeze_vision,
                        fused_loss)  # fmt: skip
    except BaseException:
        # A re-apply that failed (module_filter_fn raising, ...) converts the model again as
        # it was, as apply_coat leaves a Llama (it was left plain, its tower trainable): the
        # same modules, each with its config, options, loss and requires_grad flags. CUDA
        # graphs enabled before are not (enable_cuda_graphs again).
        if previous is not None:
            arguments, configs, trainable = previous
            _convert(model, parts, names, **arguments)
            modules = dict(model.named_modules())
            for (fqn, name), c in configs.items():
                setattr(modules[fqn], name, c)
            for p, flag in zip(model.parameters(), trainable, strict=True):
                p.requires_grad_(flag)
        raise


def _check_unsharded(model: nn.Module, parts, what: str, vision: bool) -> None:
    """Refuse to convert or revert the projector (and with ``vision`` the tower) of a model
    that FSDP shards: their modules are replaced, and the new ones are not FSDP's (the first
    forward failed: "mixed torch.Tensor and DTensor"). The decoder layers change class in
    place, which FSDP follows."""
    sharded = [n for n in ("multi_modal_projector", "vision_tower")[: 1 + vision]
               if _sharded(getattr(parts, n))]  # fmt: skip
    if sharded:
        raise ValueError(
            f"{what}: {type(model).__name__} is sharded by FSDP, and its "
            f"{' and '.join(n.replace('_', ' ') for n in sharded)} would get modules that FSDP "
            f"does not manage: call {what} before fully_shard (or shard_model)"
        )


def _applied(model: nn.Module) -> tuple[dict, dict, list[bool]]:
    """What converts ``model`` (converted now) again as it is: ``_convert``'s arguments (the
    same modules and options), each converted module's config (``{(fqn, attribute):
    config}``) and every parameter's ``requires_grad``."""
    configs = {}
    for fqn, m in model.named_modules():
        for name in ("coat_config", "config"):
            c = m.__dict__.get(name)
            if isinstance(c, FP8ActivationConfig):
                configs[fqn, name] = c
    converted = {fqn for fqn, _ in configs}
    arguments = {
        "config": next(iter(configs.values()), None),
        "module_filter_fn": lambda m, fqn: fqn in converted,
        **model._coat_vlm["options"],
        "fused_loss": isinstance(model, _CoatCausalLM),
    }
    return arguments, configs, [p.requires_grad for p in model.parameters()]


def _convert(
    model, parts, names, config, module_filter_fn, vision, freeze_vision, fused_loss
) -> nn.Module:
    """``apply_coat_vlm``'s conversion of a model that is not converted now."""

    def part_filter(part: nn.Module):
        """``module_filter_fn`` seen from inside ``part``: its fqns get the part's prefix."""
        if module_filter_fn is None:
            return None
        prefix = names[id(part)]
        return lambda m, fqn: module_filter_fn(m, ".".join(filter(None, (prefix, fqn))))

    try:
        convert_llama(
            parts.language_model,
            config=config,
            module_filter_fn=module_filter_fn,
            prefix=names[id(parts.language_model)],
            root=model,
        )
    except UnsupportedModel as e:  # (not what module_filter_fn raises: that passes as it is)
        raise UnsupportedModel(
            "apply_coat_vlm: the language model is not supported: "
            + e.reason.removeprefix("apply_coat: "),
            e.supported,
        ) from None
    converted = ["multi_modal_projector"] + (["vision_tower"] if vision else [])
    # A plain attribute: not a buffer, so the state dict does not see it. Set before the
    # parts are converted: a failure there (module_filter_fn raising) reverts what was done.
    options = {"vision": vision, "freeze_vision": freeze_vision}  # (apply_coat again keeps them)
    model._coat_vlm = state = {"converted": [], "frozen": [], "options": options}
    try:
        for name in converted:
            part = getattr(parts, name)
            state["converted"].append(name)
            # (transformers' GELU activations become FP8 GELUs that run them in eval mode)
            convert_to_fp8_activations(part, config=config, module_filter_fn=part_filter(part))
            for m in part.modules():  # (revert_coat of a model inside this one finds them)
                if isinstance(m.__dict__.get("config"), FP8ActivationConfig):
                    m.__dict__[PART_MODULE] = True
    except BaseException:
        revert_coat_vlm(model)
        raise
    if freeze_vision:
        for name, p in parts.vision_tower.named_parameters():
            if p.requires_grad:
                p.requires_grad_(False)
                state["frozen"].append(name)
    set_fused_loss(model, fused_loss)
    # Called without gradients (generate(), torch.no_grad()), the projector and tower run
    # their original modules as the decoder layers do, also in training mode; called by
    # themselves too (generate() takes the image features through get_image_features, not
    # the model's forward: they had taken the FP8 path there).
    follow_grad_mode(model)
    for name in converted:
        follow_grad_mode(getattr(parts, name))
    return model


def revert_coat_vlm(model: nn.Module) -> nn.Module:
    """Undo ``apply_coat_vlm`` in place (modules, and the tower's ``requires_grad``)."""
    parts = _llava_parts(model)
    state = model.__dict__.get("_coat_vlm")
    if state is None:
        return model
    _check_unsharded(model, parts, "revert_coat", "vision_tower" in state["converted"])
    del model.__dict__["_coat_vlm"]
    set_fused_loss(model, False)
    follow_grad_mode(model, False)
    for name in state["converted"]:
        follow_grad_mode(getattr(parts, name), False)
    graphs.disable_cuda_graphs(parts.language_model)
    revert_classes(parts.language_model)
    for name in state["converted"]:
        revert_fp8_activations(getattr(parts, name))
    for fqn, original in state.get("gelus", ()):  # (a model converted by an earlier version)
        parent, _, name = fqn.rpartition(".")
        setattr(parts.get_submodule(parent), name, original)
    params = dict(parts.vision_tower.named_parameters())
    for name in state["frozen"]:
        params[name].requires_grad_(True)
    return model


def is_coat_vlm(model: nn.Module) -> bool:
    """True for a model ``apply_coat_vlm`` converted (and ``revert_coat_vlm`` did not undo)."""
    return "_coat_vlm" in model.__dict__


# --------------------------------------------------------------------------- configs in code
def llava_tiny_config(
    *,
    vision_hidden: int = 32,
    vision_layers: int = 2,
    hidden: int = 64,
    layers: int = 2,
    image_size: int = 32,
    patch_size: int = 8,
):
    """A tiny LLaVA for CPU tests and demos, random init, on ``vl_data``'s byte vocabulary.

    SigLIP-like tower (``vision_hidden`` wide, 2 heads, MLP 2x, GELU-tanh, no pooling head;
    32x32 images in 8x8 patches: 16 image tokens), GELU projector, Llama LM (``hidden`` wide,
    4 heads with 2 KV heads, SwiGLU MLP 2.75x rounded to a multiple of 16, untied head).
    Vocabulary: 320, the shapes-caption task's byte-level ids (256 bytes, EOS 256, image
    token 257: ``coat_models.train.vl_data``) rounded up to a multiple of 64; image token 257;
    ``eos_token_id`` 256 (generation stops at a caption's end).
    """
    from transformers import LlamaConfig, SiglipVisionConfig

    for name, value in (("vision_hidden", vision_hidden), ("hidden", hidden)):
        if value % 16:
            raise ValueError(f"{name} must be a multiple of 16 (FP8 groups of 16), got {value}")
    vision = SiglipVisionConfig(
        hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
        num_hidden_layers=vision_layers, num_attention_heads=2, image_size=image_size,
        patch_size=patch_size, vision_use_head=False,
    )  # fmt: skip
    text = LlamaConfig(
        vocab_size=_TINY_VOCAB, hidden_size=hidden,
        intermediate_size=-(-(hidden * 11 // 4) // 16) * 16, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=_TINY_EOS, pad_token_id=None,
    )  # fmt: skip
    return _llava_config(vision, text, _TINY_IMAGE_TOKEN, vision_feature_layer=-1)


def vila7b_config():
    """VILA1.5-7B shapes, random init (nothing is downloaded).

    Vision: SigLIP-so400m-like (hidden 1152, 27 layers, 16 heads, MLP 4304, patch 14, image
    384: 729 tokens per image; GELU-tanh; no pooling head), features of the second-to-last
    layer (VILA's ``mm_vision_select_layer=-2``), all tokens (SigLIP has no class token).
    Projector: linear 1152->4096, GELU, linear 4096->4096. LM: Llama-2-7B (hidden 4096,
    32 layers, 32 heads, MLP 11008, RMSNorm eps 1e-5) with llava-1.5's vocabulary of 32064
    (Llama-2's 32000 padded; image token 32000). 7.17 B parameters: tower 0.413 B,
    projector 0.022 B, LM with head 6.739 B.
    """
    from transformers import LlamaConfig, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
        image_size=384, patch_size=14, vision_use_head=False,
    )  # fmt: skip
    text = LlamaConfig(
        vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=None,
    )  # fmt: skip
    return _llava_config(vision, text, 32000, vision_feature_layer=-2)


def num_image_tokens(config) -> int:
    """Placeholder tokens one image takes in a ``LlavaConfig``'s language model: the vision
    tower's patch count, plus CLIP's class token, minus one with the ``"default"`` feature
    strategy (which drops the first token, meant to be CLIP's class token)."""
    vision = config.vision_config
    image, patch = vision.image_size, vision.patch_size
    if not (isinstance(image, int) and isinstance(patch, int)):
        raise ValueError(f"square images only: image_size {image!r}, patch_size {patch!r}")
    n = (image // patch) ** 2 + (vision.model_type == "clip_vision_model")
    return n - (config.vision_feature_select_strategy == "default")


# llava_tiny_config's vocabulary: the byte-level ids of the shapes-caption task (256 bytes,
# EOS 256, image 257) rounded up to 64; tests check them against coat_models.train.vl_data.
# The EOS ends each caption: generate() of a trained model stops there.
_TINY_VOCAB, _TINY_EOS, _TINY_IMAGE_TOKEN = 320, 256, 257


def _llava_config(vision, text, image_token_id: int, *, vision_feature_layer: int):
    from transformers import LlavaConfig

    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token_id,
        projector_hidden_act="gelu", vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy="full", multimodal_projector_bias=True,
        tie_word_embeddings=False,
    )  # fmt: skip
    config.image_seq_length = num_image_tokens(config)
    return config
