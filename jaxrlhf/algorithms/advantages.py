"""Advantage estimators: GAE over per-token rewards and values (PPO), masked whitening over the
global batch, and outcome-level group advantages (GRPO, Dr. GRPO, RLOO, REINFORCE++).

Every function returns constants (``stop_gradient``): advantages and returns are targets.
Conventions are in docs/conventions.md; the z-score rule is the one in
:mod:`jaxrlhf.algorithms.stats`: ``(x - mean) / (std + eps)``, unbiased std, equal values -> 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrlhf.algorithms.stats import masked_moments, masked_zscore

GROUP_METHODS = ("grpo", "drgrpo", "rloo", "reinforce_pp")


def gae(rewards_BT, values_BT, mask_BT, *, gamma: float, lam: float):
  """Generalised advantage estimation by a reverse ``lax.scan`` over time.

  ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``, where
  "next" is the next *valid* token of the row and is 0 past the last one (the episode ends
  there: no bootstrap).  Masked positions are skipped, so left padding, right padding and holes
  all behave as if the valid tokens were contiguous.  Returns ``(advantages_BT, returns_BT)``
  with ``returns = advantages + values``, both 0 at masked positions.
  """
  mask_BT = jnp.asarray(mask_BT).astype(bool)
  r_BT = jnp.where(mask_BT, jnp.asarray(rewards_BT, jnp.float32), 0.0)
  v_BT = jnp.where(mask_BT, jnp.asarray(values_BT, jnp.float32), 0.0)

  def step(carry, xs):
    next_v_B, next_adv_B = carry
    r_B, v_B, m_B = xs
    adv_B = r_B + gamma * next_v_B - v_B + gamma * lam * next_adv_B
    adv_B = jnp.where(m_B, adv_B, 0.0)
    carry = (jnp.where(m_B, v_B, next_v_B), jnp.where(m_B, adv_B, next_adv_B))
    return carry, adv_B

  zeros_B = jnp.zeros(mask_BT.shape[:1], jnp.float32)
  _, adv_TB = jax.lax.scan(step, (zeros_B, zeros_B), (r_BT.T, v_BT.T, mask_BT.T), reverse=True)
  adv_BT = adv_TB.T
  returns_BT = jnp.where(mask_BT, adv_BT + v_BT, 0.0)
  return jax.lax.stop_gradient(adv_BT), jax.lax.stop_gradient(returns_BT)


def whiten(x_BT, mask_BT, *, shift_mean: bool = True, eps: float = 1e-8):
  """Masked whitening over every valid entry of the array (under ``jit`` on a sharded array: the
  global batch).  ``(x - mean) / (std + eps)``; with ``shift_mean=False`` the mean is added back
  (only the spread is rescaled, as TRL's ``masked_whiten``).  0 at masked positions."""
  mask_BT = jnp.asarray(mask_BT).astype(bool)
  z, mean, _ = masked_zscore(x_BT, mask_BT, eps=eps)
  if not shift_mean:
    z = jnp.where(mask_BT, z + mean, 0.0)
  return jax.lax.stop_gradient(z)


def group_advantages(scores_B, *, group_size: int, method: str = "grpo", eps: float = 1e-6,
                     valid_B=None):
  """Outcome advantages from sequence scores; groups are consecutive rows ``[g*n, (g+1)*n)``.

  Over the *valid* members of each group (``valid_B``, default all), with ``c`` their count:
    grpo:          (r - mean) / (std + eps), std unbiased (ddof=1), as TRL and veRL.
    drgrpo:        r - mean (Dr. GRPO: no std division).
    rloo:          r - mean of the other members = c / (c - 1) * (r - mean).
    reinforce_pp:  r - group mean (REINFORCE++-baseline; with group_size 1 no group baseline),
                   then (x - mean) / (std + eps) over all valid rows of the batch.
  A group whose valid rewards are all equal gets exactly 0; grpo/drgrpo/rloo give 0 to a group
  with fewer than two valid members (nothing to compare with).  Invalid rows get 0.
  Returns float32 ``[B]``.
  """
  if method not in GROUP_METHODS:
    raise ValueError(f"advantage method {method!r} is not valid; choose one of {GROUP_METHODS}")
  scores_B = jnp.asarray(scores_B, jnp.float32)
  b = scores_B.shape[0]
  if group_size < 1 or b % group_size:
    raise ValueError(f"group_size={group_size} must be >= 1 and divide the batch of {b} rows "
                     f"(prompts x samples); check num_samples and batch_size")
  valid_B = (jnp.ones((b,), bool) if valid_B is None else jnp.asarray(valid_B).astype(bool))
  # Zeroed so that a NaN in an invalid row cannot leak into its group's sums.
  r_GN = jnp.where(valid_B, scores_B, 0.0).reshape(b // group_size, group_size)
  valid_GN = valid_B.reshape(r_GN.shape)

  if method == "reinforce_pp":
    if group_size > 1:
      mean_G1, _, _ = masked_moments(r_GN, valid_GN, axis=1)
      centred_B = jnp.where(valid_GN, r_GN - mean_G1, 0.0).reshape(b)
    else:
      centred_B = r_GN.reshape(b)
    adv_B, _, _ = masked_zscore(centred_B, valid_B, eps=eps)
    return jax.lax.stop_gradient(adv_B)

  mean_G1, std_G1, count_G1 = masked_moments(r_GN, valid_GN, axis=1)
  dev_GN = r_GN - mean_G1
  if method == "grpo":  # not a stage name
    adv_GN = dev_GN / (std_G1 + eps)
  elif method == "drgrpo":
    adv_GN = dev_GN
  else:  # rloo
    adv_GN = dev_GN * count_G1 / jnp.maximum(count_G1 - 1.0, 1.0)
  adv_GN = jnp.where(valid_GN & (count_G1 > 1), adv_GN, 0.0)
  return jax.lax.stop_gradient(adv_GN.reshape(b))
