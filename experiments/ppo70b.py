"""PPO of Llama-3-70B with an 8B-class reward and value model on a 32-GPU cluster."""

import dataclasses

from experiments._llama70b import LLAMA_8B_SCORER, base_70b
from jaxrlhf.config import PPOConfig
from jaxrlhf.registry import register


@register("ppo70b")
def build():
  cfg = base_70b("ppo70b", ("ppo",),
                 "PPO of Llama-3-70B: 128 prompts x 512 new tokens, 8B reward/value, 32 GPUs")
  return dataclasses.replace(cfg, reward_model=LLAMA_8B_SCORER, value_model=LLAMA_8B_SCORER,
                             ppo=PPOConfig(steps=5000, batch_size=128, num_minibatches=4))
