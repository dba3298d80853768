"""Rollout-side shaping before the update, as pure array functions: DAPO's overlong reward
penalty, dynamic sampling's group selection (inside fixed shapes), and the off-policy
importance weights between the trainer and the behaviour (rollout) policy (TIS, MIS and their
sequence-level variants).

Every output is a constant (``stop_gradient``); conventions in docs/conventions.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

OFF_POLICY_MODES = ("none", "tis", "mis", "seq_tis", "seq_mis")


def overlong_penalty(lengths_B, *, max_len: int, buffer: int, penalty: float = 1.0):
  """DAPO's soft overlong punishment: 0 for ``len <= max_len - buffer``, then falling linearly
  to ``-penalty`` at ``len = max_len`` (``-penalty * (len - (max_len - buffer)) / buffer``),
  ``-penalty`` beyond.  ``lengths_B`` count the stop token; ``buffer`` is DAPO's L_cache
  (``0 < buffer <= max_len``).  Returns float32 ``[B]``, to add to the sequence score."""
  if not 0 < buffer <= max_len:
    raise ValueError(f"overlong buffer={buffer} must be in (0, max_len={max_len}]")
  over_B = jnp.asarray(lengths_B, jnp.float32) - float(max_len - buffer)
  return jax.lax.stop_gradient(-penalty * jnp.clip(over_B / float(buffer), 0.0, 1.0))


def select_groups(score_B, valid_B, *, group_size: int, num_groups: int, eps: float = 0.0):
  """Dynamic sampling (DAPO) inside fixed shapes: of the ``G = B / group_size`` generated
  groups (consecutive rows), the first ``num_groups`` *informative* ones, a group being
  informative when its valid rewards are not all equal (max - min > ``eps``; a group with
  fewer than two valid members is not).  When fewer than ``num_groups`` are informative the
  rest of the selection is filled with uninformative groups, whose rows are returned invalid
  (masked out of the update): the batch keeps its size, and never trains on a group with zero
  advantage variance.

  Returns ``(rows_K, valid_K, metrics)``: the ``K = num_groups * group_size`` selected row
  indices (int32, groups in their generated order, informative first), which of them train,
  and ``dynamic/{generated,informative,kept,shortfall}_groups`` (float32 counts; shortfall:
  selected groups masked for want of informative ones, the over-sampling limit reached).
  """
  score_B = jnp.asarray(score_B, jnp.float32)
  b = score_B.shape[0]
  if group_size < 1 or b % group_size:
    raise ValueError(f"group_size={group_size} must divide the {b} generated rows")
  g = b // group_size
  if not 1 <= num_groups <= g:
    raise ValueError(f"num_groups={num_groups} must be in [1, {g}] (the generated groups)")
  valid_GN = jnp.asarray(valid_B).astype(bool).reshape(g, group_size)
  s_GN = score_B.reshape(g, group_size)
  hi_G = jnp.max(jnp.where(valid_GN, s_GN, -jnp.inf), axis=1)
  lo_G = jnp.min(jnp.where(valid_GN, s_GN, jnp.inf), axis=1)
  informative_G = (jnp.sum(valid_GN, axis=1) >= 2) & (hi_G - lo_G > eps)
  # Stable: informative groups first, each class in generated order.
  order_G = jnp.argsort(~informative_G, stable=True)[:num_groups]
  rows_K = (order_G[:, None] * group_size + jnp.arange(group_size)[None]).reshape(-1)
  chosen_informative = informative_G[order_G]
  valid_K = (valid_GN[order_G] & chosen_informative[:, None]).reshape(-1)
  n_inf = jnp.sum(informative_G).astype(jnp.float32)
  kept = jnp.sum(chosen_informative).astype(jnp.float32)
  metrics = {"dynamic/generated_groups": jnp.float32(g), "dynamic/informative_groups": n_inf,
             "dynamic/kept_groups": kept,
             "dynamic/shortfall_groups": jnp.float32(num_groups) - kept}
  return rows_K.astype(jnp.int32), valid_K, metrics


def off_policy_weights(trainer_logp_BN, behaviour_logp_BN, mask_BN, *, mode: str, cap: float,
                       log_ratio_clamp: float = 20.0):
  """Importance weights for the rollout/trainer mismatch, ``w = pi_trainer / pi_behaviour``:

    tis:      per token, truncated: ``min(w_t, cap)`` (truncated IS).
    mis:      per token, masked: ``w_t`` where ``1 / cap <= w_t <= cap``, else the token is
              dropped from the update (masked IS).
    seq_tis / seq_mis: the same on the sequence's ratio ``exp(sum_t log w_t)``, written at
              each of its tokens (a masked sequence drops every token).

  The log-ratio (and the sequence's sum) is clamped to ``+-log_ratio_clamp`` before ``exp``.
  Returns ``(weight_BN, keep_BN, metrics)``: the constant weights (0 where not kept), the
  tokens that stay in the update, and ``is_weight_mean`` (mean weight over kept tokens),
  ``is_clipped_frac`` (tokens truncated or masked, of the valid ones), ``is_ratio_max``.
  """
  if mode not in OFF_POLICY_MODES or mode == "none":
    raise ValueError(f"off-policy mode {mode!r} is not valid; choose one of "
                     f"{OFF_POLICY_MODES[1:]}")
  if not cap > 1.0:
    raise ValueError(f"off-policy cap={cap} must be > 1 (typically 2)")
  mask_BN = jnp.asarray(mask_BN).astype(bool)
  log_w_BN = jnp.where(mask_BN, jnp.asarray(trainer_logp_BN, jnp.float32)
                       - jnp.asarray(behaviour_logp_BN, jnp.float32), 0.0)
  if mode.startswith("seq_"):
    log_w_BN = jnp.broadcast_to(jnp.sum(log_w_BN, axis=-1, keepdims=True), mask_BN.shape)
  w_BN = jnp.exp(jnp.clip(log_w_BN, -log_ratio_clamp, log_ratio_clamp))
  if mode.endswith("tis"):
    out_BN = (w_BN > cap) & mask_BN
    keep_BN = mask_BN
    weight_BN = jnp.where(mask_BN, jnp.minimum(w_BN, cap), 0.0)
  else:
    out_BN = ((w_BN > cap) | (w_BN < 1.0 / cap)) & mask_BN
    keep_BN = mask_BN & ~out_BN
    weight_BN = jnp.where(keep_BN, w_BN, 0.0)
  n_valid = jnp.maximum(jnp.sum(mask_BN), 1).astype(jnp.float32)
  metrics = {"is_weight_mean": jnp.sum(weight_BN) / jnp.maximum(jnp.sum(keep_BN), 1),
             "is_clipped_frac": jnp.sum(out_BN) / n_valid,
             "is_ratio_max": jnp.max(jnp.where(mask_BN, w_BN, 0.0))}
  return (jax.lax.stop_gradient(weight_BN), keep_BN,
          {k: jax.lax.stop_gradient(v).astype(jnp.float32) for k, v in metrics.items()})
