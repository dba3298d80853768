"""The 70B experiments with LoRA (rank 16 on every projection, the frozen base in bfloat16):
the policy's base doubles as the reference, and only the adapters carry optimizer state, so
each fits on fewer GPUs than its full fine-tune (docs/plan.md, "LoRA")."""

import dataclasses

from experiments import dpo70b, grpo70b, ppo70b
from jaxrlhf.config import LoraConfig, MeshConfig
from jaxrlhf.registry import register

LORA_70B = LoraConfig(rank=16, alpha=32.0, base_dtype="bfloat16")


def _lora(cfg, stage: str, devices: int, mesh: MeshConfig, what: str):
  return dataclasses.replace(
      cfg, name=f"{cfg.name}_lora", description=f"{cfg.description.rsplit(',', 1)[0]}, "
      f"LoRA rank 16, {what}", mesh=mesh, plan=dataclasses.replace(cfg.plan, devices=devices),
      **{stage: dataclasses.replace(getattr(cfg, stage), lora=LORA_70B)})


@register("dpo70b_lora")
def build_dpo():
  cfg = _lora(dpo70b.build(), "dpo", 8, MeshConfig(dp=1, fsdp=1, tp=8), "one 8-GPU node")
  # One node has no data axis to spread the batch over: 16 micro-batches of 8 pairs keep the
  # layers' saved inputs (80 x 16 x 1,024 x 8,192 bf16) at 21 GB per device.
  optim = dataclasses.replace(cfg.dpo.optim, grad_accum=16)
  return dataclasses.replace(cfg, dpo=dataclasses.replace(cfg.dpo, optim=optim))


@register("grpo70b_lora")
def build_grpo():
  return _lora(grpo70b.build(), "grpo", 16, MeshConfig(dp=-1, fsdp=2, tp=8), "16 GPUs")


@register("ppo70b_lora")
def build_ppo():
  return _lora(ppo70b.build(), "ppo", 16, MeshConfig(dp=-1, fsdp=2, tp=8), "16 GPUs")
