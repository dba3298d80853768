"""Supervised fine-tuning of Llama-3-70B on a 32-GPU cluster (plan it with --plan)."""

import dataclasses

from experiments._llama70b import base_70b
from jaxrlhf.config import SFTConfig
from jaxrlhf.registry import register


@register("sft70b")
def build():
  cfg = base_70b("sft70b", ("sft",), "SFT of Llama-3-70B, batch 128 x 1024 tokens, 32 GPUs")
  return dataclasses.replace(cfg, sft=SFTConfig(steps=2000, batch_size=128))
