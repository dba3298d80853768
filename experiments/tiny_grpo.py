"""GRPO on 2-digit addition from a short SFT, rule reward (exact match); CPU, minutes."""


from experiments.tiny_ppo import ADDITION, GREEDY_LEN, TINY, TINY_SFT
from jaxrlhf.config import ExperimentConfig, GRPOConfig, OptimizerConfig, RewardConfig
from jaxrlhf.registry import register


@register("tiny_grpo")
def build():
  return ExperimentConfig(
      name="tiny_grpo",
      description="SFT, then GRPO (8 samples per prompt, exact-match rule reward) on addition",
      stages=("sft", "grpo"), model=TINY, data=ADDITION, rollout=GREEDY_LEN, sft=TINY_SFT,
      grpo=GRPOConfig(steps=120, batch_size=16, num_samples=8, eval_every=20,
                      reward=RewardConfig(sources=("rule:exact_match",)),
                      optim=OptimizerConfig(lr=1e-4, warmup_steps=5, schedule="constant")))
