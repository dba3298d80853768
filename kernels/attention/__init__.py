"""Causal attention with a padding mask over (optionally cached) keys.

One entry point, :func:`attention`; ``impl`` picks the implementation ("auto" by backend).
"""

from kernels.attention.dispatch import attention
from kernels.attention.reference import attention_reference

__all__ = ["attention", "attention_reference"]
