"""Causal attention with a padding mask over (optionally cached) keys.

One entry point, :func:`attention`; ``impl`` picks the implementation ("auto" by backend):
the plain-jnp reference ("xla"), Pallas flash attention (training, prefill) and decode
attention (a few tokens over a KV cache), or cuDNN.
"""

from kernels.attention.decode import DecodeBlockSizes, decode_attention
from kernels.attention.dispatch import IMPLS, attention
from kernels.attention.flash import BlockSizes, flash_attention
from kernels.attention.reference import attention_reference

__all__ = ["attention", "attention_reference", "flash_attention", "decode_attention",
           "BlockSizes", "DecodeBlockSizes", "IMPLS"]
