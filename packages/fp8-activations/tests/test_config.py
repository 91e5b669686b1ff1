"""FP8ActivationConfig: the former name FP8Config still imports (same class) and warns; the
backend is fp8_quant.Backend, given as the enum or its string."""

from __future__ import annotations

import importlib
import sys
import warnings

import fp8_activations
import pytest
from fp8_activations import FP8ActivationConfig
from fp8_quant import Backend


@pytest.mark.parametrize("module", ["fp8_activations", "fp8_activations.config"])
def test_old_name_is_the_same_class_and_warns(module):
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match="FP8Config is renamed FP8ActivationConfig"):
        old = mod.FP8Config
    assert old is FP8ActivationConfig
    # Code written against the old name builds the same configs.
    with pytest.warns(DeprecationWarning):
        assert mod.FP8Config(group_size=32) == FP8ActivationConfig(group_size=32)


def test_old_name_import_statement_warns_at_the_importing_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        from fp8_activations import FP8Config  # noqa: F401
    # The import system looks the name up twice (hasattr, then getattr): one warning, at
    # this line, also under the "always" filter (it gave two).
    assert [(w.category, w.filename, w.lineno) for w in caught] == [
        (DeprecationWarning, __file__, line)
    ]


def test_unknown_names_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'FP8Cfg'"):
        fp8_activations.FP8Cfg  # noqa: B018
    assert "FP8Config" not in fp8_activations.__all__
    assert "FP8ActivationConfig" in fp8_activations.__all__


@pytest.mark.parametrize("backend", ["auto", "triton", "reference", *Backend], ids=repr)
def test_backend_is_stored_as_the_enum(backend):
    cfg = FP8ActivationConfig(backend=backend)
    assert type(cfg.backend) is Backend and cfg.backend == Backend.parse(backend)
    # Either spelling gives the same config (equal and hashing alike: it keys caches).
    other = FP8ActivationConfig(backend=str(backend))
    assert other == cfg and hash(other) == hash(cfg)
    assert cfg.replace(backend="reference").backend is Backend.REFERENCE


def test_bad_backend_names_the_valid_values():
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'triton', 'ref"):
        FP8ActivationConfig(backend="cuda")


def test_enum_backend_runs_the_same_bits_as_its_string(backend):
    import torch

    x = torch.randn(4, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    outs = []
    for b in (backend, Backend(backend)):
        y = fp8_activations.fp8_linear(fp8_activations.silu(x, FP8ActivationConfig(backend=b)), w,
                                       None, FP8ActivationConfig(backend=b))  # fmt: skip
        y.backward(torch.ones_like(y))
        outs.append([y.detach(), x.grad, w.grad])
        x.grad = w.grad = None
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_numpy_integer_group_size_is_an_int():
    """A sweep's np.int64(64) was refused: "must be a positive power of two, got np.int64(64)"."""
    import numpy as np

    cfg = FP8ActivationConfig(group_size=np.int64(64))
    assert cfg.group_size == 64 and type(cfg.group_size) is int
    with pytest.raises(ValueError, match="power of two"):
        FP8ActivationConfig(group_size=np.int64(48))
