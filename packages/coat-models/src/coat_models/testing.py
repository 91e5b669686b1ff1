"""Tiny random-init Llama models for tests, examples and benchmarks on a CPU, and the error
measure the tests compare them with.

One definition of "a tiny Llama" that every test module (and the worker processes some of
them spawn) imports; tests that need another shape pass overrides.

>>> model = tiny_llama(seed=0, num_hidden_layers=1)
>>> mistral = tiny_causal_lm("Mistral", sliding_window=32)
"""

from __future__ import annotations

import math

import torch

# 2 layers, hidden 64 (4 heads of 16, GQA with 2 KV heads), MLP 176 (11 x 16: FP8 GEMMs
# need multiples of 16), a 256-token (byte) vocabulary. The shape only: other Llama-shaped
# configs (Mistral, Qwen2) take it too.
TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def tiny_llama_config(**overrides):
    """``transformers.LlamaConfig`` of ``TINY_LLAMA`` and SDPA attention, with ``overrides``
    (any config field)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_LLAMA, "attn_implementation": "sdpa", **overrides})


def tiny_llama(seed: int = 0, **overrides):
    """A ``LlamaForCausalLM`` of ``tiny_llama_config(**overrides)``, its weights drawn after
    ``torch.manual_seed(seed)`` (so equal seeds give equal weights), in fp32 on the CPU."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(**overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def tiny_causal_lm(family: str = "Llama", seed: int = 0, **overrides):
    """A ``transformers.<family>ForCausalLM`` of ``<family>Config`` with ``TINY_LLAMA``'s
    shape and ``overrides``, its weights drawn after ``torch.manual_seed(seed)``: the
    Llama-shaped families (``"Mistral"``, ``"Qwen2"``...) and those ``apply_coat`` refuses.
    The attention implementation is the config's default unless ``overrides`` name one."""
    import transformers

    config = getattr(transformers, f"{family}Config")(**{**TINY_LLAMA, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, f"{family}ForCausalLM")(config)


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``x`` against ``ref`` in dB (in float64)."""
    ref, x = ref.double(), x.double()
    return 10 * math.log10(ref.pow(2).sum().item() / (ref - x).pow(2).sum().item())
