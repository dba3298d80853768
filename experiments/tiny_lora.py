"""The tiny GRPO and DPO experiments with LoRA in the second stage (rank 8 on every
projection, alpha 16): the same SFT start, adapters instead of full weights, a 10x / 3x higher
learning rate (an adapter's update moves the weights less than a full one at the same rate)."""

import dataclasses

from experiments import tiny_dpo, tiny_grpo
from jaxrlhf.config import LoraConfig
from jaxrlhf.registry import register

TINY_LORA = LoraConfig(rank=8, alpha=16.0)


def _lora(cfg, stage: str, lr: float):
  scfg = getattr(cfg, stage)
  return dataclasses.replace(
      cfg, name=f"{cfg.name}_lora", description=f"{cfg.description}; LoRA rank 8",
      **{stage: dataclasses.replace(scfg, lora=TINY_LORA,
                                    optim=dataclasses.replace(scfg.optim, lr=lr))})


@register("tiny_grpo_lora")
def build_grpo():
  return _lora(tiny_grpo.build(), "grpo", 1e-3)


@register("tiny_dpo_lora")
def build_dpo():
  cfg = _lora(tiny_dpo.build(), "dpo", 1e-3)
  # The beta its figures were measured with (tiny_dpo moved to 0.4 afterwards).
  return dataclasses.replace(cfg, dpo=dataclasses.replace(cfg.dpo, beta=0.2))
