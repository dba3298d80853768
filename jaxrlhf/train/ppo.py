"""PPO: policy, frozen reference, frozen reward model and a trained value model; KL-shaped
per-token rewards, GAE, clipped policy and value losses.  Its spec, its advantages and its
value term; the policy term is the shared one of train/phases.py."""

from __future__ import annotations

import jax.numpy as jnp

from jaxrlhf.algorithms import gae, kl_shaped_rewards, value_loss, whiten
from jaxrlhf.config import PPOConfig
from jaxrlhf.train import packed as PK
from jaxrlhf.train import spec
from jaxrlhf.train.phases import policy_term
from jaxrlhf.train.rl import RLStage, rl_roles, rl_validate
from jaxrlhf.train.work import rl_flops


def advantages(statics, carry, score_B, kl_BN, kl_coef, update_mask_BN):
  scfg = statics.scfg
  coef = kl_coef if scfg.kl.placement == "reward" else 0.0
  mask = carry.rollout.response_mask_BN
  turn = carry.rollout.turn_rewards_BN
  if turn is not None and scfg.reward.normalize == "none" and not scfg.reward.clip:
    # Multi-turn episodes: each turn's reward where its action ends (GAE skips the observations
    # between actions), the other sources' score at the last token.  Normalised or clipped
    # scores are not a sum over turns: the whole return then stays at the last token.
    turn = jnp.where(mask, statics.env_weight * turn, 0.0)
    rewards = kl_shaped_rewards(score_B - jnp.sum(turn, axis=-1), kl_BN, mask, coef=coef) + turn
  else:
    rewards = kl_shaped_rewards(score_B, kl_BN, mask, coef=coef)
  adv, returns = gae(rewards, carry.scored.values_BN, update_mask_BN, gamma=scfg.gamma,
                     lam=scfg.lam)
  if scfg.whiten_advantages:
    adv = whiten(adv, update_mask_BN)
  return adv, returns


def value_term(statics, params, mb, *, denom, n_seq, kl_coef):
  """``vf_coef`` x the clipped value loss; reads the value head's parameters only (the
  policy's with a shared backbone)."""
  del n_seq, kl_coef
  scfg = statics.scfg
  v = PK.token_scores(statics, statics.value_params(params), mb.tokens_BT, mb.mask_BT, mb.packed,
                      role="value")[:, mb.prompt_len - 1:mb.tokens_BT.shape[1] - 1]
  vl, vm = value_loss(v, mb.values_BN, mb.returns_BN, mb.update_mask_BN, clip=scfg.value_clip,
                      agg="token_mean", denom=denom)
  return scfg.vf_coef * vl, {"value/loss": vl,
                             "value/explained_variance": vm["explained_variance"]}


class PPOStage(RLStage):
  name = "ppo"


# Separate models: the two terms touch disjoint parameters, so their sum's gradients are each
# term's own.  A shared backbone gets both terms' gradients; the two forward passes over the
# same parameters and tokens are one computation after XLA's CSE.
SPEC = spec.register(spec.AlgorithmSpec(
    name="ppo", config_type=PPOConfig, stage=PPOStage,
    roles=lambda cfg: rl_roles(cfg, "ppo", value_head=True),
    batch="prompts", rows_per_example=1, flops=rl_flops, evaluation="exact_match",
    eval_at_start=True, validate=lambda cfg, data: rl_validate(cfg, "ppo", data), generates=True, advantages=advantages,
    terms={"policy": policy_term, "value": value_term}))
