"""Across all four packages: a tiny Llama trained with COAT (fp8_activations blocks through
coat_models, CoatAdamW from fp8_optim, both on fp8_quant) stops, saves a standard Hugging
Face checkpoint plus the optimizer state, resumes in a fresh process-like setup, and ends
bit for bit where an uninterrupted run ends."""

from __future__ import annotations

import pytest
import torch
from coat_models import apply_coat, create_optimizer
from coat_models.testing import tiny_llama
from transformers import LlamaForCausalLM


def _model() -> LlamaForCausalLM:
    return tiny_llama(0, vocab_size=128, max_position_embeddings=64)


def _steps(model, optimizer, batches) -> list[float]:
    model.train()
    losses = []
    for ids in batches:
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.fixture
def one_thread():
    """A tiny model: one thread is faster than two, and far faster on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_resume_from_standard_checkpoint_is_exact(tmp_path, one_thread):
    batches = torch.randint(0, 128, (6, 4, 32), generator=torch.Generator().manual_seed(3))

    model = apply_coat(_model())
    optimizer = create_optimizer(model, lr=3e-3)
    want = _steps(model, optimizer, batches)

    model = apply_coat(_model())
    optimizer = create_optimizer(model, lr=3e-3)
    got = _steps(model, optimizer, batches[:3])
    model.save_pretrained(tmp_path / "model")
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    del model, optimizer

    model = apply_coat(LlamaForCausalLM.from_pretrained(tmp_path / "model"))
    optimizer = create_optimizer(model, lr=3e-3)
    optimizer.load_state_dict(torch.load(tmp_path / "optimizer.pt"))
    got += _steps(model, optimizer, batches[3:])
    assert got == want
