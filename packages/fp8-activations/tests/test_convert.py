"""convert_to_fp8_activations called again, and on what is no module."""

import pytest
from fp8_activations import convert_to_fp8_activations
from torch import nn


def test_converting_again_applies_the_new_config_and_bad_models_are_type_errors():
    """Called again with another config, the modules converted before take it (they kept
    the first one without a word); a model that is no module is a TypeError naming the
    type (it was an AttributeError), for revert too."""
    from fp8_activations import FP8ActivationConfig, revert_fp8_activations

    model = nn.Sequential(nn.Linear(32, 32), nn.GELU())
    convert_to_fp8_activations(model, config=FP8ActivationConfig(group_size=16))
    convert_to_fp8_activations(model, config=FP8ActivationConfig(group_size=32))
    assert [m.config.group_size for m in model] == [32, 32]
    keep = FP8ActivationConfig(group_size=16)
    convert_to_fp8_activations(model, config=keep, module_filter_fn=lambda m, fqn: fqn != "1")
    assert [m.config.group_size for m in model] == [16, 32]
    for call in (convert_to_fp8_activations, revert_fp8_activations):
        with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
            call("x")
