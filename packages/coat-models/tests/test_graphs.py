"""enable_cuda_graphs: COAT decoder layers replayed from CUDA graphs.

On the GPU a graphed model trains bit for bit like the eager COAT model (same init, data,
optimizer), with gradient accumulation too (every micro-batch replayed); the checks that need
no GPU run everywhere."""

from __future__ import annotations

import copy
import weakref
from types import SimpleNamespace

import coat_models
import pytest
import torch
from coat_models import (
    apply_coat,
    blocks,
    disable_cuda_graphs,
    enable_cuda_graphs,
    graphs,
    revert_coat,
)
from coat_models.testing import tiny_llama
from fp8_activations import FP8ActivationConfig

NO_CACHE = FP8ActivationConfig(weight_cache=False)


def test_needs_a_coat_model():
    with pytest.raises(ValueError, match="apply_coat"):
        enable_cuda_graphs(tiny_llama())


def test_needs_the_weight_cache_off():
    with pytest.raises(ValueError, match="weight_cache=False"):
        enable_cuda_graphs(apply_coat(tiny_llama()))


def test_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        enable_cuda_graphs(apply_coat(tiny_llama(), config=NO_CACHE))


def test_guard_refuses_overwritten_recordings():
    """The identity on the last graphed layer's output: its backward raises when a later
    forward replayed since (generation moved on) or when it runs a second time."""
    state = {"gen": 1}
    x = torch.randn(4, requires_grad=True)
    y = graphs._Guard.apply(x * 2, state, 1)
    state["pending"] = weakref.ref(y.grad_fn)
    assert not graphs._may_replay(state, [])  # pending: a new forward would run eagerly
    y.sum().backward(retain_graph=True)
    assert torch.equal(x.grad, torch.full((4,), 2.0)) and state["pending"] is None
    with pytest.raises(RuntimeError, match="overwritten"):
        y.sum().backward()  # a second backward over the same recordings
    z = graphs._Guard.apply(x * 2, state, 1)
    state["gen"] = 2  # another graphed forward replayed meanwhile
    with pytest.raises(RuntimeError, match="overwritten"):
        z.sum().backward()


def test_may_replay_unless_pending_and_gives_grads_their_own_memory():
    layer = torch.nn.Linear(2, 2)
    assert graphs._may_replay({}, [layer])
    # Accumulation: a .grad that may be a graph's output buffer becomes a marked copy (the
    # replay adds to it in place), once.
    buffer = torch.randn(2, 2)
    layer.weight.grad = buffer
    assert graphs._may_replay({}, [layer])
    own = layer.weight.grad
    assert own is not buffer and own.data_ptr() != buffer.data_ptr()
    assert torch.equal(own, buffer) and layer.bias.grad is None
    assert graphs._may_replay({}, [layer]) and layer.weight.grad is own
    layer.weight.grad = None
    y = graphs._Guard.apply(torch.randn(2, requires_grad=True) * 1, {"gen": 0}, 0)
    state = {"pending": weakref.ref(y.grad_fn)}
    assert not graphs._may_replay(state, [layer])
    del y  # the forward's graph dropped without a backward: nothing pending
    assert graphs._may_replay(state, [layer])


def test_signature_follows_parameters():
    model = apply_coat(tiny_llama(), config=NO_CACHE)
    layers = graphs._coat_layers(model)
    before = graphs._signature(layers)
    layers[0].mlp.up_proj.weight.requires_grad_(False)
    assert graphs._signature(layers) != before  # unfreezing/freezing records again
    before = graphs._signature(layers)
    layers[0].coat_ops = SimpleNamespace(**{**vars(blocks.FP8_OPS), "fused_residual": False})
    assert graphs._signature(layers) != before  # another op set records again
    layers[0].coat_ops = SimpleNamespace(**vars(blocks.FP8_OPS))
    assert graphs._signature(layers) == before  # the same ops: the recording stands


def test_copies_carry_no_graphs():
    """deepcopy / pickle of a converted model leave the graphs (and the weakref to the
    model) behind: they belong to the original's tensors."""
    model = apply_coat(tiny_llama(), config=NO_CACHE)
    for layer in graphs._coat_layers(model):
        layer.__dict__["_coat_graph_owner"] = weakref.ref(model)
        layer.__dict__["_coat_graphed"] = object()
    copied = copy.deepcopy(model)
    assert all(k not in layer.__dict__ for layer in graphs._coat_layers(copied)
               for k in graphs.LAYER_KEYS)  # fmt: skip
    disable_cuda_graphs(model)


def test_disable_collects_only_what_graphs_left(monkeypatch):
    """disable_cuda_graphs runs the full collection (a graphed body and its layer reference
    each other) only where graphs were enabled: revert_coat of a model never graphed (every
    CPU model) does not pay for it."""
    import gc

    collections = []
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(a) or 0)
    model = apply_coat(tiny_llama(), config=NO_CACHE)
    disable_cuda_graphs(model)
    assert collections == []
    layer = graphs._coat_layers(model)[0]
    layer.__dict__["_coat_graph_owner"] = weakref.ref(model)
    layer.__dict__["_coat_graphed"] = object()
    disable_cuda_graphs(model)
    assert len(collections) == 1 and "_coat_graphed" not in layer.__dict__


def _emulated(monkeypatch, model):
    """Graphs "recorded" as the eager layer body itself, on CPU: every decision of
    ``run_graphed`` (replay or not, the guard, the recording key) runs as on a GPU, and a
    "replay" computes what a real one would, so results must match eager bit for bit."""
    calls = []

    def record(owner, key, hidden, cos, sin):
        state = graphs._STATES[owner]
        for layer in state["layers"]:
            layer.__dict__[graphs._GRAPHED] = graphs._LayerBody(layer)
            layer.__dict__[graphs._PARAMS] = graphs._layer_params(layer)
        state["key"] = key
        calls.append(key)

    monkeypatch.setattr(graphs, "_record", record)
    monkeypatch.setattr(graphs, "_on_gpu", lambda hidden: True)
    graphs._install(model, graphs._coat_layers(model))
    return calls


def _step_grads(model, ids, forwards: int = 1):
    """Gradients after ``forwards`` forwards then their backwards, in order."""
    model.zero_grad(set_to_none=True)
    losses = []
    for _ in range(forwards):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(model(ids, labels=ids, use_cache=False).loss)
    for loss in losses:
        loss.backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def test_replay_rules_emulated_on_cpu(monkeypatch):
    ref = tiny_llama()
    eager = apply_coat(copy.deepcopy(ref), config=NO_CACHE)
    model = apply_coat(copy.deepcopy(ref), config=NO_CACHE)
    calls = _emulated(monkeypatch, model)
    state = graphs._STATES[model]
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    # One forward, one backward: "replayed", same gradients; recorded once.
    got, want = _step_grads(model, ids), _step_grads(eager, ids)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert state["replay"] and len(calls) == 1 and state["pending"] is None
    _step_grads(model, ids)
    assert len(calls) == 1  # same shape, same parameters: no new recording
    # Two forwards, then both backwards: the second forward runs eagerly, gradients match.
    got, want = _step_grads(model, ids, 2), _step_grads(eager, ids, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # A second backward over the same recordings raises instead of returning wrong grads.
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="overwritten"):
        loss.backward()
    del loss
    # Freezing a weight records again; another shape records again.
    model.zero_grad(set_to_none=True)
    graphs._coat_layers(model)[1].mlp.down_proj.weight.requires_grad_(False)
    _step_grads(model, ids)
    _step_grads(model, ids[:1])
    assert len(calls) == 3


class _Wrapper(torch.nn.Module):
    """What DDP's wrapper looks like to the graphs' API: the model as ``.module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_replays_read_through_a_ddp_style_wrapper(monkeypatch):
    """Graphs enabled on the model, then the model wrapped (as DDP wraps it): replays pass
    each layer's parameters themselves (the same bits as eager), and ``cuda_graph_replays``
    / ``cuda_graphs_enabled`` / ``disable_cuda_graphs`` answer for the wrapper (coat-train's
    summary asked the wrapper and said the graphs never ran)."""
    ref = tiny_llama()
    eager = apply_coat(copy.deepcopy(ref), config=NO_CACHE)
    model = apply_coat(copy.deepcopy(ref), config=NO_CACHE)
    _emulated(monkeypatch, model)
    wrapped = _Wrapper(model)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    got, want = _step_grads(wrapped, ids), _step_grads(eager, ids)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    layer = graphs._coat_layers(model)[0]
    assert layer.__dict__[graphs._PARAMS] == tuple(layer.parameters())
    assert graphs.cuda_graph_replays(wrapped) == graphs.cuda_graph_replays(model) == 1
    assert graphs.cuda_graphs_enabled(wrapped)
    disable_cuda_graphs(wrapped)
    assert not graphs.cuda_graphs_enabled(model) and graphs.cuda_graph_replays(wrapped) == 0


def test_to_drops_the_recording(monkeypatch):
    """``model.to(...)``: the recording (whose stand-ins share the old parameters' storage,
    which would stay alive) is dropped, the graphs stay enabled, and the next graphed
    forward records again."""
    model = apply_coat(tiny_llama(), config=NO_CACHE)
    calls = _emulated(monkeypatch, model)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    _step_grads(model, ids)
    layers = graphs._coat_layers(model)
    assert graphs._STATES[model]["key"] is not None and graphs._PARAMS in vars(layers[0])
    model.to(torch.bfloat16)
    assert graphs._STATES[model]["key"] is None and graphs.cuda_graphs_enabled(model)
    assert all(vars(lyr)[graphs._GRAPHED] is None and graphs._PARAMS not in vars(lyr)
               for lyr in layers)  # fmt: skip
    model.to(torch.float32)
    _step_grads(model, ids)
    assert len(calls) == 2


def test_a_parameter_replaced_in_place_records_again():
    """A parameter object swapped for another over the same storage: the replay would hand
    the gradients to the old object, so the recording key changes."""
    model = apply_coat(tiny_llama(), config=NO_CACHE)
    layers = graphs._coat_layers(model)
    before = graphs._signature(layers)
    lin = layers[0].self_attn.q_proj
    lin.weight = torch.nn.Parameter(lin.weight.data)  # same storage, another Parameter
    assert graphs._signature(layers) != before


def _train(model, stream, micro_batches: int, use_graphs: bool):
    """Losses and final parameters of len(stream) optimizer steps under bf16 autocast, each
    over ``micro_batches`` slices of the step's batch; with ``graphs``, whether each
    micro-batch replayed the graphs."""
    if use_graphs:
        enable_cuda_graphs(model)
    opt = coat_models.create_optimizer(model, lr=3e-3, weight_decay=0.1)
    model.train()
    losses, replayed = [], []
    for ids in stream:
        for part in ids.chunk(micro_batches):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(part, labels=part).loss / micro_batches
            replayed.append(graphs._STATES.get(model, {}).get("replay"))
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = [p.detach().clone() for p in model.parameters()]
    return torch.stack(losses), params, replayed


@pytest.mark.gpu
@pytest.mark.parametrize("micro_batches", [1, 2], ids=["mb1", "mb2-accumulate"])
def test_gpu_graphed_training_matches_eager(micro_batches):
    stream = torch.randint(0, 256, (4, 4, 64), generator=torch.Generator().manual_seed(1)).cuda()
    ref = tiny_llama().cuda()
    eager = apply_coat(copy.deepcopy(ref), config=NO_CACHE)
    graphed = apply_coat(copy.deepcopy(ref), config=NO_CACHE)
    want_loss, want_params, _ = _train(eager, stream, micro_batches, use_graphs=False)
    got_loss, got_params, replayed = _train(graphed, stream, micro_batches, use_graphs=True)
    layers = graphed.model.layers
    assert all(layer.__dict__.get("_coat_graphed") is not None for layer in layers)
    assert replayed == [True] * len(stream) * micro_batches
    assert torch.equal(got_loss, want_loss)
    for a, b in zip(got_params, want_params, strict=True):
        assert torch.equal(a, b)
    # Another shape records again; eval and revert leave no graphs behind.
    with torch.autocast("cuda", dtype=torch.bfloat16):
        graphed(stream[0, :2], labels=stream[0, :2]).loss.backward()
    graphed.eval()
    with torch.no_grad():
        logits = graphed(stream[0]).logits
    assert torch.equal(logits, eager.eval()(stream[0]).logits)
    disable_cuda_graphs(graphed)
    assert all("_coat_graphed" not in layer.__dict__ for layer in layers)
    enable_cuda_graphs(graphed)
    revert_coat(graphed)
    assert all("_coat_graphed" not in layer.__dict__ for layer in layers)


_NO_MISMATCH_WARNING = """
import warnings, torch
from coat_models import apply_coat, enable_cuda_graphs
from coat_models.graphs import cuda_graph_replays
from coat_models.testing import tiny_llama
from fp8_activations import FP8ActivationConfig
model = enable_cuda_graphs(apply_coat(tiny_llama().cuda(),
                                      config=FP8ActivationConfig(weight_cache=False)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 256, (3, 2, 4, 64), generator=torch.Generator().manual_seed(0)).cuda()
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for step in ids:
        for micro in step:  # two micro-batches: the second replays into accumulated grads
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(micro, labels=micro).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
print("replays", cuda_graph_replays(model))
print("mismatch", sum("AccumulateGrad" in str(w.message) for w in seen))
"""


@pytest.mark.gpu
def test_gpu_graphed_training_warns_of_no_stream_mismatch():
    """torch warns once per process when a gradient accumulator's stream differs from its
    producer's; the recording (make_graphed_callables differentiating its samples on a side
    stream, accumulating nothing) made it warn at every first graphed step. A fresh process,
    so that no earlier test has used up the warning."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _NO_MISMATCH_WARNING], capture_output=True,
                          text=True, timeout=240, env=os.environ.copy())  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split() for line in done.stdout.splitlines() if line.count(" ") == 1)
    assert int(lines["replays"]) == 6  # every micro-batch replayed
    assert lines["mismatch"] == "0", done.stdout
