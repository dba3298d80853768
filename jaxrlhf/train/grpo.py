"""GRPO: N samples per prompt, group-relative advantages, KL to the reference in the loss (or
in the reward), no value model.  Its spec and its advantages; the loss is the shared policy
term (clipped surrogate, entropy, KL) of train/phases.py."""

from __future__ import annotations

import jax.numpy as jnp

from jaxrlhf.algorithms import group_advantages
from jaxrlhf.config import GRPOConfig
from jaxrlhf.train import spec
from jaxrlhf.train.phases import policy_term
from jaxrlhf.train.rl import RLStage, rl_roles, rl_validate
from jaxrlhf.train.work import rl_flops


def advantages(statics, carry, score_B, kl_BN, kl_coef, update_mask_BN):
  scfg = statics.scfg
  if scfg.kl.placement == "reward":
    score_B = score_B - kl_coef * jnp.sum(kl_BN, axis=-1)
  valid = jnp.any(update_mask_BN, axis=-1)
  adv = group_advantages(score_B, group_size=statics.n, method=scfg.advantage, eps=scfg.std_eps,
                         valid_B=valid)
  return jnp.where(update_mask_BN, adv[:, None], 0.0), None


class GRPOStage(RLStage):
  name = "grpo"


SPEC = spec.register(spec.AlgorithmSpec(
    name="grpo", config_type=GRPOConfig, stage=GRPOStage,
    roles=lambda cfg: rl_roles(cfg, "grpo", value_head=False),
    batch="prompts", rows_per_example=1, flops=rl_flops, evaluation="exact_match",
    eval_at_start=True, validate=lambda cfg, data: rl_validate(cfg, "grpo", data), generates=True, advantages=advantages,
    terms={"policy": policy_term}))
