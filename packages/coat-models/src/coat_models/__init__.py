"""coat_models: COAT FP8 training for Hugging Face Llama-shaped models.

>>> from coat_models import apply_coat, create_optimizer
>>> apply_coat(model)                          # in place; eval()/generate() stay plain
>>> optimizer = create_optimizer(model, lr=3e-4)
"""

from .compiling import compile_layers
from .convert import apply_coat, revert_coat
from .graphs import disable_cuda_graphs, enable_cuda_graphs
from .llama import is_coat
from .loss import linear_cross_entropy
from .optim import create_optimizer, param_groups

__version__ = "0.1.0"

__all__ = [
    "apply_coat",
    "compile_layers",
    "create_optimizer",
    "disable_cuda_graphs",
    "enable_cuda_graphs",
    "is_coat",
    "linear_cross_entropy",
    "param_groups",
    "revert_coat",
]
