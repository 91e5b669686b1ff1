"""FP8ActivationConfig: the former name FP8Config still imports (same class) and warns."""

from __future__ import annotations

import importlib
import sys
import warnings

import fp8_activations
import pytest
from fp8_activations import FP8ActivationConfig


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
    # The import system looks the name up twice (hasattr, then getattr); both warnings point
    # at this line, so Python's once-per-location filter shows one.
    assert caught and all(w.category is DeprecationWarning for w in caught)
    assert {(w.filename, w.lineno) for w in caught} == {(__file__, line)}


def test_unknown_names_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'FP8Cfg'"):
        fp8_activations.FP8Cfg  # noqa: B018
    assert "FP8Config" not in fp8_activations.__all__
    assert "FP8ActivationConfig" in fp8_activations.__all__
