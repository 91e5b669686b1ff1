"""Launch plans (coat_models.plans): a recorded layer step replays the eager step's bits."""

from __future__ import annotations

import contextlib
import copy
import os
import weakref

import pytest
import torch
from coat_models import apply_coat, enable_cuda_graphs, plans
from coat_models.plans import (
    disable_launch_plans,
    enable_launch_plans,
    launch_plan_refusals,
    launch_plan_replays,
)
from coat_models.testing import tiny_llama
from fp8_activations import FP8ActivationConfig

# On the CPU the plan records the Triton kernels in the interpreter (what CI runs). Tests of
# the plans' own bookkeeping (dropout, a second forward, overwritten arenas, masks) use the
# reference kernels instead: the interpreter takes seconds a step.
INTERPRETED = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU tests need TRITON_INTERPRET=1"
)
DEVICES = [pytest.param("cpu", marks=INTERPRETED), pytest.param("cuda", marks=pytest.mark.gpu)]


def config(device: str, backend: str | None = None) -> FP8ActivationConfig:
    # On the CPU the Triton kernels run in the interpreter (what the plan records).
    backend = backend or ("triton" if device == "cpu" else "auto")
    return FP8ActivationConfig(weight_cache=False, backend=backend)


def pair(device: str, layers: int = 2, backend: str | None = None, **overrides):
    """The same COAT model twice (fp32 master weights), the second with launch plans."""
    base = tiny_llama(0, num_hidden_layers=layers, **overrides).to(device)
    eager = apply_coat(copy.deepcopy(base), config=config(device, backend))
    planned = enable_launch_plans(apply_coat(base, config=config(device, backend)))
    return eager, planned


def step(model, ids, device, optimizer=None, **kwargs):
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids, **kwargs).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad()
    return loss.detach(), grads


def assert_same(a, b):
    assert torch.equal(a[0], b[0])
    assert len(a[1]) == len(b[1])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow  # (Triton's interpreter: over 10 s)
def test_planned_steps_are_the_eager_bits(device):
    """An optimizer step, then one at another shape (a second plan), then the first shape
    again with every weight halved (the first plan's second use: every maximum its kernels
    take is smaller than the last, which a counter not zeroed since would keep): the losses
    and every gradient equal the eager COAT model's bit for bit, every layer step replayed
    from a plan."""
    eager, planned = pair(device)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_p = torch.optim.AdamW(planned.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for batch, seq in [(2, 8), (1, 12), (2, 8)]:
        if launch_plan_replays(planned) == 2 * 2:
            with torch.no_grad():
                for p in [*eager.parameters(), *planned.parameters()]:
                    p.mul_(0.5)
        ids = torch.randint(0, 128, (batch, seq), generator=gen).to(device)
        assert_same(step(eager, ids, device, opt_e), step(planned, ids, device, opt_p))
    assert launch_plan_replays(planned) == 3 * 2 and launch_plan_refusals(planned) == []
    # The kernels' zero-filled counters are the plan's own bytes, zeroed as a step starts:
    # no zeros op is called again.
    made = plans._STATES[planned]["plans"]
    assert made and all(plan.zeroed.numel() > 0 for plan in made)
    steps = [s for plan in made for s in plan.fwd + plan.bwd if s is not None]
    calls = [s[7] for s in steps if s[0] in ("op", "alloc", "nondet")]
    assert not set(calls) & plans._ZEROS


def test_the_public_bindings_a_plan_calls_run_the_recorded_overloads():
    """A plan calls some ops through their public bindings (faster to parse): each binding
    bears the overload's name and gives what the overload gives for the arguments a record
    holds (positional as the schema orders them, keyword-only ones as keywords)."""
    aten = torch.ops.aten
    for overload, binding in plans._PUBLIC.items():
        assert overload._schema.name == f"aten::{binding.__name__}", (overload, binding)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 32, generator=gen), torch.randn(32, 16, generator=gen)
    fa, fb = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
    one, two = torch.tensor(1.0), torch.tensor(0.5)
    kw = {"dtype": torch.bfloat16, "layout": torch.strided, "device": torch.device("cpu")}
    calls = [
        (aten.empty.memory_format, ([3, 5],), {**kw, "pin_memory": False}),
        (aten.empty_strided.default, ([3, 5], [1, 3]), kw),
        (aten.empty_like.default, (a,), {"memory_format": torch.preserve_format}),
        (aten.zeros.default, ([3, 5],), kw),
        (aten.amax.default, (a, [1], True), {}),
        (aten.amax.default, (a,), {}),
        (aten.mm.default, (a, b), {}),
        (aten._scaled_mm.default, (fa, fb, one, two, None, None, torch.bfloat16, False), {}),
    ]
    for overload, args, kwargs in calls:
        want, got = overload(*args, **kwargs), plans._PUBLIC[overload](*args, **kwargs)
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
        if overload not in plans._ALLOCS:
            assert torch.equal(got, want), overload


def test_the_reference_kernels_are_planned_too():
    """COAT's plain-PyTorch path (the reference backend: no Triton; its weight maxima come
    from one _foreach_norm, which returns a list of tensors) is recorded and replayed with
    the eager bits (it was refused: "returned more than its schema says")."""
    eager, planned = pair("cpu", backend="reference")
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_p = torch.optim.AdamW(planned.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        ids = torch.randint(0, 128, (2, 8), generator=gen)
        assert_same(step(eager, ids, "cpu", opt_e), step(planned, ids, "cpu", opt_p))
    assert launch_plan_refusals(planned) == [] and launch_plan_replays(planned) == 2 * 2


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_accumulation_and_frozen_weights(device):
    """Two micro-batches accumulate into .grad as eagerly; a frozen projection gets no
    gradient and the others the eager bits."""
    # (on the CPU the reference kernels: the Triton ones are planned in the test above)
    eager, planned = pair(device, layers=1, backend="reference" if device == "cpu" else None)
    for m in (eager, planned):
        m.model.layers[0].self_attn.k_proj.weight.requires_grad_(False)
    gen = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, 128, (2, 8), generator=gen).to(device) for _ in range(2)]
    for model in (eager, planned):
        for x in ids:
            with torch.autocast(device, dtype=torch.bfloat16):
                model(input_ids=x, labels=x).loss.backward()
    for a, b in zip(eager.parameters(), planned.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None)
        assert a.grad is None or torch.equal(a.grad, b.grad)
    assert planned.model.layers[0].self_attn.k_proj.weight.grad is None
    assert launch_plan_replays(planned) == 2


def test_dropout_and_the_random_state_follow_the_eager_run():
    """Attention dropout draws the eager masks (the op called again consumes the generator
    as eagerly), and making a plan (its record and check run on a forked generator) leaves
    the random state where the eager run leaves it."""
    eager, planned = pair("cpu", layers=1, backend="reference", attention_dropout=0.25)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(6))
    results, after = [], []
    for model in (eager, planned):
        torch.manual_seed(7)
        results.append([step(model, ids, "cpu") for _ in range(2)])
        after.append(torch.rand(4))
    for a, b in zip(*results, strict=True):
        assert_same(a, b)
    assert torch.equal(*after)
    assert launch_plan_replays(planned) == 2, launch_plan_refusals(planned)


def test_moving_the_model_records_again():
    """``.to()`` / ``.float()`` (``nn.Module._apply``) drops the layers' plans, whose
    arenas and addresses belong to the old tensors; the next step records again."""
    eager, planned = pair("cpu", layers=1, backend="reference")
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(8))
    assert_same(step(eager, ids, "cpu"), step(planned, ids, "cpu"))
    layer = planned.model.layers[0]
    assert len(vars(layer)["_coat_launch_plans"]) == 1
    planned.float()
    assert vars(layer)["_coat_launch_plans"] == {} and plans._STATES[planned]["plans"] == []
    assert_same(step(eager, ids, "cpu"), step(planned, ids, "cpu"))
    assert launch_plan_replays(planned) == 2


def test_a_planned_model_saves_and_copies_without_its_plans():
    """``torch.save(model)`` and ``copy.deepcopy`` of a planned model work; what they give
    back has no plans (the arenas and records stay with the original): it trains eagerly,
    with the same bits, until ``enable_launch_plans`` is called on it, and its steps are
    not counted on the original."""
    import io

    eager, planned = pair("cpu", layers=1, backend="reference")
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(9))

    def fresh_step(model):  # (gradients from None: a copy keeps the original's .grad)
        for p in model.parameters():
            p.grad = None
        return step(model, ids, "cpu")

    assert_same(fresh_step(eager), fresh_step(planned))
    buffer = io.BytesIO()
    torch.save(planned, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)  # (the bytes written just above)
    for other in (copy.deepcopy(planned), loaded):
        assert launch_plan_replays(other) == 0
        assert not any(set(plans.LAYER_KEYS) & set(vars(m)) for m in other.modules())
        assert_same(fresh_step(eager), fresh_step(other))
        assert launch_plan_replays(planned) == 1 and plans.launch_plan_eager_steps(planned) == 0
    copied = enable_launch_plans(copy.deepcopy(planned))
    assert_same(fresh_step(eager), fresh_step(copied))
    assert launch_plan_replays(copied) == 1 and launch_plan_replays(planned) == 1


def test_a_second_forward_before_the_backward_runs_eagerly():
    """The layer's arena holds the pending forward's saved activations: a second forward
    before its backward runs eagerly, and both backwards give the eager gradients."""
    eager, planned = pair("cpu", layers=1, backend="reference")
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randint(0, 128, (2, 8), generator=gen) for _ in range(2))
    for model in (eager, planned):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=a, labels=a).loss + model(input_ids=b, labels=b).loss
        loss.backward()
    pairs = zip(eager.parameters(), planned.parameters(), strict=True)
    assert all(torch.equal(x.grad, y.grad) for x, y in pairs)
    assert launch_plan_replays(planned) == 1  # the first forward only
    assert plans.launch_plan_eager_steps(planned) == 1  # the second


def test_a_backward_over_overwritten_activations_raises():
    _, planned = pair("cpu", layers=1, backend="reference")
    ids = torch.randint(0, 128, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = planned(input_ids=ids, labels=ids).loss
    first.backward(retain_graph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        planned(input_ids=ids, labels=ids).loss.backward()  # replays into the same arena
    with pytest.raises(RuntimeError, match="overwritten"):
        first.backward()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_attention_masks_are_planned_with_the_eager_bits(device):
    """A padded batch's attention mask is an input of the plan, given per call as the hidden
    states are: steps with other padding at the same shapes replay the plan (the mask's
    values reach the attention kernels, not the step's Python), a step without a mask is a
    plan of its own; every loss and gradient equals the eager model's bit for bit. (On the
    CPU COAT's reference kernels; on the GPU Triton's and SDPA's CUDA backends, at a size
    where two eager runs agree.)"""
    backend = "reference" if device == "cpu" else None
    eager, planned = pair(device, layers=1, backend=backend)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_p = torch.optim.AdamW(planned.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(4)
    for pad in [(0, 3), (5, 0), None, (2, 1)]:
        ids = torch.randint(0, 128, (2, 8), generator=gen).to(device)
        kwargs = {}
        if pad is not None:
            mask = torch.ones(2, 8, dtype=torch.long)
            for row, n in enumerate(pad):
                mask[row, :n] = 0  # (left padding)
            kwargs["attention_mask"] = mask.to(device)
        assert_same(
            step(eager, ids, device, opt_e, **kwargs), step(planned, ids, device, opt_p, **kwargs)
        )
    assert launch_plan_refusals(planned) == []
    assert launch_plan_replays(planned) == 4 and plans.launch_plan_eager_steps(planned) == 0
    assert len(plans._STATES[planned]["plans"]) == 2  # with a mask, without
    with torch.no_grad():  # evaluation is neither replayed nor counted as eager
        planned(input_ids=ids, **kwargs)
    assert launch_plan_replays(planned) == 4 and plans.launch_plan_eager_steps(planned) == 0


def test_sdpa_priority_order_and_math_reduction_are_part_of_the_key():
    """SDPA's backend priority order and whether its math backend may reduce in bf16 decide
    the attention a step runs: a step under other settings gets a plan of its own (each the
    eager bits), the first plan is used again when the settings come back."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    eager, planned = pair("cpu", layers=1, backend="reference")
    gen = torch.Generator().manual_seed(5)
    order = [SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.CUDNN_ATTENTION]  # fmt: skip
    low = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    settings = [
        contextlib.nullcontext,
        lambda: sdpa_kernel(order, set_priority=True),
        contextlib.nullcontext,
    ]
    made = []
    try:
        for setting in [*settings, None]:
            if setting is None:  # the math backend's reduction switched
                torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(not low)
                setting = contextlib.nullcontext
            ids = torch.randint(0, 128, (2, 8), generator=gen)
            with setting():
                assert_same(step(eager, ids, "cpu"), step(planned, ids, "cpu"))
            made.append(len(plans._STATES[planned]["plans"]))
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(low)
    assert made == [1, 2, 2, 3]
    assert launch_plan_replays(planned) == 4 and launch_plan_refusals(planned) == []


def test_the_check_keeps_a_broadcast_input_at_its_own_size():
    """The check keeps a copy of a nondeterministic op's inputs: an attention mask expanded
    over the heads (stride 0, as SDPA's memory-efficient backward gets it) is kept at the
    mask's own size, not once per head."""
    mask = torch.randn(2, 1, 8, 8).expand(2, 32, 8, 8)
    kept = plans._kept_copy(mask)
    assert torch.equal(kept, mask) and kept.shape == mask.shape
    assert kept.untyped_storage().nbytes() == 2 * 8 * 8 * 4
    assert kept.untyped_storage().data_ptr() != mask.untyped_storage().data_ptr()
    view = torch.randn(3, 4)[:, 1:3]  # (no broadcast dimension: a plain copy)
    kept = plans._kept_copy(view)
    assert torch.equal(kept, view)
    assert kept.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()


def test_keys_past_the_cap_run_eagerly_with_one_warning(monkeypatch):
    """Batches at ever new lengths: a layer tries at most ``max_plans_per_layer`` keys (a
    plan keeps an arena, a try records the step; a refused key counts too); steps at further
    lengths run eagerly, with the eager bits, one warning (at the caller's line) and one
    refusal line per layer, also after ``.to()`` dropped the plans; the lengths that have
    plans still replay them."""
    base = tiny_llama(0, num_hidden_layers=2)
    eager = apply_coat(copy.deepcopy(base), config=config("cpu", "reference"))
    planned = enable_launch_plans(
        apply_coat(base, config=config("cpu", "reference")), max_plans_per_layer=3
    )
    make = plans._make_plan
    tried = []

    def refuse_12(layer, state, hidden, *args):
        tried.append(hidden.shape[1])
        if hidden.shape[1] == 12:
            raise plans._NoPlan("refused for the test")
        return make(layer, state, hidden, *args)

    monkeypatch.setattr(plans, "_make_plan", refuse_12)
    gen = torch.Generator().manual_seed(6)
    with pytest.warns(UserWarning, match="at its cap of 3 keys .max_plans_per_layer.") as caught:
        for seq in [8, 12, 16, 20, 24, 8, 16, 12]:
            ids = torch.randint(0, 128, (1, seq), generator=gen)
            assert_same(step(eager, ids, "cpu"), step(planned, ids, "cpu"))
    (warning,) = [w for w in caught if "launch plans" in str(w.message)]
    assert warning.filename == __file__  # (step() above: the caller's line)
    assert tried == [8, 8, 12, 12, 16, 16]  # (two layers; 20 and 24 not tried)
    assert len(plans._STATES[planned]["plans"]) == 2 * 2
    assert launch_plan_replays(planned) == 2 * 4  # seq 8 and 16, each twice, two layers
    assert plans.launch_plan_eager_steps(planned) == 2 * 4  # 12 (refused) twice, 20, 24
    capped = [r for r in launch_plan_refusals(planned) if "at its cap" in r]
    assert len(capped) == 2 and len(launch_plan_refusals(planned)) == 2 + 2
    planned.to("cpu", torch.float32)  # (drops the plans: the next steps try again)
    for seq in [28, 32, 36, 40]:
        step(planned, torch.randint(0, 128, (1, seq), generator=gen), "cpu")
    assert len(plans._STATES[planned]["plans"]) == 2 * 3
    assert len([r for r in launch_plan_refusals(planned) if "at its cap" in r]) == 2
    for bad, error in [(0, ValueError), (2.0, TypeError), (True, TypeError)]:
        with pytest.raises(error, match="max_plans_per_layer"):
            enable_launch_plans(planned, max_plans_per_layer=bad)


def test_refusals():
    with pytest.raises(ValueError, match="apply_coat"):
        enable_launch_plans(tiny_llama())
    with pytest.raises(ValueError, match="weight_cache=False"):
        enable_launch_plans(apply_coat(tiny_llama()))
    with pytest.raises(ValueError, match="'sdpa' or 'eager', got 'flex_attention'"):
        no_cache = config("cpu", "reference")
        enable_launch_plans(
            apply_coat(tiny_llama(attn_implementation="flex_attention"), config=no_cache)
        )
    model = apply_coat(tiny_llama(), config=config("cpu", "reference"))
    enable_launch_plans(model)
    disable_launch_plans(model)
    assert launch_plan_replays(model) == 0
    ids = torch.randint(0, 128, (1, 8))
    step(model, ids, "cpu")  # eager again: nothing recorded
    assert not any(set(plans.LAYER_KEYS) & set(vars(m)) for m in model.modules())


@INTERPRETED
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
@pytest.mark.slow  # (Triton's interpreter: over 10 s)
def test_fsdp2_and_ddp_layers_replay_the_eager_bits(tmp_path, strategy):
    """Under FSDP2 (one process, bf16 compute; each layer's parameters gathered before its
    forward and again before its backward, into storage freed in between) and under DDP
    (gradients reduced by hooks on the parameters, into bucket views) the planned layers
    take the parameters where they are: the losses and the gradients (FSDP2: shards)
    equal eager's under the same wrapper bit for bit, and the plan's output is not a view
    (FSDP2 warns of one). One rank (test_distributed.py runs plans on two)."""
    import warnings

    import torch.distributed as dist
    from coat_models.distributed import shard_model, wrap_ddp

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        eager, planned = pair("cpu", layers=1)  # (Triton launches: their pointers move too)
        if strategy == "fsdp":
            for m in (eager, planned):
                shard_model(m)  # bf16 parameters gathered, fp32 gradients reduced
            models = (eager, planned)
        else:
            models = tuple(wrap_ddp(m, torch.device("cpu")) for m in (eager, planned))
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
        gen = torch.Generator().manual_seed(9)
        for _ in range(2):
            ids = torch.randint(0, 128, (2, 8), generator=gen)
            got = []
            for m, opt in zip(models, opts, strict=True):
                with warnings.catch_warnings():
                    warnings.filterwarnings("error", message=".*returned a view tensor")
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = m(input_ids=ids, labels=ids).loss
                    loss.backward()
                grads = [getattr(p.grad, "to_local", p.grad.clone)() for p in m.parameters()]
                got.append((loss.detach(), [g.clone() for g in grads]))
                opt.step()
                opt.zero_grad()
            assert_same(*got)
        # (read through DDP's wrapper too; and dropped through it)
        assert launch_plan_replays(models[1]) == 2, launch_plan_refusals(models[1])
        arenas = sum(p.arena.nbytes + p.zeroed.nbytes for p in plans._STATES[planned]["plans"])
        scratch = sum(s.nbytes for s in plans._STATES[planned]["scratch"].values())
        assert arenas > 0 and scratch > 0
        assert plans.launch_plan_bytes(models[1]) == arenas + scratch
        disable_launch_plans(models[1])
        assert launch_plan_replays(models[1]) == 0 and planned not in plans._STATES
        assert plans.launch_plan_bytes(models[1]) == 0
    finally:
        dist.destroy_process_group()


def assert_refused_and_eager(seed: int) -> None:
    """One step of a one-layer model: its plan refused by the replay check, the layer run
    eagerly with the eager model's bits."""
    eager, planned = pair("cpu", layers=1)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(seed))
    planned_step = step(planned, ids, "cpu")
    (why,) = launch_plan_refusals(planned)
    assert "did not reproduce the recorded step bit for bit" in why
    assert launch_plan_replays(planned) == 0 and plans.launch_plan_eager_steps(planned) == 1
    assert_same(step(eager, ids, "cpu"), planned_step)


@INTERPRETED
@pytest.mark.slow  # (Triton's interpreter: over 10 s)
def test_a_plan_that_does_not_replay_the_record_is_refused(monkeypatch):
    """Each plan replays its record on the recorded inputs before it is used: one that
    misses a kernel (here: its last backward launch dropped, as for a kernel started
    outside ATen and fp8_quant's launch) is refused, and the layer trains eagerly."""
    place = plans._Plan.place

    def place_and_drop(self, scratch):
        place(self, scratch)
        last = max(i for i, s in enumerate(self.bwd) if s is not None and "launch" in s[0])
        self.bwd[last] = None

    monkeypatch.setattr(plans._Plan, "place", place_and_drop)
    assert_refused_and_eager(seed=5)


@INTERPRETED
@pytest.mark.slow  # (Triton's interpreter: over 10 s)
def test_a_plan_whose_counters_are_not_zeroed_is_refused(monkeypatch):
    """The plan zeroes the kernels' counters (allocated by zeros in the eager step) with one
    fill as each forward starts. A plan that skipped that fill would start from whatever the
    bytes held: the check's replay starts them at 0x7F bytes (a large positive value, which a
    maximum kept there does not hide, as it would -1), so it sees the difference and the
    layer trains eagerly, with eager's bits."""
    forward = plans._Plan.forward

    def forward_without_the_fill(self, inputs, params):
        zeroed, self.zeroed = self.zeroed, self.zeroed[:0]
        try:
            return forward(self, inputs, params)
        finally:
            self.zeroed = zeroed

    monkeypatch.setattr(plans._Plan, "forward", forward_without_the_fill)
    assert_refused_and_eager(seed=6)


@INTERPRETED
@pytest.mark.slow  # (Triton's interpreter: over 10 s)
def test_the_check_sees_a_missed_write_where_memory_holds_the_recorded_values(monkeypatch):
    """A missed kernel whose output memory already holds the values it would write (memory
    a run of the same step left there, as after other tests ran the same tiny model, which
    the allocator may hand out again) must not pass the check: its replay starts from 0xFF
    bytes in every buffer the step allocates. Here a
    complete replay keeps what its backward's allocations ended up holding; then the last
    backward launch is dropped, and in the check's replay each of those allocations comes
    back holding those values."""
    replay_differs, held = plans._replay_differs, []

    def check(plan, *args):
        if held:
            return replay_differs(plan, *args)
        allocs = {i: s for i, s in enumerate(plan.bwd) if s is not None and s[0] == "alloc"}
        made = []

        def kept(func):
            def alloc(*a, **k):
                made.append(func(*a, **k))
                return made[-1]

            return alloc

        for i, (kind, func, *rest) in allocs.items():
            plan.bwd[i] = (kind, kept(func), *rest)
        assert replay_differs(plan, *args) is None  # the complete plan reproduces its record
        held[:] = [t.clone() for t in made]
        values = iter(held)
        for i, (kind, _, *rest) in allocs.items():
            plan.bwd[i] = (kind, lambda *a, **k: next(values).clone(), *rest)
        last = max(i for i, s in enumerate(plan.bwd) if s is not None and "launch" in s[0])
        plan.bwd[last] = None
        try:
            return replay_differs(plan, *args)
        finally:
            for i, s in allocs.items():
                plan.bwd[i] = s

    monkeypatch.setattr(plans, "_replay_differs", check)
    eager, planned = pair("cpu", layers=1)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(5))
    planned_step = step(planned, ids, "cpu")
    (why,) = launch_plan_refusals(planned)
    assert held and "did not reproduce the recorded step bit for bit" in why
    assert launch_plan_replays(planned) == 0
    assert_same(step(eager, ids, "cpu"), planned_step)


@pytest.mark.parametrize(
    "unequal, dropout, deterministic",
    [(1, 0.0, False), (2, 0.0, False), (3, 0.0, False), (2, 0.25, False), (1, 0.0, True)],
)
def test_a_replay_check_that_differs_once_is_tried_again(
    monkeypatch, unequal, dropout, deterministic
):
    """A nondeterministic kernel (CUDA's flash-attention backward) can make one replay of
    the record differ: the check replays again (from the record's random state: dropout
    draws the same masks), and one equal replay makes the plan; a plan that no replay
    reproduces in 3 tries (here: the first ``unequal`` replays' input gradient nudged) is
    refused, and with deterministic algorithms on in 1. The reference kernels: no Triton
    launch is needed here."""
    backward, calls = plans._Plan.backward, []

    def nudged(self, saved, grad):
        grads = backward(self, saved, grad)
        calls.append(1)
        if len(calls) <= unequal:
            grads["hidden"] = grads["hidden"].clone()
            grads["hidden"].view(-1)[0] += 1
        return grads

    monkeypatch.setattr(plans._Plan, "backward", nudged)
    eager, planned = pair("cpu", layers=1, backend="reference", attention_dropout=dropout)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(9))
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        results = []
        for model in (eager, planned):
            torch.manual_seed(7)
            results.append([step(model, ids, "cpu") for _ in range(2)])
    finally:
        torch.use_deterministic_algorithms(was)
    for a, b in zip(*results, strict=True):
        assert_same(a, b)
    checks = 1 if deterministic else 3
    if unequal < checks:
        assert launch_plan_refusals(planned) == [] and launch_plan_replays(planned) == 2
        assert len(calls) == unequal + 1 + 2  # the check's replays, then the two steps
        assert plans.launch_plan_check_retries(planned) == unequal
    else:
        (why,) = launch_plan_refusals(planned)
        assert f"(hidden differs, {checks} replay" in why
        assert launch_plan_replays(planned) == 0 and len(calls) == checks
        assert plans.launch_plan_check_retries(planned) == 0  # (the refusal says it)


@pytest.mark.parametrize("upstream", [False, True], ids=["noisy op", "and its input wrong"])
def test_the_check_takes_the_recorded_results_of_a_nondeterministic_op(monkeypatch, upstream):
    """CUDA's attention backward adds dQ up with atomics: its results may differ in each
    replay, and a plan whose 3 check replays all differ is refused (the layer then runs
    eagerly). The check's replays compare such an op's floating-point inputs with the
    recorded ones bit for bit and take its recorded results. Here the CPU's attention backward is
    treated as one and gives other results in every run: the plan is made at the first
    check, and the recorded inputs and results are freed after it. With the op that writes
    its incoming gradient also wrong in the plan's runs (as a missed kernel upstream would
    make it), the plan is refused. The reference kernels: no Triton launch is needed here."""
    packet = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    monkeypatch.setattr(plans, "_NONDETERMINISTIC", frozenset({packet}))
    place, made, calls, kept = plans._Plan.place, [], [], []

    def place_noisy(self, scratch):
        place(self, scratch)
        made.append(self)
        kept.extend(weakref.ref(t) for pair in self.kept.values() for t in pair[0] + pair[1])
        for i, st in enumerate(self.bwd):
            if st is None or st[0] != "nondet":
                continue
            kind, func, args, *rest = st

            def noisy(*args, func=func, **kwargs):
                calls.append(1)
                out = [o.clone() for o in func(*args, **kwargs)]
                out[0][(0,) * out[0].dim()] += len(calls)  # (another sum each run)
                return tuple(out)

            self.bwd[i] = (kind, noisy, args, *rest)
            if upstream:  # the op writing its incoming gradient (argument 0) doubles it
                grad_out = dict(args[1])[0]  # (args: constants, per-call (index, getter))
                assert grad_out[0] == "v"  # (a per-call buffer: an op's output)
                (j,) = [j for j, s in enumerate(self.bwd[:i]) if s and grad_out[1] in s[4]]
                kind, func, *rest = self.bwd[j]
                self.bwd[j] = (kind, lambda *a, func=func, **k: func(*a, **k) * 2, *rest)

    monkeypatch.setattr(plans._Plan, "place", place_noisy)
    _, planned = pair("cpu", layers=1, backend="reference")
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(9))
    step(planned, ids, "cpu")
    assert plans.launch_plan_check_retries(planned) == 0
    (plan,) = made
    assert plan.kept == {} and kept and all(ref() is None for ref in kept)
    if upstream:
        (why,) = launch_plan_refusals(planned)
        assert "(an input of " in why and " differs, 3 replays)" in why
        assert launch_plan_replays(planned) == 0
    else:
        assert launch_plan_refusals(planned) == [] and launch_plan_replays(planned) == 1
        assert len(calls) == 2  # the nondeterministic op: once in the check, once in the step


@pytest.mark.gpu
def test_cuda_graphs_and_plans_exclude_each_other():
    model = apply_coat(tiny_llama().cuda(), config=config("cuda"))
    enable_cuda_graphs(model)
    with pytest.raises(ValueError, match="CUDA graphs"):
        enable_launch_plans(model)


def test_layer_params_are_named_parameters_in_order_each_once():
    """The plans' (and graphs') parameter list, made each call without names, is
    ``named_parameters()``'s: same order, a module reached twice and a parameter registered
    twice counted once."""
    from coat_models import graphs

    model = tiny_llama(0, num_hidden_layers=2)
    shared = model.model.layers[1]
    shared.mlp.again = shared.self_attn.q_proj  # a module reached twice
    shared.self_attn.tied = shared.mlp.up_proj.weight  # a parameter under a second name
    shared.input_layernorm.weight = None  # (named_parameters skips None)
    for layer in model.model.layers:
        want = [p for _, p in layer.named_parameters()]
        got = graphs._layer_params(layer)
        assert len(got) == len(want) and all(a is b for a, b in zip(got, want, strict=True))
    assert len(graphs._layer_params(shared)) == len(graphs._layer_params(model.model.layers[0])) - 1
