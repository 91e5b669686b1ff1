"""CoatAdamW: drop-in ``torch.optim.AdamW`` with FP8 moments and Dynamic Range Expansion."""

from __future__ import annotations

import numbers
from collections import OrderedDict, defaultdict
from itertools import chain
from typing import NamedTuple

import torch
from fp8_quant import FP8Format, resolve_backend

from . import reference
from .config import CoatAdamWConfig
from .dtensor import PER_GROUP_SUFFIXES, ShardedParam, gather, group_state_shape, is_dtensor

_PARAM_DTYPES = (torch.float32, torch.bfloat16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_FORMATS = {f.torch_dtype: f for f in FP8Format}
_TOP_CODE = {  # the bits of each format's largest finite value: 0x7E (E4M3), 0x7B (E5M2)
    f.torch_dtype: int(torch.tensor(f.max).to(f.torch_dtype).view(torch.uint8)) for f in FP8Format
}
# Keys torch.optim.AdamW puts in its param groups that mean nothing here.
_ADAMW_ONLY_KEYS = (
    "amsgrad",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
    "decoupled_weight_decay",
)
_MOMENTS = reference.MOMENTS
# Param-group keys. Other optimizers' settings that change the update or the state format,
# other names for the keys below and near-misses of them (a typo: "weight_decya") are
# refused, not ignored; any other key (a label such as "name", timm's "lr_scale") is kept
# and never read, as torch does.
_OWN_KEYS = ("params", "lr", "betas", "eps", "weight_decay", "maximize")
# What torch.optim.AdamW itself puts in a group ("param_names" for named parameters) and
# what torch's LR schedulers add (LRScheduler: initial_lr; OneCycleLR: max_lr, min_lr and,
# cycling momentum, base/max_momentum; SWALR: swa_lr): accepted so that such groups and
# AdamW state dicts load, never read.
_TORCH_KEYS = (*_ADAMW_ONLY_KEYS, "param_names")
_SCHEDULER_KEYS = ("initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr")
_GROUP_KEYS = frozenset(_OWN_KEYS + _TORCH_KEYS + _SCHEDULER_KEYS)
# The keys whose near-misses are refused: those that change the update.
_UPDATE_KEYS = ("lr", "betas", "eps", "weight_decay", "maximize", "amsgrad",
                "decoupled_weight_decay")  # fmt: skip
# State-format settings of bitsandbytes, MS-AMP's LBAdamW and Transformer Engine's FusedAdam.
_FOREIGN_KEYS = frozenset(
    ("optim_bits", "min_8bit_size", "percentile_clipping", "block_wise", "max_unorm",
     "skip_zeros", "is_paged", "optim_dtype", "momentum_dtype", "variance_dtype",
     "exp_avg_dtype", "exp_avg_sq_dtype", "master_weights", "master_weight_dtype")
)  # fmt: skip
# Other Adam implementations' switches, accepted at AdamW's value only (apex's and
# DeepSpeed's FusedAdam: bias_correction, adam_w_mode; transformers' old AdamW: correct_bias).
_ADAMW_VALUES = {"bias_correction": True, "adam_w_mode": True, "correct_bias": True}
# Other names for ours (compared without case, "_", "-" or spaces).
_SYNONYMS = {"learningrate": "lr", "epsilon": "eps", "wd": "weight_decay",
             "beta1": "betas", "beta2": "betas"}  # fmt: skip
# The keys a step need not look at again: ours, and others already found harmless.
_KEYS_SEEN = set(_GROUP_KEYS)
# The keys a saved state may hold (its codes under _CODES' names or, written by an earlier
# version, under the moment's).
_SAVED_KEYS = ("step", *_MOMENTS, *(m + sfx for m in _MOMENTS for sfx in PER_GROUP_SUFFIXES))
# Where FP8 moments keep their codes (beside ``<moment>_amax`` and ``<moment>_k``): not
# AdamW's names, so that ``torch.optim.AdamW`` given such a state dict fails (KeyError
# 'exp_avg' at its first step) instead of reading the codes as moments. fp32 moments
# (``high_precision_states``) keep AdamW's names, which AdamW reads right. The checks and
# conversions here see the codes under the moment's name (``_by_moment``).
_CODES = reference.CODES
_FP32_MAX = torch.finfo(torch.float32).max
_data_ptr, _size = torch.Tensor.data_ptr, torch.Tensor.size
_SET_PARAMS = (
    "a param group's params must be an ordered collection (a list), not a set: the "
    "stochastic-rounding streams and the state dict follow their order, which a set changes "
    "from run to run"
)
_STEP_MAX = 2**24  # fp32 counts every step exactly up to here (the kernel's powers take 25 bits)


class _Codes(NamedTuple):
    """An FP8 state tensor in a pickle: its bytes and dtype's name."""

    codes: torch.Tensor
    dtype: str

    @staticmethod
    def of(value):
        if type(value) is torch.Tensor and value.dtype in _FP8_DTYPES:
            return _Codes(value.view(torch.uint8), str(value.dtype).removeprefix("torch."))
        return value

    def tensor(self) -> torch.Tensor:
        return self.codes.view(getattr(torch, self.dtype))


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class CoatAdamW(torch.optim.Optimizer):
    """AdamW whose moments are stored in FP8 with Dynamic Range Expansion (COAT).

    Same constructor and behaviour as ``torch.optim.AdamW`` (param groups, named
    parameters, float or tensor ``lr``, LR schedulers, closures, ``zero_grad``, parameters
    without ``.grad`` skipped), plus ``config`` (``CoatAdamWConfig``) for the state format.
    Parameters: fp32 or bf16, any shape, materialized (not on the meta device); gradients:
    fp32, bf16 or fp16. ``foreach``, ``fused`` and ``capturable`` are accepted for
    compatibility and ignored: a step is always one fused pass per bucket of parameters
    (device, dtypes) with no host-device synchronization.

    Hyperparameters are checked at construction and again at every step (a scheduler or
    the user may change them): a bad value raises ``ValueError`` instead of skipping every
    group. A tensor ``lr`` on the CPU is read each step; one on a GPU is read when it is
    first seen in its group (construction, ``load_state_dict`` or assignment of a new
    tensor), never after an in-place change such as a scheduler's ``fill_``: that would cost
    a device-to-host sync every step. A non-finite value written in place into a GPU ``lr``
    makes every group of the step skip, which ``nonfinite_groups()`` counts. Param-group
    keys of other optimizers' settings, other names for CoatAdamW's and near-misses of them
    raise ``ValueError``, also when set after construction (at the next step); other keys
    are kept and never read, as torch does.

    State per parameter (``optimizer.state[p]``): ``step`` (0-dim fp32 on p's device),
    ``exp_avg_fp8`` / ``exp_avg_sq_fp8`` (FP8 codes shaped like p; not AdamW's names, so
    that ``torch.optim.AdamW`` refuses such a state dict), ``exp_avg_amax`` /
    ``exp_avg_sq_amax`` (fp32, one per group) and ``exp_avg_k`` / ``exp_avg_sq_k`` (uint8
    ``16 * k`` per group): 2.078 bytes per element at group size 128. With
    ``high_precision_states`` it is exactly torch's: ``step``, fp32 ``exp_avg``,
    ``exp_avg_sq``.

    DTensor parameters (FSDP2's ``fully_shard``, any number of ranks): each rank updates
    its own shard, and parameters and states are bit for bit those of the unsharded
    optimizer (groups follow the global tensor; see ``fp8_optim.dtensor``). ``state_dict()``
    then holds DTensor states that ``torch.distributed.checkpoint`` reshards. In every state
    dict the per-group numbers of a parameter whose rows hold whole groups are shaped
    ``(rows, groups per row)``, else ``(groups,)`` (``dtensor.group_state_shape``), so that
    checkpoints do not depend on how parameters were sharded.

    Non-finite values: a group (``group_size`` elements of one parameter) whose update
    would produce a NaN or inf in ``p``, ``m`` or ``v`` is skipped: its parameter values and
    states stay bit for bit as they were, and ``nonfinite_groups()`` counts it. The
    parameter's ``step`` still advances. Use a GradScaler to skip whole steps instead.

    >>> model = torch.nn.Linear(64, 64)
    >>> opt = CoatAdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    >>> model(torch.randn(8, 64)).square().mean().backward()
    >>> opt.step(); opt.zero_grad()
    """

    # Its step bumps the versions of the parameters it updates (fp8_activations' weight
    # cache reads them; its hook after other optimizers' steps skips this one).
    _bumps_param_versions = True

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        config: CoatAdamWConfig | None = None,
    ):
        if amsgrad:
            raise ValueError(
                "CoatAdamW does not support amsgrad=True (it would need a third state); "
                "use torch.optim.AdamW(amsgrad=True) for those parameters"
            )
        if differentiable:
            raise ValueError(
                "CoatAdamW does not support differentiable=True: use torch.optim.AdamW for "
                "differentiating through the update"
            )
        if config is None:
            config = CoatAdamWConfig()
        if not isinstance(config, CoatAdamWConfig):
            raise TypeError(f"config must be a CoatAdamWConfig, got {type(config).__name__}")
        self.config = config
        self._param_index: dict[torch.Tensor, int] = {}
        self._next_index = 0  # the index of the next parameter numbered
        self._sr_offset: dict[torch.Tensor, int] = {}
        self._shards: dict[torch.Tensor, ShardedParam] = {}
        self._plans: dict = {}
        # The kernel's launch shape (ops.AdamWLaunch; None: the default). No shape changes a
        # bit; the launch sweep and the tests set it, then clear ``_plans``.
        self._launch = None
        self._bad: dict[torch.device, torch.Tensor] = {}
        # The tensor lr last validated per group index: a GPU lr is read on the host only
        # when a new tensor appears (see the class docstring).
        self._lr_seen: dict[int, torch.Tensor] = {}
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        if isinstance(params, set | frozenset):  # (torch's list() would hide it)
            raise TypeError(_SET_PARAMS.replace("a param group's params", "params"))
        super().__init__(params, defaults)

    def __getstate__(self) -> dict:
        # torch's keeps defaults, state and param groups; launch plans hold raw addresses
        # and are made again, as are the parameter indices and DTensor shards.
        # The indices by position in the groups: a parameter put into a group's list directly
        # was numbered when first stepped, not in group order (a copy renumbered
        # it, and its rounding streams went elsewhere).
        # The index values, not only their order: a parameter removed from its group leaves
        # a gap, which a renumbering closed (the streams of those after it moved).
        order = [self._param_index.get(p) for g in self.param_groups for p in g["params"]]
        base = super().__getstate__()
        # FP8 codes as bytes: torch 2.13 cannot unpickle an FP8 tensor from plain pickle
        # (deepcopy and torch.save can), so pickle.loads failed on what pickle.dumps wrote.
        base["state"] = {
            p: {k: _Codes.of(v) for k, v in s.items()} for p, s in base["state"].items()
        }
        return {
            **base,
            "config": self.config,
            "_sr_offset": self._sr_offset,
            "_bad": self._bad,
            "_launch": self._launch,
            "_param_order": order,
            "_next_index": self._next_index,
        }

    def __setstate__(self, state: dict) -> None:
        # torch.save(optimizer), copy.deepcopy(optimizer) and multiprocessing give this.
        order = state.pop("_param_order", None)
        next_index = state.pop("_next_index", None)
        if "state" in state:
            state["state"] = defaultdict(dict, {  # (_codes_named: pickled before the codes'
                p: _codes_named(  # names, an FP8 state held them under the moments')
                    {k: v.tensor() if isinstance(v, _Codes) else v for k, v in s.items()}
                )
                for p, s in state["state"].items()
            })  # fmt: skip
        super().__setstate__(state)
        self._param_index, self._shards, self._plans, self._lr_seen = {}, {}, {}, {}
        self._next_index = 0
        flat = [p for group in self.param_groups for p in group["params"]]
        if order is None or len(order) != len(flat):  # (pickled before the order was kept)
            order = list(range(len(flat)))
        numbered = sorted((i, n) for n, i in enumerate(order) if i is not None)
        for i, n in numbered:
            p = flat[n]
            self._next_index = i
            self._index([p])
        if next_index is not None:
            self._next_index = max(self._next_index, next_index)
        for gi, group in enumerate(self.param_groups):
            if isinstance(group["lr"], torch.Tensor):
                self._lr_seen[gi] = group["lr"]

    def _adopt(self, p) -> None:
        """Number a parameter put into ``param_groups`` without ``add_param_group`` (a group's
        list extended, a group appended: torch's AdamW takes them; the index lookup failed
        after part of the step had run), as ``add_param_group`` would have; refuse one that
        is in a group twice or in two groups."""
        count = sum(q is p for group in self.param_groups for q in group["params"])
        if count != 1:
            raise ValueError(
                "a parameter is in the optimizer's groups more than once: pass each once"
            )
        self._index([p])

    def _index(self, params) -> None:
        """Number ``params`` after those seen before (the stochastic-rounding streams) and
        note the DTensors among them."""
        for p in params:
            self._param_index[p] = self._next_index
            self._next_index += 1
            if is_dtensor(p):
                shard = ShardedParam(p, self.config.group_size)
                self._shards[p] = shard
                self._sr_offset[p] = shard.element_offset

    # ------------------------------------------------------------------ validation
    def add_param_group(self, param_group: dict) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"a param group must be a dict, got {type(param_group).__name__}")
        _check_group_keys(param_group)
        _check_hyper({**self.defaults, **param_group})
        params = param_group["params"]
        if isinstance(params, set | frozenset):  # (list() below hid it from torch's check)
            raise TypeError(_SET_PARAMS)
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        param_group["params"] = params  # a generator would be empty when torch reads it
        tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]  # named
        for p in tensors:
            _check_param(p)
        if len({id(p) for p in tensors}) != len(tensors):
            # torch only warns: the state would be stepped twice per step (the triton
            # backend once per launch, racing on a GPU).
            raise ValueError(
                "a parameter group holds a parameter more than once: pass each parameter once"
            )
        super().add_param_group(param_group)
        lr = self.param_groups[-1]["lr"]
        if isinstance(lr, torch.Tensor):
            self._lr_seen[len(self.param_groups) - 1] = lr
        self._index(self.param_groups[-1]["params"])

    def set_element_offset(self, param: torch.Tensor, offset: int) -> None:
        """Index of ``param``'s first element in the full tensor it is a shard of.

        Stochastic rounding draws its bits from (seed, parameter index, step, element
        index + offset), so a dim-0 shard then rounds exactly like the unsharded tensor.
        """
        if param not in self._param_index:
            raise ValueError("param is not managed by this optimizer")
        if isinstance(offset, bool) or not isinstance(offset, numbers.Integral) or offset < 0:
            raise ValueError(f"offset must be a non-negative int, got {offset!r}")
        self._sr_offset[param] = int(offset)  # (a numpy int, e.g. from np.cumsum, as well)
        self._plans.clear()

    # ------------------------------------------------------------------------ step
    # Never traced: a compiled opt.step (or training step around it) runs it eagerly, a graph
    # break (fullgraph=True refuses it). Traced, an lr changed since the last step (any LR
    # scheduler) reached the update's struct.pack of fp32/f64 constants as a symbolic
    # float, and the step failed inside dynamo (RecursionError, torch 2.13).
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: torch.Tensor | float | None = None):
        """One AdamW step of every parameter with a gradient. Returns ``closure()``'s loss.

        ``grad_scale``: a factor applied to every gradient inside the update kernel, the
        bits torch's CUDA ``p.grad.mul_(grad_scale)`` would give (a bf16/fp16 gradient is
        multiplied by the factor cast to its dtype), without writing the gradients (they
        keep their values): gradient clipping without a pass over them, e.g.
        ``coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)`` from
        ``torch.nn.utils.get_total_norm``. A 0-dim tensor on the parameters' device (no
        host read) or a number.
        """
        scales = _GradScales(grad_scale)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        prepared = []
        # Host time here is paid before the first launch (every step of a 7B model walks
        # ~300 parameters): a few cheap attribute reads per parameter, the full checks
        # (with their messages) only when a cheap one fails.
        sharded = bool(self._shards)
        # Every group before any update: a bad value must not leave a half-made step.
        for gi, group in enumerate(self.param_groups):
            if not group.keys() <= _KEYS_SEEN:  # a key set since (a typo must not be ignored)
                _check_group_keys(group)
            lr = group["lr"]
            if isinstance(lr, torch.Tensor):
                _check_hyper(group, read_lr=self._lr_seen.get(gi) is not lr)
                self._lr_seen[gi] = lr
            else:
                _check_hyper(group)
        flat = [p for group in self.param_groups for p in group["params"]]
        if len(set(map(id, flat))) != len(flat):  # (one put into a group's list again since)
            raise ValueError(
                "a parameter is in the optimizer's groups more than once: pass each once "
                "(the backends would step it twice, or once, per step)"
            )
        resolved: dict[bool, str] = {}  # is_cuda -> backend, for this step
        # Every bucket is found and checked (gradients, grad_scale's device) before any is
        # updated: a bad one must not leave a half-made step.
        runs, state_keys = [], []
        try:
            for gi, group in enumerate(self.param_groups):
                runs += self._buckets(gi, group, sharded, prepared, resolved, scales)
            # The states too (those a triton plan holds when they changed since it was made).
            state_keys = [self._check_bucket_states(gi, key, ps) for gi, _, key, ps, _ in runs]
        except BaseException:
            for shard in prepared:  # nothing updated: the parameters are written back as were
                shard.finish()
            raise
        for (gi, group, key, ps, scale), state_key in zip(runs, state_keys, strict=True):
            if key[0] == "reference":
                self._step_reference(group, ps, scale)
            else:
                self._step_triton(gi, group, key, ps, scale, state_key)
        for shard in prepared:
            shard.finish()
        return loss

    def _buckets(self, gi, group, sharded, prepared, resolved, scales) -> list[tuple]:
        """``(gi, group, key, params, grad_scale)`` per bucket of group ``gi``: its parameters
        with a gradient, checked, their states made, grouped by (backend, device, dtypes)."""
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            t = p
            if sharded and p in self._shards:  # DTensor: the local shard (or the whole)
                _check_grad(p, g)
                t = self._shards[p].prepare()
                prepared.append(self._shards[p])
                g = t.grad
            elif (
                g.dtype not in _GRAD_DTYPES
                or g.layout != torch.strided
                or g.shape != p.shape
                or g.get_device() != p.get_device()
            ):
                _check_grad(p, g)
            state = self.state[p]
            if not state:
                _check_param(p)  # once per parameter: it may have moved (to meta)
                if p not in self._param_index:  # put into a group's list directly
                    self._adopt(p)
                self._init_state(t, state)
            key = (self._backend(t, resolved), t.get_device(), t.dtype, g.dtype)
            buckets.setdefault(key, []).append(p)
        for key, ps in buckets.items():  # per bucket: a parameter cast after its state was
            if key[2] not in _PARAM_DTYPES:  # made (model.half()) is refused at every step
                _check_param(self._tensor(ps[0]))
        return [
            (gi, group, key, ps, scales.on(self._tensor(ps[0]).device))
            for key, ps in buckets.items()
        ]

    def _tensor(self, p: torch.Tensor) -> torch.Tensor:
        """The plain tensor updated for ``p``: ``p`` itself, or a DTensor's local shard."""
        shard = self._shards.get(p)
        return p if shard is None else shard.work

    def _backend(self, p: torch.Tensor, resolved: dict) -> str:
        """``fp8_quant.resolve_backend``'s choice for ``p`` (the one rule of every package:
        ``FP8_QUANT_BACKEND`` steers ``"auto"`` here too), memoized in ``resolved`` per
        device kind for the step: it depends on nothing else, and a step asks per tensor."""
        cuda = p.is_cuda
        backend = resolved.get(cuda)
        if backend is None:
            backend = resolved[cuda] = resolve_backend(p, self.config.backend)
        return backend

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        cfg = self.config
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        if cfg.high_precision_states:
            for name in _MOMENTS:
                state[name] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            return
        ng = reference.num_groups(p.numel(), cfg.group_size)
        for name, fmt in zip(_MOMENTS, (cfg.m_format, cfg.v_format), strict=True):
            state[_CODES[name]] = torch.zeros(p.shape, dtype=fmt.torch_dtype, device=p.device)
            state[name + "_amax"] = torch.zeros(ng, dtype=torch.float32, device=p.device)
            state[name + "_k"] = torch.full((ng,), 16, dtype=torch.uint8, device=p.device)

    def _options(self, group: dict, p: torch.Tensor) -> dict:
        cfg = self.config
        sr = cfg.stochastic_rounding
        return dict(
            lr=group["lr"],
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            maximize=group["maximize"],
            m_format=cfg.m_format,
            v_format=cfg.v_format,
            m_dre=cfg.m_dre,
            v_dre=cfg.v_dre,
            group_size=cfg.group_size,
            high_precision=cfg.high_precision_states,
            stochastic_rounding=p.dtype == torch.bfloat16 and (sr is None or sr),
        )

    def _bad_counter(self, device: torch.device) -> torch.Tensor:
        if device not in self._bad:
            self._bad[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return self._bad[device]

    def _check_states(self, params, tensors, states) -> None:
        """Raise ``ValueError`` for a state that is no longer what its first step made (its
        keys, shapes, dtypes, device, contiguity): replaced by hand, or left from a
        parameter whose data was replaced by one of another shape."""
        cfg = self.config
        for p, t, s in zip(params, tensors, states, strict=True):
            problem = _state_problem(t, s, cfg)
            if problem is not None:
                raise ValueError(
                    f"the state of parameter {self._param_index[p]} (shape {tuple(t.shape)}, "
                    f"{t.dtype} on {t.device}) {problem}: a state keeps what its first step "
                    "made; clear optimizer.state[p] to start that parameter afresh, or load a "
                    "state dict"
                )

    def _check_bucket_states(self, gi: int, key: tuple, params: list) -> tuple | None:
        """Check the states of a bucket before any bucket is updated: every step on the
        reference backend; on the triton backend when its plan's state key (the states'
        addresses, the tensors' shapes) changed since the plan was made, which is returned.
        States replaced between steps (``state[k] = v.to("cpu")`` ... ``.to("cuda")``, an
        offload) or made anew (``opt.state.clear()``) need a new plan, or the kernel would
        read and write the old, freed ones."""
        tensors = [self._tensor(p) for p in params] if self._shards else params
        states = [self.state[p] for p in params]
        if key[0] == "reference":
            self._check_states(params, tensors, states)
            return None
        try:  # (map over the unbound methods: ~25% less host time than a generator)
            state_key = (  # (shapes: a parameter reshaped in place keeps its addresses)
                *map(_size, tensors),
                *map(_data_ptr, chain.from_iterable([s.values() for s in states])),
            )
        except TypeError:  # a state value that is no tensor: _check_states says which
            state_key = None
        cached = self._plans.get((gi, key))
        if state_key is None or cached is None or cached[2] != state_key:
            self._check_states(params, tensors, states)
        return state_key

    def _step_reference(self, group: dict, params: list[torch.Tensor], grad_scale=None) -> None:
        tensors = [self._tensor(p) for p in params]
        bad = self._bad_counter(tensors[0].device)
        for p, t in zip(params, tensors, strict=True):
            n_bad = reference.adamw_step_(
                t,
                t.grad,
                self.state[p],
                **self._options(group, t),
                seed=self.config.seed,
                param_index=self._param_index[p],
                sr_offset=self._sr_offset.get(p, 0),
                grad_scale=grad_scale,
            )
            bad.add_(n_bad)

    def _step_triton(
        self, gi: int, group: dict, key: tuple, params: list[torch.Tensor], grad_scale=None,
        state_key: tuple | None = None,
    ) -> None:  # fmt: skip
        from . import ops  # Triton is needed only here

        tensors = [self._tensor(p) for p in params] if self._shards else params
        work = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        grads = [t.grad if t.grad.is_contiguous() else t.grad.contiguous() for t in tensors]
        states = [self.state[p] for p in params]
        device = tensors[0].device
        opts = self._options(group, tensors[0])
        lr = opts["lr"]
        if isinstance(lr, torch.Tensor) and lr.device != device:
            if lr.device.type != "cpu":
                raise ValueError(f"lr is a tensor on {lr.device}, parameters are on {device}")
            opts["lr"] = lr.item()  # a CPU tensor: no device sync
        # Parameters and states keep their addresses; gradients usually do not (set_to_none).
        # A plan holds the states' addresses too (``state_key``, checked before the step).
        ptrs = tuple(map(_data_ptr, work))
        grad_ptrs = tuple(map(_data_ptr, grads))
        cached = self._plans.get((gi, key))
        if state_key is None or cached is None or cached[0] != ptrs or cached[2] != state_key:
            plan = ops.make_plan(
                work,
                grads,
                states,
                [reference.sr_stream(self.config.seed, self._param_index[p]) for p in params],
                [self._sr_offset.get(p, 0) for p in params],
                group_size=self.config.group_size,
                high_precision=self.config.high_precision_states,
                launch=self._launch,
            )
            self._plans[(gi, key)] = (ptrs, grad_ptrs, state_key, plan)
        else:
            plan = cached[3]
            if cached[1] != grad_ptrs:
                ops.set_grads(plan, grads)
                self._plans[(gi, key)] = (ptrs, grad_ptrs, state_key, plan)
        bad = self._bad_counter(device)
        ops.fused_adamw_step_(plan, work, grads, states, bad, **opts, grad_scale=grad_scale)
        for w, t in zip(work, tensors, strict=True):
            if w is not t:
                t.copy_(w)
        torch.autograd.graph.increment_version([w for w in work])

    def nonfinite_groups(self, reset: bool = False) -> int:
        """Groups skipped for non-finite values since construction or the last reset (a
        monitoring count: ``state_dict`` does not hold it).

        Reads device counters (a host-device sync): call it every N steps, not every step.
        """
        total = sum(int(c.item()) for c in self._bad.values())
        if reset:
            for c in self._bad.values():
                c.zero_()
        return total

    # ------------------------------------------------------------------ state dicts
    def state_dict(self) -> dict:
        """torch's optimizer format. Per-group numbers have their checkpoint shape
        (``dtensor.group_state_shape``); states of DTensor parameters are DTensors sharded
        like their parameter (plain replicated tensors for "full" ones, see ``dtensor``).
        Hooks of ``register_state_dict_post_hook`` see (and may replace) that format."""
        post_hooks = self._optimizer_state_dict_post_hooks
        sd = self._torch_state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        G = self.config.group_size
        for index, pstate in sd["state"].items():
            p = params[index]
            shard = self._shards.get(p)
            out = {}
            for name, value in pstate.items():
                if shard is not None:
                    value = shard.export(name, value)
                elif name.endswith(PER_GROUP_SUFFIXES):
                    value = value.reshape(group_state_shape(tuple(p.shape), G))
                out[name] = value
            sd["state"][index] = out
        for hook in post_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def _torch_state_dict(self) -> dict:
        """torch's ``state_dict()`` of this optimizer (its pre-hooks run), without the
        post-hooks: they are for the state dict returned."""
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict()
        try:
            return super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``CoatAdamW`` or a ``torch.optim.AdamW`` state dict.

        Tensors go to each parameter's device without changing a bit when the saved format
        matches this optimizer's config; otherwise the moments are converted (AdamW's fp32
        moments quantized, FP8 moments of another format or group size re-quantized, FP8
        moments dequantized for ``high_precision_states``).

        Everything is checked before anything is replaced, so a bad state dict raises
        ``ValueError`` / ``TypeError`` and leaves this optimizer as it was: parameter groups
        (keys and hyperparameters as in the constructor), each state's keys, dtypes and
        shapes (the parameter's shape; per-group numbers one per group), and its values: FP8
        codes not NaN or inf, ``exp_avg_sq`` not negative, ``amax`` zero or a finite normal
        fp32 number, ``k`` not zero, ``step`` a whole number in ``[0, 2**24]``. The checks
        are reductions (no per-element Python), one host read per tensor. Hooks registered
        with ``register_load_state_dict_pre_hook`` / ``_post_hook`` run as in torch's
        optimizers (a pre-hook may return the state dict to load instead).
        """
        # torch's load-state-dict hooks, as torch's optimizers run them: pre-hooks on a shallow
        # copy (one may return a replacement: checked after them), post-hooks once loaded.
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._load_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_state_dict(self, state_dict: dict) -> None:
        if not (
            isinstance(state_dict, dict)
            and isinstance(state_dict.get("state"), dict)
            and isinstance(state_dict.get("param_groups"), list | tuple)
        ):
            raise TypeError(
                "load_state_dict takes an optimizer state dict (a dict with 'state' and "
                "'param_groups', from CoatAdamW.state_dict() or torch.optim.AdamW.state_dict())"
            )
        groups, saved = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved):
            raise ValueError(
                f"state dict has {len(saved)} parameter groups, this optimizer {len(groups)}: load "
                "it into an optimizer built over the same groups as the one that saved it"
            )
        new_groups = []
        for i, (g, s) in enumerate(zip(groups, saved, strict=True)):
            if not isinstance(s, dict) or not isinstance(s.get("params"), list | tuple):
                raise TypeError(f"parameter group {i} of the state dict has no 'params' list")
            if len(g["params"]) != len(s["params"]):
                raise ValueError(
                    f"parameter group {i} has {len(g['params'])} parameters, "
                    f"the state dict's has {len(s['params'])}: load it into an optimizer built "
                    "over the same parameters as the one that saved it"
                )
            if s.get("amsgrad", False):
                raise ValueError("cannot load an amsgrad=True AdamW state dict into CoatAdamW")
            _check_group_keys(s)
            # Tensor values (a tensor lr) copied, as torch's optimizers copy the saved
            # groups: shared, a scheduler stepping the saving optimizer moved this one's too.
            ng = {
                k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                for k, v in s.items()
                if k not in _ADAMW_ONLY_KEYS
            }
            ng.setdefault("maximize", False)
            ng["params"] = g["params"]
            if "param_names" in g:  # as torch does: saved names win, else ours stay
                ng.setdefault("param_names", g["param_names"])
            _check_hyper({**s, **ng})  # the torch keys too (decoupled_weight_decay)
            new_groups.append(ng)
        id_map = dict(
            zip(
                chain.from_iterable(s["params"] for s in saved),
                chain.from_iterable(g["params"] for g in groups),
                strict=True,
            )
        )
        new_state: defaultdict = defaultdict(dict)
        for pid, pstate in state_dict["state"].items():
            if pid not in id_map:
                hint = ""
                if isinstance(pid, str) and not pid.isdigit():  # (renamed by a post-hook)
                    hint = (
                        ": its parameters are keyed by name, so register the load pre-hook "
                        "that maps the names back to the ids of param_groups' 'params' "
                        "(register_load_state_dict_pre_hook)"
                    )
                raise ValueError(f"state dict has state for unknown parameter id {pid!r}{hint}")
            if not isinstance(pstate, dict):  # (before .items(): an AttributeError)
                raise TypeError(f"the state of parameter {pid!r} is not a dict")
            # torch.distributed.checkpoint unflattens a state a parameter lacked to {}.
            pstate = {k: v for k, v in pstate.items() if not (isinstance(v, dict) and not v)}
            if not pstate:
                continue
            p = id_map[pid]
            # (the keys the moments were saved under, for messages)
            saved_as = {m: c if c in pstate else m for m, c in _CODES.items()}
            pstate = _by_moment(pstate, pid)
            _check_saved_state(p, pid, pstate, self.config.group_size, saved_as)
            shard = self._shards.get(p)
            if shard is not None:
                pstate = {k: shard.import_(k, v) for k, v in pstate.items()}
            else:
                pstate = {k: gather(v) if is_dtensor(v) else v for k, v in pstate.items()}
            new_state[p] = self._import_state(self._tensor(p), pstate, pid, saved_as)
        self.state = new_state
        self.param_groups = new_groups
        self._lr_seen = {
            i: g["lr"] for i, g in enumerate(new_groups) if isinstance(g["lr"], torch.Tensor)
        }
        self._plans.clear()

    def load_adamw_state_dict(self, state_dict: dict) -> None:
        """Load a ``torch.optim.AdamW`` state dict (its fp32 moments get quantized)."""
        state = state_dict.get("state") if isinstance(state_dict, dict) else None
        for pstate in state.values() if isinstance(state, dict) else ():
            if isinstance(pstate, dict) and "exp_avg_amax" in pstate:
                raise ValueError("this is a CoatAdamW state dict: use load_state_dict")
        self.load_state_dict(state_dict)  # (which checks the rest, with its errors)

    def to_adamw_state_dict(self) -> dict:
        """This optimizer's state as a ``torch.optim.AdamW`` state dict (fp32 moments).

        ``torch.optim.AdamW(params, ...).load_state_dict(opt.to_adamw_state_dict())`` then
        continues from the dequantized moments.
        """
        sd = self._torch_state_dict()  # this optimizer's own (local) tensors
        index_of = {}
        for g_saved, g in zip(sd["param_groups"], self.param_groups, strict=True):
            index_of.update(zip(g_saved["params"], g["params"], strict=True))
        state = {}
        for idx, s in sd["state"].items():
            if not s:  # a state cleared (to start afresh) or peeked at: none to export
                continue
            p = index_of[idx]
            s = _by_moment(s, idx)
            out = {"step": s["step"].detach().to("cpu", torch.float32).clone()}
            for name in _MOMENTS:
                out[name] = self._moment_fp32(self._tensor(p), s, name).clone()
                if p in self._shards:
                    out[name] = self._shards[p].export_rows(out[name])
            state[idx] = out
        groups = [{**g, "amsgrad": False} for g in sd["param_groups"]]
        return {"state": state, "param_groups": groups}

    def _moment_fp32(self, p: torch.Tensor, s: dict, name: str) -> torch.Tensor:
        x = s[name]
        if name + "_amax" not in s:
            return x.detach().float().reshape(p.shape)
        fmt = _FP8_FORMATS.get(x.dtype)
        if fmt is None:
            raise TypeError(f"state {name} holds {x.dtype}, expected an FP8 dtype")
        amax, k16 = _group_numbers(s, name)
        gs = _infer_group_size(p.numel(), amax.numel(), self.config.group_size)
        x = reference.dequantize(x, amax.to(x.device), k16.to(x.device), fmt, gs)
        return x.reshape(p.shape)

    def _import_state(self, p: torch.Tensor, s: dict, pid, saved_as: dict) -> dict:
        """One parameter's saved state (``_by_moment``'s names; keys, dtypes and shapes
        checked by ``_check_saved_state``; local tensors for a sharded ``p``) -> this
        optimizer's. ``saved_as``: each moment's key as saved, for messages."""
        return _codes_named(self._import_moments(p, s, pid, saved_as))

    def _import_moments(self, p: torch.Tensor, s: dict, pid, saved_as: dict) -> dict:
        cfg = self.config
        if p.is_meta:
            raise ValueError(
                f"parameter {pid!r} is on the meta device: its state would be lost; "
                "materialize the model (to_empty + load the weights) before loading"
            )
        where = f"state of parameter {pid!r} (shape {tuple(p.shape)})"
        if "step" not in s:  # (bias correction would restart with the moments kept)
            raise ValueError(f"{where} has no 'step': pass the state dict as it was saved")
        step = torch.as_tensor(s["step"]).detach()
        _check_step(step, where)
        out = {"step": step.to(torch.float32).reshape(()).to(p.device).clone()}
        for name in _MOMENTS:
            x = s[name]
            fp8 = name + "_amax" in s
            _check_values(x, s, name, where, saved_as[name])
            fmt = cfg.m_format if name == "exp_avg" else cfg.v_format
            same = (
                not cfg.high_precision_states
                and fp8
                and x.dtype == fmt.torch_dtype
                and s[name + "_amax"].numel() == reference.num_groups(p.numel(), cfg.group_size)
            )
            if same:  # bit-exact copy (contiguous: the update kernel reads flat memory)
                amax, k16 = _group_numbers(s, name)
                out[name] = _own(x.reshape(p.shape), p.device)
                out[name + "_amax"] = _own(amax, p.device)
                out[name + "_k"] = _own(k16, p.device)
                continue
            val = self._moment_fp32(p, s, name).to(p.device, torch.float32)
            if cfg.high_precision_states:
                out[name] = _own(val, p.device)
            else:
                dre = cfg.m_dre if name == "exp_avg" else cfg.v_dre
                codes, amax, k16 = reference.quantize(val, fmt, cfg.group_size, dre)
                out[name], out[name + "_amax"], out[name + "_k"] = codes, amax, k16
        return out


def _own(t: torch.Tensor, device) -> torch.Tensor:
    """A contiguous copy of ``t`` on ``device``, detached (the update kernel reads a state
    tensor as flat memory: a transposed one loaded as it was would be read out of order)."""
    return t.detach().to(device, copy=True, memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------- checks
def _state_problem(t: torch.Tensor, s: dict, cfg: CoatAdamWConfig) -> str | None:
    """What is wrong with ``s``, the live state of the tensor ``t`` (its local shard for a
    DTensor), or None."""
    want = {"step": ((), torch.float32)}
    if cfg.high_precision_states:
        want.update({name: (t.shape, torch.float32) for name in _MOMENTS})
    else:
        ng = (reference.num_groups(t.numel(), cfg.group_size),)
        for name, fmt in zip(_MOMENTS, (cfg.m_format, cfg.v_format), strict=True):
            want[_CODES[name]] = (t.shape, fmt.torch_dtype)
            want[name + "_amax"] = (ng, torch.float32)
            want[name + "_k"] = (ng, torch.uint8)
    if s.keys() != want.keys():
        return f"has the keys {sorted(map(str, s))}, not {sorted(want)}"
    for name, (shape, dtype) in want.items():
        v = s[name]
        if not isinstance(v, torch.Tensor):
            return f"holds a {type(v).__name__} as {name}, not a tensor"
        if v.shape != shape or v.dtype != dtype:
            return (
                f"has {name} of shape {tuple(v.shape)} and {v.dtype}, not {tuple(shape)} and "
                f"{dtype}"
            )
        if v.device != t.device:
            return f"has {name} on {v.device}"
        if not v.is_contiguous():
            return f"has a non-contiguous {name}"
    return None


def _check_param(p) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"params must be tensors, got {type(p).__name__}")
    if p.is_complex():
        raise TypeError(
            "CoatAdamW does not support complex parameters; view them as real "
            "(torch.view_as_real) first"
        )
    if p.dtype not in _PARAM_DTYPES:
        raise TypeError(
            f"CoatAdamW updates float32 or bfloat16 parameters, got {p.dtype} (shape "
            f"{tuple(p.shape)}): keep fp32 master weights, or bf16 with stochastic rounding"
        )
    if p.is_sparse:
        raise TypeError("CoatAdamW does not support sparse parameters")
    if p.is_meta:
        raise ValueError(
            f"a parameter of shape {tuple(p.shape)} is on the meta device (no data): create "
            "CoatAdamW after materializing the model (model.to_empty(device=...), then load "
            "or initialize the weights)"
        )


def _check_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    if g.layout != torch.strided:
        raise RuntimeError(
            "CoatAdamW does not support sparse gradients; use torch.optim.SparseAdam"
        )
    if g.dtype not in _GRAD_DTYPES:
        raise TypeError(
            f"gradients must be float32, bfloat16 or float16, got {g.dtype} for a parameter "
            f"of shape {tuple(p.shape)}"
        )
    if g.shape != p.shape or g.device != p.device:
        raise ValueError(
            f"gradient {tuple(g.shape)} on {g.device} does not match its parameter "
            f"{tuple(p.shape)} on {p.device}"
        )


def _check_group_keys(group: dict) -> None:
    """Refuse (``ValueError``) another optimizer's setting, another name or a near-miss of a
    key that changes the update; remember the harmless rest (a step checks only new keys)."""
    bad = []
    for k, v in group.items():
        if k in _KEYS_SEEN:
            continue
        if k in _ADAMW_VALUES:
            if v is not _ADAMW_VALUES[k]:
                bad.append(f"{k!r} ({v!r}: CoatAdamW updates as {k}={_ADAMW_VALUES[k]} does)")
            continue  # (not remembered: its value is checked at every step)
        meant = _meant_key(k)
        if k in _FOREIGN_KEYS:
            bad.append(f"{k!r} (another optimizer's state format)")
        elif meant is not None:
            bad.append(f"{k!r} (did you mean {meant!r}?)")
        elif isinstance(k, str) and len(_KEYS_SEEN) < 1024:
            _KEYS_SEEN.add(k)
    if bad:
        raise ValueError(
            f"unknown parameter-group key(s) {', '.join(bad)}: CoatAdamW takes "
            f"{', '.join(_OWN_KEYS)} (and the keys torch.optim.AdamW and torch's LR schedulers "
            "add); the FP8 state format is set by config=CoatAdamWConfig(...); remove the "
            "key (from a state dict's param_groups too, to load it)"
        )


def _meant_key(key) -> str | None:
    """The key that changes the update which ``key`` looks like a slip for: the same letters
    in another case or with other separators ("LR", "lr_", "WeightDecay"), another name
    ("epsilon", "wd"), or, for the longer keys, one letter added, dropped, changed or two
    swapped ("weight_decya", "maximise", "beta")."""
    if not isinstance(key, str):
        return None
    k = "".join(c for c in key.lower() if c.isalnum())
    if k in _SYNONYMS:
        return _SYNONYMS[k]
    for name in _UPDATE_KEYS:
        n = name.replace("_", "")
        if k == n or (len(n) > 3 and _one_slip(k, n)):
            return name
    return None


def _one_slip(a: str, b: str) -> bool:
    """Whether ``a`` is ``b`` with one letter added, dropped or changed, or two neighbours
    swapped."""
    if a == b or abs(len(a) - len(b)) > 1:
        return a == b
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (
            len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]]
            and a[diff[1]] == b[diff[0]]
        )  # fmt: skip
    short, long = (a, b) if len(a) < len(b) else (b, a)
    return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


def _as_float(x):
    """A real scalar that torch.optim.AdamW takes (a numpy float, a one-element CPU tensor:
    betas) as a float; anything else as it is, for the checks to refuse."""
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, torch.Tensor) and x.numel() == 1 and x.device.type == "cpu":
        return x.item() if x.is_floating_point() else x
    return x


def _check_hyper(group: dict, read_lr: bool = True) -> None:
    """Hyperparameters of one param group. Runs at every step: a few type checks and
    comparisons. A tensor lr's value is read when it is on the CPU (free) or ``read_lr``."""
    for key in _OWN_KEYS[1:]:
        if key not in group:
            raise ValueError(f"a parameter group lacks {key!r}")
    for key in ("lr", "eps", "weight_decay"):  # (a schedule may write numpy scalars)
        if not isinstance(group[key], int | float | torch.Tensor):
            group[key] = _as_float(group[key])
    betas = group["betas"]
    if isinstance(betas, tuple | list) and not all(isinstance(b, int | float) for b in betas):
        group["betas"] = tuple(_as_float(b) for b in betas)
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or not lr.is_floating_point() or lr.is_meta:
            raise ValueError("a tensor lr must hold one floating-point value (not on meta)")
        if read_lr or lr.device.type == "cpu":
            value = lr.item()
            if not 0.0 <= value <= _FP32_MAX:
                raise ValueError(
                    f"lr must be in [0, {_FP32_MAX:.4g}] (fp32's range), the lr tensor holds "
                    f"{value}"
                )
    elif isinstance(lr, bool) or not isinstance(lr, int | float) or not 0.0 <= lr <= _FP32_MAX:
        raise ValueError(
            f"lr must be a float in [0, {_FP32_MAX:.4g}] (fp32's range) or a 1-element tensor, "
            f"got {lr!r}"
        )
    betas = group["betas"]
    if (
        not isinstance(betas, tuple | list)
        or len(betas) != 2
        or not all(isinstance(b, int | float) and not isinstance(b, bool) for b in betas)
    ):
        raise ValueError(f"betas must be a pair of floats, got {betas!r}")
    for i, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {b}")
    for name in ("eps", "weight_decay"):
        x = group[name]
        if isinstance(x, bool) or not isinstance(x, int | float) or not (0.0 <= x <= _FP32_MAX):
            hint = f": pass float({name}), set again when it changes" if torch.is_tensor(x) else ""
            raise ValueError(
                f"{name} must be a float in [0, {_FP32_MAX:.4g}] (fp32's range), got {x!r}{hint}"
            )
    if not isinstance(group["maximize"], bool):
        raise ValueError(f"maximize must be True or False, got {group['maximize']!r}")
    # Of torch's own keys only these would change the update.
    if group.get("amsgrad", False):
        raise ValueError("CoatAdamW does not support amsgrad=True")
    if group.get("differentiable", False):
        raise ValueError(
            "CoatAdamW does not support differentiable=True: use torch.optim.AdamW for "
            "differentiating through the update"
        )
    if group.get("decoupled_weight_decay", True) is False and group["weight_decay"]:
        raise ValueError(
            "decoupled_weight_decay=False (torch.optim.Adam's L2 penalty) with "
            "weight_decay != 0: CoatAdamW decays weights decoupled, as AdamW does"
        )


def _by_moment(s: dict, pid) -> dict:
    """One parameter's state (as kept or saved) with FP8 codes under their moment's name
    (``exp_avg_fp8`` -> ``exp_avg``). State dicts saved before the codes had names of their
    own hold them so already, and load as well."""
    if not any(k in s for k in _CODES.values()):
        return s
    out = dict(s)
    for name, codes in _CODES.items():
        if codes not in out:
            continue
        if name in out:
            raise ValueError(f"state of parameter {pid!r} has both {name!r} and {codes!r}")
        if name + "_amax" not in out:
            raise ValueError(
                f"state of parameter {pid!r} has {codes!r} (FP8 codes) without "
                f"{name + '_amax'!r}: pass the state dict as CoatAdamW.state_dict() gave it"
            )
        out[name] = out.pop(codes)
    return out


def _codes_named(s: dict) -> dict:
    """``_by_moment`` undone: FP8 codes (a moment with ``_amax`` beside it) under
    ``_CODES``' names, as the optimizer keeps them."""
    return {_CODES[k] if k in _CODES and k + "_amax" in s else k: v for k, v in s.items()}


def _check_saved_state(p: torch.Tensor, pid, s: dict, group_size: int, saved_as: dict) -> None:
    """Keys, types, dtypes and (global) shapes of one parameter's saved state
    (``_by_moment``'s names; ``saved_as``: each moment's key as saved, for messages)."""
    where = f"state of parameter {pid!r} (shape {tuple(p.shape)})"
    if "max_exp_avg_sq" in s:
        raise ValueError("cannot load amsgrad state (max_exp_avg_sq) into CoatAdamW")
    unknown = sorted(str(k) for k in s if k not in _SAVED_KEYS)
    if unknown:
        known = ", ".join((*_SAVED_KEYS, *_CODES.values()))
        raise ValueError(f"{where} has unknown keys {unknown}; expected {known}")
    for name in _MOMENTS:
        if name not in s:
            raise ValueError(f"{where} lacks {name!r}")
        x = s[name]
        key = saved_as[name]
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{where}: {key} is a {type(x).__name__}, not a tensor")
        if tuple(x.shape) != tuple(p.shape):
            raise ValueError(
                f"{where}: {key} has shape {tuple(x.shape)}, not the parameter's: is the "
                "state dict from another model, or are its parameters in another order?"
            )
        amax_key, k_key = name + "_amax", name + "_k"
        if (amax_key in s) != (k_key in s):
            have, lack = (amax_key, k_key) if amax_key in s else (k_key, amax_key)
            raise ValueError(f"{where} has {have} but not {lack}")
        if amax_key not in s:
            if not x.is_floating_point() or x.dtype in _FP8_FORMATS:
                raise TypeError(
                    f"{where}: {name} holds {x.dtype}; expected a float tensor, or FP8 codes "
                    f"with {amax_key} and {k_key}"
                )
            continue
        if x.dtype not in _FP8_FORMATS:
            raise TypeError(
                f"{where}: {key} holds {x.dtype} next to {amax_key}; expected FP8 codes "
                "(float8_e4m3fn or float8_e5m2)"
            )
        amax, k16 = s[amax_key], s[k_key]
        if not (isinstance(amax, torch.Tensor) and isinstance(k16, torch.Tensor)):
            raise TypeError(f"{where}: {amax_key} and {k_key} must be tensors")
        if amax.dtype != torch.float32 or k16.dtype != torch.uint8 or amax.shape != k16.shape:
            raise TypeError(f"{where}: {amax_key} must be float32, {k_key} uint8, one per group")
        try:
            gs = _infer_group_size(p.numel(), amax.numel(), group_size)
        except ValueError as e:
            raise ValueError(f"{where}: {amax_key}: {e}") from None
        shapes = {(amax.numel(),), group_state_shape(tuple(p.shape), gs)}
        if p.numel() == 0 and amax.numel() == 0:  # no groups: the shape of (0, 128)'s states
            shapes.add(tuple(amax.shape))  # at G = 128, (0, 1), tells nothing to G = 64
        if tuple(amax.shape) not in shapes:
            raise ValueError(
                f"{where}: {amax_key} has shape {tuple(amax.shape)}, expected one of "
                f"{sorted(shapes)} (groups of {gs})"
            )


def _check_step(step: torch.Tensor, where: str) -> None:
    if step.numel() != 1 or step.dtype == torch.bool or step.is_complex():
        raise TypeError(f"{where}: step must be one real number, got {step!r}")
    value = step.item()
    if not (0 <= value <= _STEP_MAX and value == int(value)):
        raise ValueError(f"{where}: step must be a whole number in [0, 2**24], got {value}")


def _check_values(x: torch.Tensor, s: dict, name: str, where: str, key: str) -> None:
    """Values of one moment as saved (local tensors). The update of a NaN code, a negative
    second moment, a zero ``k`` or a negative or subnormal ``amax`` is undefined (and the two
    backends disagree on it). Reductions only, no elementwise temporaries, one host read per
    tensor: a 4096 x 11008 FP8 moment takes ~3 ms on one CPU core."""
    x = x.detach()
    if name + "_amax" not in s:  # fp32 (bf16, ...) moments: AdamW's, high_precision_states
        if x.numel():
            lo, hi = torch.stack(torch.aminmax(x.reshape(-1))).tolist()  # NaN propagates
            floor = 0.0 if name == "exp_avg_sq" else -_FP32_MAX
            if not (floor <= lo and hi <= _FP32_MAX):
                what = "negative, NaN or inf" if name == "exp_avg_sq" else "NaN or inf"
                raise ValueError(f"{where}: {name} holds {what} values")
        return
    # FP8 codes as bytes. Magnitudes order like their low 7 bits, so a positive code is
    # finite exactly when it is <= the bits of the format's max (``top``): the largest code
    # read as int8 bounds the positive ones, the largest read as uint8 the negative ones
    # (0x80 is -0).
    if x.numel():
        b = x.reshape(-1).view(torch.uint8)
        pos, top_byte = torch.stack((b.view(torch.int8).amax().short(), b.amax().short())).tolist()
        top = _TOP_CODE[x.dtype]
        if name == "exp_avg_sq" and not (pos <= top and top_byte <= 0x80):
            raise ValueError(f"{where}: {key} holds NaN, inf or negative FP8 codes")
        if not (pos <= top and top_byte <= 0x80 + top):
            raise ValueError(f"{where}: {key} holds NaN or inf FP8 codes")
    amax, k16 = _group_numbers(s, name)
    amax = amax.detach()
    ok = (amax == 0) | ((amax >= reference.FLUSH_BELOW) & (amax <= _FP32_MAX))
    if not ok.all().item():
        raise ValueError(
            f"{where}: {name}_amax holds {amax[~ok][0].item()!r}; each group's amax must be "
            "0 or a finite normal fp32 value (>= 2**-126)"
        )
    if k16.numel() and k16.amin().item() == 0:
        raise ValueError(f"{where}: {name}_k holds 0; it stores 16 * k, k in [1/16, 255/16]")


def _group_numbers(s: dict, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax, k16)`` of a moment, flat (state dicts may shape them ``(rows, groups)``)."""
    amax, k16 = s[name + "_amax"], s[name + "_k"]
    if amax.dtype != torch.float32 or k16.dtype != torch.uint8 or amax.shape != k16.shape:
        raise TypeError(f"state {name}_amax must be float32 and {name}_k uint8, one per group")
    return amax.reshape(-1), k16.reshape(-1)


def _infer_group_size(numel: int, ngroups: int, preferred: int) -> int:
    # Groups of G elements from element 0: for powers of two G < numel, ceil(numel / G)
    # differs for every G, so the number of groups tells the saved group size.
    if ngroups == reference.num_groups(numel, preferred):
        return preferred
    if ngroups == 1 and numel > 0:
        return max(16, 1 << max(numel - 1, 0).bit_length())
    for e in range(4, 31):
        if reference.num_groups(numel, 1 << e) == ngroups:
            return 1 << e
    raise ValueError(f"{ngroups} groups do not fit a parameter of {numel} elements")


class _GradScales:
    """``step``'s ``grad_scale`` as a 0-dim fp32 tensor per device (None: no scaling),
    checked once per step."""

    def __init__(self, scale):
        if isinstance(scale, numbers.Real) and not isinstance(scale, int | float | bool):
            scale = float(scale)  # (a numpy scalar: np.float32 from a loss scaler)
        if scale is not None and not (
            (isinstance(scale, torch.Tensor) and scale.dim() == 0 and scale.is_floating_point())
            or (isinstance(scale, int | float) and not isinstance(scale, bool))
        ):
            raise TypeError(
                "grad_scale must be a 0-dim floating tensor or a number (the factor for every "
                f"gradient), got {scale!r}"
            )
        self._scale = scale
        self._on: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor | None:
        s = self._scale
        if s is None:
            return None
        t = self._on.get(device)
        if t is None:
            if isinstance(s, torch.Tensor):
                if s.device != device:
                    raise ValueError(
                        f"grad_scale is on {s.device}, parameters on {device}: pass it on the "
                        "parameters' device (a number works anywhere)"
                    )
                t = s if s.dtype == torch.float32 else s.float()
            else:
                t = torch.tensor(float(s), dtype=torch.float32, device=device)
            self._on[device] = t
        return t
