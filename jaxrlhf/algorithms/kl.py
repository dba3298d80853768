"""KL to the frozen reference policy: per-token estimators, KL-shaped rewards (PPO), the KL term
of the loss (GRPO), and the adaptive KL coefficient of Ziegler et al. (2019).

Conventions (docs/conventions.md): ``logr = ref_logp - logp`` on tokens sampled from the policy,
so every estimator below estimates KL(policy || reference).  ``logr`` is clamped to
``[-clamp_logr, clamp_logr]`` before the estimator and the estimate to ``[-clamp_kl, clamp_kl]``
after it; a clamp <= 0 turns that clamp off.  Clamped values carry no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxrlhf.algorithms.losses import aggregate, masked_token_mean

ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp_BT, ref_logp_BT, *, estimator: str = "k1", clamp_logr: float = 20.0,
                clamp_kl: float = 10.0):
  """Per-token KL estimate, float32 ``[B, T]`` (Schulman's k1/k2/k3 on ``logr``).

  k1 = -logr (unbiased, can be negative), k2 = logr**2 / 2 (biased, >= 0),
  k3 = exp(logr) - 1 - logr (unbiased, >= 0).  Positions the caller masks hold whatever the
  inputs there give; mask them with ``jnp.where``.
  """
  if estimator not in ESTIMATORS:
    raise ValueError(f"kl estimator {estimator!r} is not valid; choose one of {ESTIMATORS}")
  logr = jnp.asarray(ref_logp_BT, jnp.float32) - jnp.asarray(logp_BT, jnp.float32)
  if clamp_logr and clamp_logr > 0:
    logr = jnp.clip(logr, -clamp_logr, clamp_logr)
  if estimator == "k1":
    kl = -logr
  elif estimator == "k2":
    kl = 0.5 * logr * logr
  else:
    # expm1 keeps precision for small logr, where k3 ~ logr**2 / 2.
    kl = jnp.expm1(logr) - logr
  if clamp_kl and clamp_kl > 0:
    kl = jnp.clip(kl, -clamp_kl, clamp_kl)
  return kl


def kl_shaped_rewards(score_B, kl_BT, mask_BT, *, coef):
  """Per-token PPO rewards ``-coef * kl`` with the sequence score added at each row's last valid
  token; 0 at masked positions.  A row with no valid token gets all zeros (its score lands
  nowhere).  ``coef`` may be a traced scalar (the adaptive controller's state)."""
  mask_BT = jnp.asarray(mask_BT).astype(bool)
  t = mask_BT.shape[-1]
  rewards_BT = jnp.where(mask_BT, -jnp.asarray(coef, jnp.float32) * kl_BT, 0.0)
  last_B = jnp.max(jnp.where(mask_BT, jnp.arange(t), -1), axis=-1)
  at_last_BT = jnp.arange(t)[None, :] == last_B[:, None]  # all false for an empty row
  return rewards_BT + jnp.where(at_last_BT, jnp.asarray(score_B, jnp.float32)[:, None], 0.0)


def kl_penalty_loss(kl_BT, mask_BT, *, coef, agg: str = "token_mean", denom=None, max_len=None):
  """GRPO-style KL in the loss: ``coef * aggregate(kl)`` with the same aggregation as the policy
  loss.  Returns ``(loss, {"kl": token-mean kl})``."""
  loss = jnp.asarray(coef, jnp.float32) * aggregate(kl_BT, mask_BT, mode=agg, denom=denom,
                                                    max_len=max_len)
  return loss, {"kl": jax.lax.stop_gradient(masked_token_mean(kl_BT, mask_BT))}


@struct.dataclass
class KLControllerState:
  """The KL coefficient, carried in the train state so it resumes."""
  coef: jax.Array  # float32 scalar


def init_kl_controller(coef: float) -> KLControllerState:
  return KLControllerState(coef=jnp.asarray(coef, jnp.float32))


def update_kl_controller(state: KLControllerState, observed_kl, n_steps, *, target: float,
                         horizon: float, adaptive: bool) -> KLControllerState:
  """Ziegler et al. (2019) proportional controller:
  ``e = clip(observed_kl / target - 1, -0.2, 0.2)``; ``coef *= 1 + e * n_steps / horizon``.

  ``observed_kl`` is the mean per-sequence KL of the batch (summed over tokens, as in the paper)
  and ``n_steps`` the number of samples it came from.  ``adaptive=False`` keeps ``coef`` fixed.
  A non-finite ``observed_kl`` leaves ``coef`` unchanged rather than poisoning it for good.
  """
  if not adaptive:
    return state
  if target <= 0 or horizon <= 0:
    raise ValueError(f"adaptive KL needs target > 0 and horizon > 0 (got target={target}, "
                     f"horizon={horizon}); set kl.target and kl.horizon")
  observed = jnp.asarray(observed_kl, jnp.float32)
  error = jnp.clip(observed / target - 1.0, -0.2, 0.2)
  mult = 1.0 + error * jnp.asarray(n_steps, jnp.float32) / horizon
  new = state.coef * mult
  return state.replace(coef=jnp.where(jnp.isfinite(observed), new, state.coef))
