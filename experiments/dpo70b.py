"""DPO of Llama-3-70B (policy + frozen reference) on a 32-GPU cluster.

128 pairs of 1,024 tokens per step in four micro-batches: in one, each layer's saved input
(80 x 32 x 1,024 x 8,192 bf16 per device) needs 78 GB per H100 against 72 usable (--plan)."""

import dataclasses

from experiments._llama70b import base_70b
from jaxrlhf.config import DPOConfig
from jaxrlhf.registry import register


@register("dpo70b")
def build():
  cfg = base_70b("dpo70b", ("dpo",), "DPO of Llama-3-70B, 128 pairs x 1024 tokens, 32 GPUs")
  optim = dataclasses.replace(DPOConfig().optim, grad_accum=4)
  return dataclasses.replace(cfg, dpo=DPOConfig(steps=2000, batch_size=128, optim=optim))
