"""DPO of Llama-3-70B (policy + frozen reference) on a 32-GPU cluster.

128 pairs of 1,024 tokens per step in eight micro-batches of 16 pairs: beside the policy's
float32 masters and moments (26.5 GB per H100) four micro-batches need 77.8 GB per H100
against 72 usable, eight 66.3 (--plan)."""

import dataclasses

from experiments._llama70b import LLAMA2_ADAMW, base_70b, warmup
from jaxrlhf.config import DPOConfig
from jaxrlhf.registry import register

STEPS = 2000


@register("dpo70b")
def build():
  cfg = base_70b("dpo70b", ("dpo",), "DPO of Llama-3-70B, 128 pairs x 1024 tokens, 32 GPUs")
  # Recipe: Tulu 2 70B DPO (Ivison et al. 2023, arXiv 2311.10702, appendix B) and OpenRLHF's
  # 34B DPO script (examples/scripts/train_dpo_llama_34b.sh): the sigmoid loss at beta 0.1,
  # lr 5e-7, a 10% warm-up then linear decay, no weight decay; 128 pairs per step as Tulu 3
  # 70B DPO (open-instruct configs/train_configs/tulu3/tulu3_dpo_70b.yaml).
  optim = dataclasses.replace(LLAMA2_ADAMW, lr=5e-7, schedule="linear", end_lr_ratio=0.0,
                              warmup_steps=warmup(STEPS, 0.1), warmup_start="first_step",
                              weight_decay=0.0, grad_accum=8)
  return dataclasses.replace(cfg, dpo=DPOConfig(steps=STEPS, batch_size=128, beta=0.1,
                                                optim=optim))
