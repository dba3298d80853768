"""PPO: policy, frozen reference, frozen reward model and a trained value model; KL-shaped
per-token rewards, GAE, clipped policy and value losses — one program per step."""

from __future__ import annotations

from jaxrlhf import model as M
from jaxrlhf.algorithms import aggregate, gae, kl_estimate, kl_shaped_rewards, value_loss, whiten
from jaxrlhf.config import ConfigError
from jaxrlhf.train.rl import RLStage


class PPOStage(RLStage):
  name = "ppo"
  trainable = {"policy": "lm", "value": "scalar"}
  uses_value = True

  def __init__(self, cfg, mesh, data):
    if cfg.ppo.shared_backbone:
      # One model, two heads: the value head reads the policy's own hidden states, and the
      # value loss trains the shared backbone too (with ppo.optim; ppo.value_optim is unused).
      if cfg.value_model is not None and cfg.value_model != cfg.model:
        raise ConfigError("ppo.shared_backbone=true: the value head sits on the policy, so "
                          "value_model must be unset (or equal to model); drop the "
                          "value_model settings or set ppo.shared_backbone=false")
      self.trainable = {"policy": "lm+scalar"}
    super().__init__(cfg, mesh, data)

  def value_params(self, params):
    return params["policy"] if self.scfg.shared_backbone else params["value"]

  def advantages(self, ro, score, kl_tok, kl_coef, update_mask):
    scfg = self.scfg
    coef = kl_coef if scfg.kl.placement == "reward" else 0.0
    rewards = kl_shaped_rewards(score, kl_tok, ro["response_mask"], coef=coef)
    adv, returns = gae(rewards, ro["values"], update_mask, gamma=scfg.gamma, lam=scfg.lam)
    if scfg.whiten_advantages:
      adv = whiten(adv, update_mask)
    return adv, {"values": ro["values"], "returns": returns}

  def policy_loss(self, params, mb, *, denom, n_seq, kl_coef):
    """The policy's share of the loss (clipped surrogate, entropy, KL when placed in the
    loss); needs ``params["policy"]`` only.  The actor pool of a disaggregated run trains on
    this alone."""
    scfg = self.scfg
    logp, loss, metrics = self.policy_terms(params, mb, denom=denom, n_seq=n_seq)
    if scfg.kl.placement == "loss":
      kl = kl_estimate(logp, mb["ref_logp"], estimator=scfg.kl.estimator,
                       clamp_logr=scfg.kl.clamp_logr, clamp_kl=scfg.kl.clamp_kl)
      loss = loss + kl_coef * aggregate(kl, mb["resp_mask"], mode="token_mean", denom=denom)
    return loss, metrics

  def value_loss_terms(self, params, mb, *, denom):
    """The value model's share (``vf_coef`` x clipped value loss); needs ``params["value"]``
    only (``params["policy"]`` with a shared backbone).  The critic pool of a disaggregated run trains on this alone."""
    scfg = self.scfg
    v = M.token_scores(self.value_params(params), mb["tokens"], mb["mask"],
                       cfg=self.model_cfg("value"),
                       kernels=self.cfg.kernels)[:, self.P - 1:self.P - 1 + self.N]
    vl, vm = value_loss(v, mb["values"], mb["returns"], mb["resp_mask"], clip=scfg.value_clip,
                        agg="token_mean", denom=denom)
    return scfg.vf_coef * vl, {"value/loss": vl,
                               "value/explained_variance": vm["explained_variance"]}

  def losses(self, params, mb, *, denom, n_seq, kl_coef):
    # Separate models: the two shares touch disjoint parameters, so their sum's gradients are
    # each share's own.  A shared backbone gets both shares' gradients; the two forward passes
    # over the same parameters and tokens are one computation after XLA's CSE.
    pol, metrics = self.policy_loss(params, mb, denom=denom, n_seq=n_seq, kl_coef=kl_coef)
    val, vmetrics = self.value_loss_terms(params, mb, denom=denom)
    return pol + val, {**metrics, **vmetrics}
