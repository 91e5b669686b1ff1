"""coat_models: COAT FP8 training for Hugging Face Llama-shaped models.

>>> from coat_models import apply_coat, create_optimizer
>>> apply_coat(model)                          # in place; eval()/generate() stay plain
>>> optimizer = create_optimizer(model, lr=3e-4)

The names below are imported on first use (``import coat_models`` imports neither torch nor
transformers): ``coat-train`` starts in a module that can answer a Ctrl-C during the imports.
"""

import importlib

__version__ = "0.1.0"

# public name -> the module defining it
_WHERE = {
    "apply_coat": "convert",
    "compile_layers": "compiling",
    "create_optimizer": "optim",
    "disable_cuda_graphs": "graphs",
    "enable_cuda_graphs": "graphs",
    "is_coat": "llama",
    "linear_cross_entropy": "loss",
    "param_groups": "optim",
    "revert_coat": "convert",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        # A submodule not imported yet (``coat_models.llama``) is imported as such.
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
