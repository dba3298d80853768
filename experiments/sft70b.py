"""Supervised fine-tuning of Llama-3-70B on a 32-GPU cluster (plan it with --plan).

Recipe: Tulu 3 70B SFT (allenai/open-instruct docs/tulu3.md, "Llama-3.1-Tulu-3-70B-SFT
Reproduction"): lr 2e-6 decayed linearly to 0 after a 3% warm-up, no weight decay, 128
sequences per step (Tulu: 64 GPUs x 1 x gradient accumulation 2), here in four micro-batches
of 32: with float32 masters and moments (26.5 GB per H100) one micro-batch's saved layer
inputs no longer fit beside them (98 GB at 1, 72.7 at 2, 61.0 at 4: --plan); Llama 2's AdamW
betas, epsilon and clipping (experiments/_llama70b.py)."""

import dataclasses

from experiments._llama70b import LLAMA2_ADAMW, base_70b, warmup
from jaxrlhf.config import SFTConfig
from jaxrlhf.registry import register

STEPS = 2000


@register("sft70b")
def build():
  cfg = base_70b("sft70b", ("sft",), "SFT of Llama-3-70B, batch 128 x 1024 tokens, 32 GPUs")
  optim = dataclasses.replace(LLAMA2_ADAMW, lr=2e-6, schedule="linear", end_lr_ratio=0.0,
                              warmup_steps=warmup(STEPS, 0.03), warmup_start="first_step",
                              weight_decay=0.0, grad_accum=4)
  return dataclasses.replace(cfg, sft=SFTConfig(steps=STEPS, batch_size=128, optim=optim))
