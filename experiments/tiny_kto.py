"""KTO (desirable / undesirable examples, a KL reference point) on 2-digit addition; minutes.

SFT as tiny_dpo's, then KTO on unpaired examples derived from the checker's pairs (the right
sum desirable, a wrong one undesirable: half of each batch each); the same held-out pairs as
tiny_dpo measure preference accuracy.
"""

from experiments.tiny_ppo import ADDITION, GREEDY_LEN, TINY, TINY_SFT
from jaxrlhf.config import ExperimentConfig, KTOConfig, OptimizerConfig
from jaxrlhf.registry import register


@register("tiny_kto")
def build():
  return ExperimentConfig(
      name="tiny_kto",
      description="SFT, then KTO on unpaired examples (right sums desirable, wrong undesirable)",
      stages=("sft", "kto"), model=TINY, data=ADDITION, rollout=GREEDY_LEN, sft=TINY_SFT,
      kto=KTOConfig(steps=300, batch_size=64, beta=0.2, eval_every=50,
                    optim=OptimizerConfig(lr=3e-4, warmup_steps=5, schedule="cosine")))
