"""The 70B experiments with LoRA (rank 16 on every projection, the frozen base in bfloat16):
the policy's base doubles as the reference, and only the adapters carry optimizer state, so
each fits on fewer GPUs than its full fine-tune (docs/plan.md, "LoRA")."""

import dataclasses

from experiments import dpo70b, grpo70b, ppo70b
from jaxrlhf.config import LoraConfig, MeshConfig
from jaxrlhf.registry import register

LORA_70B = LoraConfig(rank=16, alpha=32.0, base_dtype="bfloat16")


def _lora(cfg, stage: str, devices: int, mesh: MeshConfig, what: str, lr: float):
  """``cfg`` with adapters on ``stage``'s trained roles, trained at ``lr`` (PPO's value model
  at ten times its full fine-tune's).  Adapters take about ten times the full
  fine-tune's learning rate: veRL's LoRA guide (docs/advance/ppo_lora.rst, "increase the
  learning rate by an order of magnitude") and Zephyr's QLoRA DPO (alignment-handbook
  recipes/zephyr-7b-beta/dpo/config_qlora.yaml, 5e-6 against 5e-7 in full)."""
  scfg = getattr(cfg, stage)
  changes = {"lora": LORA_70B, "optim": dataclasses.replace(scfg.optim, lr=lr)}
  if hasattr(scfg, "value_optim"):
    changes["value_optim"] = dataclasses.replace(scfg.value_optim, lr=10 * scfg.value_optim.lr)
  return dataclasses.replace(
      cfg, name=f"{cfg.name}_lora", description=f"{cfg.description.rsplit(',', 1)[0]}, "
      f"LoRA rank 16, {what}", mesh=mesh, plan=dataclasses.replace(cfg.plan, devices=devices),
      **{stage: dataclasses.replace(scfg, **changes)})


@register("dpo70b_lora")
def build_dpo():
  cfg = _lora(dpo70b.build(), "dpo", 8, MeshConfig(dp=1, fsdp=1, tp=8), "one 8-GPU node",
              lr=5e-6)
  # One node has no data axis to spread the batch over: 16 micro-batches of 8 pairs keep the
  # layers' saved inputs (80 x 16 x 1,024 x 8,192 bf16) at 21 GB per device.
  optim = dataclasses.replace(cfg.dpo.optim, grad_accum=16)
  return dataclasses.replace(cfg, dpo=dataclasses.replace(cfg.dpo, optim=optim))


@register("grpo70b_lora")
def build_grpo():
  # veRL's GRPO-LoRA of Qwen2.5-72B (examples/tuning/70b/qwen2-72b_grpo-lora_8_h100_fsdp_vllm.sh).
  return _lora(grpo70b.build(), "grpo", 16, MeshConfig(dp=-1, fsdp=2, tp=8), "16 GPUs",
               lr=3e-5)


@register("ppo70b_lora")
def build_ppo():
  return _lora(ppo70b.build(), "ppo", 16, MeshConfig(dp=-1, fsdp=2, tp=8), "16 GPUs",
               lr=1e-5)
