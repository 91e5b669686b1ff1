"""apply_coat's checks have no side effects, and adapters (PEFT's LoRA) are refused, never
bypassed: a COAT layer reads its projections' weights directly, so a wrapper around one
would silently drop out of training."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from coat_models import apply_coat, is_coat, revert_coat
from coat_models.testing import TINY_LLAMA as TINY
from coat_models.testing import tiny_causal_lm, tiny_llama
from coat_models.vila import apply_coat_vlm, llava_tiny_config
from torch import nn

VOCAB = 256


pytestmark = pytest.mark.usefixtures("one_thread")


def tokens(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------ the probe: no side effects
class HookCounter:
    """Forward pre-hooks and hooks on every module of ``model``, counting calls."""

    def __init__(self, model: nn.Module):
        self.calls = 0
        self.handles = []
        for m in model.modules():
            self.handles.append(m.register_forward_pre_hook(self._count))
            self.handles.append(m.register_forward_hook(self._count))

    def _count(self, *args):
        self.calls += 1

    def remove(self):
        for h in self.handles:
            h.remove()


def mixed_flags(model: nn.Module) -> dict[str, bool]:
    """Give the modules of ``model`` a mix of train/eval flags; returns them by name."""
    model.train()
    for i, (_, m) in enumerate(model.named_modules()):
        if i % 3 == 1:
            m.training = False
    return {name: m.training for name, m in model.named_modules()}


def flags(model: nn.Module) -> dict[str, bool]:
    return {name: m.training for name, m in model.named_modules()}


def test_probe_fires_no_hooks_and_keeps_every_training_flag():
    model = tiny_llama()
    want = mixed_flags(model)
    layer0 = [v for k, v in want.items() if k.startswith("model.layers.0")]
    assert any(layer0) and not all(layer0)  # the probed layer holds both flags
    hooks = HookCounter(model)
    apply_coat(model)
    assert is_coat(model)
    assert hooks.calls == 0
    assert flags(model) == want
    model.eval()(tokens())  # the hooks are still there, and still removable
    assert hooks.calls > 0
    hooks.remove()
    calls = hooks.calls
    model(tokens())
    assert hooks.calls == calls


def _rejected_by_a_probe():
    one = {**TINY, "num_hidden_layers": 1, "head_dim": 16}
    granite = transformers.GraniteConfig(**one, residual_multiplier=0.5)
    # the layer probe runs, then raises
    yield "granite", transformers.GraniteForCausalLM(granite), "computes something else"
    # the SiLU probe of the MLP activation
    yield "gemma", transformers.GemmaForCausalLM(transformers.GemmaConfig(**one)), "SiLU"


@pytest.mark.parametrize(
    "model, match",
    [m[1:] for m in _rejected_by_a_probe()],
    ids=[m[0] for m in _rejected_by_a_probe()],
)
def test_probe_has_no_side_effects_when_it_raises(model, match):
    want = mixed_flags(model)
    hooks = HookCounter(model)
    with pytest.raises(TypeError, match=match):
        apply_coat(model)
    assert hooks.calls == 0
    assert flags(model) == want
    assert not is_coat(model)


def test_vlm_probes_fire_no_hooks_and_keep_every_training_flag():
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(llava_tiny_config())
    want = mixed_flags(model)
    hooks = HookCounter(model)
    apply_coat_vlm(model, vision=True)
    assert hooks.calls == 0
    # modules that conversion kept (FP8 twins replace some) keep their own flags
    assert {k: v for k, v in flags(model).items() if k in want} == {
        k: v for k, v in want.items() if k in flags(model)
    }
    assert flags(model)["model.language_model.layers.0"] == want["model.language_model.layers.0"]


# ------------------------------------------------------------------------------- adapters
class LowRank(nn.Module):
    """What a LoRA adapter does to a projection: the original ``nn.Linear`` as
    ``base_layer``, a trainable low-rank path added to its output, and ``weight`` forwarded
    to the base layer (so code that reads ``.weight`` sees a plain linear)."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def wrap(model: nn.Module, fqn: str) -> LowRank:
    parent, _, name = fqn.rpartition(".")
    owner = model.get_submodule(parent)
    adapter = LowRank(getattr(owner, name))
    setattr(owner, name, adapter)
    return adapter


def test_apply_coat_refuses_a_model_with_adapters():
    model = tiny_llama()
    wrap(model, "model.layers.1.mlp.down_proj")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        TypeError, match=r"model\.layers\.1\.mlp\.down_proj is wrapped by an adapter"
    ) as e:
        apply_coat(model)
    assert "not supported yet" in str(e.value) and "merge_and_unload" in str(e.value)
    assert not is_coat(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_vlm_with_adapters_is_refused_around_the_language_model_only():
    """Around the language model's layers COAT's fused layers would bypass an adapter:
    refused. The projector (and tower) get plain FP8 modules, which leave an adapter as it
    is and convert the layer it wraps: it trains (it was refused)."""
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(llava_tiny_config())
    wrap(model, "model.language_model.layers.0.mlp.down_proj")
    with pytest.raises(TypeError, match="apply_coat_vlm cannot convert.*wrapped by an adapter"):
        apply_coat_vlm(model)
    with pytest.raises(TypeError, match="apply_coat_vlm cannot convert.*wrapped by an adapter"):
        apply_coat(model)
    model = transformers.LlavaForConditionalGeneration(llava_tiny_config())
    adapter = wrap(model, "model.multi_modal_projector.linear_1")
    apply_coat_vlm(model).train()
    assert type(adapter.base_layer).__name__ == "FP8Linear"
    ids = torch.tensor([[256] + [257] * 16 + [97, 98]])
    model(input_ids=ids, pixel_values=torch.randn(1, 3, 32, 32), labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapter.parameters()
               if p.requires_grad)  # fmt: skip


@pytest.mark.parametrize("fqn", ["self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj"])
def test_coat_layer_refuses_to_train_with_a_wrapped_projection(fqn):
    ref = tiny_llama()
    model = apply_coat(copy.deepcopy(ref))
    for m in (ref, model):  # wrapped after apply_coat, as get_peft_model(apply_coat(m)) does
        torch.manual_seed(1)
        wrap(m, f"model.layers.1.{fqn}")
    ids = tokens()
    with pytest.raises(TypeError, match=rf"COAT decoder layer 1 cannot train: {fqn} is wrapped"):
        model.train()(ids, labels=ids)
    # evaluation runs the original forward, adapter included: the same as unconverted
    assert torch.equal(model.eval()(ids).logits, ref.eval()(ids).logits)
    # and without COAT it trains, adapter included
    revert_coat(model).train()(ids, labels=ids).loss.backward()
    adapter = model.get_submodule(f"model.layers.1.{fqn}")
    assert adapter.lora_A.weight.grad is not None and adapter.lora_A.weight.grad.abs().sum() > 0


def test_fused_loss_leaves_a_wrapped_head_to_the_model():
    # A wrapped lm_head: the model's own head and loss, so the adapter trains.
    ref = tiny_llama()
    model = apply_coat(copy.deepcopy(ref), fused_loss=True)
    for m in (ref, model):
        torch.manual_seed(1)
        wrap(m, "lm_head")
    ids = tokens()
    out = model.train()(ids, labels=ids)
    assert out.logits is not None  # not the fused loss (which returns no logits)
    out.loss.backward()
    grad = model.lm_head.lora_A.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_peft_lora():
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    ids = tokens()
    # apply_coat on a PEFT model says why it refuses
    with pytest.raises(TypeError, match="q_proj is wrapped by an adapter.*LoRA/PEFT"):
        apply_coat(peft.get_peft_model(tiny_llama(), lora))
    # LoRA added after apply_coat: training refuses instead of bypassing the adapters
    model = peft.get_peft_model(apply_coat(tiny_llama()), lora)
    with pytest.raises(TypeError, match="COAT decoder layer 0 cannot train.*lora"):
        model.train()(ids, labels=ids)
    # without COAT all 8 LoRA matrices train (B starts at zero, so A's gradient is zero)
    revert_coat(model)
    model.train()(ids, labels=ids).loss.backward()
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 4 and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b)


# ------------------------------------------------------------------ probes per layer, on meta
def _smollm3(**kw):
    config = transformers.SmolLM3Config(**{**TINY, "num_hidden_layers": 4, "pad_token_id": 0,
                                           "bos_token_id": 1, "eos_token_id": 2, **kw})  # fmt: skip
    torch.manual_seed(0)
    return transformers.SmolLM3ForCausalLM(config)


def test_layers_of_one_class_with_other_settings_are_probed_each():
    """One probe per layer class passed SmolLM3's layers without RoPE (layer 0
    has it), and they got RoPE silently. The first such layer is refused, naming
    module_filter_fn, which leaves them out; the rest convert and compute the model's bits
    with the exact ops."""
    from coat_models import reference

    plain = _smollm3().train()
    assert not plain.model.layers[3].self_attn.use_rope
    with pytest.raises(TypeError, match="layer 3 .*computes something else.*module_filter_fn"):
        apply_coat(copy.deepcopy(plain))
    model = apply_coat(copy.deepcopy(plain), fused_loss=False,
                       module_filter_fn=lambda m, fqn: m.self_attn.use_rope)  # fmt: skip
    assert [is_coat(layer) for layer in model.model.layers] == [True, True, True, False]
    for layer in model.model.layers[:3]:
        layer.coat_ops = reference  # exact arithmetic: the COAT path's math, no FP8
    x = tokens()
    got = model(x, output_hidden_states=True).hidden_states
    want = plain(x, output_hidden_states=True).hidden_states
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_meta_model_is_probed_on_a_cpu_copy():
    """On the meta device the probe was skipped, so Granite's residual
    multiplier converted there and trained silently wrong once materialized; apply_coat
    inside a meta device context failed in the SiLU probe."""
    granite = transformers.GraniteConfig(**TINY, residual_multiplier=0.5)
    llama = transformers.LlamaConfig(**TINY)
    with torch.device("meta"):
        with pytest.raises(TypeError, match="computes something else"):
            apply_coat(transformers.GraniteForCausalLM(granite))
        model = apply_coat(transformers.LlamaForCausalLM(llama))
    assert is_coat(model) and all(p.is_meta for p in model.parameters())


def test_a_meta_probe_runs_in_fp32_on_the_cpu_whatever_the_model_asks():
    """A bf16 meta SmolLM3 passed its layer without RoPE (bf16's tolerance); a
    meta model configured for flash attention crashed in the probe (its kernels)."""
    with torch.device("meta"):
        config = transformers.SmolLM3Config(**{**TINY, "num_hidden_layers": 4, "pad_token_id": 0,
                                               "bos_token_id": 1, "eos_token_id": 2})  # fmt: skip
        smol = transformers.SmolLM3ForCausalLM(config).to(torch.bfloat16)
        with pytest.raises(TypeError, match="layer 3 .*computes something else"):
            apply_coat(smol)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
        # as from_pretrained(..., attn_implementation="flash_attention_2") sets it
        model.config._attn_implementation_internal = "flash_attention_2"
        assert is_coat(apply_coat(model.to(torch.bfloat16)))


def test_a_compiled_wrapper_is_refused_and_a_neutral_logit_scale_keeps_the_fused_loss():
    """apply_coat(torch.compile(model)) changed the wrapper's class, whose
    compiled forward then skipped the fused loss silently; Granite's logits_scaling=1.0
    (its default, a no-op) had turned the fused loss off."""
    with pytest.raises(TypeError, match=r"not torch.compile's wrapper .*apply_coat\(model\) first"):
        apply_coat(torch.compile(tiny_llama()))
    granite = transformers.GraniteForCausalLM(transformers.GraniteConfig(**TINY))
    assert granite.config.logits_scaling == 1.0
    apply_coat(granite).train()
    x = tokens()
    assert granite(x, labels=x).logits is None  # the fused loss: no logits built


def test_a_peft_model_without_layer_adapters_says_to_convert_first():
    """A prompt-tuning PeftModel was refused with "PeftModelForCausalLM has no
    base model attribute 'layers'"; converting first, then wrapping, works."""
    peft = pytest.importorskip("peft")
    prompt = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    with pytest.raises(
        TypeError, match="not peft's PeftModelForCausalLM: call apply_coat.model. first"
    ):
        apply_coat(peft.get_peft_model(tiny_llama(), prompt))
    model = peft.get_peft_model(apply_coat(tiny_llama()), prompt)
    assert is_coat(model)


@pytest.mark.parametrize("family, overrides, layer", [
    ("Granite", {"residual_multiplier": 0.22}, 0),
    ("SmolLM3", {"num_hidden_layers": 4, "pad_token_id": 0, "bos_token_id": 1,
                 "eos_token_id": 2}, 3),
], ids=["granite-residual-multiplier", "smollm3-layer-without-rope"])  # fmt: skip
def test_a_bf16_model_is_probed_in_fp32(family, overrides, layer):
    """bf16 weights (from_pretrained's usual dtype) were probed in bf16, whose tolerance
    passed Granite's residual multiplier (layer updates 4.5x too large) and SmolLM3's layers
    without RoPE: both converted and trained silently wrong. Refused as in fp32."""
    model = tiny_causal_lm(family, **overrides).to(torch.bfloat16)
    with pytest.raises(TypeError, match=f"layer {layer} .*computes something else"):
        apply_coat(model)
    assert not is_coat(model)
    assert is_coat(apply_coat(tiny_causal_lm("Llama").to(torch.bfloat16)))  # a Llama converts


@pytest.mark.parametrize("family, overrides, layer", [
    ("Granite", {"residual_multiplier": 0.22}, 0),
    ("SmolLM3", {"num_hidden_layers": 4, "pad_token_id": 0, "bos_token_id": 1,
                 "eos_token_id": 2}, 3),
], ids=["granite-residual-multiplier", "smollm3-layer-without-rope"])  # fmt: skip
def test_an_fp32_model_with_zero_output_projections_is_probed_on_random_weights(
    family, overrides, layer
):
    """fp32 layers were probed with their own weights: zero attention and MLP output
    projections (a zero-initialised residual branch, or a model converted before its weights
    are loaded) hid what the layer does inside them, and Granite's residual multiplier and
    SmolLM3's layers without RoPE converted and trained silently wrong (30 steps
    from zero init, loss 2.87 against the plain model's 0.089)."""
    model = tiny_causal_lm(family, **overrides)
    for block in model.model.layers:
        block.self_attn.o_proj.weight.data.zero_()
        block.mlp.down_proj.weight.data.zero_()
    with pytest.raises(TypeError, match=f"layer {layer} .*computes something else"):
        apply_coat(model)
    assert not is_coat(model)
    llama = tiny_causal_lm("Llama")
    for block in llama.model.layers:
        block.self_attn.o_proj.weight.data.zero_()
    assert is_coat(apply_coat(llama))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_apply_coat_leaves_the_random_generators_as_they_were(monkeypatch, dtype):
    """The probe's stand-in layer was built after torch.manual_seed(0), which seeds every
    GPU's generator too (fork_rng restored the CPU's only): in a user's loop every seed got
    the same GPU randomness (dropout) after apply_coat."""
    model = tiny_causal_lm("Llama").to(dtype)
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda s: seeded.append(s))
    apply_coat(model)
    assert seeded == [] and torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("index", [0, 1])
def test_a_layer_with_a_patched_module_forward_is_probed_as_it_is(index, dtype):
    """A forward set on a module of one layer (a hand patch, a Hub kernel) is probed on that
    layer: the fp32 stand-in of a bf16 layer is built from its class (a first fix of the
    bf16 probe accepted a norm computing something else), and layers of one class and
    settings shared the first one's probe (a patch on layer 1 was accepted)."""
    model = tiny_causal_lm("Llama").to(dtype)
    norm = model.model.layers[index].post_attention_layernorm
    norm.forward = lambda x: (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)
                              + 1e-6) * 5 * norm.weight.float()).to(x.dtype)  # fmt: skip
    with pytest.raises(TypeError, match=f"layer {index} .*computes something else"):
        apply_coat(model)


def test_a_query_scale_that_grows_with_the_position_is_refused():
    """Ministral3 scales queries by 1 + beta * log(1 + floor(pos / 16384)): 1 at the probe's
    first positions, so it converted and long-context training lost the scale. The probe
    also runs far positions."""
    with pytest.raises(TypeError, match="layer 0 .*computes something else"):
        apply_coat(tiny_causal_lm("Ministral3"))


def test_dropout_the_layer_applies_in_training_is_refused():
    """The probe runs in eval mode: Seed-OSS's residual_dropout (0.1 by default) converted and
    trained without its dropout. Refused naming it; at 0 the model converts."""
    with pytest.raises(TypeError, match=r"residual_dropout = 0.1: the COAT path applies no "):
        apply_coat(tiny_causal_lm("SeedOss"))
    assert is_coat(apply_coat(tiny_causal_lm("SeedOss", residual_dropout=0.0)))


def test_a_layer_the_probe_cannot_run_is_refused_as_unsupported():
    """MiMo-V2-Flash's rotary embedding needs a layer_type: a raw TypeError from
    transformers escaped, naming nothing supported."""
    from coat_models.llama import UnsupportedModel

    with pytest.raises(UnsupportedModel, match=r"could not be probed \(TypeError: .*layer_type"):
        apply_coat(tiny_causal_lm("MiMoV2Flash"))


def test_a_vision_language_model_that_is_not_llava_shaped_names_its_language_model():
    """Qwen2-VL was refused with the Llama-only message alone, which did not say that its
    language model converts alone."""
    text = {**TINY, "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]}}
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=8,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)  # fmt: skip
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision)
    model = transformers.Qwen2VLForConditionalGeneration(config)
    with pytest.raises(TypeError, match=r"may convert alone, apply_coat\(model\.model\."
                       r"language_model\)"):  # fmt: skip
        apply_coat(model)
    assert is_coat(apply_coat(model.model.language_model))


def test_the_probe_does_not_judge_the_model_s_own_attention_kernel():
    """torch 2.13's compiled CPU flex attention gives wrong values for the probe's 8 tokens
    without a mask (NaN, or off by 0.02, call to call): a flex-attention Llama was refused as
    computing something else. Both sides of the probe run SDPA; the model keeps its
    implementation."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def noisy(module, query, key, value, attention_mask, **kwargs):  # another answer each call
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return out + torch.randn_like(out), weights

    AttentionInterface.register("coat_test_noisy", noisy)
    model = tiny_llama(attn_implementation="coat_test_noisy")
    assert is_coat(apply_coat(model))
    assert model.config._attn_implementation == "coat_test_noisy"
    assert all(layer.self_attn.config._attn_implementation == "coat_test_noisy"
               for layer in model.model.layers)  # fmt: skip
    failing = tiny_llama(attn_implementation="coat_test_noisy")  # also when the probe raises
    failing.model.layers[0].mlp.forward = lambda x: 1 / 0
    with pytest.raises(TypeError, match="could not be probed .ZeroDivisionError"):
        apply_coat(failing)
    assert failing.config._attn_implementation == "coat_test_noisy"
