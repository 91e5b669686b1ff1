"""fp8_optim: CoatAdamW, AdamW with FP8 optimizer states and Dynamic Range Expansion (COAT).

>>> from fp8_optim import CoatAdamW, CoatAdamWConfig
>>> opt = CoatAdamW(model.parameters(), lr=3e-4, config=CoatAdamWConfig(v_format="e5m2"))
"""

from .config import CoatAdamWConfig
from .optimizer import CoatAdamW

__version__ = "0.1.0"

__all__ = ["CoatAdamW", "CoatAdamWConfig"]
