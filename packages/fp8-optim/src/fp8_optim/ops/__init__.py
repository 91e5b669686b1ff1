"""Triton kernels of fp8_optim (CUDA; CPU under ``TRITON_INTERPRET=1``), one module per op.

``adamw``: the fused multi-tensor CoatAdamW step; ``reference.adamw_step_`` is its oracle.
"""

from .adamw import AdamWLaunch, Plan, fused_adamw_step_, make_plan, set_grads

__all__ = ["AdamWLaunch", "Plan", "fused_adamw_step_", "make_plan", "set_grads"]
