"""Each package's top-level ``__all__`` is its public API, exactly: every name it lists is
public and importable, and every public name the package module holds (other than
submodules and ``__version__``) is listed. Private helpers stay out of it."""

from __future__ import annotations

import importlib
import types

import pytest

PACKAGES = ["fp8_quant", "fp8_optim", "fp8_activations", "coat_models"]
# Names a reader finds in the README of each package and in this task's renames: a guard
# against a public name dropping out of __all__ together with its import.
DOCUMENTED = {
    "fp8_quant": {"Backend", "FP8Format", "quantize_per_group", "resolve_backend"},
    "fp8_optim": {"CoatAdamW", "CoatAdamWConfig"},
    "fp8_activations": {
        "FP8ActivationConfig",
        "convert_to_fp8_activations",
        "handed_over",
        "HandOver",
        "weight_cache_fresh",
    },
    "coat_models": {"apply_coat", "revert_coat", "create_optimizer", "enable_cuda_graphs"},
}


def public_names(module: types.ModuleType) -> set[str]:
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }


def test_scanner_sees_an_unlisted_name():
    fake = types.ModuleType("fake")
    fake.listed, fake.unlisted, fake._private = 1, 2, 3
    fake.sub = types.ModuleType("fake.sub")
    assert public_names(fake) == {"listed", "unlisted"}


@pytest.mark.parametrize("package", PACKAGES)
def test_all_is_the_public_api(package):
    module = importlib.import_module(package)
    listed = module.__all__
    assert listed == sorted(listed), "keep __all__ sorted"
    assert len(set(listed)) == len(listed), "a name is listed twice"
    assert not [n for n in listed if n.startswith("_")], "private names in __all__"
    missing = [n for n in listed if not hasattr(module, n)]
    assert not missing, f"__all__ lists names the package does not have: {missing}"
    unlisted = sorted(public_names(module) - set(listed))
    assert not unlisted, f"public names missing from {package}.__all__: {unlisted}"
    assert DOCUMENTED[package] <= set(listed)


@pytest.mark.parametrize("package", PACKAGES)
def test_star_import_gives_exactly_all(package):
    namespace: dict = {}
    exec(f"from {package} import *", namespace)
    namespace.pop("__builtins__")
    assert set(namespace) == set(importlib.import_module(package).__all__)


@pytest.mark.parametrize(
    "where, name, positional",
    [
        ("coat_models", "apply_coat", []),
        # (torch.optim's order: lr and friends may be positional, as in CoatAdamW)
        ("coat_models", "create_optimizer", ["lr", "weight_decay", "betas"]),
        ("coat_models.plans", "enable_launch_plans", []),
        ("fp8_activations", "convert_to_fp8_activations", []),
    ],
)
def test_settings_of_the_entry_points_are_keyword_only(where, name, positional):
    """One grammar (torchao's ``convert_to_float8_training``): the model positionally, every
    setting by keyword (those named in ``positional`` aside)."""
    import inspect

    params = list(
        inspect.signature(getattr(importlib.import_module(where), name)).parameters.values()
    )
    assert params[0].name == "model"
    by_keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD)
    assert [p.name for p in params[1:] if p.kind not in by_keyword] == positional
