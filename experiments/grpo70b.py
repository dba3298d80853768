"""GRPO of Llama-3-70B (policy, reference, 8B reward model) on a 32-GPU cluster."""

import dataclasses

from experiments._llama70b import LLAMA_8B_SCORER, base_70b
from jaxrlhf.config import GRPOConfig, RewardConfig
from jaxrlhf.registry import register


@register("grpo70b")
def build():
  cfg = base_70b("grpo70b", ("grpo",),
                 "GRPO of Llama-3-70B: 16 prompts x 8 samples x 512 new tokens, 32 GPUs")
  return dataclasses.replace(
      cfg, reward_model=LLAMA_8B_SCORER,
      grpo=GRPOConfig(steps=5000, batch_size=16, num_samples=8, num_minibatches=4,
                      reward=RewardConfig(sources=("model",))))
