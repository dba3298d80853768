"""Masked batch statistics shared by advantage whitening, group advantages and reward
normalisation, so that every z-score in the package follows one convention (docs/conventions.md):

  z = (x - mean) / (std + eps),   std unbiased (ddof=1), 0 when fewer than two valid entries.

Reductions run over the whole array given; under ``jit`` on a sharded array that is the global
batch (XLA inserts the cross-device sums).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_moments(x, mask, *, axis=None):
  """(mean, std, count) of ``x`` over entries where ``mask`` is true, reduced over ``axis``
  (kept as size-1 dimensions so the results broadcast against ``x``).

  The mean is computed around a valid member of the set (its maximum), so a set of equal values
  has exactly that value as its mean and exactly zero deviations: equal rewards give zero
  advantages, never rounding noise divided by ``eps``.  Invalid entries may hold NaN or inf.
  """
  mask = jnp.asarray(mask).astype(bool)
  # Zeroed first: a NaN under the mask would otherwise turn gradients into 0 * NaN.
  x = jnp.where(mask, jnp.asarray(x, jnp.float32), 0.0)
  count = jnp.sum(mask, axis=axis, keepdims=True).astype(jnp.float32)
  ref = jnp.max(jnp.where(mask, x, -jnp.inf), axis=axis, keepdims=True)
  # The result does not depend on ref (it cancels), so no gradient needs to flow through it.
  ref = jax.lax.stop_gradient(jnp.where(count > 0, ref, 0.0))
  shifted = jnp.where(mask, x - ref, 0.0)
  mean = ref + jnp.sum(shifted, axis=axis, keepdims=True) / jnp.maximum(count, 1.0)
  dev = jnp.where(mask, x - mean, 0.0)
  var = jnp.sum(dev * dev, axis=axis, keepdims=True) / jnp.maximum(count - 1.0, 1.0)
  # sqrt has an infinite slope at 0; keep gradients finite for equal-valued sets.
  pos = var > 0
  std = jnp.where(pos, jnp.sqrt(jnp.where(pos, var, 1.0)), 0.0)
  return mean, std, count


def masked_zscore(x, mask, *, axis=None, eps: float):
  """``((x - mean) / (std + eps), mean, std)`` over valid entries (see :func:`masked_moments`);
  the z-score is 0 at invalid entries."""
  mask = jnp.asarray(mask).astype(bool)
  x = jnp.where(mask, jnp.asarray(x, jnp.float32), 0.0)
  mean, std, _ = masked_moments(x, mask, axis=axis)
  return jnp.where(mask, (x - mean) / (std + eps), 0.0), mean, std
