"""coat_models.ops.rope: the fused RoPE kernel (CPU: Triton interpreter) against its plain-PyTorch
reference and transformers' ``apply_rotary_pos_emb``, forward and backward, bit for bit; the
COAT layer takes it where the model's RoPE is the standard one (same bits as without it);
torch.compile; the fallbacks."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import transformers
from coat_models import blocks, reference
from coat_models.ops import rope
from coat_models.testing import tiny_causal_lm
from fp8_activations import FP8ActivationConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_rope

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _cos_sin(cos_batch, seq, dim, dtype, seed=0):
    """Llama's cos, sin (theta 10000) at random positions up to 4096, one row per sequence."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 4096, (cos_batch, seq), generator=g).double()
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
    return emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)


def _projections(batch, seq, heads, dim, dtype, seed):
    """A Q or K projection output ``(batch, seq, heads * head_dim)`` and its transformers
    view ``(batch, heads, seq, head_dim)``."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(batch, seq, heads * dim, generator=g).to(DEVICE, dtype).requires_grad_()
    return p, p.view(batch, seq, heads, dim).transpose(1, 2)


# batch, seq, q heads, kv heads, head_dim, cos batch, dtype
CASES = [
    pytest.param(2, 67, 4, 4, 128, 1, torch.bfloat16, id="llama-D128-S67-bf16"),
    pytest.param(3, 13, 8, 2, 16, 1, torch.float32, id="gqa-S13-fp32"),
    pytest.param(2, 33, 6, 3, 24, 2, torch.float16, id="heads6-D24-cosB-fp16"),
    pytest.param(2, 1, 4, 1, 32, 2, torch.bfloat16, id="S1-mqa-cosB-bf16"),
    pytest.param(1, 130, 32, 8, 64, 1, torch.bfloat16, id="gqa32x8-S130-bf16"),
]


@pytest.mark.parametrize("batch, seq, hq, hk, dim, cos_batch, dtype", CASES)
def test_forward_equals_reference_and_transformers(batch, seq, hq, hk, dim, cos_batch, dtype):
    cos, sin = _cos_sin(cos_batch, seq, dim, dtype)
    _, q = _projections(batch, seq, hq, dim, dtype, 1)
    _, k = _projections(batch, seq, hk, dim, dtype, 2)
    got = rope.apply_rotary_pos_emb(q, k, cos, sin, "triton")
    want = hf_rope(q, k, cos, sin)
    ref = [rope.rope_reference(t.transpose(1, 2), cos, sin).transpose(1, 2) for t in (q, k)]
    for g, w, r, t in zip(got, want, ref, (q, k), strict=True):
        assert g.shape == t.shape and g.dtype == dtype
        assert g.transpose(1, 2).is_contiguous()  # (batch, seq, heads, head_dim) memory
        torch.testing.assert_close(g, w, rtol=0, atol=0)
        torch.testing.assert_close(r, w, rtol=0, atol=0)


def _grad_layouts(shape, dtype, seed):
    """Upstream gradients of a ``(batch, heads, seq, head_dim)`` output as SDPA's backward
    may give them: its own layout, the output's, or broadcast (``.sum()``'s)."""
    g = torch.Generator().manual_seed(seed)
    b, h, s, d = shape
    yield "bhsd", torch.randn(shape, generator=g).to(DEVICE, dtype)
    yield "bshd", torch.randn(b, s, h, d, generator=g).to(DEVICE, dtype).transpose(1, 2)
    yield "expanded", torch.randn(1, 1, 1, d, generator=g).to(DEVICE, dtype).expand(shape)


# The 32-head case's backward on 9 tokens, not 130: the interpreter runs one program per
# block of two tokens (at 32 heads x 64), ~30 s at 130 tokens on CPU; 9 also ends on a
# partial block.
BACKWARD_CASES = [
    pytest.param(1, 9, 32, 8, 64, 1, torch.bfloat16, id="gqa32x8-S9-bf16")
    if c.id == "gqa32x8-S130-bf16"
    else c
    for c in CASES
]


@pytest.mark.parametrize("batch, seq, hq, hk, dim, cos_batch, dtype", BACKWARD_CASES)
def test_backward_equals_autograd_of_reference_and_transformers(
    batch, seq, hq, hk, dim, cos_batch, dtype
):
    cos, sin = _cos_sin(cos_batch, seq, dim, dtype)
    qp, q = _projections(batch, seq, hq, dim, dtype, 1)
    kp, k = _projections(batch, seq, hk, dim, dtype, 2)
    fns = {
        "kernel": lambda: rope.apply_rotary_pos_emb(q, k, cos, sin, "triton"),
        "transformers": lambda: hf_rope(q, k, cos, sin),
        "reference": lambda: [
            rope.rope_reference(t.transpose(1, 2), cos, sin).transpose(1, 2) for t in (q, k)
        ],
    }
    layouts = zip(_grad_layouts(q.shape, dtype, 3), _grad_layouts(k.shape, dtype, 4), strict=True)
    for (layout, dq), (_, dk) in layouts:
        grads = {n: torch.autograd.grad(fn(), (qp, kp), (dq, dk)) for n, fn in fns.items()}
        for i, want in enumerate(grads["transformers"]):
            assert grads["kernel"][i].is_contiguous()  # the projections' layout, no copy
            for name in ("kernel", "reference"):
                msg = f"{name} {layout}"
                torch.testing.assert_close(grads[name][i], want, rtol=0, atol=0, msg=msg)


def test_cos_sin_in_another_dtype_are_rounded_to_q_dtype_first():
    """The model's rotary embedding returns cos, sin in q's dtype; given fp32 ones, the op
    rounds them to q's dtype (transformers would instead promote q and k to fp32)."""
    cos, sin = _cos_sin(1, 40, 64, torch.float32)
    _, q = _projections(2, 40, 4, 64, torch.bfloat16, 1)
    _, k = _projections(2, 40, 2, 64, torch.bfloat16, 2)
    got = rope.apply_rotary_pos_emb(q, k, cos, sin, "triton")
    want = hf_rope(q, k, cos.bfloat16(), sin.bfloat16())
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_rotation_is_orthogonal_and_backward_is_its_inverse():
    """In fp64 (the plain-PyTorch path): the Function's backward against numerical
    derivatives, and backward(forward(x)) == x (a rotation's transpose is its inverse)."""
    cos, sin = _cos_sin(1, 5, 8, torch.float64)
    q = torch.randn(2, 5, 3, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 5, 1, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    fn = lambda q, k: rope.RoPEFunction.apply(q, k, cos, sin, "reference")
    assert torch.autograd.gradcheck(fn, (q, k))
    qr, kr = fn(q, k)
    back = rope.rope(qr, kr, cos, sin, True, "reference")
    torch.testing.assert_close(back[0], q, rtol=0, atol=1e-12)
    torch.testing.assert_close(back[1], k, rtol=0, atol=1e-12)
    norm = torch.linalg.vector_norm
    torch.testing.assert_close(norm(qr, dim=-1), norm(q, dim=-1), rtol=1e-12, atol=0)


def test_projections_function_gradcheck_and_views():
    """The projections' node (RoPE + head views): float64 gradcheck (reference kernel), and
    its outputs are the (batch, heads, seq, head_dim) views of RoPE's output and of v."""
    cos, sin = _cos_sin(1, 5, 8, torch.float64)
    q = torch.randn(2, 5, 3 * 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 5, 1 * 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    v = torch.randn(2, 5, 1 * 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    fn = lambda q, k, v: rope.ProjectionsRoPEFunction.apply(q, k, v, cos, sin, 8, "reference")
    assert torch.autograd.gradcheck(fn, (q, k, v))
    qr, kr, vr = fn(q, k, v)
    want_q, want_k = rope.rope(q.view(2, 5, 3, 8), k.view(2, 5, 1, 8), cos, sin, False, "reference")
    assert qr.shape == (2, 3, 5, 8) and torch.equal(qr, want_q.transpose(1, 2))
    assert kr.shape == (2, 1, 5, 8) and torch.equal(kr, want_k.transpose(1, 2))
    assert torch.equal(vr, v.view(2, 5, 1, 8).transpose(1, 2))


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    cos, sin = _cos_sin(1, 19, 32, torch.bfloat16)
    qp, _ = _projections(2, 19, 4, 32, torch.bfloat16, 1)
    kp, _ = _projections(2, 19, 2, 32, torch.bfloat16, 2)

    def step(qp, kp):
        q, k = (p.view(2, 19, -1, 32).transpose(1, 2) for p in (qp, kp))
        q, k = rope.apply_rotary_pos_emb(q, k, cos, sin, "triton")
        out = torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True)
        return out.transpose(1, 2).reshape(2, 19, -1)

    def run(fn):
        out = fn(qp, kp)
        out.float().square().sum().backward()
        res = [out.detach(), qp.grad, kp.grad]
        qp.grad = kp.grad = None
        return res

    eager = run(step)
    compiled = run(torch.compile(step, backend="aot_eager", fullgraph=True))
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_inputs_get_a_clear_error():
    cos, sin = _cos_sin(1, 8, 16, torch.float32)
    q, k = torch.randn(2, 4, 8, 16, device=DEVICE), torch.randn(2, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="cos and sin must be"):
        rope.apply_rotary_pos_emb(q, k, cos[..., :8], sin[..., :8])
    with pytest.raises(ValueError, match="4-D"):
        rope.apply_rotary_pos_emb(q[0], k[0], cos, sin)
    with pytest.raises(ValueError, match="share a float dtype"):
        rope.apply_rotary_pos_emb(q, k.half(), cos, sin)
    with pytest.raises(ValueError, match="detached"):
        rope.apply_rotary_pos_emb(q, k, cos.requires_grad_(), sin)


def test_fusable_only_for_the_standard_rotate_half():
    cos, sin = _cos_sin(1, 8, 16, torch.float32)
    q, k = torch.randn(2, 4, 8, 16, device=DEVICE), torch.randn(2, 2, 8, 16, device=DEVICE)
    for family in ("llama", "mistral", "qwen2"):
        module = getattr(transformers.models, family)
        fn = getattr(module, f"modeling_{family}").apply_rotary_pos_emb
        assert rope.fusable(fn, q, k, cos, sin, "triton"), family
    gemma = transformers.models.gemma.modeling_gemma.apply_rotary_pos_emb  # not in the list
    assert not rope.fusable(gemma, q, k, cos, sin, "triton")
    assert not rope.fusable(lambda *a: hf_rope(*a), q, k, cos, sin, "triton")
    assert not rope.fusable(None, q, k, cos, sin, "triton")
    assert not rope.fusable(hf_rope, q, k, cos[..., :8], sin[..., :8], "triton")  # partial
    assert not rope.fusable(hf_rope, q.double(), k.double(), cos, sin, "triton")
    assert not rope.fusable(hf_rope, q, k, cos.requires_grad_(), sin, "triton")
    if DEVICE == "cpu":  # no GPU: only the interpreter runs Triton, and only when asked to
        assert not rope.fusable(hf_rope, q, k, cos.detach(), sin, "auto")


# ----------------------------------------------------------------------- in the COAT layer
def _tiny(family, dtype):
    """One layer of the tiny shape; Qwen2's q/k/v have biases."""
    name = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[family]
    model = tiny_causal_lm(name, vocab_size=64, num_hidden_layers=1, attn_implementation="sdpa")
    return model.to(DEVICE, dtype).train()


def _layer_step(model, ops, config, seed=1):
    """One decoder layer's output and every gradient (input and parameters)."""
    base, layer = model.model, model.model.layers[0]
    g = torch.Generator().manual_seed(seed)
    dtype = layer.input_layernorm.weight.dtype
    x = torch.randn(2, 24, 64, generator=g).to(DEVICE, dtype).requires_grad_()
    position_ids = torch.arange(24, device=DEVICE)[None]
    cos_sin = base.rotary_emb(x, position_ids)
    layer.zero_grad(set_to_none=True)
    out = blocks.decoder_layer(
        ops, layer, x, attention_mask=None, position_embeddings=cos_sin, config=config,
        attn_kwargs={"position_ids": position_ids},
    )  # fmt: skip
    out.backward(torch.randn(out.shape, generator=g).to(DEVICE, dtype))
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


def _layer_with_and_without(model, ops, config, monkeypatch):
    """The layer's output and gradients three ways: the projections' fused path (RoPE and the
    head views in one autograd node), the fused RoPE kernel on the head views, and the
    model's own RoPE. The first two must be equal bit for bit; returns the first and the
    third."""
    projections, fused_views = [], []
    rotate, fused = rope.rotate_projections, rope.apply_rotary_pos_emb

    def spy_rotate(*a):
        out = rotate(*a)
        projections.append(out is not None)
        return out

    monkeypatch.setattr(rope, "rotate_projections", spy_rotate)
    monkeypatch.setattr(rope, "apply_rotary_pos_emb", lambda *a: fused_views.append(1) or fused(*a))
    got = _layer_step(model, ops, config)
    assert projections == [True] and fused_views == []  # the projections' path ran
    with monkeypatch.context() as m:
        m.setattr(rope, "rotate_projections", lambda *a: None)
        views = _layer_step(model, ops, config)
    assert fused_views == [1]  # the kernel on the head views ran
    for a, b in zip(got, views, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with monkeypatch.context() as m:
        m.setattr(rope, "is_rotate_half", lambda fn: False)
        want = _layer_step(model, ops, config)
    assert fused_views == [1] and projections == [True]
    return got, want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_layer_with_fused_rope_gives_the_same_bits(family, dtype, monkeypatch):
    """Exact ops (``coat_models.reference``): the fused path against the model's own RoPE."""
    config = SimpleNamespace(backend="triton")
    got, want = _layer_with_and_without(_tiny(family, dtype), reference, config, monkeypatch)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_coat_layer_with_fused_rope_gives_the_same_bits(monkeypatch):
    """The FP8 op set (Triton kernels throughout): with and without the fused RoPE."""
    model = _tiny("llama", torch.bfloat16)
    got, want = _layer_with_and_without(
        model, blocks.FP8_OPS, FP8ActivationConfig(backend="triton"), monkeypatch
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_hub_kernel_in_place_of_the_wrapped_function_is_not_fused(monkeypatch):
    """transformers 5.25+ wraps ``apply_rotary_pos_emb`` in a ``kernels`` function module,
    which runs the file's own function (fused here) until ``kernelize`` gives it a forward
    of its own: then the model's function runs, not the kernel."""
    from transformers.models.llama import modeling_llama

    fn = modeling_llama.apply_rotary_pos_emb
    if not isinstance(fn, torch.nn.Module):
        pytest.skip(f"transformers {transformers.__version__} does not wrap apply_rotary_pos_emb")
    assert rope.is_rotate_half(fn)
    fn.forward = lambda *args: args  # an instance forward, as kernelize gives it
    try:
        assert not rope.is_rotate_half(fn)
    finally:
        del fn.forward  # the class's forward again (monkeypatch would pin the bound one)
    assert rope.is_rotate_half(fn)
    # a wrapper of another make, in the module's place
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", torch.nn.Identity())
    assert not rope.is_rotate_half(modeling_llama.apply_rotary_pos_emb)
