"""GRPO: N samples per prompt, group-relative advantages, KL to the reference in the loss
(or in the reward), no value model."""

from __future__ import annotations

import jax.numpy as jnp

from jaxrlhf.algorithms import aggregate, group_advantages, kl_estimate
from jaxrlhf.train.rl import RLStage


class GRPOStage(RLStage):
  name = "grpo"
  trainable = {"policy": "lm"}

  def advantages(self, ro, score, kl_tok, kl_coef, update_mask):
    scfg = self.scfg
    if scfg.kl.placement == "reward":
      score = score - kl_coef * jnp.sum(kl_tok, axis=-1)
    valid = jnp.any(update_mask, axis=-1)
    adv = group_advantages(score, group_size=self.n, method=scfg.advantage, eps=scfg.std_eps,
                           valid_B=valid)
    return jnp.where(update_mask, adv[:, None], 0.0), {}

  def losses(self, params, mb, *, denom, n_seq, kl_coef):
    scfg = self.scfg
    logp, loss, metrics = self.policy_terms(params, mb, denom=denom, n_seq=n_seq)
    if scfg.kl.placement == "loss" and (scfg.kl.coef > 0 or scfg.kl.adaptive):
      kl = kl_estimate(logp, mb["ref_logp"], estimator=scfg.kl.estimator,
                       clamp_logr=scfg.kl.clamp_logr, clamp_kl=scfg.kl.clamp_kl)
      kl_loss = aggregate(kl, mb["resp_mask"], mode=scfg.loss_agg,
                          denom=denom if scfg.loss_agg == "token_mean" else n_seq,
                          max_len=self.N)
      loss = loss + kl_coef * kl_loss
      metrics["kl/loss"] = kl_loss
    return loss, metrics
