"""CoatAdamW on DTensor parameters (FSDP2's ``fully_shard``): each rank updates its own
shard, and every parameter and state byte equals what the unsharded optimizer computes.

FSDP2 splits each parameter on dim 0 like ``torch.chunk``: rank r of W holds rows
``[r*c, min((r+1)*c, n0))`` with ``c = ceil(n0 / W)`` (the last ranks may hold fewer rows,
or none). CoatAdamW quantizes groups of G consecutive elements of the flattened parameter,
starting at element 0. Run on a rank's flattened shard, the groups are the unsharded ones
only if the shard starts at a global element that is a multiple of G; otherwise a group
would straddle two ranks and each rank would quantize part of it with its own max, min and
``k``: states that depend on W and could not be resharded. ``shard_layout`` decides:

* ``"rows"``: a row holds whole groups (``prod(shape[1:]) % G == 0``, every Llama matrix):
  every shard starts on a group boundary for any W; the per-group numbers are kept as
  ``(n0, groups per row)`` in state dicts, sharded by rows like the parameter.
* ``"flat"``: rows hold partial groups, but for this W every shard starts on a group boundary
  and its groups are the ``torch.chunk`` slice of all ``ceil(numel / G)`` groups (e.g. a
  4096-element norm weight on 2 ranks); per-group numbers ``(groups,)``, sharded on dim 0.
* ``"full"``: any other case (a 64-element norm weight on 2 ranks). The rank all-gathers the
  parameter and its gradient, updates the whole tensor with a replicated state and keeps its
  slice: two small all-gathers per step and the parameter's full state on every rank.

For "rows" and "flat" the optimizer updates a plain tensor that aliases the local shard and
draws stochastic-rounding bits by global element index (``set_element_offset``). Ranks must
agree on which parameters have a gradient (a "full" parameter's gather is a collective);
FSDP2's reduce-scatter guarantees that.
"""

from __future__ import annotations

import torch

PER_GROUP_SUFFIXES = ("_amax", "_k")  # state names holding one number per group


def is_dtensor(t) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def chunk_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank`` when ``n`` rows are split like ``torch.chunk``
    (FSDP2, DTensor ``Shard(0)``)."""
    size = _ceil_div(n, world)
    start = min(rank * size, n)
    return start, min(start + size, n)


def shard_layout(shape: tuple[int, ...], world: int, group_size: int) -> str:
    """``"rows"``, ``"flat"`` or ``"full"`` for a parameter of global ``shape`` split on dim
    0 over ``world`` ranks (see the module docstring).

    >>> [shard_layout(s, 2, 128) for s in ((4096, 4096), (4096,), (64,))]
    ['rows', 'flat', 'full']
    """
    rows, cols = shape[0], _numel(shape[1:])
    if cols % group_size == 0:
        return "rows"
    ngroups = _ceil_div(rows * cols, group_size)
    for r in range(world):
        start, end = chunk_range(rows, world, r)
        if start == end:
            continue
        groups = (start * cols // group_size, _ceil_div(end * cols, group_size))
        if (start * cols) % group_size or groups != chunk_range(ngroups, world, r):
            return "full"
    return "flat"


def group_state_shape(shape: tuple[int, ...], group_size: int) -> tuple[int, ...]:
    """Shape of a per-group state in state dicts: ``(rows, groups per row)`` when rows hold
    whole groups (so it shards like the parameter), else ``(groups,)``. It depends only on
    the parameter's global shape, never on how it is sharded."""
    cols = _numel(shape[1:])  # not numel // rows: a parameter may have 0 rows
    if len(shape) >= 2 and cols % group_size == 0:
        return (shape[0], cols // group_size)
    return (_ceil_div(_numel(shape), group_size),)


def gather(t):
    """``DTensor.full_tensor()``; FP8 moves as bytes (gloo cannot all-gather FP8 dtypes)."""
    from torch.distributed.tensor import DTensor

    if t.dtype.itemsize == 1 and t.is_floating_point():
        as_bytes = DTensor.from_local(
            t.to_local().view(torch.uint8),
            t.device_mesh,
            t.placements,
            shape=t.shape,
            stride=t.stride(),
            run_check=False,
        )
        return as_bytes.full_tensor().view(t.dtype)
    return t.full_tensor()


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


class ShardedParam:
    """One DTensor parameter: where this rank's shard sits in the full tensor, and ``work``,
    the plain tensor the optimizer updates in its place (an alias of the local shard, or a
    full-size copy for "full")."""

    def __init__(self, param, group_size: int):
        from torch.distributed.tensor import Replicate, Shard

        placements = param.placements
        sharded = [i for i, pl in enumerate(placements) if pl != Replicate()]
        if param.dim() == 0 or len(sharded) != 1 or placements[sharded[0]] != Shard(0):
            raise ValueError(
                f"CoatAdamW takes DTensor parameters sharded on dim 0 (FSDP2's fully_shard, "
                f"HSDP); got placements {placements} for shape {tuple(param.shape)}: "
                "tensor-parallel layouts are not supported"
            )
        mesh = param.device_mesh
        self.param = param
        self.shape = tuple(param.shape)
        self.world = mesh.size(sharded[0])
        self.rank = mesh.get_local_rank(sharded[0])
        self.start, self.end = chunk_range(self.shape[0], self.world, self.rank)
        local = param._local_tensor
        # A parameter without elements (4 x 0): FSDP2 gives every rank a 0 x 0 shard; its
        # ``work`` is an empty tensor of the rows this rank would hold, aliasing nothing.
        self.empty = _numel(self.shape) == 0
        if not self.empty and local.shape[0] != self.end - self.start:
            raise ValueError(
                f"unexpected dim-0 shard: rank {self.rank} of {self.world} holds "
                f"{local.shape[0]} rows of {self.shape[0]}, expected {self.end - self.start}"
            )
        self.cols = _numel(self.shape[1:])
        self.layout = shard_layout(self.shape, self.world, group_size)
        self.group_shape = group_state_shape(self.shape, group_size)
        if self.layout == "full":
            self.work = torch.zeros(self.shape, dtype=param.dtype, device=local.device)
        elif self.empty:
            rows = (self.end - self.start, *self.shape[1:])
            self.work = torch.zeros(rows, dtype=param.dtype, device=local.device)
        else:
            self.work = torch.empty(0, dtype=param.dtype, device=local.device)
            self.rebind()

    @property
    def element_offset(self) -> int:
        """Global index of ``work``'s first element."""
        return 0 if self.layout == "full" else self.start * self.cols

    @torch.no_grad()
    def rebind(self) -> None:
        # FSDP2 may swap the local tensor behind a sharded parameter (lazy init, to_empty,
        # load_state_dict(assign=True)): alias the current one. No copy.
        local = self.param._local_tensor
        w = self.work
        if self.empty:  # (nothing to alias)
            return
        if (
            w.untyped_storage().data_ptr() != local.untyped_storage().data_ptr()
            or w.storage_offset() != local.storage_offset()
            or w.shape != local.shape
        ):
            w.set_(local.untyped_storage(), local.storage_offset(), local.shape, local.stride())

    @torch.no_grad()
    def prepare(self) -> torch.Tensor:
        """Before a step: ``work`` holds the parameter and ``work.grad`` its gradient."""
        grad = self.param.grad
        if not is_dtensor(grad):
            raise TypeError("a DTensor parameter has a plain-tensor gradient; expected a DTensor")
        if self.layout == "full":
            self.work.copy_(gather(self.param))
            self.work.grad = gather(grad)
        elif self.empty:
            self.work.grad = torch.zeros_like(self.work)
        else:
            self.rebind()
            self.work.grad = grad.to_local()
        return self.work

    @torch.no_grad()
    def finish(self) -> None:
        """After a step: write back a "full" parameter's slice; drop the gradient alias."""
        if self.layout == "full":
            self.param._local_tensor.copy_(self.work[self.start : self.end])
        self.work.grad = None

    # ----------------------------------------------------------------- state dicts
    def _dtensor(self, local: torch.Tensor, shape: tuple[int, ...]):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local,
            self.param.device_mesh,
            self.param.placements,
            shape=torch.Size(shape),
            stride=_contiguous_stride(shape),
            run_check=False,
        )

    def export(self, name: str, value):
        """A state tensor (local, or full for "full") -> its state-dict form: DTensors
        sharded like the parameter, or plain replicated tensors for "full"; 0-dim as is."""
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        per_group = name.endswith(PER_GROUP_SUFFIXES)
        if self.layout == "full":
            return value.reshape(self.group_shape if per_group else self.shape)
        rows = self.end - self.start
        if not per_group:
            return self._dtensor(value.reshape(rows, *self.shape[1:]), self.shape)
        if self.layout == "rows":
            value = value.reshape(rows, *self.group_shape[1:])
        return self._dtensor(value, self.group_shape)

    def export_rows(self, value: torch.Tensor):
        """An element-wise tensor shaped like ``work`` -> a DTensor sharded like the
        parameter (what torch optimizers keep for DTensor parameters)."""
        if self.layout == "full":
            value = value[self.start : self.end]
        return self._dtensor(value, self.shape)

    def import_(self, name: str, value):
        """A state-dict value (DTensor of any sharding, or full tensor) -> the local (or, for
        "full", whole) state tensor; 0-dim as is."""
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        per_group = name.endswith(PER_GROUP_SUFFIXES)
        if per_group and value.numel() != _numel(self.group_shape):
            raise ValueError(
                f"state {name} has {value.numel()} groups, a DTensor parameter of shape "
                f"{self.shape} needs {_numel(self.group_shape)}: a sharded optimizer loads "
                "only states of its own group size (convert them with an unsharded one)"
            )
        if is_dtensor(value):
            if self.layout != "full" and value.placements == self.param.placements:
                return value.to_local().reshape(-1 if per_group else self.work.shape)
            value = gather(value)
        if self.layout == "full":
            return value.reshape(-1 if per_group else self.shape)
        if not per_group:
            return value.reshape(self.shape)[self.start : self.end]
        if self.layout == "rows":
            return value.reshape(self.group_shape)[self.start : self.end].reshape(-1)
        g0, g1 = chunk_range(self.group_shape[0], self.world, self.rank)
        return value.reshape(-1)[g0:g1]
