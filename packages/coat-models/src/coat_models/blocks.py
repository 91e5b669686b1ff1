"""One Llama-shaped decoder layer as three COAT blocks, written once against an op set.

The blocks (COAT, arXiv 2410.19313, section 2):

1. ``RMSNorm -> Q, K, V projections``, fused (``rms_norm_linear``): the norm saves its
   input in FP8 (1x16 groups) and its per-row rstd; its output is quantized per tensor once
   for the three GEMMs and not saved at all: backward re-forms it from the norm's FP8 input
   for the weight gradients. The same for ``RMSNorm -> gate, up``.
2. ``attention output projection + residual add``: the residual stream stays in the
   model's dtype; the residual add saves nothing.
3. ``SwiGLU -> down + residual add``: SwiGLU saves gate and up in FP8 (1x16); fused with the
   down GEMM (``swiglu_linear``), whose input is re-formed from them in backward instead of
   being saved.

RoPE and attention run in the model's dtype through the model's own attention
implementation (``config._attn_implementation``: SDPA, flash attention, eager, ...).

``ops`` supplies ``rms_norm(x, weight, eps, config)``, ``linear(x, weight, bias, config)``,
``swiglu(gate, up, config)`` and ``residual_add(x, residual, config)``, and optionally the
fused ``rms_norm_linear(x, norm_weight, eps, weights, biases, config)`` and
``swiglu_linear(gate, up, weight, bias, config)``, and ``weight_amaxes(weights, config)`` (then the
linears take ``weight_amax=`` / ``weight_amaxes=``: one reduction launch for the layer's
seven weights instead of two per weight), and ``weight_cache_fresh(weights, config)``
(then the maxima are computed only when a weight will be cast), and
``cast_weights(weights, config, weight_amaxes=)`` (then the linears take ``weight_cast=`` /
``weight_casts=``: the seven weights cast in one launch per direction; traced, forward's
in one and backward's one per fused linear: q/k/v, gate/up, o, down), and
``cached_weight_casts(weights, config)`` (the weight cache's copies as such items, which a
compiled layer takes as inputs: ``layer_weight_casts``): ``FP8_OPS`` are
fp8_activations' functional ops (each saves FP8 and hands its output's FP8 form or group
maxima to the next op), ``coat_models.reference`` the model's exact arithmetic (no fused ops).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import SimpleNamespace

import fp8_activations as fa
import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .ops import rope

FP8_OPS = SimpleNamespace(
    rms_norm=fa.rms_norm,
    rms_norm_linear=fa.rms_norm_linear,
    linear=fa.fp8_linear,
    swiglu=fa.swiglu,
    swiglu_linear=fa.swiglu_linear,
    residual_add=fa.residual_add,
    weight_amaxes=fa.weight_amaxes,
    weight_cache_fresh=fa.weight_cache_fresh,
    cast_weights=fa.cast_weights,
    cached_weight_casts=fa.cached_weight_casts,
    # linear and swiglu_linear take residual= (the residual add in their autograd node)
    fused_residual=True,
)


# The attribute of a converted layer's attention that holds what apply_coat's probe saw its
# own code pass to the attention function: {"sliding_window": the window, "tensors":
# {keyword: the name of the attention's parameter or buffer passed so}}.
ATTENTION_ARGS = "coat_attention_args"


def norm_eps(norm: nn.Module) -> float:
    """The epsilon of a Llama-style RMSNorm module (``variance_epsilon`` or ``eps``)."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm.eps if eps is None else eps


def model_function(module: nn.Module, name: str) -> Callable | None:
    """``name`` from the modeling file that defines ``type(module)`` (e.g. its RoPE helper)."""
    return getattr(sys.modules[type(module).__module__], name, None)


def _amax_kw(name: str, amax, cast_name: str = "", cast=None) -> dict:
    """The keywords passing a weight's precomputed max |w| and its layer cast (nothing for
    what is None)."""
    kw = {} if amax is None else {name: amax}
    if cast is not None:
        kw[cast_name] = cast
    return kw


def _project(ops, x, lin: nn.Linear, config, amax=None, cast=None, residual=None):
    """``lin(x)``, plus ``residual`` when given (in the linear's node where the op set
    fuses it, else by ``ops.residual_add``)."""
    kw = _amax_kw("weight_amax", amax, "weight_cast", cast)
    if residual is not None and getattr(ops, "fused_residual", False):
        return ops.linear(x, lin.weight, lin.bias, config, residual=residual, **kw)
    y = ops.linear(x, lin.weight, lin.bias, config, **kw)
    return y if residual is None else ops.residual_add(y, residual, config)


def norm_project(
    ops, x, norm: nn.Module, linears: list[nn.Linear], config, amaxes=None, casts=None
) -> list:
    """``[linear(rms_norm(x))]`` for each of ``linears``: one fused op when the op set has
    ``rms_norm_linear`` (the norm output is then not saved but re-formed in backward).
    ``amaxes``: the linears' weight maxima (``ops.weight_amaxes``) or None; ``casts``: their
    weights' items of ``ops.cast_weights`` or None."""
    fused = getattr(ops, "rms_norm_linear", None)
    if fused is not None:
        weights, biases = [lin.weight for lin in linears], [lin.bias for lin in linears]
        kw = _amax_kw("weight_amaxes", amaxes, "weight_casts", casts)
        return list(fused(x, norm.weight, norm_eps(norm), weights, biases, config, **kw))
    normed = ops.rms_norm(x, norm.weight, norm_eps(norm), config)
    amaxes, casts = amaxes or [None] * len(linears), casts or [None] * len(linears)
    return [
        _project(ops, normed, lin, config, a, c)
        for lin, a, c in zip(linears, amaxes, casts, strict=True)
    ]


def attention(
    ops,
    attn: nn.Module,
    qkv: list[torch.Tensor],
    shape: tuple[int, ...],
    attention_mask: torch.Tensor | None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    cache,
    config,
    attn_kwargs: dict,
    o_amax=None,
    o_cast=None,
    residual=None,
) -> torch.Tensor:
    """RoPE + the model's attention on the Q/K/V projections ``qkv`` (a list of three
    ``(batch, seq, heads * head_dim)`` tensors, emptied here so that the pre-RoPE q and k
    are freed as soon as RoPE has run), then the output projection.

    ``shape`` is ``(batch, seq)``; returns the output projection ``(batch, seq, hidden)``,
    plus ``residual`` when given; ``o_amax``: its weight's max |w| or None, ``o_cast`` its
    item of ``ops.cast_weights`` or None.

    RoPE is ``coat_models.ops.rope``'s one kernel for q and k (the same bits) when the model's
    ``apply_rotary_pos_emb`` is the standard ``rotate_half`` one and Triton runs, the
    model's own function otherwise. The kernel leaves no layout copies around SDPA, forward
    or backward: q, k, v stay ``(batch, seq, heads, head_dim)`` memory seen as ``(batch,
    heads, seq, head_dim)``, which SDPA's flash and cuDNN kernels take as is and answer in
    (output and gradients), so the reshapes here and in transformers' SDPA function are
    views, and RoPE's backward reads SDPA's dq, dk in their strides.
    """
    hidden_shape, dtype = (*shape, -1, attn.head_dim), qkv[0].dtype
    cos, sin = position_embeddings
    apply_rotary = model_function(attn, "apply_rotary_pos_emb")
    backend = getattr(config, "backend", "auto")
    # The projections to SDPA's views and RoPE in one autograd node where the kernel runs.
    rotated = None
    if rope.is_rotate_half(apply_rotary):
        rotated = rope.rotate_projections(*qkv, cos, sin, attn.head_dim, backend)
    if rotated is not None:
        q, k, v = rotated
        qkv.clear()
    else:
        q, k, v = (t.view(hidden_shape).transpose(1, 2) for t in qkv)
        qkv.clear()
        if rope.fusable(apply_rotary, q, k, cos, sin, backend):
            q, k = rope.apply_rotary_pos_emb(q, k, cos, sin, backend)
        else:
            q, k = apply_rotary(q, k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx)
    attention_fn = ALL_ATTENTION_FUNCTIONS.get_interface(
        attn.config._attn_implementation, model_function(attn, "eager_attention_forward")
    )
    # What the layer's own code passes (apply_coat's probe recorded it: a Llama layer passes
    # no window, whatever its config holds; GraniteSWA its sinks); unprobed, Mistral's window
    # is the config's, Qwen2's the module's.
    probed = attn.__dict__.get(ATTENTION_ARGS)
    if probed is None:
        sliding_window = getattr(
            attn, "sliding_window", getattr(attn.config, "sliding_window", None)
        )
        extra = {}
    else:
        sliding_window = probed["sliding_window"]
        extra = {key: getattr(attn, name) for key, name in probed["tensors"].items()}
    out, _ = attention_fn(
        attn,
        q,
        k,
        v,
        attention_mask,
        dropout=attn.attention_dropout if attn.training else 0.0,
        scaling=attn.scaling,
        sliding_window=sliding_window,
        **extra,
        **attn_kwargs,
    )
    # Under autocast SDPA returns the autocast dtype; the residual stream keeps its own.
    out = out.reshape(*shape, -1).to(dtype).contiguous()
    return _project(ops, out, attn.o_proj, config, o_amax, o_cast, residual)


def mlp(
    ops, module: nn.Module, gate, up, config, amax=None, cast=None, residual=None,
    residual_config=None,
):  # fmt: skip
    """SwiGLU of the gate/up projections, down GEMM (fused with SwiGLU when the op set has
    ``swiglu_linear``: the down GEMM's input is then re-formed in backward, not saved),
    plus ``residual`` when given, added with ``residual_config`` (default ``config``): in
    the down GEMM's node when the op set fuses it and the add keeps the layer's config.
    ``amax``: the down weight's max |w| or None; ``cast``: its item of
    ``ops.cast_weights`` or None."""
    down = module.down_proj
    kw = _amax_kw("weight_amax", amax, "weight_cast", cast)
    fused = getattr(ops, "swiglu_linear", None)
    res_config = config if residual_config is None else residual_config
    if (
        residual is not None and fused is not None and res_config is config
        and getattr(ops, "fused_residual", False)
    ):  # fmt: skip
        return fused(gate, up, down.weight, down.bias, config, residual=residual, **kw)
    if fused is not None:
        y = fused(gate, up, down.weight, down.bias, config, **kw)
    else:
        y = _project(ops, ops.swiglu(gate, up, config), down, config, amax, cast)
    return y if residual is None else ops.residual_add(y, residual, res_config)


def layer_linears(layer: nn.Module) -> list[nn.Module]:
    """A Llama-shaped layer's seven linears in the order the blocks use their weights: q, k,
    v, o, gate, up, down."""
    attn, mlp_ = layer.self_attn, layer.mlp
    return [
        attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
        mlp_.gate_proj, mlp_.up_proj, mlp_.down_proj,
    ]  # fmt: skip


# The keyword of a COAT decoder layer's forward that takes ``layer_weight_casts``' items.
WEIGHT_CASTS = "coat_weight_casts"


def layer_weight_casts(ops, layer: nn.Module, config=None) -> list | None:
    """The weight cache's FP8 copies of the layer's seven weights (the stale ones refreshed
    in one launch), as ``decoder_layer``'s ``weight_casts``: made eagerly, outside a compiled
    layer, which cannot read the cache. None when the op set or ``config`` has no cache."""
    cached = getattr(ops, "cached_weight_casts", None)
    if cached is None or not getattr(ops, "cast_weights", None) or not torch.is_grad_enabled():
        return None  # (an op set without cast_weights casts each weight in its linear)
    return cached([lin.weight for lin in layer_linears(layer)], config)


def decoder_layer(
    ops,
    layer: nn.Module,
    hidden_states: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    cache=None,
    config=None,
    attn_kwargs: dict | None = None,
    hand_over_output: bool = True,
    weight_casts: list | None = None,
) -> torch.Tensor:
    """A pre-norm Llama decoder layer: ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``.

    ``hidden_states (batch, seq, hidden)`` in the model's dtype; returns the same shape and
    dtype. ``attn_kwargs`` go to the attention implementation (``position_ids``, flash
    attention's packing arguments, ...). ``hand_over_output=False``: the output carries no
    FP8 copy for the next layer's norm (which then quantizes it itself, same bits): under
    gradient checkpointing the output is kept as the next layer's checkpoint input, and the
    copy would be kept with it (1.25 B/elem more than the input itself). ``weight_casts``:
    the seven weights' ``layer_weight_casts``, made before the call, or None (the layer
    casts them itself).
    """
    attn, mlp_, shape = layer.self_attn, layer.mlp, hidden_states.shape[:-1]
    linears = layer_linears(layer)
    qkv, gate_up = linears[:3], linears[4:6]
    amaxes = getattr(ops, "weight_amaxes", None)
    weights = [lin.weight for lin in linears]
    casts = weight_casts
    fresh = getattr(ops, "weight_cache_fresh", None)
    if casts is not None:
        amaxes = None  # cast before the call (layer_weight_casts)
    # Only while training: the weights' maxima let backward re-cast them without reductions;
    # not when every weight's cached FP8 copy is current (micro-batches after the first of a
    # step): nothing is cast then, and the reduction would read every weight for nothing.
    elif amaxes and torch.is_grad_enabled() and not (fresh and fresh(weights, config)):
        amaxes = amaxes(weights, config)
    else:
        amaxes = None
    # All seven weights cast in one launch (and again in one for backward; traced, one per
    # weight there), or their cached copies refreshed in one: None when the op set (or
    # cast_weights) leaves it to the linears.
    cast_weights = getattr(ops, "cast_weights", None)
    if cast_weights and amaxes:
        casts = cast_weights(weights, config, weight_amaxes=amaxes)
        if casts is not None or (fresh and fresh(weights, config)):
            amaxes = None  # every weight is cast (or cached): the linears need no maxima
    a, c = amaxes or [None] * len(linears), casts or [None] * len(linears)
    hidden_states = attention(
        ops,
        attn,
        norm_project(
            ops,
            hidden_states,
            layer.input_layernorm,
            qkv,
            config,
            amaxes and a[:3],
            casts and c[:3],
        ),  # fmt: skip
        shape,
        attention_mask,
        position_embeddings,
        cache,
        config,
        attn_kwargs or {},
        a[3],
        c[3],
        residual=hidden_states,
    )
    norm2 = layer.post_attention_layernorm
    # gate and up (bf16, the widest tensors of the layer) live only while mlp() runs.
    gate, up = norm_project(
        ops, hidden_states, norm2, gate_up, config, amaxes and a[4:6], casts and c[4:6]
    )
    res_config = config
    if not hand_over_output:
        res_config = (config or fa.FP8ActivationConfig()).replace(precision_flow=False)
    return mlp(
        ops, mlp_, gate, up, config, a[6], c[6], residual=hidden_states, residual_config=res_config
    )
