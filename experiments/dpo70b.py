"""DPO of Llama-3-70B (policy + frozen reference) on a 32-GPU cluster."""

import dataclasses

from experiments._llama70b import base_70b
from jaxrlhf.config import DPOConfig
from jaxrlhf.registry import register


@register("dpo70b")
def build():
  cfg = base_70b("dpo70b", ("dpo",), "DPO of Llama-3-70B, 128 pairs x 1024 tokens, 32 GPUs")
  return dataclasses.replace(cfg, dpo=DPOConfig(steps=2000, batch_size=128))
