"""Multi-GPU COAT: FSDP2 / DDP wrapping, FP8 optimizer states on DTensor shards, DCP checkpoints.

Run one process per GPU under ``torchrun --nproc-per-node N``::

    from coat_models import apply_coat, create_optimizer
    from coat_models.distributed import init_distributed, shard_model

    init_distributed()                      # reads torchrun's env; nccl on GPUs, gloo on CPU
    apply_coat(model)                       # before sharding: COAT swaps layer classes
    shard_model(model)                      # FSDP2: fully_shard per decoder layer, then root
    optimizer = create_optimizer(model, lr=3e-4)  # CoatAdamW updates each rank's shards
    ...
    save_checkpoint("ckpt/step100", model, optimizer, extra={"step": 100})
    extra = load_checkpoint("ckpt/step100", model, optimizer)   # any number of ranks

A checkpoint directory carries a manifest with the SHA-256 of every file
(``coat_models.checkpoint``); loading checks it before reading anything, and DCP's pickled
``.metadata`` is read by an unpickler that builds only DCP's own metadata classes.

The multi-GPU section of coat-models' README says what is supported; why CoatAdamW's FP8
states do not depend on the number of ranks is in ``fp8_optim.dtensor``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import pickle
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint

__all__ = [
    "IMPLEMENTATION_KEYS",
    "STRATEGIES",
    "CheckpointMismatchError",
    "LaunchError",
    "all_ranks_max",
    "all_ranks_mean",
    "as_float",
    "decoder_layers",
    "enable_activation_checkpointing",
    "grad_copy_in_choice",
    "init_distributed",
    "load_checkpoint",
    "prepare_data_parallel",
    "read_checkpoint_extra",
    "run_on_rank0",
    "save_checkpoint",
    "shard_model",
    "verify_checkpoint",
    "wrap_ddp",
]


# --------------------------------------------------------------------------- process group
class LaunchError(RuntimeError):
    """torchrun's launch does not fit this host (more processes per node than GPUs)."""


def init_distributed(timeout: timedelta | None = None) -> torch.device:
    """Join the process group ``torchrun`` describes and return this rank's device.

    NCCL and ``cuda:LOCAL_RANK`` where CUDA is available, gloo and CPU otherwise. ``timeout``:
    how long a collective may wait before the job fails (torch's default: 10 minutes).
    Calling it again (or after your own ``init_process_group``) only returns the device.
    """
    if not dist.is_initialized() and "RANK" not in os.environ:
        raise RuntimeError(
            "init_distributed() needs the environment torchrun sets (RANK, WORLD_SIZE, "
            "MASTER_ADDR, ...): launch with `torchrun --nproc-per-node N ...`"
        )
    if torch.cuda.is_available():
        local, count = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
        if local >= count:
            raise LaunchError(
                f"local rank {local} has no GPU: this host has {count} visible; launch at most "
                f"{count} processes per node (torchrun --nproc-per-node {count}), or train on "
                "the CPU with CUDA_VISIBLE_DEVICES="
            )
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        kw = {} if timeout is None else {"timeout": timeout}
        if device.type == "cuda":
            # Bound to this rank's GPU: NCCL otherwise guesses it from the rank, and every
            # barrier() warns that it does.
            kw["device_id"] = device
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **kw)
    return device


def _require_process_group(what: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs torch.distributed: call coat_models.distributed.init_distributed() "
            "(or torch.distributed.init_process_group) first, under torchrun"
        )


# ------------------------------------------------------------------------- model wrapping
def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a Hugging Face model: the modules whose class is in
    ``model._no_split_modules`` (``LlamaDecoderLayer`` for Llama), in order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if m is not model and _class_names(m) & names]
    if not layers:
        raise ValueError(
            f"found no decoder layers in {type(model).__name__}: expected a Hugging Face model "
            "whose _no_split_modules names its decoder layer class (LlamaForCausalLM, ...)"
        )
    return layers


def _class_names(module: nn.Module) -> set[str]:
    # apply_coat and fully_shard subclass the layer class; match the original name too.
    return {cls.__name__ for cls in type(module).__mro__}


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in backward (non-reentrant ``torch.utils.checkpoint``).

    Uses the model's own switch so that FSDP2's hooks stay outside the recomputed region.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ValueError(
            f"{type(model).__name__} has no activation_checkpointing_enable(): pass "
            "activation_checkpointing=False or checkpoint its layers yourself"
        )


def _mp_policy(mp_policy):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if isinstance(mp_policy, MixedPrecisionPolicy):
        return mp_policy
    if mp_policy in (None, "fp32"):
        return MixedPrecisionPolicy()
    if mp_policy == "bf16":
        # bf16 compute and all-gathers, fp32 gradient reduction: sums of many bf16
        # gradients would lose the low bits that AdamW's second moment needs.
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raise ValueError(
        f"mp_policy must be 'bf16', 'fp32', None or a MixedPrecisionPolicy, got {mp_policy!r}"
    )


def shard_model(
    model: nn.Module,
    mesh=None,
    *,
    mp_policy="bf16",
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
    reduce_scatter_unused_params: bool = False,
) -> nn.Module:
    """FSDP2: ``fully_shard`` every decoder layer, then the root; in place, returns ``model``.

    Parameters become ``DTensor`` s sharded on dim 0 over ``mesh`` (default: all ranks, on
    ``cuda`` where available, else ``cpu`` with gloo). ``mp_policy``: ``"bf16"`` (bf16 compute,
    fp32 gradient reduce-scatter; master weights keep their dtype), ``"fp32"``/``None`` or a
    ``MixedPrecisionPolicy``. ``reduce_scatter_unused_params=True`` lets ranks skip different
    parameters in forward (zeros are reduced for them; FSDP2 of torch 2.13 has it).

    Call ``apply_coat`` before this and build the optimizer after it, on the sharded
    parameters (``create_optimizer(model)``: CoatAdamW then updates each rank's shards).
    The first call also gives FSDP2 (process-wide) a cheaper gradient copy-in with the same
    bits (``_copy_in_per_gradient``).

    >>> shard_model(model, activation_checkpointing=True)
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _require_process_group("shard_model")
    if mesh is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    policy = _mp_policy(mp_policy)
    _install_grad_copy_in()
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    from .llama import weight_cache_off

    weight_cache_off(model)  # FSDP2 would leave FP8 weight caches stale
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if reduce_scatter_unused_params:
        if not hasattr(model, "set_reduce_scatter_unused_params"):
            raise RuntimeError(
                f"torch {torch.__version__} FSDP2 cannot reduce unused parameters: upgrade to "
                "torch >= 2.13, or make every rank use every parameter in forward"
            )
        model.set_reduce_scatter_unused_params(True)
    return model


def _copy_in_per_gradient(torch_copy_in, unsharded_grads, reduce_scatter_input, world_size):
    """FSDP2's gradient copy-in, one ``copy_`` per gradient: the same bits as torch's.

    Before each reduce-scatter FSDP2 lays a layer's gradients out as ``world_size`` rows,
    row ``w`` holding the ``w``-th dim-0 chunk of every gradient, cast to the reduce dtype
    (``torch._chunk_cat``). Its CUDA kernel builds host-side metadata of one integer per
    2 KiB of output and copies it to the device on every call: for a Llama-2-7B layer in
    fp32, hundreds of thousands of integers, milliseconds of host time per layer and
    micro-batch (the largest host item of an FSDP2 step, for bf16 and COAT alike), which a
    host-bound step (eager COAT) waits for. Here it is one ``copy_`` per gradient. When
    a gradient's dim 0 does not split evenly (torch pads it) torch's path runs."""
    if any(g.dim() == 0 or g.size(0) % world_size for g in unsharded_grads):
        torch_copy_in(unsharded_grads, reduce_scatter_input, world_size)
        return
    rows = reduce_scatter_input.view(world_size, -1)
    start = 0
    for grad in unsharded_grads:
        n = grad.numel() // world_size
        # Views on both sides: a non-contiguous gradient is read in place, not copied first.
        dst = rows[:, start : start + n].view(world_size, -1, *grad.shape[1:])
        dst.copy_(grad.unflatten(0, (world_size, -1)))
        start += n


def grad_copy_in_choice() -> str:
    """``COAT_FSDP_COPY_IN`` (default ``"coat"``): whose gradient copy-in FSDP2 uses under
    ``shard_model``. Raises ``ValueError`` for another value."""
    choice = os.environ.get("COAT_FSDP_COPY_IN", "coat")
    if choice not in ("coat", "torch"):
        raise ValueError(f"COAT_FSDP_COPY_IN must be 'coat' or 'torch', got {choice!r}")
    return choice


def _install_grad_copy_in() -> None:
    """Route FSDP2's gradient copy-in through ``_copy_in_per_gradient`` (process-wide, once),
    where torch's function has the signature it was written for (checked on torch
    2.11-2.13); elsewhere, and with ``COAT_FSDP_COPY_IN=torch`` in the environment, FSDP2
    keeps its own."""
    import inspect

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    if grad_copy_in_choice() == "torch":
        return

    torch_copy_in = getattr(collectives, "foreach_reduce_scatter_copy_in", None)
    if torch_copy_in is None or isinstance(torch_copy_in, functools.partial):
        return
    names = list(inspect.signature(torch_copy_in).parameters)
    if names != ["unsharded_grads", "reduce_scatter_input", "world_size"]:
        return
    collectives.foreach_reduce_scatter_copy_in = functools.partial(
        _copy_in_per_gradient, torch_copy_in
    )


def wrap_ddp(
    model: nn.Module,
    device: torch.device | None = None,
    *,
    activation_checkpointing: bool = False,
    find_unused_parameters: bool = False,
) -> nn.Module:
    """DDP: move ``model`` to ``device`` (default: this rank's GPU, else CPU) and return a
    ``DistributedDataParallel`` wrapper. Every rank keeps the full model and the full FP8
    optimizer state; use ``torch.autocast`` for bf16 compute.

    >>> ddp = wrap_ddp(model); optimizer = create_optimizer(ddp.module)
    """
    from torch.nn.parallel import DistributedDataParallel

    _require_process_group("wrap_ddp")
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    model.to(device)
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=True,  # gradients live in the buckets: one copy, not two
    )


# ----------------------------------------------------------------- coat-train under torchrun
STRATEGIES = ("fsdp", "ddp")


def prepare_data_parallel(
    model: nn.Module,
    strategy: str,
    *,
    fp8_activations: bool,
    fp8_optimizer: bool,
    lr: float,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    activation_checkpointing: bool = False,
):
    """A model and its optimizer for one rank of a ``torchrun`` job, in a training loop of
    your own (coat-train's ``Trainer`` does the same steps, with its own options): returns
    ``(model, optimizer)``.

    ``apply_coat`` (if ``fp8_activations``), then ``strategy``: ``"fsdp"`` (``shard_model``
    with the bf16 policy) or ``"ddp"`` (``wrap_ddp``; run forward under bf16 autocast), then
    the optimizer on what this rank updates: ``create_optimizer`` (CoatAdamW, which updates
    each rank's DTensor shards under FSDP2) if ``fp8_optimizer``, else ``torch.optim.AdamW``
    (fused on CUDA) with the same decay / no-decay groups. Each rank should train on its own
    micro-batches (e.g. micro-batch ``micro * world_size + rank`` of a step): then N ranks
    with ``grad_accum = A`` see the tokens of one process with ``grad_accum = N * A``.

    >>> model, optimizer = prepare_data_parallel(model, "fsdp", fp8_activations=True,
    ...                                          fp8_optimizer=True, lr=3e-4)
    """
    from .convert import apply_coat
    from .optim import training_optimizer

    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    _require_process_group("prepare_data_parallel")  # before the model changes
    if fp8_activations:
        apply_coat(model)
    if strategy == "fsdp":
        shard_model(model, activation_checkpointing=activation_checkpointing)
        target = model
    else:
        model = wrap_ddp(model, activation_checkpointing=activation_checkpointing)
        target = model.module
    optimizer = training_optimizer(
        target, fp8=fp8_optimizer, lr=lr, weight_decay=weight_decay, betas=betas
    )
    return model, optimizer


def _all_reduce_number(value: float, op) -> float:
    if not dist.is_initialized():
        return float(value)
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.item()


def all_ranks_mean(value: float) -> float:
    """Mean of a Python number over all ranks (float64 all-reduce), e.g. the logged loss;
    the value itself without a process group."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return _all_reduce_number(value, dist.ReduceOp.SUM) / world


def all_ranks_max(value: float) -> float:
    """Max of a Python number over all ranks, e.g. per-GPU peak memory; an int stays an int
    (exact below 2**53: the reduction runs in float64)."""
    result = _all_reduce_number(value, dist.ReduceOp.MAX)
    return int(result) if isinstance(value, int) else result


def as_float(value) -> float:
    """``float()`` of a 0-dim tensor or DTensor (FSDP2's ``clip_grad_norm_`` returns one)."""
    full_tensor = getattr(value, "full_tensor", None)
    return float(full_tensor() if full_tensor is not None else value)


# ------------------------------------------------------------------------ DCP checkpoints
class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model/optimizer it is loaded into (names, shapes, dtypes)."""


def _dcp_state(model: nn.Module, optimizer) -> dict:
    """``{"model": ..., "optim": ...}`` with flat keys (``state.<fqn>.<name>``): DTensors for
    sharded tensors, plain tensors for replicated ones, so DCP can reshard on load."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=options)}
    try:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    except KeyError:
        # torch's bare KeyError ('0') for an optimizer over another model's parameters. (Not
        # checked before: FSDP2 keeping layers gathered registers other tensors until its
        # state-dict hook reshards them.)
        own = {id(p) for p in model.parameters()}
        if any(id(p) not in own for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(
                "the optimizer holds parameters that are not the model's: pass the optimizer "
                "built over this model's parameters"
            ) from None
        raise
    return {"model": model_sd, "optim": optim_sd}


def _undo_state_init(optimizer) -> None:
    """Drop the state that torch's ``get_state_dict`` gave an optimizer that had none: it
    steps it once with lr 0 on zero gradients, which sets every step count to 1, so the
    first real step used the second step's bias correction (a save before the first step
    changed the run; a failed load left it so)."""
    optimizer.state.clear()


@contextlib.contextmanager
def _single_process_quiet():
    # DCP warns that it "assumes the intent is to save/load in a single process" whenever no
    # process group exists: that is exactly the intent here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def run_on_rank0(fn) -> None:
    """Run ``fn()`` on rank 0 alone (in one process: run it); the other ranks wait until it
    is done, and if it fails there every rank raises (rather than waiting for rank 0 in
    their next collective forever)."""
    error = None
    if _is_rank0():
        try:
            fn()
        except Exception as e:
            if not dist.is_initialized() or dist.get_world_size() == 1:
                raise
            error = f"{type(e).__name__}: {e}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise RuntimeError(f"rank 0 failed: {box[0]}")


def save_checkpoint(
    path,
    model: nn.Module,
    optimizer=None,
    *,
    extra: dict | None = None,
    step: int | None = None,
    info: dict | None = None,
) -> None:
    """Save model and optimizer (FP8 states included) sharded with ``torch.distributed.checkpoint``.

    Every rank calls it. ``path`` is a directory; it appears only once complete: written as
    ``<path>.partial``, then rank 0 (after a barrier, so every rank's shards are on disk)
    hashes every file into its ``manifest.json`` (``coat_models.checkpoint``: kind ``"dcp"``,
    the number of ranks, ``step``, JSON ``info``) and renames it into place, replacing an
    older one (a save killed between those renames leaves the new one complete as
    ``<path>.partial``, which ``checkpoint.settle(path)`` publishes: the next save of the path
    does so first; a read of ``path`` meanwhile says so). Rank 0 must see every rank's files
    (one machine, or a shared file system). ``extra`` (step, scheduler state, ...: anything
    ``torch.load(weights_only=True)`` reads back) is returned by ``load_checkpoint``, its
    tensors on the CPU; DCP stores one copy, so it must be equal on every rank (gather
    per-rank values such as RNG states into it). Works for FSDP2, DDP and single-process
    models alike.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    fresh = optimizer is not None and not optimizer.state
    state = _dcp_state(model, optimizer)
    if fresh:  # not stepped yet: it has no state to save, and keeps none (_undo_state_init)
        _undo_state_init(optimizer)
        state["optim"] = {k: v for k, v in state["optim"].items() if not k.startswith("state.")}
    if extra is not None:
        buffer = io.BytesIO()
        torch.save(extra, buffer)
        buffer.seek(0)
        state["extra"] = buffer

    def remove_stale():  # a save of this path that was killed before it finished
        checkpoint.settle(path)  # (killed while publishing: path missing, partial complete)
        if partial.exists():
            checkpoint.remove(partial, "stale")

    run_on_rank0(remove_stale)
    _barrier()
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=partial)
    _barrier()
    world = dist.get_world_size() if dist.is_initialized() else 1

    def seal_and_publish():
        checkpoint.write_manifest(
            partial,
            kind="dcp",
            world_size=world,
            step=step,
            serial=checkpoint.next_serial(path.parent),
            info=info,
        )
        checkpoint.publish(partial, path)

    run_on_rank0(seal_and_publish)
    _barrier()


def verify_checkpoint(path) -> checkpoint.Manifest:
    """Check a ``save_checkpoint`` directory against its manifest before anything in it is
    read: exactly the listed files, each with its SHA-256. Every rank calls it; the ranks
    share the hashing (rank r hashes files r, r + N, ...) and every rank raises if any file
    differs, if a rank cannot read its path (that rank its own error, the others a
    ``CheckpointError`` with its text) or if the ranks were given different checkpoints.
    Returns the manifest.

    >>> verify_checkpoint("ckpt/step100").step
    100
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if world == 1:
        manifest = _read_dcp_manifest(path)
        checkpoint.verify(Path(path), manifest, sorted(manifest.files))
        return manifest
    # Every rank reaches both collectives, whatever fails where: a rank that raised before
    # them left the others waiting in theirs (or pairing it with a later collective), and
    # ranks given different checkpoints loaded a mix of their shards without a word.
    manifest, error = None, None
    try:
        manifest = _read_dcp_manifest(path)
    except Exception as e:  # re-raised below, on every rank
        error = e
    said = [None] * world
    mine = (str(error), None) if error is not None else (None, manifest.to_json())
    dist.all_gather_object(said, (os.fspath(path), *mine))
    _raise_first_problem(said, error)
    if len({content for _, _, content in said}) > 1:
        paths = ", ".join(f"rank {r}: {p}" for r, (p, _, _) in enumerate(said))
        raise checkpoint.CheckpointError(
            f"the ranks were given different checkpoints ({paths}): pass every rank the same one"
        )
    error = None
    try:
        checkpoint.verify(Path(path), manifest, sorted(manifest.files)[rank::world])
    except Exception as e:
        error = e
    said = [None] * world
    dist.all_gather_object(said, (os.fspath(path), None if error is None else str(error), None))
    _raise_first_problem(said, error)
    return manifest


def _read_dcp_manifest(path) -> checkpoint.Manifest:
    manifest = checkpoint.read_manifest(Path(path))
    if manifest.kind != "dcp":
        raise checkpoint.CheckpointError(
            f"{path} was written by one process with torch.save (kind {manifest.kind!r}), not "
            "by save_checkpoint"
        )
    return manifest


def _raise_first_problem(said: list, error: BaseException | None) -> None:
    """After a gather of ``(path, problem or None, ...)`` from every rank: this rank's own
    error as it was raised, else the first rank's problem as a ``CheckpointError``."""
    if error is not None:
        raise error
    for _, problem, *_ in said:
        if problem is not None:
            raise checkpoint.CheckpointError(problem)


# torch optimizers' implementation switches, which a loaded checkpoint does not change: they
# belong to the machine (one written on the CPU says fused=False, which would keep a GPU run
# on the slower loop).
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable")


def load_checkpoint(
    path, model: nn.Module, optimizer=None, *, strict: bool = True, verify: bool = True
) -> dict | None:
    """Load what ``save_checkpoint`` wrote into ``model`` (and ``optimizer``), on any number of
    ranks: DCP reads each rank's shard. Every rank calls it; returns ``extra`` (or ``None``),
    its tensors on the CPU.

    First the files are checked against the checkpoint's manifest (``verify_checkpoint``;
    ``verify=False`` skips it when the caller has just done so): a changed, missing or added
    file raises ``CheckpointError`` and nothing is read. Then the checkpoint is checked
    against the model and optimizer: a missing or extra tensor, or a shape or dtype that
    differs (another model size, another optimizer or FP8 format, another group size) raises
    ``CheckpointMismatchError`` naming them, and nothing is loaded. ``strict=False`` skips
    the model keys the checkpoint lacks. A torch optimizer keeps its own implementation
    switches (``IMPLEMENTATION_KEYS``), not the checkpoint's.
    """
    if verify:
        verify_checkpoint(path)
    path = os.fspath(path)
    saved = _saved_metadata(path)
    fresh = optimizer is not None and not optimizer.state
    try:
        return _load(path, saved, model, optimizer, strict)
    except BaseException:
        if fresh:  # it came without state and leaves without (torch gave it some)
            _undo_state_init(optimizer)
        raise


def _load(path: str, saved, model: nn.Module, optimizer, strict: bool) -> dict | None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = _dcp_state(model, optimizer)
    renamed = _older_code_names(state, saved)
    unsaved = _check_against(saved, state, path, strict)
    # Parameters without optimizer state when saved (no gradient yet), and hyperparameters
    # the saved optimizer had not: the latter keep this optimizer's values.
    removed = {k: state["optim"].pop(k) for k in unsaved}
    own = {k: v for k, v in removed.items() if k.startswith("param_groups.")}
    # Saved before the optimizer's first step (no state at all): torch loads this optimizer's
    # own initial state back (it needs one per parameter), which is then dropped.
    stateless = optimizer is not None and not any(k.startswith("state.") for k in state["optim"])
    if stateless:
        own |= {k: v for k, v in removed.items() if k.startswith("state.")}
    if "extra" in saved:
        state["extra"] = io.BytesIO()
    # Flat keys "param_groups.<fqn>.<name>": this optimizer's values go back over the loaded
    # ones, before torch places the step counters by them.
    switches = {
        k: v
        for k, v in state.get("optim", {}).items()
        if k.startswith("param_groups.") and k.rpartition(".")[2] in IMPLEMENTATION_KEYS
    }
    _dcp_load(state, path)
    for new_key, old_key in renamed.items():
        state["optim"][new_key] = state["optim"].pop(old_key)
    if switches or own:
        state["optim"].update(switches, **own)
    options = StateDictOptions(flatten_optimizer_state_dict=True, strict=strict)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state["model"], options=options)
    else:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )
        if stateless:
            _undo_state_init(optimizer)
    return _extra(state)


def read_checkpoint_extra(path, *, verify: bool = True) -> dict | None:
    """The ``extra`` of a ``save_checkpoint`` checkpoint alone (or ``None``), without model or
    optimizer: e.g. to check a run's settings before loading. Every rank calls it; the files
    are verified first as in ``load_checkpoint``.

    >>> read_checkpoint_extra("ckpt/step100")["step"]
    100
    """

    if verify:
        verify_checkpoint(path)
    path = os.fspath(path)
    if "extra" not in _saved_metadata(path):
        return None
    state = {"extra": io.BytesIO()}
    _dcp_load(state, path)
    return _extra(state)


# DCP pickles its .metadata. These are the only globals a .metadata of torch 2.13 refers to
# (checked on FSDP2, DDP and one-process checkpoints of COAT models): its own dataclasses,
# torch.Size, dtypes and layouts, and the Path of the checkpoint. Anything else, e.g. a
# function that a planted file would call, is refused before it is looked up.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} is not part of a checkpoint's metadata: refused"
        )


def _read_metadata(path: str):
    """DCP's ``Metadata`` of ``path``, unpickled with ``_MetadataUnpickler``; every item it
    places must lie in a file of the checkpoint directory itself (a ``relative_path`` such as
    ``../x`` read a file outside, which the manifest had not hashed)."""
    metadata_path = os.path.join(path, ".metadata")
    with open(metadata_path, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except Exception as e:  # any garbage: truncated, another pickle, refused class
            raise checkpoint.CheckpointError(
                f"{metadata_path} is not the metadata of a DCP checkpoint ({e})"
            ) from None
    storage = getattr(metadata, "storage_data", None) or {}
    for info in storage.values() if isinstance(storage, dict) else [None]:
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name:
            raise checkpoint.CheckpointError(
                f"{metadata_path} places data in {name!r}, not a file of the checkpoint: refused"
            )
        # save_checkpoint writes items as they are; a transform (DCP's zstd stream) read
        # back without a bound on what it expands to.
        if getattr(info, "transform_descriptors", None):
            raise checkpoint.CheckpointError(
                f"{metadata_path} asks for transforms {info.transform_descriptors!r} of its "
                "data, which save_checkpoint never writes: refused"
            )
    return metadata


@functools.cache
def _reader_class():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(dcp.FileSystemReader):
        """``FileSystemReader`` whose ``.metadata`` goes through ``_MetadataUnpickler``."""

        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:  # per-rank metadata: save_checkpoint writes none
                raise FileNotFoundError("save_checkpoint writes no per-rank metadata")
            metadata = _read_metadata(os.fspath(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader


def _reader(path: str):
    return _reader_class()(path)


def _dcp_load(state: dict, path: str) -> None:
    """``dcp.load`` of ``state`` from ``path`` through the checked reader and planner; the
    ``CheckpointError`` one of them raised comes out as itself (DCP wraps what a read
    raises in its ``CheckpointException``, every rank's traceback in its text)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=_reader(path), planner=_planner_class()())
    except CheckpointException as e:
        ours = [
            exc for exc, _ in e.failures.values() if isinstance(exc, checkpoint.CheckpointError)
        ]
        if ours:
            raise ours[0] from None
        raise


@functools.cache
def _planner_class():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element  # (as torch's planner)

    class Planner(dcp.DefaultLoadPlanner):
        """``DefaultLoadPlanner`` whose non-tensor items (``extra``'s bytes, the optimizer's
        hyperparameters) load with ``weights_only=True``: torch's unpickles them with
        ``weights_only=False``, running whatever code a checkpoint's data file names, after
        the manifest passed (anyone who can write the files can write a manifest)."""

        def load_bytes(self, read_item, value) -> None:
            loaded = _load_plain(value, read_item.dest_index.fqn)
            if self.flatten_state_dict:
                fqn = self.mappings[read_item.dest_index.fqn]
                set_element(self.original_state_dict, fqn, loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return Planner


def _saved_metadata(path: str) -> dict:
    """The checkpoint's ``state_dict_metadata``; a clear error where there is none."""
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise checkpoint.missing(path)
    metadata = _read_metadata(path)
    if not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise checkpoint.CheckpointError(f"{path}/.metadata holds no DCP state_dict_metadata")
    return metadata.state_dict_metadata


def _extra(state: dict) -> dict | None:
    if "extra" not in state:
        return None
    extra = state["extra"]  # DCP puts a new BytesIO in the dict
    extra.seek(0)
    # Onto the CPU: DCP wrote one rank's copy, so a GPU tensor in it would come back on that
    # rank's GPU on every rank, and fail to load where that GPU does not exist.
    return _load_plain(extra, "extra", map_location="cpu")


def _load_plain(value, name: str, **kw):
    """``torch.load(weights_only=True)`` of one of the checkpoint's non-tensor items, or a
    ``CheckpointError`` naming it (torch's own text for a refused pickle suggests
    ``weights_only=False``: running the file's code)."""
    checkpoint.check_archive_stored(value, f"{name} of the checkpoint")
    with torch.serialization.safe_globals([io.BytesIO]):  # (``extra``'s container)
        try:
            return torch.load(value, weights_only=True, **kw)
        except pickle.UnpicklingError as e:
            why = next((ln.strip() for ln in str(e).splitlines()
                        if "Unsupported" in ln), "not plain data")  # fmt: skip
            raise checkpoint.CheckpointError(
                f"{name} of the checkpoint holds more than data ({why}): refused"
            ) from None


def _chunks_tile(meta) -> bool:
    """Whether a tensor's saved chunks lie inside it, overlap nowhere and add up to all of
    it (so every element is read from the checkpoint exactly once)."""
    size = tuple(meta.size)
    boxes, total = [], 0
    for chunk in getattr(meta, "chunks", None) or []:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(size) or len(sizes) != len(size):
            return False
        if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, size, strict=True)):
            return False
        total += math.prod(sizes)
        boxes.append((offsets, sizes))
    if total != math.prod(size):
        return False
    return not any(
        all(max(ao, bo) < min(ao + an, bo + bn) for ao, an, bo, bn in zip(*a, *b, strict=True))
        for i, a in enumerate(boxes)
        for b in boxes[i + 1 :]
    )


def _check_against(saved: dict, state: dict, path: str, strict: bool) -> list[str]:
    """Compare the checkpoint's metadata with the state we would load into; raise
    ``CheckpointMismatchError`` listing every difference. Returns the optimizer-state keys of
    parameters that had no state when saved (they are left without state on load) and of
    hyperparameters the saved optimizer had not (they keep this optimizer's values); a
    hyperparameter saved that this optimizer has not is not loaded."""
    problems: list[str] = []
    corrupt: list[str] = []

    def describe(meta) -> str:
        size = getattr(meta, "size", None)
        if size is None:
            return "a non-tensor value"
        return f"{tuple(size)} {meta.properties.dtype}"

    def compare(key: str, value) -> None:
        meta = saved.get(key)
        if meta is None:
            problems.append(f"{key}: missing from the checkpoint")
        elif isinstance(value, torch.Tensor):
            want = f"{tuple(value.shape)} {value.dtype}"
            if describe(meta) != want:
                problems.append(f"{key}: checkpoint has {describe(meta)}, this run expects {want}")
            elif not _chunks_tile(meta):  # (the rest kept this run's values, without a word)
                corrupt.append(f"{key}: its chunks do not cover its {tuple(meta.size)}")

    for name, value in state["model"].items():
        if strict or f"model.{name}" in saved:
            compare(f"model.{name}", value)
    expected = {f"model.{name}" for name in state["model"]}
    unsaved: list[str] = []
    if "optim" in state:
        expected |= {f"optim.{name}" for name in state["optim"]}
        by_param: dict[str, list[str]] = {}
        for name in state["optim"]:
            if name.startswith("state."):
                by_param.setdefault(_state_owner(name), []).append(name)
        for names in by_param.values():
            if not any(f"optim.{n}" in saved for n in names):
                unsaved.extend(names)
        for name, value in state["optim"].items():
            if name in unsaved:
                continue
            if name.startswith("param_groups.") and f"optim.{name}" not in saved:
                # A hyperparameter the saved optimizer had not (a scheduler's initial_lr, a
                # default of a later torch): this optimizer's value stays, as torch's own
                # load_state_dict compares none of them.
                unsaved.append(name)
                continue
            compare(f"optim.{name}", value)
        if not any(key.startswith("optim.") for key in saved):
            problems.append("the checkpoint holds no optimizer state (saved without optimizer)")
    for key in saved:
        if key.startswith(("model.", "optim.")) and key not in expected:
            if key.startswith("model.") and not strict:
                continue
            if key.startswith("optim.") and "optim" not in state:
                continue  # the weights alone are loaded (no optimizer given)
            if key.startswith("optim.param_groups."):
                continue  # one this optimizer has not (initial_lr without a scheduler)
            problems.append(f"{key}: in the checkpoint but not in this model/optimizer")
    if corrupt:
        raise checkpoint.CheckpointError(
            f"{path}/.metadata is not one save_checkpoint wrote: {corrupt[0]} exactly"
            + (f" (and {len(corrupt) - 1} more)" if len(corrupt) > 1 else "")
        )
    if problems:
        shown = "\n  ".join(problems[:12])
        more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
        raise CheckpointMismatchError(
            f"checkpoint {path!r} does not match this model/optimizer ({len(problems)} "
            f"differences; another model config, optimizer or FP8 state format?):\n  {shown}{more}"
        )
    return unsaved


def _older_code_names(state: dict, saved: dict) -> dict[str, str]:
    """CoatAdamW keeps FP8 codes under ``exp_avg_fp8`` / ``exp_avg_sq_fp8``; checkpoints
    written before it did hold them under ``exp_avg`` / ``exp_avg_sq``. Where the checkpoint
    has the older name, the flat optimizer state to load takes it (to be renamed back once
    loaded); returns {the state's key: the checkpoint's}."""
    from fp8_optim.reference import CODES

    moment_of = {code: moment for moment, code in CODES.items()}
    renamed = {}
    for key in list(state.get("optim", ())):
        owner, _, name = key.rpartition(".")
        if key.startswith("state.") and name in moment_of:
            old_key = f"{owner}.{moment_of[name]}"
            if f"optim.{key}" not in saved and f"optim.{old_key}" in saved:
                state["optim"][old_key] = state["optim"].pop(key)
                renamed[key] = old_key
    return renamed


def _state_owner(flat_key: str) -> str:
    """``state.model.layers.0.mlp.up_proj.weight.exp_avg`` -> the parameter's prefix."""
    return flat_key.rsplit(".", 1)[0]
