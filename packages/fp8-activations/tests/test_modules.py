"""Modules and conversion: what is swapped, parameter names and state dicts both ways,
eval mode is the plain high-precision forward, revert gives back the original modules."""

from __future__ import annotations

import copy
from collections import OrderedDict

import fp8_activations as fa
import pytest
import torch
from fp8_activations import (
    FP8GELU,
    FP8LayerNorm,
    FP8Linear,
    FP8RMSNorm,
    FP8SiLU,
    convert_to_fp8_activations,
    revert_fp8_activations,
)
from torch import nn


class LlamaLikeRMSNorm(nn.Module):
    """The Hugging Face Llama formula: weight * (x / rms(x)) cast back first."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class GemmaLikeRMSNorm(LlamaLikeRMSNorm):
    """(1 + weight) scaling: must not be converted."""

    def __init__(self, n):
        super().__init__(n)
        nn.init.zeros_(self.weight)

    def forward(self, x):
        return super().forward(x) / self.weight * (1 + self.weight)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(32, 64),
            ln=nn.LayerNorm(64),
            act=nn.GELU(approximate="tanh"),
            fc2=nn.Linear(64, 48, bias=False),
            rms=nn.RMSNorm(48),
            hf=LlamaLikeRMSNorm(48),
            silu=nn.SiLU(),
            odd=nn.Linear(48, 10),  # 10 is not a multiple of 16: stays high precision
        )
    )


EXPECTED = {
    "fc1": FP8Linear,
    "ln": FP8LayerNorm,
    "act": FP8GELU,
    "fc2": FP8Linear,
    "rms": FP8RMSNorm,
    "hf": FP8RMSNorm,
    "silu": FP8SiLU,
    "odd": nn.Linear,
}


def test_convert_swaps_supported_modules_and_keeps_names():
    model = _model()
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    convert_to_fp8_activations(model)
    for name, cls in EXPECTED.items():
        assert type(getattr(model, name)) is cls, name
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())  # shared, not copied
    assert model.act.approximate == "tanh" and model.hf.eps == 1e-6


def test_state_dicts_load_both_ways():
    fp8 = convert_to_fp8_activations(_model())
    with torch.no_grad():
        for p in fp8.parameters():
            p.add_(torch.randn_like(p))
    plain = _model()
    plain.load_state_dict(fp8.state_dict(), strict=True)
    back = convert_to_fp8_activations(_model())
    back.load_state_dict(plain.state_dict(), strict=True)
    for (n, a), (_, b) in zip(fp8.state_dict().items(), back.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


def test_eval_mode_is_the_plain_forward_and_train_mode_is_close():
    plain = _model()
    fp8 = convert_to_fp8_activations(copy.deepcopy(plain))
    x = torch.randn(4, 7, 32)
    plain.eval()
    fp8.eval()
    torch.testing.assert_close(fp8(x), plain(x), rtol=0, atol=0)
    fp8.train()
    y, ref = fp8(x), plain(x)
    assert 10 * torch.log10(ref.pow(2).sum() / (y - ref).pow(2).sum()) > 20


def test_revert_restores_original_modules():
    model = _model()
    originals = dict(model.named_children())
    x = torch.randn(3, 32)
    before = model(x)
    convert_to_fp8_activations(model)
    with torch.no_grad():
        model.fc1.weight.mul_(0.5)  # training happened: revert must carry the new values
    revert_fp8_activations(model)
    for name, mod in model.named_children():
        assert mod is originals[name], name  # the very same objects, HF class included
    assert model.fc1.weight.data_ptr() == originals["fc1"].weight.data_ptr()
    model.fc1.weight.data.mul_(2)
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)


def test_filter_and_gemma_style_norm_skipped():
    model = _model()
    model.add_module("gemma", GemmaLikeRMSNorm(10))
    with pytest.warns(UserWarning, match="left in high precision"):
        convert_to_fp8_activations(model, module_filter_fn=lambda m, fqn: fqn != "fc2")
    assert type(model.fc2) is nn.Linear and type(model.gemma) is GemmaLikeRMSNorm
    assert type(model.fc1) is FP8Linear


def test_filter_gets_each_fqn_and_arguments_are_keyword_only():
    model = _model()
    seen = []
    convert_to_fp8_activations(model, module_filter_fn=lambda m, fqn: seen.append(fqn) or True)
    assert seen == [fqn for fqn, _ in _model().named_modules()]  # top down, "" the root
    back = []
    revert_fp8_activations(model, module_filter_fn=lambda m, fqn: back.append(fqn) or fqn != "fc1")
    assert type(model.fc1) is FP8Linear and type(model.fc2) is nn.Linear and "fc2" in back
    with pytest.raises(TypeError, match="positional"):
        convert_to_fp8_activations(_model(), fa.FP8ActivationConfig())
    with pytest.raises(TypeError, match="module_filter_fn must be a callable"):
        convert_to_fp8_activations(_model(), module_filter_fn="fc1")


def test_single_module_and_direct_construction():
    lin = convert_to_fp8_activations(nn.Linear(32, 16))
    assert isinstance(lin, FP8Linear) and isinstance(lin, nn.Linear)
    direct = FP8Linear(32, 16)
    assert type(direct.to_float()) is nn.Linear and direct.to_float().weight is direct.weight
    norm = FP8LayerNorm(16, bias=False)
    y = norm(torch.randn(2, 16, requires_grad=True))
    y.sum().backward()
    assert norm.weight.grad is not None and type(norm.to_float()) is nn.LayerNorm


def test_hugging_face_llama_rms_norm():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    block = nn.Sequential(llama.LlamaRMSNorm(64, eps=1e-5))
    convert_to_fp8_activations(block)
    assert type(block[0]) is FP8RMSNorm and block[0].eps == 1e-5
    revert_fp8_activations(block)
    assert type(block[0]) is llama.LlamaRMSNorm


def test_converted_model_deepcopies_and_trains():
    model = copy.deepcopy(convert_to_fp8_activations(_model()))
    model(torch.randn(5, 32)).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert isinstance(model.fc1.config, fa.FP8ActivationConfig)


def test_follow_grad_mode_runs_the_originals_when_called_without_gradients():
    """Under follow_grad_mode a converted model in training mode called under no_grad /
    inference_mode (samples generated during training) answers with the original's bits;
    with gradients, and without follow_grad_mode, it takes the FP8 path; a reentrant
    checkpoint inside a training forward takes it in both passes (the same bits as without
    checkpointing: the first pass was plain when the modules read the grad mode
    themselves)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64), nn.SiLU(), nn.RMSNorm(64))
    model = fa.convert_to_fp8_activations(copy.deepcopy(ref)).train()
    x = torch.randn(8, 64)
    want = ref(x).detach()
    with torch.no_grad():
        assert not torch.equal(model(x), want)  # (not followed: the FP8 path)
    assert fa.follow_grad_mode(model) is model
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            assert torch.equal(model(x), want)
    assert not torch.equal(model(x).detach(), want)

    class Outer(nn.Module):
        def __init__(self, inner, reentrant):
            super().__init__()
            self.inner, self.reentrant = inner, reentrant

        def forward(self, x):
            if self.reentrant is None:
                return self.inner(x)
            return checkpoint(self.inner, x, use_reentrant=self.reentrant)

    runs = []
    for reentrant in (None, True, False):
        inner = fa.convert_to_fp8_activations(copy.deepcopy(ref)).train()
        outer = fa.follow_grad_mode(Outer(inner, reentrant))
        xi = x.clone().requires_grad_()
        loss = outer(xi).square().mean()
        loss.backward()
        runs.append((loss.detach(), xi.grad, inner[0].weight.grad))
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))
    fa.follow_grad_mode(model, enabled=False)
    assert not model._forward_pre_hooks and not model._forward_hooks
    with torch.no_grad():
        assert not torch.equal(model(x), want)


def test_hugging_face_gelus_are_converted_and_come_back():
    """transformers' GELU activations become FP8 GELUs (exact or tanh, as they compute),
    which run the original module in eval mode and give it back on revert; QuickGELU and
    ReLU stay as they are."""
    from transformers.activations import ACT2FN

    torch.manual_seed(0)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    for name, approximate in [("gelu", "none"), ("gelu_new", "tanh"),
                              ("gelu_pytorch_tanh", "tanh"), ("quick_gelu", None),
                              ("relu", None), ("silu", "silu"), ("swish", "silu")]:  # fmt: skip
        act = ACT2FN[name]
        model = fa.convert_to_fp8_activations(nn.Sequential(act)).train()
        if approximate is None:
            assert model[0] is act
            continue
        if approximate == "silu":
            # ACT2FN["silu"] (Llama's, Mistral's, Qwen's) is transformers' SiLUActivation in
            # transformers 5.2x, not an nn.SiLU: it had stayed in high precision.
            assert isinstance(model[0], fa.FP8SiLU)
            torch.testing.assert_close(model(x), fa.silu(x), rtol=0, atol=0)
        else:
            assert isinstance(model[0], fa.FP8GELU) and model[0].approximate == approximate
        assert torch.equal(model.eval()(x), act(x))
        assert fa.revert_fp8_activations(model)[0] is act


def test_gelu_probe_ignores_the_default_device_and_dtype():
    """The probe is fp32 on the CPU whatever the defaults (made under a meta device context,
    a cached probe failed that conversion and every later one; under a bf16 default dtype a
    NewGELU was left unconverted for good), and a GELU clipped at +-10 is not taken for one."""
    from transformers.activations import ACT2FN

    with torch.device("meta"):
        model = fa.convert_to_fp8_activations(nn.Sequential(nn.Linear(32, 32), ACT2FN["gelu_new"]))
    assert type(model[1]) is fa.FP8GELU
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = fa.convert_to_fp8_activations(nn.Sequential(ACT2FN["gelu_new"]))
    finally:
        torch.set_default_dtype(torch.float32)
    assert type(model[0]) is fa.FP8GELU
    clipped = ACT2FN["gelu_10"]
    assert fa.convert_to_fp8_activations(nn.Sequential(clipped))[0] is clipped


class _Sink(torch.autograd.Function):
    """Passes its inputs through; backward hands on None for an output without a gradient,
    as DDP's output sink does (find_unused_parameters)."""

    @staticmethod
    def forward(ctx, *xs):
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        return grads


@pytest.mark.parametrize(
    "op",
    [
        lambda x: fa.layer_norm(x, 64),
        lambda x: fa.rms_norm(x, None, 1e-6),
        lambda x: fa.gelu(x),
        lambda x: fa.silu(x),
        lambda x: fa.swiglu(x, x.flip(-1)),
        lambda x: fa.residual_add(x, x.flip(-1)),
    ],
    ids=["layer_norm", "rms_norm", "gelu", "silu", "swiglu", "residual_add"],
)
def test_an_output_without_gradient_costs_nothing(op):
    """An op's output that reaches backward without a gradient (a LLaVA's image outputs under
    DDP with find_unused_parameters) gives no gradient (backward read None.contiguous())."""
    x = torch.randn(8, 64, requires_grad=True)
    other = torch.randn(8, 64, requires_grad=True)
    unused, used = _Sink.apply(op(x), other * 2)
    used.sum().backward()
    assert x.grad is None and torch.equal(other.grad, torch.full_like(other, 2.0))


def test_follow_grad_mode_under_torch_compile_fullgraph():
    """A compiled model under follow_grad_mode called without gradients runs the originals
    (compiled, it took the FP8 path; with fullgraph=True its disabled hooks failed to
    trace); with gradients it takes the FP8 path, as eagerly."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU())
    model = fa.follow_grad_mode(convert_to_fp8_activations(copy.deepcopy(ref))).train()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(compiled(x), ref(x))
    assert torch.equal(compiled(x), model(x)) and not torch.equal(model(x), ref(x))
    # Without follow_grad_mode the compiled FP8 modules take the FP8 path in training mode.
    fa.follow_grad_mode(model, enabled=False)
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(torch.compile(model, backend="eager", fullgraph=True)(x), model(x))


def test_eval_runs_with_functional_call_parameters():
    """torch.func.functional_call in eval mode: the twin took its plain tensors through
    setattr, which refused them (TypeError)."""
    torch.manual_seed(0)
    model = convert_to_fp8_activations(nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)))
    params = {k: v.detach() * 2 for k, v in model.named_parameters()}
    plain = revert_fp8_activations(copy.deepcopy(model)).eval()
    x = torch.randn(4, 64)
    got = torch.func.functional_call(model.eval(), params, (x,))
    assert torch.equal(got, torch.func.functional_call(plain, params, (x,)))
    assert torch.equal(model(x), plain(x))  # and the module's own parameters after it


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
def test_parametrized_modules_stay_plain_and_later_ones_are_read():
    """A parametrized or weight-normed Linear is left alone (its conversion raised
    TypeError); a parametrization registered after conversion is what eval mode computes
    with, as training does (eval ran the raw weight: 50% off)."""
    import torch.nn.utils.parametrize as P
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    for make in (parametrizations.weight_norm, torch.nn.utils.weight_norm):
        lin = make(nn.Linear(64, 64))
        assert convert_to_fp8_activations(nn.Sequential(lin))[0] is lin

    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    model = convert_to_fp8_activations(nn.Sequential(nn.Linear(64, 64, bias=False)))
    P.register_parametrization(model[0], "weight", Double())
    x = torch.randn(4, 64)
    want = x @ model[0].weight.T
    assert torch.equal(model.eval()(x), want)


def test_edits_after_conversion_reach_eval_and_revert():
    """A bias dropped or an eps changed on a converted module: eval mode and revert had
    kept the values of conversion time."""
    torch.manual_seed(0)
    model = convert_to_fp8_activations(
        nn.Sequential(
            nn.Linear(64, 64),
            nn.RMSNorm(64, eps=1e-6),
            LlamaLikeRMSNorm(64),
            nn.LayerNorm(64),
            nn.GELU(),
        )  # fmt: skip
    )
    model[0].bias = None
    model[1].eps = model[2].eps = model[3].eps = 0.5
    model[4].approximate = "tanh"
    x = torch.randn(4, 64) * 0.1
    plain = nn.Sequential(
        nn.Linear(64, 64, bias=False), nn.RMSNorm(64, eps=0.5), LlamaLikeRMSNorm(64, eps=0.5),
        nn.LayerNorm(64, eps=0.5), nn.GELU("tanh"),
    )  # fmt: skip
    plain[0].weight = model[0].weight
    for i in (1, 2, 3):
        plain[i].load_state_dict(model[i].state_dict())
    assert torch.equal(model.eval()(x), plain(x))
    back = revert_fp8_activations(model)
    assert back[0].bias is None and back[1].eps == back[2].variance_epsilon == 0.5
    assert back[3].eps == 0.5 and back[4].approximate == "tanh"
    assert torch.equal(back(x), plain(x))


def test_global_hooks_fire_once_per_call_in_eval_too():
    """In eval mode the original module ran through its own call: hooks registered for every
    module (register_module_forward_hook: profilers, trackers) fired twice."""
    model = convert_to_fp8_activations(nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32)))
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: seen.append(type(m).__name__)
    )
    try:
        model.eval()(torch.randn(2, 32))
    finally:
        handle.remove()
    assert seen == ["FP8Linear", "FP8LayerNorm", "Sequential"]


def test_follow_grad_mode_compiled_part_in_a_reentrant_checkpoint_keeps_the_fp8_path():
    """A compiled part of a model under follow_grad_mode, run by a reentrant checkpoint: its
    no-grad first pass must take the FP8 path its recomputation in backward takes (it took
    the float path, so the loss and the gradients came from different
    functions). Eagerly this held already."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    inner = convert_to_fp8_activations(nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)))
    compiled = torch.compile(inner, backend="aot_eager")

    class Outer(nn.Module):
        def __init__(self, part):
            super().__init__()
            self.part = part

        def forward(self, x):
            return checkpoint(self.part, x, use_reentrant=True)

    x = torch.randn(4, 64, requires_grad=True)
    want = Outer(inner).train()(x)  # eager: the FP8 path
    torch._dynamo.reset()
    outer = fa.follow_grad_mode(Outer(compiled)).train()
    got = outer(x)
    assert torch.equal(got, want) and not torch.equal(got, revert_fp8_activations(
        copy.deepcopy(inner)).train()(x))  # fmt: skip
    got.sum().backward()  # the recomputation agrees with the first pass
    with torch.no_grad():  # and called without gradients, the originals
        assert torch.equal(outer(x), revert_fp8_activations(copy.deepcopy(inner))(x))


def test_follow_grad_mode_state_survives_threads_and_interrupts():
    """The grad mode compiled code reads is the running roots' common one across threads
    (None when they differ), and comes back to None when they end in any order (it was one
    global restored per exit: another thread's value leaked, for good); a root
    whose earlier call was interrupted (a KeyboardInterrupt skips the forward hook) drops
    what that call left when it is called again."""
    import threading

    from fp8_activations import modules as fm

    class Interrupted(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 32)
            self.stop = False

        def forward(self, x):
            if self.stop:
                raise KeyboardInterrupt
            return self.lin(x)

    model = fa.follow_grad_mode(convert_to_fp8_activations(Interrupted())).train()
    x = torch.randn(2, 32)
    model.stop = True
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        model(x)
    assert fm._ROOT_GRAD is False  # left by the interrupted call
    model.stop = False
    y = model(x)  # with gradients: the FP8 path again, and nothing left after it
    assert torch.equal(y, fa.fp8_linear(x, model.lin.weight, model.lin.bias))
    assert fm._ROOT_GRAD is None and fm._GRAD_AT_ROOT.get() is None

    entered, recorded = threading.Barrier(3), threading.Barrier(2)  # (roots, this thread)
    seen = {}

    class Waits(nn.Module):
        def forward(self, x):
            entered.wait()
            seen[torch.is_grad_enabled()] = fm._ROOT_GRAD
            recorded.wait()  # neither root ends before both have read it
            return x

    roots = [fa.follow_grad_mode(Waits()), fa.follow_grad_mode(Waits())]

    def run(root, grad):
        with torch.set_grad_enabled(grad):
            root(x)

    threads = [
        threading.Thread(target=run, args=(r, g)) for r, g in zip(roots, (True, False), strict=True)
    ]
    for t in threads:
        t.start()
    entered.wait()  # both roots are inside their forwards now
    for t in threads:
        t.join()
    assert seen == {True: None, False: None}  # the threads' roots differ: no common mode
    assert fm._ROOT_GRAD is None and not fm._STACKS


def test_follow_grad_mode_reaches_threads_the_root_starts():
    """A root under follow_grad_mode whose forward runs its parts in threads
    (nn.DataParallel's parallel_apply: new threads start with an empty context, so the
    context variable is unset there) took the FP8 path in them when called without
    gradients; with gradients they still take it."""
    import threading

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(32, 32), nn.GELU())
    parts = [fa.convert_to_fp8_activations(copy.deepcopy(ref)).train() for _ in range(2)]

    class Parallel(nn.Module):
        def __init__(self):
            super().__init__()
            self.parts = nn.ModuleList(parts)

        def forward(self, xs):  # what parallel_apply does (it needs an accelerator)
            grad, out = torch.is_grad_enabled(), [None] * len(xs)

            def work(i):
                with torch.set_grad_enabled(grad):
                    out[i] = self.parts[i](xs[i])

            threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return out

    root = fa.follow_grad_mode(Parallel())
    xs = [torch.randn(4, 32), torch.randn(4, 32)]
    with torch.no_grad():
        got = root(xs)
    assert all(torch.equal(y, ref(x)) for y, x in zip(got, xs, strict=True))
    got = root(xs)
    assert all(torch.equal(y, p(x)) for y, p, x in zip(got, parts, xs, strict=True))
    assert not any(torch.equal(y.detach(), ref(x)) for y, x in zip(got, xs, strict=True))


def test_eval_of_a_replica_and_of_a_pruned_module_uses_their_weights():
    """Eval lent the twin the module's _parameters only. nn.DataParallel's replicas
    hold their weights as plain attributes (their _parameters emptied): eval raised
    AttributeError; torch's prune keeps the pruned weight as one too: eval computed with the
    unpruned weight, silently."""
    from torch.nn.utils import prune

    torch.manual_seed(0)
    x = torch.randn(4, 32)
    model = convert_to_fp8_activations(nn.Sequential(nn.Linear(32, 16))).eval()
    replica = model[0]._replicate_for_data_parallel()  # what torch's replicate() then does:
    replica._former_parameters = OrderedDict()
    w, b = model[0].weight * 2, model[0].bias + 1  # (broadcast copies: not leaves)
    replica.weight, replica.bias = w, b
    assert torch.equal(replica(x), nn.functional.linear(x, w, b))
    pruned = convert_to_fp8_activations(nn.Sequential(nn.Linear(32, 16))).eval()
    prune.l1_unstructured(pruned[0], "weight", amount=0.5)
    want = nn.functional.linear(x, pruned[0].weight_orig * pruned[0].weight_mask, pruned[0].bias)
    assert torch.equal(pruned(x), want)


def test_eval_lends_the_parameters_for_the_call_only():
    """The twin (the original module) gives back what it held after an eval call, keeping
    no reference to parameters swapped in since (accelerate's offload moves the weights to
    meta after a forward; the twin kept them on the device); nn.DataParallel's replicas
    each get their own twin (a shared one lent one replica's weights to another's call)."""
    import gc
    import weakref

    model = convert_to_fp8_activations(nn.Sequential(nn.Linear(32, 32))).eval()
    original = model[0].__dict__["_float_original"]
    model[0].weight = nn.Parameter(torch.randn(32, 32))  # swapped in, as offloading does
    swapped = weakref.ref(model[0].weight)
    x = torch.randn(2, 32)
    assert torch.equal(model(x), nn.functional.linear(x, model[0].weight, model[0].bias))
    model[0].weight = nn.Parameter(torch.randn(32, 32))
    gc.collect()
    assert swapped() is None and original.weight is not model[0].weight
    replica = model[0]._replicate_for_data_parallel()
    assert replica.__dict__["_float_original"] is not original


def test_checkpoint_recomputation_keeps_the_fp8_path_while_another_thread_samples():
    """A thread without a root's context read the roots' common grad mode, and so
    did a backward's checkpoint recomputation: while another thread ran the root under
    no_grad (sampling during training), it took the float path its forward had not taken
    (a CheckpointError, or, reentrant, other gradients)."""
    import threading

    from torch.utils.checkpoint import checkpoint

    entered, release = threading.Event(), threading.Event()

    class Gate(nn.Module):
        def forward(self, x):
            if not torch.is_grad_enabled():  # the sampling thread waits in here
                entered.set()
                release.wait(10)
            return x

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x):
            return checkpoint(self.lin, x, use_reentrant=False)

    torch.manual_seed(0)
    root = fa.follow_grad_mode(convert_to_fp8_activations(nn.Sequential(Gate(), Block())))
    x = torch.randn(4, 32, requires_grad=True)

    def grads():
        root.zero_grad()
        x.grad = None
        root(x).square().sum().backward()
        return x.grad.clone(), root[1].lin.weight.grad.clone()

    alone = grads()

    def sample():
        with torch.no_grad():
            root(x)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        assert entered.wait(10)
        beside = grads()
    finally:
        release.set()
        sampler.join()
    assert all(torch.equal(a, b) for a, b in zip(alone, beside, strict=True))


def test_a_linear_under_autocast_answers_in_autocasts_dtype_as_nn_linear():
    """It answered an fp32 input in fp32 under bf16 autocast: the model's next ops ran in
    fp32, and DeBERTa's masked_fill of bf16 scores with the fp32 minimum raised. The output
    is the fp32 result rounded to bf16; gradients keep the parameters' and input's dtypes."""
    lin = nn.Linear(32, 48)
    fp8 = fa.convert_to_fp8_activations(copy.deepcopy(lin)).train()
    x = torch.randn(2, 4, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8(x)
        assert y.dtype == lin(x).dtype == torch.bfloat16
        scores = y @ y.transpose(-1, -2)
        scores.masked_fill(torch.ones_like(scores, dtype=torch.bool), torch.finfo(y.dtype).min)
    want = fa.fp8_linear(x.detach(), lin.weight.detach(), lin.bias.detach())
    assert torch.equal(y, want.bfloat16())
    y.float().sum().backward()
    assert x.grad.dtype == fp8.weight.grad.dtype == torch.float32
    for given, autocast in (
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.bfloat16),
        (torch.bfloat16, torch.float16),
        (torch.float64, torch.bfloat16),
    ):
        with torch.autocast("cpu", dtype=autocast):  # any float but fp64, as nn.Linear
            want = torch.float64 if given == torch.float64 else autocast
            assert fp8.to(given)(x.detach().to(given)).dtype == want, (given, autocast)
    fp8.float()
    assert fp8(x.detach()).dtype == torch.float32  # no autocast: the input's dtype


def test_an_inplace_silu_stays_plain():
    """Code that reads the input an nn.SiLU(inplace=True) wrote (``act(h); lin(h)``) trained
    without the activation: the FP8 twin does not write its input. It stays plain."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.out = nn.Linear(32, 32), nn.Linear(32, 32)
            self.act = nn.SiLU(inplace=True)

        def forward(self, x):
            h = self.lin(x)
            self.act(h)
            return self.out(h)

    plain = Block()
    model = fa.convert_to_fp8_activations(copy.deepcopy(plain)).train()
    assert type(model.act) is nn.SiLU and type(model.lin) is not nn.Linear
    x = torch.randn(4, 32)
    got, want = model(x), plain(x)
    err = (got - want).pow(2).sum() / want.pow(2).sum()  # FP8 rounding only (it was ~0.7)
    assert err < 1e-2, err
