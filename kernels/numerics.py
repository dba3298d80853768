"""Sums whose rounding does not depend on the shape of the array around them.

XLA's CPU compiler picks how to vectorise a reduction from the whole array's shape, so the
float32 sum of one row over a short minor axis (an RMSNorm over ``d_model`` < ~300 lanes, a
softmax over a few dozen keys, a vocabulary tile of 64) can round differently when the batch
has 1, 4 or 8 rows, or 12 or 20 positions (measured: benchmarks/NOTES.md, "bf16 parity").  A
decode step and the trainer's forward then disagree in the last bit of a norm, which a bf16
rounding can turn into a whole bf16 step.  :func:`fixed_order_sum` adds in one order fixed by
the axis length alone -- a pairwise tree of elementwise adds -- so every row rounds the same
whatever the rest of the array looks like (and a pairwise sum is the more accurate one)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fixed_order_sum(x: jax.Array, keepdims: bool = False) -> jax.Array:
  """The sum over the last axis as a pairwise tree: zero lanes out to the next power of two,
  then halves added elementwise until one lane is left.  The order depends only on the last
  axis's length, so a row's sum is the same bits in any batch and any fusion; and zero lanes
  at the end (masked key slots, a longer cache) change nothing: while the upper half is all
  zeros a halving adds exact zeros, so the tree over ``2^k`` lanes is the tree over the
  smallest power of two that holds the last non-zero lane."""
  # Materialised first: fused with the op that makes it, a product feeding the first adds is
  # contracted into fused multiply-adds (XLA:CPU), or not, as that fusion happens to form.
  x = jax.lax.optimization_barrier(x)
  n = x.shape[-1]
  width = 1 << max(n - 1, 0).bit_length()
  if width != n:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = x[..., :half] + x[..., half:]
  return x if keepdims else x[..., 0]
