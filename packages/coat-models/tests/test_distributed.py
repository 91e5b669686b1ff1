"""FSDP2 and DDP with COAT (FP8 activations + FP8 optimizer states) on CPU: 2 processes over
gloo against one process, DCP checkpoints moved between 2 ranks and 1.

One ``torchrun --nproc-per-node 2`` launch of this file (the ``__main__`` part at the end)
runs every distributed scenario and writes what it saw to a directory; the tests compare it
with single-process runs computed here. The single-process runs reproduce the distributed
arithmetic exactly: each rank's micro-batch is a micro-batch of gradient accumulation,
accumulated in fp32 (FSDP2 reduces in fp32, DDP's buckets are fp32), and for FSDP2's bf16
MixedPrecisionPolicy a bf16 copy of the parameters (not of the buffers) computes, as FSDP2's
all-gathered bf16 parameters do. Averaging two gradients ``(a + b) / 2`` rounds the same
whichever side divides first, so the expected difference is zero: the tolerances below
(1e-6 relative) only leave room for a platform whose kernels are not deterministic.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

# One xdist worker takes the whole module (nox runs --dist loadgroup), so that the
# module-scoped `runs` is computed once, not once on every worker.
pytestmark = pytest.mark.xdist_group("distributed")
WORLD = 2
STEPS = 4  # optimizer steps per run; checkpoints are written after step SAVE_AT
SAVE_AT = 2
PER_RANK = 2  # sequences per rank and step
SEQ = 32
VOCAB = 256
LR = 1e-2
LOSS_RTOL = 1e-6  # see the module docstring: expected 0
GRAD_RTOL = 1e-6


# ----------------------------------------------------------------------------------- shared
def tiny_llama(seed: int = 0, coat: bool = True, **overrides):
    """coat_models.testing's tiny Llama with 64 positions, in train mode; COAT applied."""
    from coat_models import apply_coat
    from coat_models.testing import tiny_llama as build

    model = build(seed, **{"max_position_embeddings": 64, **overrides}).train()
    return apply_coat(model) if coat else model


def batch(step: int, rank: int) -> torch.Tensor:
    """Token ids [PER_RANK, SEQ] of one rank (= one accumulation micro-batch) and step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (PER_RANK, SEQ), generator=g)


def coat_adamw(params, **config):
    from fp8_optim import CoatAdamW, CoatAdamWConfig

    return CoatAdamW(params, lr=LR, weight_decay=0.1, config=CoatAdamWConfig(**config))


def llama_optimizer(model, **config):
    """What ``prepare_data_parallel`` builds: ``create_optimizer`` (CoatAdamW, decay and
    no-decay groups)."""
    from coat_models import create_optimizer
    from fp8_optim import CoatAdamWConfig

    return create_optimizer(model, lr=LR, config=CoatAdamWConfig(**config))


# Awkward shapes for the optimizer alone: partial groups, rows shorter than a group, an
# empty shard (1 row on 2 ranks), shards starting inside a group, a 3-D tensor.
OPT_SHAPES = [(7,), (64,), (300,), (256,), (5, 100), (3, 256), (1, 130), (2, 64),
              (9, 3, 50), (13, 67), (256, 64)]  # fmt: skip


def opt_params(dtype):
    torch.manual_seed(0)
    return [torch.randn(s, dtype=dtype) for s in OPT_SHAPES]


def opt_grads(step: int):
    """Gradients whose scales differ by orders of magnitude between tensors and steps."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for s in OPT_SHAPES:
        scale = 10.0 ** torch.randint(-4, 3, (1,), generator=g).item()
        out.append(torch.randn(s, generator=g) * scale)
    return out


class Net(nn.Module):
    """Two blocks sharded on their own, a parameter only rank 0 uses, one nobody uses, and
    a 1-row head (rank 1 holds an empty shard of it)."""

    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.extra = nn.Linear(16, 16)
        self.never = Block()
        self.head = nn.Linear(16, 1)

    def forward(self, x, use_extra: bool):
        for block in self.blocks:
            x = block(x)
        if use_extra:
            x = x + self.extra(x)
        return self.head(x).square().mean()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def net_input(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(50 * step + rank))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bit-for-bit comparisons of any dtype (FP8 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def full_states(optimizer) -> dict[int, dict[str, torch.Tensor]]:
    """Per parameter index, every state as a full tensor in the checkpoint layout (per-group
    numbers by row where rows hold whole groups); collective for DTensor states."""
    from fp8_optim.dtensor import gather, is_dtensor

    return {
        index: {
            key: (gather(v) if is_dtensor(v) else v).detach().clone() for key, v in state.items()
        }
        for index, state in optimizer.state_dict()["state"].items()
    }


def states_by_name(optimizer, model) -> dict[str, torch.Tensor]:
    """``{"<param fqn>.<state>": full tensor}``, see ``full_states``."""
    names = {p: n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {
        f"{names[params[index]]}.{key}": value
        for index, state in full_states(optimizer).items()
        for key, value in state.items()
    }


# ---------------------------------------------------------------- single-process references
class EmulatedFSDP:
    """One process doing what FSDP2 with the bf16 policy does on WORLD ranks: fp32 master
    weights and CoatAdamW; each step, a bf16 copy of the parameters computes one
    micro-batch per rank and the fp32 gradients are averaged."""

    def __init__(self, seed: int = 0):
        self.master = tiny_llama(seed)
        self.compute = copy.deepcopy(self.master)
        for p in self.compute.parameters():
            p.data = p.data.to(torch.bfloat16)
        self.opt = llama_optimizer(self.master)

    def step(self, step: int) -> float:
        """One optimizer step; the averaged gradients stay in ``self.grads``."""
        with torch.no_grad():
            for pc, pm in zip(self.compute.parameters(), self.master.parameters(), strict=True):
                pc.copy_(pm)
        losses, grads = [], None
        for rank in range(WORLD):
            ids = batch(step, rank)
            loss = self.compute(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
            g = [p.grad.float() for p in self.compute.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g, strict=True)]
            self.compute.zero_grad(set_to_none=True)
        for pm, g in zip(self.master.parameters(), grads, strict=True):
            pm.grad = g / WORLD
        self.grads = {n: p.grad.clone() for n, p in self.master.named_parameters()}
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return sum(losses) / WORLD


class EmulatedDDP:
    """One process doing what DDP does on WORLD ranks under bf16 autocast: fp32 model, one
    micro-batch per rank, gradients summed in fp32 and divided by WORLD."""

    def __init__(self, seed: int = 0):
        self.model = tiny_llama(seed)
        self.opt = llama_optimizer(self.model)

    def step(self, step: int) -> float:
        losses = []
        for rank in range(WORLD):
            ids = batch(step, rank)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = self.model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
        for p in self.model.parameters():
            p.grad /= WORLD
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return sum(losses) / WORLD


def net_reference(steps: int):
    """Net trained in one process: micro-batch of rank 0 uses ``extra``, rank 1's does not."""
    net = Net()
    opt = coat_adamw(net.parameters())
    for step in range(1, steps + 1):
        for rank in range(WORLD):
            net(net_input(step, rank), use_extra=rank == 0).backward()
        for p in net.parameters():
            if p.grad is not None:
                p.grad /= WORLD
        opt.step()
        opt.zero_grad(set_to_none=True)
    return net, opt


# -------------------------------------------------------------------------- the launch
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Single-process references (and their checkpoint), then one 2-process launch."""
    from coat_models.distributed import save_checkpoint

    out = tmp_path_factory.mktemp("distributed")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is faster, and the CPU is shared
    ref = {"fsdp_losses": []}
    fsdp = EmulatedFSDP()
    for step in range(1, STEPS + 1):
        ref["fsdp_losses"].append(fsdp.step(step))
        if step == 1:
            ref["fsdp_grads"] = fsdp.grads
        if step == SAVE_AT:
            save_checkpoint(out / "single_ckpt", fsdp.master, fsdp.opt, extra={"step": step})
            ref["single_states"] = states_by_name(fsdp.opt, fsdp.master)
            ref["single_params"] = {
                n: p.detach().clone() for n, p in fsdp.master.named_parameters()
            }
    ddp = EmulatedDDP()
    ref["ddp_losses"] = [ddp.step(step) for step in range(1, STEPS + 1)]
    ref["net"] = net_reference(SAVE_AT)

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={WORLD}", __file__, str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(
            f"the {WORLD}-process run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    got = torch.load(out / "results.pt", weights_only=False)
    yield out, ref, got
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------------- tests
# Every test that takes `runs` is marked slow: the first one pays for the 2-process launch
# and the single-process references (about 10 s on 2 CPU cores).
@pytest.mark.slow
def test_optimizer_on_shards_is_bit_identical_to_unsharded(runs):
    """CoatAdamW on DTensor shards == CoatAdamW on the full tensors, every bit of every
    parameter and state, over 4 steps, for fp32 and bf16 (stochastic rounding) params."""
    from fp8_optim.dtensor import shard_layout

    _, _, got = runs
    layouts = [shard_layout(s, WORLD, 128) for s in OPT_SHAPES]
    assert set(layouts) == {"rows", "flat", "full"}  # every path is exercised
    for dtype in (torch.float32, torch.bfloat16):
        params = opt_params(dtype)
        opt = coat_adamw(params)
        for step in range(4):
            for p, g in zip(params, opt_grads(step), strict=True):
                p.grad = g.to(dtype)
            opt.step()
        sharded = got["opt"][str(dtype)]
        want = full_states(opt)
        for i, p in enumerate(params):
            assert torch.equal(bits(sharded["params"][i]), bits(p)), OPT_SHAPES[i]
            assert sharded["states"][i].keys() == want[i].keys()
            for key, value in want[i].items():
                assert torch.equal(bits(sharded["states"][i][key]), bits(value)), (
                    OPT_SHAPES[i],
                    key,
                )
    # bf16 run: its export to torch AdamW (dequantized fp32 moments) is the unsharded one's
    want = opt.to_adamw_state_dict()["state"]
    for i in range(len(params)):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["opt"]["adamw"][i][key], want[i][key]), (OPT_SHAPES[i], key)


@pytest.mark.slow
def test_fsdp_gradients_match_single_process(runs):
    """COAT Llama under fully_shard (bf16 policy, activation checkpointing): the first
    step's reduced gradients against the single-process emulation."""
    _, ref, got = runs
    for name, g in ref["fsdp_grads"].items():
        diff = (got["fsdp_grads"][name] - g).norm() / g.norm()
        assert diff <= GRAD_RTOL, (name, diff.item())
    assert got["fsdp_chunk_cats"] == 0  # the gradients took coat_models' copy-in


@pytest.mark.slow
def test_fsdp_bf16_policy_gradients_as_close_to_fp32_as_autocast(runs):
    """FSDP2's bf16 policy (bf16 parameters) is not the single-GPU recipe (bf16 autocast
    over fp32 parameters): against plain fp32 gradients of the unconverted model, the
    2-rank COAT gradients are within 1.25x the error of single-process COAT + autocast
    (max relative error over parameters about 0.116 vs 0.111; COAT's FP8 noise
    dominates both)."""
    _, _, got = runs

    def grads(model, autocast: bool) -> dict[str, torch.Tensor]:
        for rank in range(WORLD):
            ids = batch(1, rank)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad / WORLD for n, p in model.named_parameters()}

    def error(g: dict, ref: dict) -> float:
        return max(((g[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref)

    fp32 = grads(tiny_llama(coat=False), autocast=False)
    autocast = grads(tiny_llama(), autocast=True)
    assert error(got["fsdp_grads"], fp32) <= 1.25 * error(autocast, fp32)


@pytest.mark.slow
def test_fsdp_losses_match_single_process(runs):
    _, ref, got = runs
    torch.testing.assert_close(got["fsdp_losses"], ref["fsdp_losses"], rtol=LOSS_RTOL, atol=0)


@pytest.mark.slow
def test_ddp_losses_match_single_process(runs):
    _, ref, got = runs
    torch.testing.assert_close(got["ddp_losses"], ref["ddp_losses"], rtol=LOSS_RTOL, atol=0)


@pytest.mark.slow
def test_compiled_layers_under_fsdp_and_ddp_keep_eager_bits(runs):
    """compile_layers before FSDP2 (with activation checkpointing) and before DDP: the same
    losses (and FSDP's first reduced gradients) as the eager runs on the same ranks, bit for
    bit, one graph for every layer of a run, no break."""
    _, _, got = runs
    assert got["fsdp_compiled_losses"] == got["fsdp_losses"]
    assert got["ddp_compiled_losses"] == got["ddp_losses"]
    for name, g in got["fsdp_grads"].items():
        assert torch.equal(got["fsdp_compiled_grads"][name], g), name
    assert got["fsdp_compiled_graphs"] == got["ddp_compiled_graphs"] == (1, {})


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_planned_layers_on_two_ranks_keep_eager_bits(runs, strategy):
    """Launch plans under FSDP2 (each rank gathers the other's shards into fresh storage
    before every forward and backward) and DDP (gradients all-reduced by hooks while the
    backward runs): the losses and the reduced gradients of every step equal those of eager
    layers under the same wrapper on the same ranks, bit for bit, and every training step of
    every layer replayed."""
    _, _, got = runs
    planned, eager = got[f"{strategy}_planned"], got[f"{strategy}_unplanned"]
    assert planned["losses"] == eager["losses"]
    for step, (a, b) in enumerate(zip(planned["grads"], eager["grads"], strict=True)):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), (step, name)
    layers = 2  # coat_models.testing.tiny_llama
    assert planned["counts"] == (STEPS * layers, 0, [])


@pytest.mark.slow
def test_checkpoint_1_to_2_ranks_is_bit_identical_and_resumes(runs):
    """Saved by one process, loaded by FSDP2 on 2 ranks: every parameter and FP8 state
    equal to the bit; the 2 ranks then continue with the uninterrupted run's losses."""
    _, ref, got = runs
    loaded = got["from_single"]
    assert loaded["extra"] == {"step": SAVE_AT}
    assert loaded["states"].keys() == ref["single_states"].keys()
    for key, value in ref["single_states"].items():
        assert torch.equal(bits(loaded["states"][key]), bits(value)), key
    for name, value in ref["single_params"].items():
        assert torch.equal(loaded["params"][name], value), name
    torch.testing.assert_close(
        loaded["losses"], ref["fsdp_losses"][SAVE_AT:], rtol=LOSS_RTOL, atol=0
    )


@pytest.mark.slow
def test_checkpoint_2_to_1_rank_is_bit_identical_and_resumes(runs):
    """Saved by FSDP2 on 2 ranks, loaded here in one plain process: bit-identical, and the
    single process continues with the 2-rank run's losses."""
    from coat_models.distributed import load_checkpoint

    out, _, got = runs
    run = EmulatedFSDP(seed=7)  # other weights: everything must come from the checkpoint
    assert load_checkpoint(out / "fsdp_ckpt", run.master, run.opt) == {"step": SAVE_AT}
    states = states_by_name(run.opt, run.master)
    assert states.keys() == got["fsdp_saved"]["states"].keys()
    for key, value in got["fsdp_saved"]["states"].items():
        assert torch.equal(bits(states[key]), bits(value)), key
    for name, p in run.master.named_parameters():
        assert torch.equal(p.detach(), got["fsdp_saved"]["params"][name]), name
    losses = [run.step(step) for step in range(SAVE_AT + 1, STEPS + 1)]
    torch.testing.assert_close(losses, got["fsdp_losses"][SAVE_AT:], rtol=LOSS_RTOL, atol=0)


@pytest.mark.slow
def test_ddp_checkpoint_loads_in_one_process(runs):
    from coat_models.distributed import load_checkpoint

    out, _, got = runs
    run = EmulatedDDP(seed=7)
    load_checkpoint(out / "ddp_ckpt", run.model, run.opt)
    states = states_by_name(run.opt, run.model)
    for key, value in got["ddp_saved"]["states"].items():
        assert torch.equal(bits(states[key]), bits(value)), key
    losses = [run.step(step) for step in range(SAVE_AT + 1, STEPS + 1)]
    torch.testing.assert_close(losses, got["ddp_losses"][SAVE_AT:], rtol=LOSS_RTOL, atol=0)


@pytest.mark.slow
def test_parameters_without_gradient_on_a_rank(runs):
    """``extra`` gets no gradient on rank 1 (FSDP2 reduces zeros for it), ``never`` none on
    any rank (skipped, no state), ``head`` is an empty shard on rank 1: same parameters and
    states as one process, and a checkpoint of it loads in one process."""
    from coat_models.distributed import load_checkpoint

    out, ref, got = runs
    net, opt = ref["net"]
    names = dict(net.named_parameters())
    assert got["net"]["local_rows"]["head.weight"] == [1, 0]
    for name, p in names.items():
        assert torch.equal(got["net"]["params"][name], p.detach()), name
    want = states_by_name(opt, net)
    assert not any(k.startswith("never.") for k in want)
    assert got["net"]["states"].keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(bits(got["net"]["states"][key]), bits(value)), key
    fresh = Net()
    fresh_opt = coat_adamw(fresh.parameters())
    load_checkpoint(out / "net_ckpt", fresh, fresh_opt)
    assert fresh_opt.state.get(fresh.never.lin.weight, {}) == {}  # no state, as when saved
    loaded = states_by_name(fresh_opt, fresh)
    for key, value in want.items():
        assert torch.equal(bits(loaded[key]), bits(value)), key


@pytest.mark.slow
def test_weights_alone_load_from_a_checkpoint_with_optimizer_state(runs):
    """``load_checkpoint(path, model)`` without an optimizer loads the weights of a checkpoint
    that holds optimizer state too, the same as with one (every ``optim.*`` key was reported
    as a mismatch: a 2-rank coat-train checkpoint could not seed a new run)."""
    from coat_models.distributed import load_checkpoint

    out, _, _ = runs
    alone, both = tiny_llama(seed=1), tiny_llama(seed=2)  # (weights unlike the checkpoint's)
    load_checkpoint(out / "fsdp_ckpt", alone)
    load_checkpoint(out / "fsdp_ckpt", both, llama_optimizer(both))
    for (name, p), q in zip(alone.named_parameters(), both.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.slow
@pytest.mark.slow
def test_ranks_given_different_checkpoint_paths_all_refuse_and_stay_in_step(runs):
    """Rank 0 and rank 1 given two valid checkpoints loaded a silent mix of their shards; a
    path missing on one rank raised there before the collective check, leaving the other
    rank in it (gloo: 'Connection closed by peer'; a caller that went on paired it with its
    next collective)."""
    _, _, got = runs
    rank0, rank1 = got["wrong_paths"]
    for said in (rank0, rank1):
        assert said["different"].startswith("CheckpointError: the ranks were given different ")
        assert "rank 0: " in said["different"] and "single_ckpt" in said["different"]
        assert "rank 1: " in said["different"] and "fsdp_ckpt" in said["different"]
        assert said["untouched"]
    assert rank1["missing"].startswith("FileNotFoundError: ") and "no_such_ckpt" in rank1["missing"]
    assert rank0["missing"].startswith("CheckpointError: ") and "no_such_ckpt" in rank0["missing"]


def test_mismatched_checkpoint_gives_a_clear_error(runs):
    from coat_models.distributed import CheckpointMismatchError, load_checkpoint

    out, _, got = runs
    # On 2 ranks: both raise (no hang) and name the offending tensor.
    for message in got["mismatch"]:
        assert "mlp.up_proj.weight: checkpoint has (176, 64)" in message
    other = tiny_llama(intermediate_size=192)
    with pytest.raises(CheckpointMismatchError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        load_checkpoint(out / "fsdp_ckpt", other, llama_optimizer(other))
    model = tiny_llama()
    with pytest.raises(CheckpointMismatchError, match=r"exp_avg_amax: checkpoint has \(\d+,?\d*\)"):
        load_checkpoint(out / "fsdp_ckpt", model, llama_optimizer(model, group_size=64))
    with pytest.raises(CheckpointMismatchError, match="float8_e4m3fn"):
        load_checkpoint(out / "fsdp_ckpt", model, llama_optimizer(model, v_format="e5m2"))
    adamw = torch.optim.AdamW(model.parameters())  # fp32 states, no per-group numbers
    with pytest.raises(CheckpointMismatchError, match=r"exp_avg: missing from the checkpoint"):
        load_checkpoint(out / "fsdp_ckpt", model, adamw)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(out / "nowhere", model)


def test_shard_layout():
    from fp8_optim.dtensor import shard_layout

    assert shard_layout((4096, 4096), 8, 128) == "rows"  # Llama matrices: always rows
    assert shard_layout((11008, 4096), 3, 128) == "rows"
    assert shard_layout((4096,), 2, 128) == "flat"  # norm weight: 2048-element shards
    assert shard_layout((4096,), 64, 128) == "full"  # 64-element shards cut groups
    assert shard_layout((4096,), 3, 128) == "full"  # 1366 is not a multiple of 128
    assert shard_layout((256, 64), 2, 128) == "flat"
    assert shard_layout((5, 64), 2, 128) == "full"  # rank 1 would start at element 192


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gradient_copy_in_is_torchs_bit_for_bit(world, monkeypatch):
    """FSDP2's copy-in replaced by one copy per gradient (bf16 -> fp32, as under the bf16
    policy): the same rows as torch's ``_chunk_cat``; a dim 0 that does not split evenly
    (5 rows over 2 or 4 ranks, which torch pads) goes to torch's own function."""
    from coat_models.distributed import _copy_in_per_gradient, _install_grad_copy_in
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    monkeypatch.delenv("COAT_FSDP_COPY_IN", raising=False)  # the opt-out
    _install_grad_copy_in()  # what shard_model does; a second call changes nothing
    _install_grad_copy_in()
    installed = collectives.foreach_reduce_scatter_copy_in
    assert installed.func is _copy_in_per_gradient
    torch_copy_in = installed.args[0]
    g = torch.Generator().manual_seed(world)
    for shapes in ([(64, 48), (48,), (96, 64)], [(64, 48), (5, 8)]):
        grads = [torch.randn(s, generator=g).bfloat16() for s in shapes]
        grads[0] = grads[0].t().contiguous().t()  # a non-contiguous gradient
        padded = sum(-(-s[0] // world) * world * (s[1] if len(s) > 1 else 1) for s in shapes)
        want = torch.full((padded,), float("nan"))
        got = want.clone()
        torch_copy_in(grads, want, world)
        installed(grads, got, world)
        assert torch.equal(got, want)


def test_bad_copy_in_choice_is_named(monkeypatch):
    from coat_models.distributed import _install_grad_copy_in
    from coat_models.train import cli

    monkeypatch.setenv("COAT_FSDP_COPY_IN", "off")
    with pytest.raises(ValueError, match="COAT_FSDP_COPY_IN must be 'coat' or 'torch', got 'off'"):
        _install_grad_copy_in()
    torchrun = {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    for key, value in torchrun.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(cli.UsageError, match="got 'off' \\(or unset it\\)"):
        cli._strategy(cli.build_parser().parse_args(["--fsdp"]))


def test_needs_a_process_group():
    import coat_models
    from coat_models.distributed import prepare_data_parallel, shard_model, wrap_ddp

    model = tiny_llama(coat=False)
    with pytest.raises(RuntimeError, match="prepare_data_parallel needs torch.distributed"):
        prepare_data_parallel(model, "ddp", fp8_activations=True, fp8_optimizer=True, lr=1e-3)
    assert not coat_models.is_coat(model)  # refused before it was converted

    with pytest.raises(RuntimeError, match="init_distributed"):
        shard_model(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="init_distributed"):
        wrap_ddp(nn.Linear(2, 2))


def test_a_local_rank_without_a_gpu_is_refused_with_the_remedy(monkeypatch):
    """torchrun with more processes than GPUs: one line naming the count to launch, before
    any process group or CUDA call (CUDA's own error says "invalid device ordinal")."""
    from coat_models.distributed import LaunchError, init_distributed

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device called"))
    with pytest.raises(LaunchError, match=r"local rank 1 has no GPU: .* --nproc-per-node 1\)"):
        init_distributed()


# ------------------------------------------------------------------- the 2-process side
def _worker(out: Path) -> None:
    import torch.distributed as dist
    from coat_models.distributed import (
        CheckpointMismatchError,
        init_distributed,
        load_checkpoint,
        prepare_data_parallel,
        save_checkpoint,
        shard_model,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    init_distributed()
    torch.set_num_threads(1)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    res: dict = {}

    def full_params(model):
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}

    def mean_loss(loss) -> float:
        # Average in Python as the single-process side does (an fp32 all_reduce rounds).
        losses = [None] * WORLD
        dist.all_gather_object(losses, loss.item())
        return sum(losses) / WORLD

    # 1. CoatAdamW on the shards of awkward shapes, synthetic gradients.
    res["opt"] = {}
    for dtype in (torch.float32, torch.bfloat16):
        params = [nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])) for p in opt_params(dtype)]
        opt = coat_adamw(params)
        for step in range(4):
            for p, g in zip(params, opt_grads(step), strict=True):
                p.grad = distribute_tensor(g.to(dtype), mesh, [Shard(0)])
            opt.step()
        res["opt"][str(dtype)] = {
            "params": [p.full_tensor() for p in params], "states": full_states(opt),
        }  # fmt: skip
    # ... and its moments exported to torch AdamW (DTensor fp32 moments), which trains on.
    exported = opt.to_adamw_state_dict()
    res["opt"]["adamw"] = {
        i: {k: v.full_tensor() for k, v in state.items() if k != "step"}
        for i, state in exported["state"].items()
    }
    adamw = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
    adamw.load_state_dict(exported)
    for p, g in zip(params, opt_grads(4), strict=True):
        p.grad = distribute_tensor(g.to(p.dtype), mesh, [Shard(0)])
    adamw.step()

    # 2. COAT Llama under FSDP2 (bf16 policy, activation checkpointing), CoatAdamW shards.
    # torch._chunk_cat counted: torch's gradient copy-in calls it, coat_models' does not.
    chunk_cats, torch_chunk_cat = [], torch._chunk_cat
    torch._chunk_cat = lambda *a, **k: chunk_cats.append(1) or torch_chunk_cat(*a, **k)
    model, opt = prepare_data_parallel(
        tiny_llama(coat=False), "fsdp", fp8_activations=True, fp8_optimizer=True, lr=LR,
        activation_checkpointing=True,
    )  # fmt: skip
    losses = []
    for step in range(1, STEPS + 1):
        ids = batch(step, rank)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 1:
            res["fsdp_grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(mean_loss(loss))
        if step == SAVE_AT:
            save_checkpoint(out / "fsdp_ckpt", model, opt, extra={"step": step})
            res["fsdp_saved"] = {"states": states_by_name(opt, model), "params": full_params(model)}
    res["fsdp_losses"] = losses
    torch._chunk_cat = torch_chunk_cat
    res["fsdp_chunk_cats"] = len(chunk_cats)

    # 3. The single-process checkpoint loaded on 2 ranks, then 2 more steps.
    model, opt = prepare_data_parallel(
        tiny_llama(seed=7, coat=False), "fsdp", fp8_activations=True, fp8_optimizer=True,
        lr=LR, activation_checkpointing=True,
    )  # fmt: skip
    extra = load_checkpoint(out / "single_ckpt", model, opt)
    res["from_single"] = {"extra": extra, "states": states_by_name(opt, model),
                          "params": full_params(model), "losses": []}  # fmt: skip
    for step in range(SAVE_AT + 1, STEPS + 1):
        ids = batch(step, rank)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        res["from_single"]["losses"].append(mean_loss(loss))

    # 4. A checkpoint of another model size: every rank raises, nobody hangs.
    model = shard_model(tiny_llama(intermediate_size=192))
    opt = llama_optimizer(model)
    try:
        load_checkpoint(out / "single_ckpt", model, opt)
        message = "no error"
    except CheckpointMismatchError as e:
        message = str(e)
    messages = [None] * WORLD
    dist.all_gather_object(messages, message)
    res["mismatch"] = messages

    # 4b. Ranks given different checkpoints, or a path that is there on one rank only: every
    # rank raises (they loaded a mix of shards, or one rank left the others in a collective),
    # nothing is loaded, and the ranks stay in step (the sections below run).
    from coat_models.checkpoint import CheckpointError

    model = shard_model(tiny_llama(seed=5))
    opt = llama_optimizer(model)
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}
    said = {}
    for case, other in (("different", "fsdp_ckpt"), ("missing", "no_such_ckpt")):
        try:
            load_checkpoint(out / ("single_ckpt" if rank == 0 else other), model, opt)
            said[case] = "no error"
        except (CheckpointError, FileNotFoundError) as e:
            said[case] = f"{type(e).__name__}: {e}"
    said["untouched"] = (
        all(torch.equal(p.to_local(), before[n]) for n, p in model.named_parameters())
        and not opt.state
    )
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, said)
    res["wrong_paths"] = gathered

    # 5. COAT Llama under DDP with bf16 autocast; CoatAdamW unchanged.
    ddp, opt = prepare_data_parallel(
        tiny_llama(coat=False), "ddp", fp8_activations=True, fp8_optimizer=True, lr=LR
    )
    losses = []
    for step in range(1, STEPS + 1):
        ids = batch(step, rank)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(mean_loss(loss))
        if step == SAVE_AT:
            save_checkpoint(out / "ddp_ckpt", ddp, opt)
            res["ddp_saved"] = {"states": states_by_name(opt, ddp.module)}
    res["ddp_losses"] = losses

    # 6. Parameters without gradient on a rank (see Net), fp32 FSDP2.
    net = Net()
    shard_model(net, mp_policy=None, reduce_scatter_unused_params=True)
    rows = {n: p.to_local().shape[0] for n, p in net.named_parameters()}
    all_rows = [None] * WORLD
    dist.all_gather_object(all_rows, rows)
    opt = coat_adamw(net.parameters())
    for step in range(1, SAVE_AT + 1):
        net(net_input(step, rank), use_extra=rank == 0).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    save_checkpoint(out / "net_ckpt", net, opt)
    res["net"] = {
        "params": full_params(net), "states": states_by_name(opt, net),
        "local_rows": {n: [r[n] for r in all_rows] for n in rows},
    }  # fmt: skip

    # 7. Sections 2 and 5 with each decoder layer compiled first (compile_layers, aot_eager:
    # the traced ops as they are), as coat-train --compile does before sharding / wrapping.
    from coat_models import apply_coat, compile_layers

    counters = torch._dynamo.utils.counters
    for strategy in ("fsdp", "ddp"):
        torch._dynamo.reset()
        counters.clear()
        model = compile_layers(apply_coat(tiny_llama(coat=False)), backend="aot_eager")
        model, opt = prepare_data_parallel(
            model, strategy, fp8_activations=False, fp8_optimizer=True, lr=LR,
            activation_checkpointing=strategy == "fsdp",
        )  # fmt: skip
        losses = []
        for step in range(1, STEPS + 1):
            ids = batch(step, rank)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=strategy == "ddp"):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if step == 1 and strategy == "fsdp":
                grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
                res["fsdp_compiled_grads"] = grads
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(mean_loss(loss))
        res[f"{strategy}_compiled_losses"] = losses
        res[f"{strategy}_compiled_graphs"] = (
            counters["stats"]["unique_graphs"], dict(counters["graph_break"])
        )  # fmt: skip

    # 8. Launch plans on the decoder layers (weight cache off), under FSDP2 and under DDP:
    # each planned run against an eager run under the same wrapper on the same ranks.
    from coat_models.plans import (
        enable_launch_plans,
        launch_plan_eager_steps,
        launch_plan_refusals,
        launch_plan_replays,
    )
    from fp8_activations import FP8ActivationConfig

    # (COAT's plain-PyTorch kernels: in Triton's interpreter these 16 layer steps per rank
    # take minutes; test_plans replays the Triton kernels under FSDP2 and DDP on one rank)
    config = FP8ActivationConfig(weight_cache=False, backend="reference")
    for strategy in ("fsdp", "ddp"):
        for planned in (False, True):
            model = apply_coat(tiny_llama(coat=False), config=config)
            if planned:
                enable_launch_plans(model)
            model, opt = prepare_data_parallel(
                model, strategy, fp8_activations=False, fp8_optimizer=True, lr=LR
            )
            losses, grads = [], []
            for step in range(1, STEPS + 1):
                ids = batch(step, rank)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=strategy == "ddp"):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                grads.append({n: getattr(p.grad, "full_tensor", p.grad.clone)()
                              for n, p in model.named_parameters()})  # fmt: skip
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(mean_loss(loss))
            name = f"{strategy}_{'planned' if planned else 'unplanned'}"
            res[name] = {"losses": losses, "grads": grads}
            if planned:
                res[name]["counts"] = (
                    launch_plan_replays(model), launch_plan_eager_steps(model),
                    launch_plan_refusals(model),
                )  # fmt: skip

    if rank == 0:
        torch.save(res, out / "results.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))


@pytest.mark.parametrize(
    "how",
    ["apply_coat-after-shard_model", "fully_shard-after-apply_coat", "root-only", "stack-only",
     pytest.param("compiled", marks=pytest.mark.slow)],
)  # fmt: skip
def test_a_model_sharded_otherwise_than_by_shard_model_trains_without_the_weight_cache(
    how, tmp_path
):
    """FSDP all-gathers into the weights' storage without bumping their versions: a COAT
    layer that kept its FP8 weight cache trained on the previous step's weights (the losses
    left the reference's after 2-3 steps). ``apply_coat`` on a sharded model, a layer
    sharded by ``fully_shard`` itself, and one held by a module that ``fully_shard`` shards
    (the model alone, its decoder stack alone) train without it: the reference's bits. So does
    ``torch.compile`` of a model sharded so (Dynamo failed tracing the cache's switch-off)."""
    import torch.distributed as dist
    from coat_models import apply_coat, create_optimizer
    from coat_models.distributed import shard_model
    from fp8_activations import FP8ActivationConfig
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        plain = tiny_llama(coat=False)
        ref = apply_coat(plain, config=FP8ActivationConfig(weight_cache=False))
        shard_model(ref, mp_policy="fp32")
        if how == "apply_coat-after-shard_model":
            model = tiny_llama()  # converted
            shard_model(model, mp_policy="fp32")  # (turns its cache off)
            apply_coat(model)  # again, with the default config: the cache on
        elif how in ("fully_shard-after-apply_coat", "compiled"):
            model = tiny_llama()
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            if how == "compiled":
                torch._dynamo.reset()
                model = torch.compile(model, backend="aot_eager")
        else:  # one FSDP unit above the layers: the model's root, or its decoder stack
            model = tiny_llama()
            fully_shard(model if how == "root-only" else model.model)
        optimizers = [create_optimizer(m, lr=1e-2) for m in (ref, model)]
        for step in range(4):
            ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(step))
            losses = []
            for m, opt in zip((ref, model), optimizers, strict=True):
                loss = m(ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
            assert torch.equal(losses[0], losses[1]), (step, losses)
        layers = getattr(model, "_orig_mod", model).model.layers
        assert all(not layer.coat_config.weight_cache for layer in layers)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("how", ["shard_model", "fully_shard-after-apply_coat"])
def test_a_sharded_vision_language_model_trains_without_any_weight_cache(how, tmp_path):
    """A LLaVA model's projector and vision tower are fp8_activations modules with FP8 weight
    caches of their own: sharded, they trained on the previous step's FP8 weights (shard_model
    turned off only the decoder layers' caches; helper-131's probe). Every part trains without
    a cache: the bits of a model converted with weight_cache=False."""
    import torch.distributed as dist
    from coat_models.distributed import shard_model
    from coat_models.train.vl_data import ShapesCaptions
    from coat_models.vila import apply_coat_vlm, llava_tiny_config, num_image_tokens
    from fp8_activations import FP8ActivationConfig
    from torch.distributed.fsdp import fully_shard
    from transformers import LlavaForConditionalGeneration

    config = llava_tiny_config()
    task = ShapesCaptions(32, num_image_tokens(config), config.image_token_id, seed=1)

    def llava(cache_config):
        torch.manual_seed(0)
        model = LlavaForConditionalGeneration(config).train()
        return apply_coat_vlm(model, config=cache_config, vision=True)

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        ref = llava(FP8ActivationConfig(weight_cache=False))
        shard_model(ref, mp_policy="fp32")
        model = llava(None)
        if how == "shard_model":
            shard_model(model, mp_policy="fp32")
        else:
            for layer in model.model.language_model.layers:
                fully_shard(layer)
            fully_shard(model)
        optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
        for step in range(6):
            batch = task.batch(step, 4)
            losses = []
            for m, opt in zip((ref, model), optimizers, strict=True):
                loss = m(**batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
            assert torch.equal(losses[0], losses[1]), (step, losses)
        configs = [
            c for mod in model.modules() for c in (getattr(mod, "coat_config", None),
                                                   getattr(mod, "config", None))
            if isinstance(c, FP8ActivationConfig)
        ]  # fmt: skip
        assert len(configs) > 10 and not any(c.weight_cache for c in configs)
    finally:
        dist.destroy_process_group()


def test_apply_coat_and_revert_coat_refuse_a_llava_model_fsdp_shards(tmp_path):
    """apply_coat after fully_shard (or again after shard_model) gave the projector and
    tower FP8 modules that FSDP does not manage, and revert_coat plain ones: the first
    forward failed with "mixed torch.Tensor and DTensor" (helper-131's probe). Refused, the
    model as it was; converted before sharding it trains."""
    import torch.distributed as dist
    from coat_models import apply_coat, is_coat, revert_coat
    from coat_models.distributed import shard_model
    from coat_models.train.vl_data import ShapesCaptions
    from coat_models.vila import apply_coat_vlm, llava_tiny_config, num_image_tokens
    from torch.distributed.fsdp import fully_shard
    from transformers import LlavaForConditionalGeneration

    config = llava_tiny_config()
    batch = ShapesCaptions(32, num_image_tokens(config), config.image_token_id, seed=1).batch(0, 2)
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        plain = LlavaForConditionalGeneration(config).train()
        for layer in plain.model.language_model.layers:
            fully_shard(layer)
        fully_shard(plain)
        modules = list(plain.modules())
        what = "FSDPLlavaForConditionalGeneration is sharded by FSDP, and its multi modal"
        with pytest.raises(ValueError, match=f"apply_coat: {what} projector would get modules"):
            apply_coat(plain)
        assert list(plain.modules()) == modules and not is_coat(plain)
        model = apply_coat_vlm(LlavaForConditionalGeneration(config).train(), vision=True)
        shard_model(model, mp_policy="fp32")
        modules = list(model.modules())
        match = "multi modal projector and vision tower would get modules that FSDP does not"
        for call in (apply_coat, revert_coat):
            with pytest.raises(ValueError, match=f"{call.__name__}: .* {match}"):
                call(model)
            assert list(model.modules()) == modules and is_coat(model)
        model(**batch).loss.backward()
        # a Llama's layers change class in place: revert_coat of a sharded one works, and
        # leaves the FP8 module the user made (its lm_head) as it is (helper-134's review)
        from fp8_activations import convert_to_fp8_activations

        llama = tiny_llama(coat=False)
        convert_to_fp8_activations(llama, module_filter_fn=lambda m, fqn: fqn == "lm_head")
        apply_coat(llama)
        for layer in llama.model.layers:
            fully_shard(layer)
        fully_shard(llama)
        revert_coat(llama)
        assert not is_coat(llama) and type(llama.lm_head).__name__ == "FP8Linear"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("scheduler_at", ["save", "load"])
def test_an_lr_scheduler_on_one_side_of_a_checkpoint_is_no_mismatch(scheduler_at, tmp_path):
    """A scheduler adds initial_lr to the param groups: a checkpoint saved with one loaded
    without (or the reverse) was refused as another model/optimizer. The state loads exactly;
    this optimizer keeps its own initial_lr."""
    from coat_models import create_optimizer
    from coat_models.distributed import load_checkpoint, save_checkpoint

    model = tiny_llama()
    opt = create_optimizer(model, lr=1e-3)
    ids = batch(0, 0)
    model(ids, labels=ids).loss.backward()
    opt.step()
    if scheduler_at == "save":
        torch.optim.lr_scheduler.LinearLR(opt)
    save_checkpoint(tmp_path / "ckpt", model, opt)
    other = tiny_llama(seed=1)
    other_opt = create_optimizer(other, lr=1e-3)
    if scheduler_at == "load":
        torch.optim.lr_scheduler.LinearLR(other_opt)
    load_checkpoint(tmp_path / "ckpt", other, other_opt)
    for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    saved, loaded = opt.state_dict(), other_opt.state_dict()
    for a, b in zip(saved["state"].values(), loaded["state"].values(), strict=True):
        assert a.keys() == b.keys()
        for name in a:
            x, y = a[name], b[name]
            if x.dtype.itemsize == 1:  # FP8 codes: compared as bytes
                x, y = x.view(torch.uint8), y.view(torch.uint8)
            assert torch.equal(x, y), name
    for g, h in zip(saved["param_groups"], loaded["param_groups"], strict=True):
        assert g["lr"] == h["lr"]
        assert ("initial_lr" in h) == (scheduler_at == "load")


def _train(model, opt, steps):
    losses = []
    for step in range(steps):
        ids = batch(step, 0)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.parametrize("optimizer", ["coat", "torch"])
def test_a_checkpoint_before_the_first_step_changes_nothing(optimizer, tmp_path):
    """torch's get_state_dict gives an optimizer without state one by stepping it with lr 0:
    every step count became 1, so a save before the first step changed the run's updates
    (bias correction), a load of that checkpoint did not give a fresh optimizer (torch
    AdamW's raised a TypeError), and a refused load left the state behind."""
    from coat_models import create_optimizer
    from coat_models.distributed import (
        CheckpointMismatchError,
        load_checkpoint,
        save_checkpoint,
    )

    def make(seed=0):
        model = tiny_llama(seed=seed)
        if optimizer == "coat":
            return model, create_optimizer(model, lr=1e-3)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    plain, plain_opt = make()
    want = _train(plain, plain_opt, 3)
    saved, saved_opt = make()
    save_checkpoint(tmp_path / "step0", saved, saved_opt)
    assert not saved_opt.state
    assert torch.equal(_train(saved, saved_opt, 3), want)
    loaded, loaded_opt = make(seed=1)
    load_checkpoint(tmp_path / "step0", loaded, loaded_opt)
    assert not loaded_opt.state
    assert torch.equal(_train(loaded, loaded_opt, 3), want)
    other = tiny_llama(seed=0, hidden_size=48)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    with pytest.raises(CheckpointMismatchError):
        load_checkpoint(tmp_path / "step0", other, other_opt)
    assert not other_opt.state


def test_an_optimizer_of_another_model_is_named(tmp_path):
    """save_checkpoint / load_checkpoint with an optimizer built over another model's
    parameters raised torch's bare KeyError: '0'."""
    from coat_models import create_optimizer
    from coat_models.distributed import load_checkpoint, save_checkpoint

    model, other = tiny_llama(), tiny_llama(seed=1)
    save_checkpoint(tmp_path / "ckpt", model, create_optimizer(model, lr=1e-3))
    wrong = create_optimizer(other, lr=1e-3)
    for call in (save_checkpoint, load_checkpoint):
        with pytest.raises(ValueError, match="the optimizer holds parameters that are not the"):
            call(tmp_path / "ckpt", model, wrong)
