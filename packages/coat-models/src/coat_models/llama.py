"""Run Hugging Face Llama-shaped models with COAT's FP8 blocks, reversibly and in place.

``apply_coat`` gives each decoder layer (and a causal-LM head) a subclass of its own class
whose ``forward`` takes the COAT path while the module trains and the plain path otherwise.
No module is replaced and no parameter renamed, so the state dict, ``save_pretrained``,
hooks, ``isinstance`` checks and gradient checkpointing behave as before;
``revert_coat`` restores the original classes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import typing
import weakref
from collections import OrderedDict

import torch
import torch.nn.functional as F
from fp8_activations import FP8ActivationConfig
from fp8_activations.convert import FilterFn  # (module, fqn) -> bool, one contract
from fp8_activations.ops import drop_cached_weight_fp8
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import blocks, graphs, plans, reference
from .loss import linear_cross_entropy

SUPPORTED = (
    "Llama-shaped decoder-only transformers models (LlamaForCausalLM, LlamaModel, "
    "MistralForCausalLM, Qwen2ForCausalLM, ... of transformers>=5.17): each decoder layer "
    "is x + self_attn(input_layernorm(x)) then h + mlp(post_attention_layernorm(h)) with "
    "RMSNorm norms, RoPE attention with nn.Linear q_proj/k_proj/v_proj/o_proj and a SwiGLU "
    "MLP with nn.Linear gate_proj/up_proj/down_proj"
)
_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTN_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP_CHILDREN = {"gate_proj", "up_proj", "down_proj"}
# Config fields of causal LMs whose head is more than ``hidden @ lm_head.weight.T``.
_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


# ------------------------------------------------------------------------------ detection
def _children(module: nn.Module) -> set[str]:
    return {name for name, _ in module.named_children()}


@contextlib.contextmanager
def _probing(*roots: nn.Module):
    """Run probe code on ``roots`` without side effects: every module under them in eval
    mode and without forward hooks while it runs; each module's own ``training`` flag and
    hooks come back afterwards, also when the probe raises. (``layer.train(flag)`` would
    instead set one flag on every submodule, and the user's hooks would see probe data.)"""
    saved = []
    for module in {id(m): m for root in roots for m in root.modules()}.values():
        saved.append((module, module.training, module._forward_pre_hooks, module._forward_hooks))
        module.training = False
        module._forward_pre_hooks, module._forward_hooks = OrderedDict(), OrderedDict()
    try:
        yield
    finally:
        for module, training, pre_hooks, hooks in saved:
            module.training = training
            module._forward_pre_hooks, module._forward_hooks = pre_hooks, hooks


def _wrapped_by_adapter(module: nn.Module) -> bool:
    """An adapter around a layer (PEFT's LoRA, IA3, ...) keeps the original as ``base_layer``."""
    return isinstance(getattr(module, "base_layer", None), nn.Module)


_ADAPTERS_UNSUPPORTED = (
    "COAT's fused layers read the projection weights directly and would bypass the adapter. "
    "LoRA/PEFT adapters are not supported yet: train the adapters without COAT, or merge "
    "them into the weights (PEFT: merge_and_unload()) before apply_coat"
)


def _adapter_problem(model: nn.Module, within: tuple[str, ...] | None = None) -> str | None:
    """Why ``model`` cannot be converted because of adapters, or ``None``. ``within``: only
    modules whose name starts with one of these (a LLaVA model's language model and head:
    its projector and tower get plain FP8 modules, which leave an adapter alone)."""
    for fqn, module in model.named_modules():
        if within is not None and not any(fqn == w or fqn.startswith(w + ".") for w in within):
            continue
        if _wrapped_by_adapter(module):
            cls = type(module)
            return (
                f"{fqn or 'the model'} is wrapped by an adapter ({cls.__module__}."
                f"{cls.__qualname__} around its base_layer): {_ADAPTERS_UNSUPPORTED}"
            )
    return None


_FSDP_CLASSES: tuple[type, ...] | None = None


def _fsdp_classes() -> tuple[type, ...]:
    """FSDP2's ``FSDPModule`` and FSDP1's wrapper (imported on first use; none without
    torch.distributed). Kept in a global, not ``functools.cache``: a compiled layer reads it
    too, and Dynamo warns at every ``lru_cache`` it traces."""
    global _FSDP_CLASSES
    if _FSDP_CLASSES is None:
        try:
            from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
        except ImportError:
            _FSDP_CLASSES = ()
        else:
            _FSDP_CLASSES = (FSDPModule, FullyShardedDataParallel)
    return _FSDP_CLASSES


def _sharded(model: nn.Module) -> bool:
    """Whether FSDP shards ``model`` or a part of it (a module of its FSDP classes, or a
    DTensor parameter)."""
    classes = _fsdp_classes()
    return any(isinstance(m, classes) for m in model.modules()) or any(
        type(p).__name__ == "DTensor" for p in model.parameters()
    )


def layer_config(layer: nn.Module) -> FP8ActivationConfig:
    """The COAT layer's config for this training call. A layer that FSDP shards trains
    without the FP8 weight cache, turned off for good here (``fully_shard`` after
    ``apply_coat``, of the layers or of a module that holds them: the model, its decoder
    stack): FSDP all-gathers each step into the weight's storage without bumping its
    version, so the cache would serve the previous step's FP8 weights. The modules that
    held the layer at ``apply_coat`` are looked at (``_HOLDERS``; eagerly: a compiled
    layer's config is read eagerly first), not a wrapper put around the model later
    (``shard_model``, or ``weight_cache=False``, then); units below the layer are refused
    by ``check_coat_layer``: their hooks would not run."""
    config = layer.coat_config
    if config.weight_cache and (
        isinstance(layer, _fsdp_classes())
        or (not torch.compiler.is_compiling() and _held_by_fsdp(layer))
    ):
        # The whole model's, not only this layer's: a VLM's projector (and tower) are
        # fp8_activations modules with caches of their own, under the same FSDP units.
        holders = _HOLDERS.get(layer, ())
        root = holders[0]() if holders else None
        weight_cache_off(layer if root is None else root)
        config = layer.coat_config
    return config


@torch.compiler.disable  # (run eagerly under torch.compile(model): Dynamo cannot trace __dict__)
def weight_cache_off(model: nn.Module) -> None:
    """Turn off the FP8 weight cache (``FP8ActivationConfig.weight_cache``) of every COAT part
    of ``model``, the decoder layers' (``coat_config``) and fp8_activations modules' (a VLM's
    projector and tower: ``config``), and free the copies it holds. For a model that FSDP
    shards (``distributed.shard_model``, ``layer_config``): the cache is keyed on the weight's
    version and storage, and FSDP2 all-gathers each step into the unsharded weight's storage
    without bumping its version (the same storage, resized to nothing and back; where the
    allocator hands back the same address, as the CUDA caching allocator usually does,
    nothing in the key changes), so the cache would serve last step's FP8 weights (on CPU
    the losses leave the single-process run's within 2-4 steps). Unsharded FP8 copies of
    every layer would also cost 2 bytes per parameter on every rank, undoing the sharding.
    Without the cache a weight is cast where it is used (one more read of it per GEMM)."""
    for module in model.modules():
        for name in ("coat_config", "config"):
            config = module.__dict__.get(name)
            if isinstance(config, FP8ActivationConfig) and config.weight_cache:
                setattr(module, name, config.replace(weight_cache=False))
                drop_cached_weight_fp8(module.parameters())


# layer -> weak references to the modules that held it at apply_coat (``_holders``). Kept
# out of the layer itself: a pickled or deep-copied model carries no weak references.
_HOLDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _held_by_fsdp(layer: nn.Module) -> bool:
    classes = _fsdp_classes()
    return any(isinstance(ref(), classes) for ref in _HOLDERS.get(layer, ()))


def _holders(top: nn.Module, fqn: str) -> tuple:
    """Weak references to the modules from ``top`` down to the one holding ``top``'s module
    ``fqn`` (``layer_config`` looks for FSDP units among them)."""
    parts = fqn.split(".")
    return tuple(weakref.ref(top.get_submodule(".".join(parts[:i]))) for i in range(len(parts)))


def _layer_problem(layer: nn.Module) -> str | None:
    """Why ``layer`` is not a Llama-shaped decoder layer, or ``None`` if it is (by structure)."""
    if _children(layer) != _LAYER_CHILDREN:
        return f"its sub-modules are {sorted(_children(layer))}, expected {sorted(_LAYER_CHILDREN)}"
    attn, mlp = layer.self_attn, layer.mlp
    if _children(attn) != _ATTN_CHILDREN:
        names = sorted(_children(attn))
        return f"self_attn has sub-modules {names}, expected {sorted(_ATTN_CHILDREN)}"
    if not _MLP_CHILDREN <= _children(mlp) or _children(mlp) - _MLP_CHILDREN - {"act_fn"}:
        return f"mlp has sub-modules {sorted(_children(mlp))}, expected {sorted(_MLP_CHILDREN)}"
    problem = _projection_problem(layer)
    if problem is not None:
        return problem
    for attr in ("head_dim", "scaling", "layer_idx", "config", "attention_dropout"):
        if not hasattr(attn, attr):
            return f"self_attn has no attribute {attr!r}"
    for fn in ("apply_rotary_pos_emb", "eager_attention_forward"):
        if blocks.model_function(attn, fn) is None:
            return f"the modeling file of {type(attn).__name__} defines no {fn}"
    # Dropout the layer's own code applies in training (the probe runs in eval mode): the
    # COAT path applies attention_dropout only (Seed-OSS's residual_dropout trained without).
    for owner, module in (("", layer), ("self_attn.", attn), ("mlp.", mlp)):
        for name, value in vars(module).items():
            if (
                "dropout" in name and (owner, name) != ("self_attn.", "attention_dropout")
                and isinstance(value, float | int) and not isinstance(value, bool) and value > 0
            ):  # fmt: skip
                return (
                    f"{owner}{name} = {value}: the COAT path applies no such dropout (set it "
                    "to 0 in the model's config to train with COAT)"
                )
    probe = torch.linspace(-6, 6, 97, device="cpu")  # (whatever the default device: meta)
    act = getattr(mlp, "act_fn", None)
    if not callable(act):
        return "the MLP activation is not SiLU (SwiGLU needed)"
    with _probing(mlp):
        silu = torch.allclose(act(probe), F.silu(probe), rtol=1e-5, atol=1e-6)
    if not silu:
        return "the MLP activation is not SiLU (SwiGLU needed)"
    for name in ("input_layernorm", "post_attention_layernorm"):
        norm = getattr(layer, name)
        weight = getattr(norm, "weight", None)
        if (
            not isinstance(weight, torch.Tensor)
            or weight.dim() != 1
            or getattr(norm, "bias", None) is not None
        ):
            return f"{name} is not an RMSNorm with one weight vector and no bias"
        if getattr(norm, "variance_epsilon", getattr(norm, "eps", None)) is None:
            return f"{name} has no variance_epsilon/eps attribute"
    return None


_PROJECTIONS = (
    *(("self_attn", n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
    *(("mlp", n) for n in ("gate_proj", "up_proj", "down_proj")),
)


def _projection_problem(layer: nn.Module) -> str | None:
    """Why the seven projections of ``layer`` are not plain ``nn.Linear`` modules, or None."""
    for owner, name in _PROJECTIONS:
        lin = getattr(getattr(layer, owner, None), name, None)
        if type(lin) is nn.Linear:
            continue
        if _wrapped_by_adapter(lin):
            cls = type(lin)
            return (
                f"{owner}.{name} is wrapped by an adapter ({cls.__module__}.{cls.__qualname__} "
                f"around an nn.Linear): {_ADAPTERS_UNSUPPORTED}"
            )
        return f"{owner}.{name} is a {type(lin).__name__}, not an nn.Linear"
    return None


def check_coat_layer(layer: nn.Module) -> None:
    """Raise ``TypeError`` if a projection of a COAT layer is no longer a plain ``nn.Linear``
    (PEFT's ``get_peft_model`` after ``apply_coat`` wraps them): the COAT path reads the
    weights directly and would silently train without the wrapper.

    Runs at the start of every COAT training forward. No cached verdict (wrapping may happen
    at any time, and a cache would cost as much to validate): nine dict lookups and seven
    type tests, under a microsecond of host time per layer.
    """
    try:
        modules = layer._modules
        attn, mlp = modules["self_attn"]._modules, modules["mlp"]._modules
        ok = (
            type(attn["q_proj"]) is nn.Linear
            and type(attn["k_proj"]) is nn.Linear
            and type(attn["v_proj"]) is nn.Linear
            and type(attn["o_proj"]) is nn.Linear
            and type(mlp["gate_proj"]) is nn.Linear
            and type(mlp["up_proj"]) is nn.Linear
            and type(mlp["down_proj"]) is nn.Linear
        )
    except KeyError:
        ok = False
    if ok:
        problem = _bypassed_module(layer)
    else:
        problem = _projection_problem(layer) or "its sub-modules changed"
    if problem is not None:
        index = getattr(getattr(layer, "self_attn", None), "layer_idx", "?")
        raise TypeError(
            f"COAT decoder layer {index} cannot train: {problem} (to train without COAT, "
            "call coat_models.revert_coat(model))"
        )


_INSTANCE_FORWARD = (
    "e.g. accelerate's hooks, from a device_map across devices, offloading or cpu_offload: "
    "a COAT layer runs on one device with its weights in place; load the model onto one "
    "device, or remove the hooks with accelerate.hooks.remove_hook_from_module(model, "
    "recurse=True), before apply_coat"
)
# transformers' hook that records a module's output for output_attentions= and
# output_hidden_states= (installed once, idle unless that output is asked for).
_CAPTURE_HOOK = "output_capturing_hook"


def _instance_forward_problem(layer: nn.Module) -> str | None:
    """Why ``apply_coat`` must not convert ``layer``: a forward set on the layer instance
    (accelerate's hooks, ...) runs instead of the COAT class's, which would silently never
    train; ``compile_layers``' own runs the class's and passes."""
    own = vars(layer).get("forward")
    if own is not None and not (
        getattr(own, "coat_compiled_forward", False) and own.own_forward is None
    ):
        return f"its forward is replaced on the instance ({_INSTANCE_FORWARD})"
    return _bypassed_module(layer, at_apply=True)


def _bypassed_module(layer: nn.Module, at_apply: bool = False) -> str | None:
    """What the COAT path would silently skip in ``layer``, or None: it reads the weights
    of the layer's sub-modules and never calls them, so their forward hooks and
    accelerate's hooks (which place or load weights) would not run. Hooks on the layer
    itself run; so does another forward set on a sub-module (a Hub kernel's, say: the COAT
    path computes what the module does). transformers' output-capturing hooks are idle
    unless attention weights are asked for, which the COAT path does not compute.
    ``at_apply``: accelerate's hooks only (hooks may be added and removed between training
    steps). A few dict reads per sub-module."""
    modules = layer._modules
    for owner in (layer, modules["self_attn"], modules["mlp"]):
        for name, m in owner._modules.items():
            if m is None:
                continue
            if "_hf_hook" in m.__dict__:  # (accelerate's marker)
                return f"{name} carries accelerate's hooks ({_INSTANCE_FORWARD})"
            if at_apply:
                continue
            if m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
                return f"{name} has hooks, which the COAT path does not run: {_HOOKS_REMEDY}"
            hooks = m._forward_hooks
            if hooks:
                capture = [getattr(h, "__name__", "") == _CAPTURE_HOOK for h in hooks.values()]
                if not all(capture):
                    return f"{name} has hooks, which the COAT path does not run: {_HOOKS_REMEDY}"
                if name == "self_attn" and _attentions_asked():
                    return (
                        "output_attentions=True (an argument, or the model config's): the COAT "
                        "path does not compute attention weights; ask for them in eval mode or "
                        "under torch.no_grad(), and train with "
                        "model.config.output_attentions = False"
                    )
    return None


_HOOKS_REMEDY = "register them on the decoder layer instead (its hooks run)"


# The keyword with which compile_layers tells a compiled COAT layer's forward that it ran
# check_coat_layer eagerly just before (dynamo cannot read the attention recorder's
# ContextVar; under torch.compile(model) that read breaks the graph, and the check holds).
CHECKED = "coat_checked"


def _attentions_asked() -> bool:
    """Whether transformers is recording attention weights in this forward."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # another transformers: no recorder of that kind to serve
        return False
    collected = _active_collector.get()
    return collected is not None and "attentions" in collected


def _rope_positions(rotary: nn.Module, position_ids: torch.Tensor) -> torch.Tensor:
    """The position ids ``rotary`` takes, as the model's own forward hands them: a multimodal
    RoPE (``mrope_section``: Qwen2-VL's text model) gets them as ``(3, batch, seq)``, one row
    per axis of its grid; transformers 5.17's raises for the plain ``(batch, seq)`` (later
    versions expand them inside)."""
    if getattr(rotary, "mrope_section", None) is not None and position_ids.ndim == 2:
        return position_ids[None].expand(3, *position_ids.shape)
    return position_ids


@torch.no_grad()
def _layer_mismatch(
    base: nn.Module, layer: nn.Module, stand_in: bool = True, found: dict | None = None
) -> str | None:
    """Run ``layer`` and ``blocks.decoder_layer`` with the exact ops on one short random
    sequence; a Llama-shaped layer gives the same output. Catches layers that match by
    structure but compute something else (Gemma's ``1 + weight`` norm, Granite's residual
    multiplier, ...). First on a narrow fp32 CPU stand-in of the layer's class with random
    weights (``stand_in``), then, unless on the meta device, on the layer itself; skipped
    when sharded (DTensors).

    The stand-in's attention records what the layer's code passes to the attention function:
    ``found`` gets its window and the attention's own tensors it passes (``_attention_args``:
    COAT passes the same; a Llama layer passes no window, whatever its config says;
    GraniteSWA passes its sinks), and other arguments COAT does not pass the same are a
    problem. The layer itself runs its model's attention when that is SDPA or eager, and the
    recording SDPA in place of any other kernel (flex, flash, a Hub kernel), which records
    there too: a kernel that cannot run here fails at the model's first forward instead."""
    params = list(layer.parameters())
    if any(type(p.data) is not torch.Tensor for p in params):
        return None
    meta = any(p.is_meta for p in params)
    if stand_in:
        # The layer's own weights can hide what it computes: zero output projections (a
        # fresh zero-initialised model, or one converted before its weights are loaded)
        # hid Granite's residual multiplier and SmolLM3's layers without RoPE, and bf16's
        # tolerance passed them too. The real layer is run after it: a forward set on one of
        # its modules' instances is not the class's.
        cpu = _cpu_probe(base, layer)
        problem = None
        if cpu is not None:
            try:
                problem = _layer_mismatch(*cpu, stand_in=False, found=found)
            except Exception:  # a stand-in this family's code cannot run
                pass
        if problem is not None or meta:
            return problem  # (meta: nothing real to run; left to the real weights)
    elif meta:
        return None
    weight = layer.input_layernorm.weight
    x = torch.randn(
        1,
        8,
        weight.shape[0],
        device=weight.device,
        dtype=params[0].dtype,
        generator=torch.Generator(weight.device).manual_seed(0),
    )
    # Early positions and far ones (past any context length: a query scale that grows with
    # the position, Ministral3's, is 1 for the first thousands of tokens).
    position_ids = torch.tensor([[0, 1, 2, 3, *range(_FAR, _FAR + 4)]], device=weight.device)
    # The original class's forward, not layer(...): no hooks of the layer, no COAT path.
    forward = _original_class(layer).forward
    # A copy of the rotary embedding: a dynamic one keeps state from the positions it saw.
    rotary = copy.deepcopy(base.rotary_emb)
    attn = layer.self_attn
    impl = getattr(attn.config, "_attn_implementation", None)
    # Which attention kernel runs is the model's choice, not something COAT changes, and some
    # kernels give wrong values on the probe's 8 tokens without a mask (torch 2.13's compiled
    # CPU flex attention: NaN, or off by 0.02, call to call): both sides of the probe run the
    # recording SDPA.
    swap = impl not in (None, "sdpa", "eager", _PROBE_ATTENTION) and hasattr(
        attn.config, "_attn_implementation_internal"
    )
    raw = getattr(attn.config, "_attn_implementation_internal", None)  # what comes back
    records = swap or impl == _PROBE_ATTENTION
    before = attn.__dict__.get(_ARGS, _ARGS)
    model_calls, coat_calls = [], []
    try:
        if swap:
            _register_probe_attention()
            attn.config._attn_implementation_internal = _PROBE_ATTENTION
        with _probing(layer, rotary):
            cos_sin = rotary(x, _rope_positions(rotary, position_ids))
            with _recording(model_calls):
                want = forward(
                    layer,
                    x,
                    attention_mask=None,
                    position_embeddings=cos_sin,
                    position_ids=position_ids,
                )
            if records and model_calls and found is not None:
                found.update(_attention_args(attn, model_calls[0]))
            if found:
                setattr(attn, _ARGS, dict(found))
            with _recording(coat_calls):
                got = blocks.decoder_layer(
                    reference,
                    layer,
                    x,
                    attention_mask=None,
                    position_embeddings=cos_sin,
                    attn_kwargs={"position_ids": position_ids},
                )
    finally:
        if swap:
            attn.config._attn_implementation_internal = raw
        if before is _ARGS:
            attn.__dict__.pop(_ARGS, None)
        else:
            setattr(attn, _ARGS, before)
    if records and model_calls and coat_calls:
        problem = _attention_difference(model_calls[0], coat_calls[0])
        if problem is not None:
            return problem
    if isinstance(want, tuple):
        want = want[0]
    tol = 1e-4 if x.dtype in (torch.float32, torch.float64) else 2e-2
    err = (want.float() - got.float()).abs().max().item()
    if not err <= tol * want.float().abs().max().item():
        return f"its forward computes something else (max |difference| {err:.3g} on a probe input)"
    return None


_FAR = 2**21  # a position of the probe's second half

# The stand-in probe's attention implementation: SDPA, recording each call's keyword
# arguments (while ``_RECORDING`` is a list) so that the probe sees what the model's own
# attention passes beside q, k, v and the mask, and COAT can pass the same.
_PROBE_ATTENTION = "coat_probe_sdpa"
_RECORDING: list | None = None


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _RECORDING is not None:
        _RECORDING.append(kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_probe_attention() -> None:
    """Make ``_PROBE_ATTENTION`` a name transformers' attention lookup knows."""
    from transformers import AttentionInterface

    AttentionInterface.register(_PROBE_ATTENTION, _recording_attention)


@contextlib.contextmanager
def _recording(calls: list):
    global _RECORDING
    _RECORDING = calls
    try:
        yield
    finally:
        _RECORDING = None


# Arguments a layer hands its attention that change nothing it computes here (the cache's,
# which COAT's layer takes itself), and the window, which COAT takes from the probe.
_BOOKKEEPING = frozenset(
    ("use_cache", "cache_position", "past_key_value", "past_key_values", "output_attentions",
     "sliding_window")
)  # fmt: skip


def _attention_args(attn: nn.Module, call: dict) -> dict:
    """``blocks.ATTENTION_ARGS`` of ``attn`` from its own code's ``call``: the window, and
    which of the attention's own parameters and buffers it passes under which keyword."""
    own = [*attn.named_parameters(recurse=False), *attn.named_buffers(recurse=False)]
    tensors = {
        key: name
        for key, value in call.items()
        if isinstance(value, torch.Tensor)
        for name, t in own
        if t is value
    }
    return {"sliding_window": call.get("sliding_window"), "tensors": tensors}


def _attention_difference(model_args: dict, coat_args: dict) -> str | None:
    """What the model's own attention call passes that COAT's does not (or otherwise), or
    None; the window (``sliding_window``) COAT takes from the probe (``coat_sliding_window``)."""
    for name in sorted(set(model_args) | set(coat_args)):
        if name in _BOOKKEEPING or name not in model_args:
            continue
        mine, theirs = coat_args.get(name), model_args[name]
        same = mine is theirs if isinstance(theirs, torch.Tensor) else mine == theirs
        if name not in coat_args or not same:
            what = "a tensor" if isinstance(theirs, torch.Tensor) else repr(theirs)
            return (
                f"its attention is called with {name}={what}, which COAT's attention block "
                "does not pass"
            )
    return None


def _probe_key(layer: nn.Module) -> tuple:
    """What one probe answers for: the layer's class and the plain settings (numbers,
    flags, strings) of it and its attention and MLP, but their index. Layers of one class
    may differ by settings (SmolLM3's without RoPE: one probe per class passed them all,
    and they got RoPE)."""

    def settings(m):
        return tuple(sorted(
            (k, v) for k, v in vars(m).items()
            if not k.startswith("_") and k not in ("training", "layer_idx")
            and isinstance(v, bool | int | float | str | type(None))
        ))  # fmt: skip

    # A forward set on a module's instance (a patch, a Hub kernel) is its own arithmetic.
    patched = tuple(sorted(
        (name, getattr(getattr(f, "__func__", f), "__code__", None) or id(f))
        for name, m in layer.named_modules() if "forward" in m.__dict__
        for f in (m.__dict__["forward"],) if not getattr(f, "coat_compiled_forward", False)
    ))  # fmt: skip
    return (_original_class(layer), settings(layer), settings(layer.self_attn),
            settings(layer.mlp), patched)  # fmt: skip


def _cpu_probe(base: nn.Module, layer: nn.Module):
    """``(base, layer)`` stand-ins on the CPU for probing ``layer``: its class built anew, in
    fp32 with SDPA attention, from a narrow copy of its config (64 wide, 4 heads of 16: what
    the probe checks is the layer's arithmetic, which the config's other settings decide; a
    full-width copy of a 70B layer would take gigabytes), with random weights, and a rotary
    embedding for that config; None if they cannot be made so."""
    attn = layer.self_attn
    config = copy.deepcopy(attn.config)
    mha = getattr(config, "num_key_value_heads", None) == getattr(config, "num_attention_heads", 0)
    narrow = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 4 if mha else 2, "head_dim": 16}  # fmt: skip
    try:
        for name, value in narrow.items():
            setattr(config, name, value)
        # Attention the CPU runs (a flash-attention config asked for its GPU kernels): SDPA,
        # recording what the layer's code passes to it.
        _register_probe_attention()
        config._attn_implementation = _PROBE_ATTENTION
        # The CPU generator's state is restored after the init below (its values are
        # replaced from ``gen``); no manual_seed: it would seed every GPU's generator too.
        with torch.device("cpu"), torch.random.fork_rng(devices=[]):
            # fp32 whatever the model's dtype: bf16's tolerance passed a layer without RoPE.
            stand_in = _original_class(layer)(config, attn.layer_idx).float()
            rotary = type(base.rotary_emb)(config)
    except Exception:  # an unusual family (its own constructor): left to the real weights
        return None
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in stand_in.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05, generator=gen)
            else:
                p.uniform_(0.5, 1.5, generator=gen)
    holder = nn.Module()
    holder.rotary_emb = rotary
    return holder, stand_in


# apply_coat's hint when a later layer is refused after earlier ones passed.
FILTER_HINT = "; module_filter_fn can leave such layers out"


class UnsupportedModel(TypeError):
    """A model (or layer) that ``apply_coat`` cannot convert; the message says why.

    ``UnsupportedModel(reason, supported=False)`` (positional: exceptions take no keywords):
    ``reason`` is what is wrong with this model, first in the message; a true ``supported``
    adds what ``apply_coat`` supports after it (the long text, ``SUPPORTED``). No
    ``__init__`` of its own: torch.compile traces the raise inside a compiled layer."""

    @property
    def reason(self) -> str:
        """The message without what ``apply_coat`` supports (what coat-train prints)."""
        return str(self.args[0]) if self.args else ""

    @property
    def supported(self) -> bool:
        return len(self.args) > 1 and bool(self.args[1])

    def __str__(self) -> str:
        return f"{self.reason}. apply_coat supports {SUPPORTED}" if self.supported else self.reason


def _base_model(model: nn.Module) -> nn.Module:
    if type(model).__module__.split(".")[0] == "peft":  # (no adapter around a layer: above)
        raise UnsupportedModel(
            f"apply_coat takes the transformers model, not peft's {type(model).__name__}: "
            "call apply_coat(model) first, then peft's get_peft_model"
        )
    base = getattr(model, "base_model", model)
    for attr in ("layers", "rotary_emb"):
        if not hasattr(base, attr):
            raise UnsupportedModel(
                f"apply_coat: {type(model).__name__} has no "
                f"{'base model ' if base is not model else ''}attribute {attr!r}"
                + _language_model_hint(model, base),
                True,  # supported: what apply_coat supports follows
            )
    return base


def _language_model_hint(model: nn.Module, base: nn.Module) -> str:
    """For a vision-language model that is not LLaVA-shaped (Qwen2-VL, ...): where its
    language model is, which may convert alone."""
    inner = getattr(base, "language_model", None)
    if not (isinstance(inner, nn.Module) and hasattr(inner, "layers")):
        return ""
    fqn = next((name for name, m in model.named_modules() if m is inner), "language_model")
    return (
        f" (a vision-language model: its language model may convert alone, "
        f"apply_coat(model.{fqn}), and train with the model's own loss)"
    )


# ------------------------------------------------------------------------------ subclasses
def _bind(cls: type, args: tuple, kwargs: dict) -> dict:
    """Name every argument of a call to ``cls.forward`` (``**kwargs`` flattened)."""
    bound = inspect.signature(cls.forward).bind(None, *args, **kwargs).arguments
    bound.pop(next(iter(bound)))  # self
    for name, param in inspect.signature(cls.forward).parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            bound.update(bound.pop(name, {}))
    return bound


def _unpickle(original: type, mixin: type, state: dict | None = None) -> nn.Module:
    # Pickles written before the state moved to pickle's state slot pass it here.
    module = original.__new__(original)
    if state is not None:
        module.__setstate__(state)
    module.__class__ = _coat_class(mixin, original)
    return module


class _CoatMixin:
    def __new__(cls, *args, **kwargs):
        # COAT is what apply_coat does to a model, not a class to build: a model built from a
        # converted one's class (type(model).from_pretrained(...), _from_config, a layer's
        # type(layer)(config, i)) is built as the original class, plain. It had been the
        # COAT class with plain layers, which is_coat called converted. (FSDP2's classes
        # build their originals the same way.) A raw allocation, cls.__new__(cls) without
        # arguments (nn.DataParallel's replicas, copies), gets the COAT class, uninitialized.
        if not args and not kwargs:
            return super().__new__(cls)
        original = cls._coat_original_class
        module = original.__new__(original)
        module.__init__(*args, **kwargs)  # (not an instance of cls: Python does not init it)
        return module

    def __reduce_ex__(self, protocol):
        # Pickle finds classes by name, and the COAT subclass carries the original's name:
        # rebuild the original class, then convert again (torch.save(model), deepcopy).
        # Without CUDA graphs or launch plans (they belong to this model's tensors; a copy
        # records its own once they are enabled on it).
        # The state goes in pickle's state slot, restored once the module exists: pickle
        # and deepcopy then resolve what refers back to the module (a compiled layer's
        # CompiledForward, a forward set on the instance) to the copy; as an argument of
        # _unpickle it was copied before the module existed (a second copy of it, or no end).
        dropped = (*graphs.LAYER_KEYS, *plans.LAYER_KEYS)
        state = {k: v for k, v in self.__dict__.items() if k not in dropped}
        return _unpickle, (type(self)._coat_original_class, type(self)._coat_mixin), state


class _CoatDecoderLayer(_CoatMixin):
    """Mixed in before a decoder layer's class: training runs ``blocks.decoder_layer``."""

    coat_config = None
    # The op set the training forward runs (``blocks``' contract): an instance attribute
    # replaces it for that layer alone (a test's spy on one op, a different op set) until
    # apply_coat or revert_coat, which drop it.
    coat_ops = blocks.FP8_OPS
    # The marker ``graphs`` finds COAT layers by (it does not import this module, which
    # imports it). On the class, so that a reverted layer loses it with its class.
    _coat_decoder_layer = True

    def __call__(self, *args, **kwargs):
        if getattr(self, "gradient_checkpointing", False):
            # Whether the caller has grad, before a reentrant checkpoint turns it off.
            self._coat_called_with_grad = torch.is_grad_enabled()
        return super().__call__(*args, **kwargs)

    def forward(self, hidden_states, *args, **kwargs):
        # Reentrant gradient checkpointing runs its first forward without grad: take the COAT
        # path there too, so that the recomputation in backward computes the same function;
        # not in a caller's torch.no_grad() (generation mid-training): the original forward.
        checkpointing = getattr(self, "gradient_checkpointing", False) and vars(self).get(
            "_coat_called_with_grad", True
        )
        checked = kwargs.pop(CHECKED, False)
        if not (self.training and (torch.is_grad_enabled() or checkpointing)):
            return super().forward(hidden_states, *args, **kwargs)
        if not checked:
            check_coat_layer(self)
        return self._coat_forward(hidden_states, *args, **kwargs)

    def _coat_forward(self, hidden_states, *args, **kwargs):
        checkpointing = getattr(self, "gradient_checkpointing", False)
        if args:
            kwargs = _bind(self._coat_original_class, (hidden_states, *args), kwargs)
            hidden_states = kwargs.pop("hidden_states")
        kwargs.pop("use_cache", None)
        weight_casts = kwargs.pop(blocks.WEIGHT_CASTS, None)  # compile_layers' cached copies
        # transformers 5.17 calls the cache past_key_values, later versions cache.
        cache = kwargs.pop("cache", None)
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        if torch.compiler.is_compiling() and cache is not None and cache.get_seq_length() == 0:
            # Traced, a training forward leaves an empty cache empty (as CUDA graphs do):
            # nobody reads keys and values of a training step, and filling it would make each
            # layer's index a guard of its own, recompiling the shared graph for every layer.
            # A cache holding tokens (a prefix the step attends to) is used, as eagerly (one
            # graph per layer then): dropped, attention would not see the prefix. The first
            # layer's length decides, one guard that every layer shares.
            cache = None
        dtype, device = hidden_states.dtype, hidden_states.device.type
        cos_sin = kwargs.pop("position_embeddings", None)
        if cos_sin is None:  # (apply_coat's probe gives every layer RoPE: it cannot tell)
            raise UnsupportedModel(
                f"{type(self).__name__} was called without position_embeddings (a layer "
                "without RoPE, e.g. GraniteSWA's with rope theta 0): COAT's attention block "
                "applies RoPE; leave such layers out with apply_coat's module_filter_fn"
            )
        if torch.is_autocast_enabled(device):
            # fp32 master weights under autocast: run the whole layer in the autocast dtype,
            # residual stream included (COAT keeps it in BF16), rather than in fp32 with bf16
            # GEMM outputs; the output goes back to the stream's dtype.
            compute = torch.get_autocast_dtype(device)
            hidden_states = _in_dtype(hidden_states, compute)
            cos_sin = tuple(_in_dtype(t, compute) for t in cos_sin)
        mask = _rows_see_a_key(kwargs.pop("attention_mask", None), self)
        out = graphs.run_graphed(self, hidden_states, cos_sin, mask, cache, kwargs, checkpointing)
        if out is None:  # enable_launch_plans: the recorded step
            out = plans.run_planned(
                self, hidden_states, cos_sin, mask, cache, kwargs, checkpointing
            )
        # Under checkpointing the fp32 output is kept as the next layer's checkpoint input:
        # it must not keep the bf16 one alive too (and no FP8 hand-over is made to reuse).
        to_dtype = _plain_to_dtype if checkpointing else _to_dtype
        if out is not None:  # the recorded layer (CUDA graphs or a launch plan)
            return to_dtype(out, dtype)
        with torch.autocast(device, enabled=False):
            out = blocks.decoder_layer(
                self.coat_ops,
                self,
                hidden_states,
                attention_mask=mask,
                position_embeddings=cos_sin,
                cache=cache,
                config=layer_config(self),
                attn_kwargs=kwargs,
                hand_over_output=not checkpointing,
                weight_casts=weight_casts,
            )
        return to_dtype(out, dtype)

    def _apply(self, fn, recurse=True):
        # .to(), .cuda(), .half(), ...: a CUDA-graph recording holds stand-ins of the old
        # parameters' storage; drop it so that the storage can go (recorded again on use).
        graphs.drop_recording(self)
        plans.drop_plans(self)  # (the same for launch plans: recorded again on use)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        ops = ", ops=own" if "coat_ops" in self.__dict__ else ""
        return f"coat={self.coat_config}{ops}"


# Under autocast with fp32 master weights each COAT layer runs in the autocast dtype and
# hands the model its output in the stream's dtype (fp32). The next layer would convert it
# back, and RoPE's cos and sin (one pair for all layers) would be converted in every layer.
# Instead a layer's fp32 output remembers the output it was made from, and a copy of a
# tensor that needs no gradient (cos, sin) is remembered on it: ``(dtype, version, other,
# other's version)``. The next layer takes the remembered tensor (the same values; a layer
# output's FP8 hand-over for the norm kept) while neither has changed since. Copies of
# tensors that need gradients are not remembered: a leaf's copy would hold the leaf through
# autograd (a cycle the collector cannot see), and such inputs are converted once anyway.
_CONVERTED = "_coat_converted"


def _plain_to_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype)


def _to_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, remembering ``t`` on the result when that is a new tensor."""
    if t.dtype == dtype:
        return t
    if torch.compiler.is_compiling():  # a traced tensor remembers nothing
        return t.to(dtype)
    out = t.to(dtype)
    setattr(out, _CONVERTED, (t.dtype, out._version, t, t._version))
    return out


_OPENED = "_coat_rows_see_a_key"  # (on a mask: what _rows_see_a_key made from it)


def _rows_see_a_key(mask, layer: nn.Module):
    """A 4D boolean attention mask whose query rows that see no key (a left-padded batch's
    pad positions under a causal mask) see the first key. CUDA's cuDNN attention gives such
    rows NaN gradients (seen with torch 2.11 on an H100: the tiny Llama at 64 tokens, plain
    bf16 transformers too), which reach every weight. The first key is never later than the
    query, with a cache of any kind too (no label leaks), and the other rows' attention is
    unchanged; the pad rows' outputs change (from 0 on the backends that make them 0), and
    with them the per-tensor FP8 scales they may set. Broadcast dimensions stay broadcast.
    Made once per model forward: remembered on the mask for the next layers, made again when
    the layer that made it sees the mask again (the next forward, or a recomputation) or its
    version changed."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
        return mask  # (a 2D flash-attention mask, a float or block mask: as given)
    keep = not (torch.compiler.is_compiling() or mask.is_inference())
    hit = getattr(mask, _OPENED, None) if keep else None
    if hit is not None and hit[0] == mask._version and hit[2] != id(layer):
        return hit[1]
    base = plans._unbroadcast(mask)
    first = torch.arange(base.shape[-1], device=mask.device) == 0
    out = (base | (first & ~base.any(-1, keepdim=True))).expand(mask.shape)
    if keep:
        setattr(mask, _OPENED, (mask._version, out, id(layer)))
    return out


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``: the tensor remembered on ``t`` when it still matches (same dtype,
    neither changed, the same ``requires_grad``), else a copy (remembered when ``t`` needs no
    gradient)."""
    if t.dtype == dtype:
        return t
    if torch.compiler.is_compiling():  # a traced tensor remembers nothing
        return t.to(dtype)
    hit = getattr(t, _CONVERTED, None)
    if (
        hit is not None and hit[0] == dtype and hit[1] == t._version
        and hit[2]._version == hit[3] and hit[2].requires_grad == t.requires_grad
    ):  # fmt: skip
        return hit[2]
    out = t.to(dtype)
    if not t.requires_grad:
        setattr(t, _CONVERTED, (dtype, t._version, out, out._version))
    return out


class _CoatCausalLM(_CoatMixin):
    """Mixed in before a causal LM's class: training with labels computes the loss in
    chunks straight from the last hidden states (no full logits tensor, no fp32 copy of it)
    and returns ``logits=None``."""

    def forward(self, *args, **kwargs):
        # The fused loss reads the head's weight without calling the head: the model's own
        # head and loss run when the head or loss changed since apply_coat (PEFT's LoRA on
        # lm_head, a biased head, another loss_function) or hooks wait on the head's call.
        if not (self.training and torch.is_grad_enabled()) or not _fusable_now(self):
            return super().forward(*args, **kwargs)
        named = _bind(self._coat_original_class, args, kwargs)
        labels = named.pop("labels", None)
        shift_labels = named_shift = named.pop("shift_labels", None)
        # transformers' heads compute a loss only with labels (shift_labels alone: logits,
        # no loss), and return all logits only when logits_to_keep is 0.
        if labels is None or not _is_zero(named.pop("logits_to_keep", 0)):
            return super().forward(*args, **kwargs)
        return_dict = named.pop("return_dict", None)
        num_items = named.get("num_items_in_batch")
        ignore_index = named.pop("ignore_index", -100)
        outputs = self.base_model(**named)
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        hidden = outputs.last_hidden_state
        if shift_labels.shape != hidden.shape[:-1] or shift_labels.dtype != torch.int64:
            name = "labels" if named_shift is None else "shift_labels"
            raise ValueError(
                f"{name} must be int64 (torch.long) of the inputs' shape "
                f"{tuple(hidden.shape[:-1])}, got {shift_labels.dtype} {tuple(shift_labels.shape)}"
            )
        loss = linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]),
            self.lm_head.weight,
            shift_labels.reshape(-1).to(hidden.device),
            ignore_index=ignore_index,
            num_items=num_items,
        )
        # The output class the model's own forward returns (a VLM's carries its image
        # outputs too), with the base model's outputs of the same names.
        cls, fields = _output_class(self._coat_original_class)
        out = cls(loss=loss, logits=None, **{k: v for k, v in outputs.items() if k in fields})
        if return_dict is False:
            # to_tuple() drops None fields: logits keep their place (None), so that out[1]
            # is not the cache that follows them.
            loss, *rest = out.to_tuple()
            return (loss, None, *rest)
        return out


_OUTPUT_CLASSES: dict[type, tuple[type, frozenset]] = {}


def _output_class(original: type) -> tuple[type, frozenset]:
    """``(output dataclass, its fields but loss and logits)`` that ``original.forward``
    returns by its annotation (``tuple | LlavaCausalLMOutputWithPast``, ...), or
    ``CausalLMOutputWithPast`` when it names none with loss and logits."""
    hit = _OUTPUT_CLASSES.get(original)
    if hit is None:
        try:
            ret = typing.get_type_hints(original.forward).get("return")
        except Exception:  # an annotation that does not resolve
            ret = None
        found = CausalLMOutputWithPast
        for cls in typing.get_args(ret) or (ret,):
            if isinstance(cls, type) and dataclasses.is_dataclass(cls):
                names = {f.name for f in dataclasses.fields(cls)}
                if {"loss", "logits"} <= names:
                    found = cls
                    break
        fields = frozenset(f.name for f in dataclasses.fields(found)) - {"loss", "logits"}
        hit = _OUTPUT_CLASSES[original] = (found, fields)
    return hit


def _is_zero(logits_to_keep) -> bool:
    return isinstance(logits_to_keep, int) and logits_to_keep == 0


_SUBCLASSES: dict[tuple[type, type], type] = {}


def _coat_class(mixin: type, cls: type) -> type:
    """``mixin`` + ``cls`` under ``cls``'s name, so that ``save_pretrained`` writes the
    original architecture name into config.json."""
    key = (mixin, cls)
    if key not in _SUBCLASSES:

        def forward(self, *args, **kwargs):
            return mixin.forward(self, *args, **kwargs)

        # Trainer (which dataset columns to keep) and generate() read the signature.
        forward.__signature__ = inspect.signature(cls.forward)
        forward.__doc__ = cls.forward.__doc__
        attrs = {"_coat_original_class": cls, "_coat_mixin": mixin, "forward": forward}
        sub = type(cls.__name__, (mixin, cls), attrs)
        sub.__qualname__ = cls.__qualname__
        sub.__module__ = cls.__module__
        _SUBCLASSES[key] = sub
    return _SUBCLASSES[key]


def _original_class(module: nn.Module) -> type:
    return getattr(type(module), "_coat_original_class", type(module))


def set_fused_loss(model: nn.Module, enabled: bool = True) -> bool:
    """Turn the chunked training loss of a causal LM on or off (``apply_coat``'s
    ``fused_loss``); returns whether it is on. Models whose head is not a plain bias-free
    ``lm_head`` with transformers' ``ForCausalLMLoss`` keep their own loss."""
    check_flags(enabled=enabled)  # ("False" switched it on)
    original = _original_class(model)
    on = enabled and _head_supported(model)
    model.__class__ = _coat_class(_CoatCausalLM, original) if on else original
    return on


def _fusable_now(model: nn.Module) -> bool:
    """What of ``_head_supported`` can change after apply_coat (the head, its bias, the
    loss function; the config's head settings were checked then), and nothing waits on the
    head's call: no hook on it, no forward of its own instance (accelerate's). A few
    attribute reads per training forward."""
    head = model.lm_head
    return (
        type(head) is nn.Linear and head.bias is None
        and getattr(model.loss_function, "__name__", "") == "ForCausalLMLoss"
        and not (head._forward_hooks or head._forward_pre_hooks or head._backward_hooks
                 or head._backward_pre_hooks or "forward" in head.__dict__)
    )  # fmt: skip


def _head_supported(model: nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear or head.bias is not None:
        # loss_function is not read here: on a model without a loss (a VLM's LlamaModel)
        # transformers logs that its loss_type=None is unrecognized.
        return False
    config = getattr(model, "config", None)
    # A VLM's head settings may live in its text config (or be copied onto the model).
    text_config = getattr(config, "get_text_config", lambda: None)()
    return getattr(model.loss_function, "__name__", "") == "ForCausalLMLoss" and not any(
        _is_set(name, getattr(owner, name, None))
        for owner in (config, text_config, model)
        for name in _HEAD_EXTRAS
    )


def _is_set(name: str, value) -> bool:
    """A head setting in use: a tensor (a learned scale), a scale other than 1 (Granite's
    default ``logits_scaling=1.0`` had turned the fused loss off), a softcap other than
    0/None."""
    if isinstance(value, torch.Tensor):
        return True
    if name in ("logit_scale", "logits_scaling"):
        return value is not None and value != 1
    return bool(value)


# ------------------------------------------------------------------------------ conversion


def check_flags(**flags) -> None:
    """Boolean options: a string or a number was taken for its truth ("False" switched on)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


def check_options(config, module_filter_fn) -> FP8ActivationConfig:
    """``config`` (``None``: the defaults) once checked, with ``module_filter_fn``: a
    ``TypeError`` naming what is expected."""
    if config is None:
        config = FP8ActivationConfig()
    if not isinstance(config, FP8ActivationConfig):
        raise TypeError(
            "config must be an fp8_activations.FP8ActivationConfig or None, "
            f"got {type(config).__name__}"
        )
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(
            "module_filter_fn must be a callable (module, fqn) -> bool or None, got "
            f"{type(module_filter_fn).__name__}"
        )
    return config


def convert_llama(
    model: nn.Module,
    *,
    config: FP8ActivationConfig | None = None,
    module_filter_fn: FilterFn | None = None,
    fused_loss: bool = True,
    prefix: str = "",
    root: nn.Module | None = None,
) -> nn.Module:
    """``coat_models.apply_coat`` for a Llama-shaped model (the public entry point, which
    also dispatches LLaVA models, lives in ``coat_models.convert``; see its docstring).
    ``root``: the model that ``model`` is a part of (a VLM), for ``layer_config``.

    ``module_filter_fn(layer, fqn)`` is called once per decoder layer, ``fqn`` being the
    layer's name in ``model.named_modules()`` with ``prefix`` (``"."``-joined) in front: the
    name in the model the user passed when ``model`` is a part of it (a VLM's language
    model). Layers for which it returns False stay plain.
    """
    config = check_options(config, module_filter_fn)
    if config.weight_cache and _sharded(model):
        # Sharded before (shard_model, then apply_coat again): see layer_config.
        config = config.replace(weight_cache=False)
    base = _base_model(model)
    layers = list(base.layers)
    if not layers:
        raise UnsupportedModel(f"apply_coat: {type(model).__name__} has no decoder layers")
    if module_filter_fn is not None:
        names = {id(m): name for name, m in model.named_modules()}
        fqns = [".".join(filter(None, (prefix, names[id(layer)]))) for layer in layers]
        keep = [bool(module_filter_fn(layer, fqn)) for layer, fqn in zip(layers, fqns, strict=True)]
    else:
        keep = [True] * len(layers)
    passed, probed, keys = False, {}, [None] * len(layers)
    for index, (layer, convert) in enumerate(zip(layers, keep, strict=True)):
        if not convert:  # left plain: whatever it computes
            continue
        problem = _layer_problem(layer)
        if problem is None:
            keys[index] = _probe_key(layer)
        if problem is None and keys[index] not in probed:
            found = probed[keys[index]] = {}
            try:
                problem = _layer_mismatch(base, layer, found=found)
            except Exception as e:  # its code needs what the probe does not give it
                line = (str(e).strip().splitlines() or [""])[0]
                problem = f"its forward could not be probed ({type(e).__name__}: {line})"
        if problem is not None:
            hint = FILTER_HINT if passed else ""
            raise UnsupportedModel(
                f"apply_coat: layer {index} of {type(model).__name__} "
                f"({type(layer).__name__}) is not supported: {problem}{hint}",
                True,  # supported: what apply_coat supports follows
            )
        passed = True
    for index, (layer, convert) in enumerate(zip(layers, keep, strict=True)):
        problem = _instance_forward_problem(layer) if convert else None
        if problem is not None:
            raise UnsupportedModel(
                f"apply_coat: layer {index} of {type(model).__name__} cannot take COAT: {problem}"
            )
    top = root if root is not None else model
    where = {id(m): name for name, m in top.named_modules()}
    for layer, convert, key in zip(layers, keep, keys, strict=True):
        original = _original_class(layer)
        layer.self_attn.__dict__.pop(_ARGS, None)
        if not convert:
            layer.__class__ = original
            for name in _LAYER_STATE:
                layer.__dict__.pop(name, None)
            _HOLDERS.pop(layer, None)
            continue
        found = probed.get(key)
        if found:  # (else blocks.attention reads the window off the module and config)
            setattr(layer.self_attn, _ARGS, dict(found))
        layer.__class__ = _coat_class(_CoatDecoderLayer, original)
        layer.coat_config = config
        layer.__dict__.pop("coat_ops", None)  # converted again: the default op set
        _HOLDERS[layer] = _holders(top, where[id(layer)])
    set_fused_loss(model, fused_loss)
    return model


def revert_classes(model: nn.Module) -> nn.Module:
    """Give every module of ``model`` its original class back (the Llama part of
    ``coat_models.revert_coat``)."""
    for module in model.modules():
        original = _original_class(module)
        if original is not type(module):
            module.__class__ = original
        for name in (*_LAYER_STATE, _ARGS):
            module.__dict__.pop(name, None)
        _HOLDERS.pop(module, None)
    return model


# What apply_coat sets on a converted layer (beside its class), dropped when it is reverted.
_LAYER_STATE = ("coat_config", "coat_ops")
# On a converted layer's attention: what its own code passes to the attention function (the
# probe's record: blocks.ATTENTION_ARGS), which blocks.attention passes too.
_ARGS = blocks.ATTENTION_ARGS


def is_coat(module: nn.Module) -> bool:
    """True for a model (or layer) that ``apply_coat`` converted, or a part of which it
    converted (a LLaVA model whose language-model layers were all filtered out still has an
    FP8 projector: ``_coat_vlm``, what ``vila.is_coat_vlm`` looks for)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"is_coat takes an nn.Module, got {type(module).__name__}")
    return any(
        hasattr(type(m), "_coat_original_class") or "_coat_vlm" in m.__dict__
        for m in module.modules()
    )
