"""convert_to_fp8_activations called again, and on what is no module."""

import pytest
import torch
from fp8_activations import convert_to_fp8_activations
from torch import nn


def test_converting_again_applies_the_new_config_and_bad_models_are_type_errors():
    """Called again with another config, the modules converted before take it (they kept
    the first one without a word); a model that is no module is a TypeError naming the
    type (it was an AttributeError), for revert too."""
    from fp8_activations import FP8ActivationConfig, revert_fp8_activations

    model = nn.Sequential(nn.Linear(32, 32), nn.GELU())
    convert_to_fp8_activations(model, config=FP8ActivationConfig(group_size=16))
    convert_to_fp8_activations(model, config=FP8ActivationConfig(group_size=32))
    assert [m.config.group_size for m in model] == [32, 32]
    keep = FP8ActivationConfig(group_size=16)
    convert_to_fp8_activations(model, config=keep, module_filter_fn=lambda m, fqn: fqn != "1")
    assert [m.config.group_size for m in model] == [16, 32]
    for call in (convert_to_fp8_activations, revert_fp8_activations):
        with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
            call("x")


def test_hooks_move_with_the_converted_module():
    """Hooks registered before conversion move to the FP8 module (they stayed on the float
    original, which an FP8 module calls in eval mode only: they fired in eval, never in
    training), once per call in both modes; their handles still remove them; revert moves
    them back."""
    import torch
    from fp8_activations import revert_fp8_activations

    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    calls = []
    fwd = model[0].register_forward_hook(lambda m, i, o: calls.append(("fwd", type(m).__name__)))
    model[0].register_forward_pre_hook(lambda m, i: calls.append(("pre", type(m).__name__)))
    model[2].register_full_backward_hook(lambda m, gi, go: calls.append(("bwd", type(m).__name__)))
    convert_to_fp8_activations(model)
    x = torch.randn(8, 64)
    model.train()
    model(x).sum().backward()
    want = [("pre", "FP8Linear"), ("fwd", "FP8Linear"), ("bwd", "FP8Linear")]
    assert calls == want
    calls.clear()
    model.eval()
    model(x)
    assert calls == want[:2]
    calls.clear()
    fwd.remove()
    model.train()
    model(x)
    assert calls == [("pre", "FP8Linear")]
    calls.clear()
    revert_fp8_activations(model)
    model(x)
    assert calls == [("pre", "Linear")]


def test_a_load_state_dict_pre_hook_bound_to_its_module_gets_the_fp8_module():
    """A load-state-dict pre-hook registered with ``with_module=True`` is called with the
    module in the model: after conversion the FP8 one, after revert the float one (it was
    called with the float module that conversion had taken out of the model)."""
    import torch
    from fp8_activations import revert_fp8_activations
    from fp8_activations.modules import FP8Linear

    model = nn.Sequential(nn.Linear(64, 64))
    seen = []
    model[0]._register_load_state_dict_pre_hook(lambda m, *args: seen.append(m), with_module=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    convert_to_fp8_activations(model)
    model.load_state_dict(state)
    assert type(model[0]) is FP8Linear and seen == [model[0]]
    revert_fp8_activations(model)
    model.load_state_dict(state)
    assert type(model[0]) is nn.Linear and seen[1] is model[0]
    assert torch.equal(model[0].weight, state["0.weight"])


def test_a_module_whose_forward_is_replaced_is_left_alone():
    """A module whose forward is set on the instance (accelerate's hooks) stays as it is, as
    a subclass overriding forward does (converted, that forward ran in eval only)."""
    import torch
    from fp8_activations.modules import FP8Linear

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    calls = []

    def forward(x, lin=model[0]):
        calls.append(1)
        return nn.Linear.forward(lin, x)

    model[0].forward = forward
    convert_to_fp8_activations(model)
    assert type(model[0]) is nn.Linear and type(model[1]) is FP8Linear
    model.train()(torch.randn(4, 64))
    assert calls == [1]


class _GemmaRMSNorm(nn.Module):
    """Gemma's norm: ``x / rms(x) * (1 + weight)``, not what an FP8RMSNorm computes."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


class LlamaRMSNorm(nn.Module):
    """A Llama-style norm as Hugging Face writes it: ``weight * x / rms(x)``."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_norms_on_the_meta_device_are_probed_as_on_the_cpu():
    """A ``*RMSNorm`` built on the meta device is checked on a CPU copy: Gemma's ``(1 +
    weight)`` norm stays as it is, with the warning it gets on the CPU (it was converted,
    and then trained as ``weight * x / rms(x)``); a Llama-style one is converted."""
    from fp8_activations.modules import FP8RMSNorm

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), _GemmaRMSNorm(64), LlamaRMSNorm(64))
    with pytest.warns(UserWarning, match="_GemmaRMSNorm does not compute"):
        convert_to_fp8_activations(model)
    assert type(model[1]) is _GemmaRMSNorm and type(model[2]) is FP8RMSNorm


class _BiasedRMSNorm(LlamaRMSNorm):
    """``weight * x / rms(x) + bias`` (xLSTM's norms with use_bias=True)."""

    def __init__(self, dim):
        super().__init__(dim)
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return super().forward(x) + self.bias


def test_norms_are_probed_on_random_weights_not_their_own():
    """The probe ran the norm's own weights: a bias still zero at init passed (FP8RMSNorm
    has none: the bias left the model's parameters and state dict, never trained, and
    revert left the norm without it), and so did Gemma's ``(1 + weight)`` with weights near
    60 (within the probe's tolerance of weight * x / rms(x))."""
    from fp8_activations import revert_fp8_activations
    from fp8_activations.modules import FP8RMSNorm

    biased = _BiasedRMSNorm(64)
    gemma = _GemmaRMSNorm(64)
    with torch.no_grad():
        gemma.weight.fill_(60.0)
    model = nn.Sequential(nn.Linear(64, 64), biased, gemma, LlamaRMSNorm(64))
    keys = sorted(model.state_dict())
    with pytest.warns(UserWarning) as said:
        convert_to_fp8_activations(model)
    text = " ".join(str(w.message) for w in said)
    assert "_BiasedRMSNorm has parameters besides its weight (bias)" in text
    assert "_GemmaRMSNorm does not compute" in text
    assert model[1] is biased and model[2] is gemma and type(model[3]) is FP8RMSNorm
    assert sorted(model.state_dict()) == keys
    revert_fp8_activations(model)
    assert model[1].bias is biased.bias


def test_the_norm_probe_fires_no_hook_and_a_replaced_forward_is_left_alone():
    """Checking a ``*RMSNorm`` runs its class's forward, not its hooks (they saw a made-up
    input); one whose forward is replaced on the instance stays as it is."""
    from fp8_activations.modules import FP8RMSNorm

    model = nn.Sequential(LlamaRMSNorm(64), LlamaRMSNorm(64))
    calls = []
    model[0].register_forward_hook(lambda m, i, o: calls.append(tuple(i[0].shape)))
    model[1].forward = lambda x, m=model[1]: LlamaRMSNorm.forward(m, x)
    convert_to_fp8_activations(model)
    assert calls == [] and type(model[0]) is FP8RMSNorm and type(model[1]) is LlamaRMSNorm
    model(torch.randn(3, 64))
    assert calls == [(3, 64)]


def test_a_module_used_at_two_places_becomes_one_fp8_module():
    """A module shared by two places of a model is replaced by one FP8 module at both (it
    became two, and its hooks moved to one of them: they fired once per forward, not
    twice); revert restores the one float module."""
    from fp8_activations import revert_fp8_activations
    from fp8_activations.modules import FP8Linear

    lin = nn.Linear(32, 32)
    model = nn.Sequential(lin, nn.GELU(), lin)
    calls = []
    lin.register_forward_hook(lambda *a: calls.append(1))
    convert_to_fp8_activations(model)
    assert type(model[0]) is FP8Linear and model[0] is model[2]
    model.train()(torch.randn(4, 32)).sum().backward()
    assert calls == [1, 1]
    revert_fp8_activations(model)
    assert model[0] is model[2] and type(model[0]) is nn.Linear


class _LockedRMSNorm(LlamaRMSNorm):
    """A Llama-style norm holding state that cannot be deep-copied (a lock)."""

    def __init__(self, dim):
        super().__init__(dim)
        import threading

        self.lock = threading.Lock()


class _GpuOnlyRMSNorm(LlamaRMSNorm):
    def forward(self, x):
        if not x.is_cuda:
            raise RuntimeError("this kernel runs on CUDA tensors only")
        return super().forward(x)


def test_meta_norms_that_cannot_be_probed_on_the_cpu_stay_and_say_why():
    """The meta probe copies no state but the parameters (a norm holding a lock was not
    deep-copyable: conversion raised), and a forward that fails on the CPU leaves the norm
    in high precision with a warning that says why (conversion raised)."""
    from fp8_activations.modules import FP8RMSNorm

    with torch.device("meta"):
        model = nn.Sequential(_LockedRMSNorm(64), _GpuOnlyRMSNorm(64))
    with pytest.warns(UserWarning, match="_GpuOnlyRMSNorm could not be checked .RuntimeError: "):
        convert_to_fp8_activations(model)
    assert type(model[0]) is FP8RMSNorm and type(model[1]) is _GpuOnlyRMSNorm
    assert model[0].weight.is_meta  # the probe's CPU tensors stayed with the probe


def test_revert_frees_the_weight_cache():
    """Reverted modules' parameters keep no FP8 copy (they held the last cached copies, 1
    B/param per layout, for as long as they lived)."""
    from fp8_activations import revert_fp8_activations
    from fp8_activations.ops import cached_weight_fp8

    model = convert_to_fp8_activations(nn.Sequential(nn.Linear(32, 32), nn.GELU()))
    model.train()(torch.randn(4, 32))
    assert cached_weight_fp8(model[0].weight)
    revert_fp8_activations(model)
    assert cached_weight_fp8(model[0].weight) == ()


def test_multihead_attention_stays_whole():
    """Its out_proj became an FP8Linear that never ran FP8 (the attention's
    forward reads out_proj.weight itself): a model that looked converted trained in high
    precision there. It stays an nn.Linear now; the linears beside it convert."""
    layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, batch_first=True)
    convert_to_fp8_activations(layer)
    assert type(layer.self_attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert type(layer.linear1).__name__ == "FP8Linear"
    layer(torch.randn(2, 5, 32)).sum().backward()
    assert layer.self_attn.out_proj.weight.grad is not None


def test_revert_of_a_module_pruned_since_conversion_keeps_the_pruning():
    """Reverted, a module pruned with torch's prune failed at its next call (the
    mask buffer stayed behind on the FP8 module, the pruning hook moved): the reverted
    Linear holds weight_orig, weight_mask and the masked weight, and computes with them."""
    from fp8_activations import revert_fp8_activations
    from torch.nn.utils import prune

    torch.manual_seed(0)
    model = convert_to_fp8_activations(nn.Sequential(nn.Linear(32, 16)))
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    x = torch.randn(4, 32)
    model(x)
    revert_fp8_activations(model)
    lin = model[0]
    assert type(lin) is nn.Linear
    assert {n for n, _ in lin.named_parameters()} == {"weight_orig", "bias"}
    assert {n for n, _ in lin.named_buffers()} == {"weight_mask"}
    want = nn.functional.linear(x, lin.weight_orig * lin.weight_mask, lin.bias)
    assert torch.equal(lin(x), want)
    prune.remove(lin, "weight")  # torch's own clean-up works on it
    assert torch.equal(lin(x), want) and isinstance(lin.weight, nn.Parameter)


def test_a_model_fsdp_shards_is_refused_before_anything_changes(tmp_path):
    """Converted (or reverted) after ``fully_shard``, the new modules were not FSDP's: their
    parameters stayed sharded DTensors and the first forward failed ("mixed torch.Tensor and
    DTensor"). Refused before any module is replaced; a model converted before sharding
    trains, and takes a new config in place."""
    import torch.distributed as dist
    from fp8_activations import FP8ActivationConfig, revert_fp8_activations
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        plain = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 16))
        fully_shard(plain)
        before = list(plain)
        for keep, name in ((None, "0"), (lambda m, fqn: fqn != "0", "2")):
            with pytest.raises(ValueError, match=f"_activations: {name} is sharded by FSDP"):
                convert_to_fp8_activations(plain, module_filter_fn=keep)
            assert list(plain) == before
        # what the filter leaves alone is not asked about: the GELU (no parameters) converts
        convert_to_fp8_activations(plain, module_filter_fn=lambda m, fqn: fqn == "1")
        assert type(plain[1]).__name__ == "FP8GELU" and plain[0] is before[0]
        model = convert_to_fp8_activations(nn.Sequential(nn.Linear(32, 32), nn.GELU()))
        fully_shard(model)
        convert_to_fp8_activations(model, config=FP8ActivationConfig(group_size=32))
        assert model[0].config.group_size == 32
        model(torch.randn(4, 32)).sum().backward()  # the FP8 modules are FSDP's
        converted = list(model)
        with pytest.raises(ValueError, match="revert_fp8_activations: 0 is sharded by FSDP .* "
                           "call it before fully_shard$"):  # fmt: skip
            revert_fp8_activations(model)
        assert list(model) == converted
        revert_fp8_activations(model, module_filter_fn=lambda m, fqn: fqn == "1")
        assert type(model[1]) is nn.GELU and model[0] is converted[0]
    finally:
        dist.destroy_process_group()
