"""Loss functions of every algorithm, as pure array functions, and the one aggregation rule they
share: the policy losses (PPO/GRPO clipped surrogate, GSPO and its token variant, CISPO), the
entropy bonus, the clipped value loss, the preference losses (DPO: sigmoid, IPO, conservative;
SimPO; ORPO; KTO), the Bradley-Terry reward-model loss and SFT cross-entropy.

Each returns ``(loss, metrics)``: a float32 scalar and a dict of float32 scalars (metrics carry
no gradient and are means over *this call's* valid entries; a caller that splits a batch into
micro-batches averages them).  Conventions (docs/conventions.md):

* Aggregation over the *global* batch.  Under ``jit`` a sum over a data-parallel-sharded array
  is a global sum, so the defaults are already global.  Across gradient-accumulation
  micro-batches pass ``denom`` = :func:`agg_count` of the *full* batch's mask: the sum of the
  micro-batch losses (and gradients) then equals the full-batch loss (and gradient).
* Masking is by ``jnp.where`` on the inputs, so garbage (even NaN) at padded positions never
  reaches a value or a gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
DPO_LOSSES = ("sigmoid", "ipo", "cdpo")
# The preference losses that read no reference model (their specs drop the reference role).
REFERENCE_FREE_LOSSES = ("simpo", "orpo")
PREFERENCE_LOSSES = DPO_LOSSES + REFERENCE_FREE_LOSSES + ("kto",)


# ------------------------------------------------------------------------------ aggregation


def _f32(x):
  return jnp.asarray(x, jnp.float32)


def _check_mode(mode):
  if mode not in AGG_MODES:
    raise ValueError(f"loss aggregation {mode!r} is not valid; choose one of {AGG_MODES}")


def agg_count(mask_BT, *, mode: str = "token_mean"):
  """The denominator :func:`aggregate` uses for ``mode`` when ``denom`` is None: the number of
  valid tokens (``token_mean``) or of sequences with at least one valid token (the two
  sequence modes), float32.  Compute it on the full batch and pass it as ``denom`` to every
  micro-batch."""
  _check_mode(mode)
  mask_BT = jnp.asarray(mask_BT).astype(bool)
  if mode == "token_mean":
    return jnp.sum(mask_BT).astype(jnp.float32)
  return jnp.sum(jnp.any(mask_BT, axis=-1)).astype(jnp.float32)


def aggregate(x_BT, mask_BT, *, mode: str = "token_mean", denom=None, max_len=None):
  """Reduces a per-token loss to a scalar.

  token_mean:               sum over valid tokens / number of valid tokens (default).
  seq_mean_token_mean:      each sequence's mean over its valid tokens, summed over sequences /
                            number of non-empty sequences.
  seq_mean_token_sum_norm:  (Dr. GRPO) each sequence's sum / ``max_len`` (a constant: default
                            ``T``, the generation budget), summed / number of non-empty sequences.
  ``denom`` replaces the count (tokens for token_mean, sequences otherwise), see
  :func:`agg_count`.  A count of 0 is treated as 1, so an all-masked batch gives 0, not NaN.
  """
  _check_mode(mode)
  mask_BT = jnp.asarray(mask_BT).astype(bool)
  x_BT = jnp.where(mask_BT, _f32(x_BT), 0.0)
  if denom is None:
    denom = agg_count(mask_BT, mode=mode)
  denom = jnp.maximum(_f32(denom), 1.0)
  if mode == "token_mean":
    return jnp.sum(x_BT) / denom
  sums_B = jnp.sum(x_BT, axis=-1)
  if mode == "seq_mean_token_mean":
    per_seq_B = sums_B / jnp.maximum(jnp.sum(mask_BT, axis=-1), 1).astype(jnp.float32)
  else:
    max_len = mask_BT.shape[-1] if max_len is None else max_len
    per_seq_B = sums_B / float(max_len)
  return jnp.sum(per_seq_B) / denom


def masked_token_mean(x_BT, mask_BT):
  """Mean over valid entries (0 when there are none), without gradient: for metrics."""
  mask_BT = jnp.asarray(mask_BT).astype(bool)
  x = jnp.where(mask_BT, _f32(jax.lax.stop_gradient(x_BT)), 0.0)
  return jnp.sum(x) / jnp.maximum(jnp.sum(mask_BT), 1).astype(jnp.float32)


# ------------------------------------------------------------------------------------- PPO


def ppo_policy_loss(logp_BT, old_logp_BT, adv_BT, mask_BT, *, clip_low: float, clip_high: float,
                    dual_clip: float = 0.0, agg: str = "token_mean", denom=None, max_len=None,
                    log_ratio_clamp: float = 20.0):
  """Clipped surrogate ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` per token, with
  ``r = exp(clamp(logp - old_logp, +-log_ratio_clamp))``.  Separate low/high clips give
  "clip-higher" (DAPO).  ``dual_clip = c > 1`` also bounds the loss of negative-advantage tokens
  by ``-c A`` (Ye et al. 2020); 0 turns it off.

  Metrics: ``pg_loss`` (the aggregated loss), ``clip_frac`` (tokens where the clipped term is
  taken), ``dual_clip_frac``, ``approx_kl`` (k3 estimate of KL(old || new) on the sampled
  tokens: mean of ``r - 1 - log r``), ``ratio_mean``, ``ratio_max``.
  """
  if dual_clip and dual_clip <= 1.0:
    raise ValueError(f"dual_clip={dual_clip}: use 0 (off) or a constant > 1 (typically 3)")
  mask_BT = jnp.asarray(mask_BT).astype(bool)
  logp_BT = jnp.where(mask_BT, _f32(logp_BT), 0.0)
  old_BT = jnp.where(mask_BT, _f32(old_logp_BT), 0.0)
  adv_BT = jnp.where(mask_BT, _f32(adv_BT), 0.0)
  log_ratio_BT = logp_BT - old_BT
  if log_ratio_clamp and log_ratio_clamp > 0:
    log_ratio_BT = jnp.clip(log_ratio_BT, -log_ratio_clamp, log_ratio_clamp)
  ratio_BT = jnp.exp(log_ratio_BT)
  loss1_BT = -adv_BT * ratio_BT
  loss2_BT = -adv_BT * jnp.clip(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
  pg_BT = jnp.maximum(loss1_BT, loss2_BT)
  dual_BT = jnp.zeros_like(mask_BT)
  if dual_clip:
    bound_BT = -adv_BT * dual_clip
    dual_BT = (adv_BT < 0) & (pg_BT > bound_BT)
    pg_BT = jnp.where(dual_BT, bound_BT, pg_BT)
  loss = aggregate(pg_BT, mask_BT, mode=agg, denom=denom, max_len=max_len)
  ratio_sg = jax.lax.stop_gradient(ratio_BT)
  metrics = {
      "pg_loss": jax.lax.stop_gradient(loss),
      "clip_frac": masked_token_mean(loss2_BT > loss1_BT, mask_BT),
      "dual_clip_frac": masked_token_mean(dual_BT, mask_BT),
      "approx_kl": masked_token_mean(ratio_sg - 1.0 - jax.lax.stop_gradient(log_ratio_BT),
                                     mask_BT),
      "ratio_mean": masked_token_mean(ratio_sg, mask_BT),
      "ratio_max": jnp.max(jnp.where(mask_BT, ratio_sg, 0.0)),
  }
  return loss, metrics


def _policy_inputs(logp_BT, old_logp_BT, adv_BT, mask_BT):
  mask_BT = jnp.asarray(mask_BT).astype(bool)
  z = lambda x: jnp.where(mask_BT, _f32(x), 0.0)
  return mask_BT, z(logp_BT), z(old_logp_BT), z(adv_BT)


def _no_dual_clip(name, dual_clip):
  if dual_clip:
    raise ValueError(f"dual_clip={dual_clip}: the {name} policy loss has no dual clip; use 0")


def _ratio_metrics(ratio_BT, log_ratio_BT, clipped_BT, mask_BT, loss):
  ratio_sg = jax.lax.stop_gradient(ratio_BT)
  return {
      "pg_loss": jax.lax.stop_gradient(loss),
      "clip_frac": masked_token_mean(clipped_BT, mask_BT),
      "approx_kl": masked_token_mean(ratio_sg - 1.0 - jax.lax.stop_gradient(log_ratio_BT),
                                     mask_BT),
      "ratio_mean": masked_token_mean(ratio_sg, mask_BT),
      "ratio_max": jnp.max(jnp.where(mask_BT, ratio_sg, 0.0)),
  }


def gspo_policy_loss(logp_BT, old_logp_BT, adv_BT, mask_BT, *, clip_low: float,
                     clip_high: float, token_level: bool = False, agg: str = "seq_mean_token_mean",
                     denom=None, max_len=None, log_ratio_clamp: float = 10.0,
                     dual_clip: float = 0.0):
  """GSPO (Zheng et al. 2025): a *sequence-level* importance ratio, the geometric mean of the
  token ratios ``s = exp(mean_t (logp - old_logp))`` over each row's valid tokens, clipped as a
  whole: per row ``max(-A s, -A clip(s, 1 - clip_low, 1 + clip_high))``, written at every valid
  token (so ``seq_mean_token_mean`` gives the paper's mean over sequences).

  ``token_level`` (GSPO-token): the token's ratio ``s_t = sg(s) * pi_t / sg(pi_t)`` (equal to
  ``s`` in value, its gradient the token's own) with the token's advantage ``A_t``; with one
  advantage per sequence it has GSPO's gradient.  The mean log-ratio is clamped to
  ``+-log_ratio_clamp`` before ``exp`` (peers use 10).  Metrics as :func:`ppo_policy_loss`
  (``clip_frac`` counts the tokens of clipped sequences).
  """
  _no_dual_clip("gspo", dual_clip)
  mask_BT, logp_BT, old_BT, adv_BT = _policy_inputs(logp_BT, old_logp_BT, adv_BT, mask_BT)
  n_B = jnp.maximum(jnp.sum(mask_BT, axis=-1), 1).astype(jnp.float32)
  seq_log_ratio_B = jnp.sum(logp_BT - old_BT, axis=-1) / n_B
  if log_ratio_clamp and log_ratio_clamp > 0:
    seq_log_ratio_B = jnp.clip(seq_log_ratio_B, -log_ratio_clamp, log_ratio_clamp)
  if token_level:
    log_ratio_BT = (jax.lax.stop_gradient(seq_log_ratio_B)[:, None] + logp_BT
                    - jax.lax.stop_gradient(logp_BT))
  else:
    log_ratio_BT = jnp.broadcast_to(seq_log_ratio_B[:, None], mask_BT.shape)
  ratio_BT = jnp.exp(log_ratio_BT)
  loss1_BT = -adv_BT * ratio_BT
  loss2_BT = -adv_BT * jnp.clip(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
  pg_BT = jnp.maximum(loss1_BT, loss2_BT)
  loss = aggregate(pg_BT, mask_BT, mode=agg, denom=denom, max_len=max_len)
  return loss, _ratio_metrics(ratio_BT, log_ratio_BT, loss2_BT > loss1_BT, mask_BT, loss)


def cispo_policy_loss(logp_BT, old_logp_BT, adv_BT, mask_BT, *, clip_low: float,
                      clip_high: float, agg: str = "token_mean", denom=None, max_len=None,
                      log_ratio_clamp: float = 20.0, dual_clip: float = 0.0):
  """CISPO (MiniMax-M1, 2025): REINFORCE on every token, weighted by its importance ratio
  clipped and stopped: ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp`` per token, with
  ``r = exp(clamp(logp - old_logp))``.  Unlike PPO's clip no token's gradient is dropped, only
  its weight bounded (MiniMax-M1 sets no lower bound: pass ``clip_low >= 1``).  Metrics as
  :func:`ppo_policy_loss` (``clip_frac``: tokens whose weight was clipped)."""
  _no_dual_clip("cispo", dual_clip)
  mask_BT, logp_BT, old_BT, adv_BT = _policy_inputs(logp_BT, old_logp_BT, adv_BT, mask_BT)
  log_ratio_BT = logp_BT - old_BT
  if log_ratio_clamp and log_ratio_clamp > 0:
    log_ratio_BT = jnp.clip(log_ratio_BT, -log_ratio_clamp, log_ratio_clamp)
  ratio_BT = jnp.exp(log_ratio_BT)
  lo, hi = max(1.0 - clip_low, 0.0), 1.0 + clip_high
  clipped_BT = (ratio_BT < lo) | (ratio_BT > hi)
  coef_BT = jax.lax.stop_gradient(jnp.clip(ratio_BT, lo, hi) * adv_BT)
  pg_BT = -coef_BT * logp_BT
  loss = aggregate(pg_BT, mask_BT, mode=agg, denom=denom, max_len=max_len)
  return loss, _ratio_metrics(ratio_BT, log_ratio_BT, clipped_BT, mask_BT, loss)


# The policy losses ``{rl}.policy_loss`` selects; one signature: (logp, old_logp, adv, mask,
# *, clip_low, clip_high, dual_clip, agg, denom, max_len) -> (loss, metrics).  An off-policy
# weight w >= 0 enters through the advantages: each loss is positively homogeneous in A.
POLICY_LOSSES = {
    "ppo": ppo_policy_loss,  # not a stage name: the clipped surrogate
    "gspo": gspo_policy_loss,
    "gspo_token": functools.partial(gspo_policy_loss, token_level=True),
    "cispo": cispo_policy_loss,
}


def entropy_bonus(entropy_BT, mask_BT, *, coef: float, agg: str = "token_mean", denom=None,
                  max_len=None):
  """``-coef * aggregate(entropy)``: added to the loss, it rewards keeping entropy up.
  Metrics: ``entropy`` (token mean)."""
  loss = -coef * aggregate(entropy_BT, mask_BT, mode=agg, denom=denom, max_len=max_len)
  return loss, {"entropy": masked_token_mean(entropy_BT, mask_BT)}


def value_loss(values_BT, old_values_BT, returns_BT, mask_BT, *, clip: float,
               agg: str = "token_mean", denom=None, max_len=None):
  """Clipped value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)`` with
  ``V_clip = V_old + clip(V - V_old, -clip, clip)``; ``clip <= 0`` turns clipping off.

  Metrics: ``vf_loss``, ``vf_clip_frac``, ``explained_variance`` (``1 - Var(R - V) / Var(R)``
  over valid tokens with the current values; 0 when the returns have no variance),
  ``value_mean``, ``return_mean``.
  """
  mask_BT = jnp.asarray(mask_BT).astype(bool)
  v_BT = jnp.where(mask_BT, _f32(values_BT), 0.0)
  old_BT = jnp.where(mask_BT, _f32(old_values_BT), 0.0)
  ret_BT = jnp.where(mask_BT, _f32(returns_BT), 0.0)
  sq_BT = jnp.square(v_BT - ret_BT)
  if clip and clip > 0:
    v_clip_BT = old_BT + jnp.clip(v_BT - old_BT, -clip, clip)
    sq_clip_BT = jnp.square(v_clip_BT - ret_BT)
    clipped_BT = sq_clip_BT > sq_BT
    sq_BT = jnp.maximum(sq_BT, sq_clip_BT)
  else:
    clipped_BT = jnp.zeros_like(mask_BT)
  loss = 0.5 * aggregate(sq_BT, mask_BT, mode=agg, denom=denom, max_len=max_len)
  v_sg = jax.lax.stop_gradient(v_BT)
  var_ret = _masked_var(ret_BT, mask_BT)
  var_res = _masked_var(ret_BT - v_sg, mask_BT)
  metrics = {
      "vf_loss": jax.lax.stop_gradient(loss),
      "vf_clip_frac": masked_token_mean(clipped_BT, mask_BT),
      "explained_variance": jnp.where(var_ret > 0, 1.0 - var_res / jnp.where(var_ret > 0,
                                                                               var_ret, 1.0), 0.0),
      "value_mean": masked_token_mean(v_sg, mask_BT),
      "return_mean": masked_token_mean(ret_BT, mask_BT),
  }
  return loss, metrics


def _masked_var(x_BT, mask_BT):
  """Population variance over valid entries (a ratio of two of them is ddof-free)."""
  mean = masked_token_mean(x_BT, mask_BT)
  return masked_token_mean(jnp.square(x_BT - mean), mask_BT)


# ------------------------------------------------------------------------- pairs and SFT


def _pair_inputs(valid_B, *xs_B):
  """The validity mask (default all) and the inputs zeroed where invalid, so that garbage in a
  padding pair reaches neither the loss nor the gradients."""
  valid_B = (jnp.ones(jnp.shape(xs_B[0]), bool) if valid_B is None
             else jnp.asarray(valid_B).astype(bool))
  return (valid_B,) + tuple(jnp.where(valid_B, _f32(x), 0.0) for x in xs_B)


def _pair_mean(x_B, valid_B, denom=None):
  count = jnp.sum(valid_B).astype(jnp.float32) if denom is None else _f32(denom)
  return jnp.sum(jnp.where(valid_B, x_B, 0.0)) / jnp.maximum(count, 1.0)


def dpo_loss(pol_chosen_B, pol_rejected_B, ref_chosen_B, ref_rejected_B, *, beta: float,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0, valid_B=None, denom=None):
  """Direct preference optimisation on summed response log-probs per sequence.

  With ``h = (pol_c - ref_c) - (pol_r - ref_r)``:
    sigmoid: ``-(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h)`` (Rafailov et al.; with
             ``label_smoothing = ls > 0`` this is conservative DPO, as in TRL),
    cdpo:    the same formula (named for clarity when ``ls > 0``),
    ipo:     ``(h - 1 / (2 beta))^2`` (Azar et al.; pass length-averaged log-probs to follow
             the paper exactly).
  Mean over valid pairs (or sum / ``denom`` for micro-batches).  Implicit rewards are
  ``beta * (pol - ref)``.  Metrics: ``chosen_reward``, ``rejected_reward``, ``reward_margin``,
  ``pref_accuracy`` (fraction of pairs with chosen reward > rejected reward), ``dpo_loss``.
  """
  if loss_type not in DPO_LOSSES:
    raise ValueError(f"dpo loss {loss_type!r} is not valid; choose one of {DPO_LOSSES}")
  if beta <= 0:
    raise ValueError(f"dpo beta={beta} must be > 0")
  valid_B, pc_B, pr_B, rc_B, rr_B = _pair_inputs(valid_B, pol_chosen_B, pol_rejected_B,
                                                  ref_chosen_B, ref_rejected_B)
  chosen_B = pc_B - rc_B
  rejected_B = pr_B - rr_B
  h_B = chosen_B - rejected_B
  if loss_type == "ipo":
    per_B = jnp.square(h_B - 1.0 / (2.0 * beta))
  else:
    per_B = (-(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * h_B)
             - label_smoothing * jax.nn.log_sigmoid(-beta * h_B))
  loss = _pair_mean(per_B, valid_B, denom)
  r_c = jax.lax.stop_gradient(beta * chosen_B)
  r_r = jax.lax.stop_gradient(beta * rejected_B)
  metrics = {
      "dpo_loss": jax.lax.stop_gradient(loss),
      "chosen_reward": _pair_mean(r_c, valid_B),
      "rejected_reward": _pair_mean(r_r, valid_B),
      "reward_margin": _pair_mean(r_c - r_r, valid_B),
      "pref_accuracy": _pair_mean((r_c > r_r).astype(jnp.float32), valid_B),
  }
  return loss, metrics


def simpo_loss(pol_chosen_B, pol_rejected_B, len_chosen_B, len_rejected_B, *, beta: float,
               gamma: float, valid_B=None, denom=None):
  """SimPO (Meng et al. 2024): reference-free, length-normalised:
  ``-log sigmoid(beta (pol_c / len_c - pol_r / len_r) - gamma)`` on summed response log-probs
  and response lengths (tokens, floored at 1), ``gamma`` the target margin (TRL writes it as
  ``gamma_beta_ratio * beta``).  Mean over valid pairs.  Implicit rewards are
  ``beta * pol / len``.  Metrics as :func:`dpo_loss`."""
  if beta <= 0:
    raise ValueError(f"simpo beta={beta} must be > 0")
  valid_B, pc_B, pr_B, lc_B, lr_B = _pair_inputs(valid_B, pol_chosen_B, pol_rejected_B,
                                                  len_chosen_B, len_rejected_B)
  r_c_B = beta * pc_B / jnp.maximum(lc_B, 1.0)
  r_r_B = beta * pr_B / jnp.maximum(lr_B, 1.0)
  per_B = -jax.nn.log_sigmoid(r_c_B - r_r_B - gamma)
  loss = _pair_mean(per_B, valid_B, denom)
  return loss, preference_metrics(loss, r_c_B, r_r_B, valid_B)


def orpo_loss(pol_chosen_B, pol_rejected_B, len_chosen_B, len_rejected_B, *, beta: float,
              valid_B=None, denom=None, max_logp: float = -1e-6):
  """ORPO (Hong et al. 2024): SFT on the chosen response plus ``beta`` (the paper's lambda)
  times an odds-ratio term, no reference model.  With ``a = pol / len`` (the mean token
  log-prob, capped at ``max_logp`` < 0 so that ``log(1 - e^a)`` stays finite):
  ``log odds = a - log(1 - e^a)``, per pair
  ``-a_c - beta log sigmoid(log odds_c - log odds_r)``.  Mean over valid pairs.  Implicit
  rewards (metrics) are ``beta * a``; ``nll`` the SFT part, ``log_odds_ratio`` the mean."""
  if beta < 0:
    raise ValueError(f"orpo beta={beta} must be >= 0")
  valid_B, pc_B, pr_B, lc_B, lr_B = _pair_inputs(valid_B, pol_chosen_B, pol_rejected_B,
                                                  len_chosen_B, len_rejected_B)
  a_c_B = jnp.minimum(pc_B / jnp.maximum(lc_B, 1.0), max_logp)
  a_r_B = jnp.minimum(pr_B / jnp.maximum(lr_B, 1.0), max_logp)
  log_odds = lambda a: a - jnp.log(-jnp.expm1(a))
  lor_B = log_odds(a_c_B) - log_odds(a_r_B)
  per_B = -a_c_B - beta * jax.nn.log_sigmoid(lor_B)
  loss = _pair_mean(per_B, valid_B, denom)
  metrics = preference_metrics(loss, beta * a_c_B, beta * a_r_B, valid_B)
  metrics.update(nll=_pair_mean(jax.lax.stop_gradient(-a_c_B), valid_B),
                 log_odds_ratio=_pair_mean(jax.lax.stop_gradient(lor_B), valid_B))
  return loss, metrics


def kto_loss(pol_B, ref_B, desirable_B, *, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0, valid_B=None, denom=None):
  """KTO (Ethayarajh et al. 2024) on unpaired examples.  With ``r = pol - ref`` (summed
  response log-probs) and the reference point ``z0 = sg(max(0, mean r))`` over the valid
  examples of the batch (an estimate of KL(policy || reference); the paper's estimate uses
  mismatched completions, see docs/conventions.md), per example
  desirable ``w_D (1 - sigmoid(beta (r - z0)))``, undesirable ``w_U (1 - sigmoid(beta (z0 - r)))``;
  mean over valid examples.  Metrics: ``kl`` (z0), ``chosen_reward`` / ``rejected_reward``
  (mean ``beta r`` of the desirable / undesirable examples), ``kto_loss``."""
  if beta <= 0:
    raise ValueError(f"kto beta={beta} must be > 0")
  valid_B, p_B, r_B = _pair_inputs(valid_B, pol_B, ref_B)
  good_B = jnp.asarray(desirable_B).astype(bool)
  logr_B = p_B - r_B
  z0 = jax.lax.stop_gradient(jnp.maximum(_pair_mean(logr_B, valid_B), 0.0))
  per_B = jnp.where(good_B, desirable_weight * (1.0 - jax.nn.sigmoid(beta * (logr_B - z0))),
                    undesirable_weight * (1.0 - jax.nn.sigmoid(beta * (z0 - logr_B))))
  loss = _pair_mean(per_B, valid_B, denom)
  rew = jax.lax.stop_gradient(beta * logr_B)
  return loss, {"kto_loss": jax.lax.stop_gradient(loss), "kl": z0,
                "chosen_reward": _pair_mean(rew, valid_B & good_B),
                "rejected_reward": _pair_mean(rew, valid_B & ~good_B)}


def preference_metrics(loss, r_c_B, r_r_B, valid_B):
  """A preference loss's metrics from its implicit rewards of chosen and rejected (as
  :func:`dpo_loss`'s): ``dpo_loss`` (the loss), ``chosen_reward``, ``rejected_reward``,
  ``reward_margin``, ``pref_accuracy``."""
  r_c, r_r = jax.lax.stop_gradient(r_c_B), jax.lax.stop_gradient(r_r_B)
  return {"dpo_loss": jax.lax.stop_gradient(loss),
          "chosen_reward": _pair_mean(r_c, valid_B),
          "rejected_reward": _pair_mean(r_r, valid_B),
          "reward_margin": _pair_mean(r_c - r_r, valid_B),
          "pref_accuracy": _pair_mean((r_c > r_r).astype(jnp.float32), valid_B)}


def bradley_terry_loss(r_chosen_B, r_rejected_B, *, valid_B=None, denom=None):
  """Reward-model pairwise loss ``-log sigmoid(r_c - r_r)``, mean over valid pairs.
  Metrics: ``rm_loss``, ``accuracy`` (fraction with ``r_c > r_r``; ties count as wrong),
  ``margin``, ``chosen_score``, ``rejected_score``."""
  valid_B, r_c, r_r = _pair_inputs(valid_B, r_chosen_B, r_rejected_B)
  loss = _pair_mean(-jax.nn.log_sigmoid(r_c - r_r), valid_B, denom)
  c, r = jax.lax.stop_gradient(r_c), jax.lax.stop_gradient(r_r)
  metrics = {
      "rm_loss": jax.lax.stop_gradient(loss),
      "accuracy": _pair_mean((c > r).astype(jnp.float32), valid_B),
      "margin": _pair_mean(c - r, valid_B),
      "chosen_score": _pair_mean(c, valid_B),
      "rejected_score": _pair_mean(r, valid_B),
  }
  return loss, metrics


def sft_loss(logp_BT, mask_BT, *, denom=None):
  """Masked cross-entropy: ``-sum(logp over mask) / n_valid`` (global token mean; ``denom`` for
  micro-batches).  The caller's mask chooses the tokens (response-only by default in the
  config).  Metrics: ``nll`` (token mean), ``ppl`` (``exp(nll)``), ``tokens`` (valid count)."""
  mask_BT = jnp.asarray(mask_BT).astype(bool)
  nll_BT = -_f32(logp_BT)
  loss = aggregate(nll_BT, mask_BT, mode="token_mean", denom=denom)
  nll = masked_token_mean(nll_BT, mask_BT)
  return loss, {"nll": nll, "ppl": jnp.exp(nll),
                "tokens": jnp.sum(mask_BT).astype(jnp.float32)}
