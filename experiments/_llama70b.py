"""Shared shape and cluster of the 70B experiments: Llama-3-70B on 4 nodes x 8 GPUs (ppo70b
takes 8 nodes).

The weights are stored in bfloat16 (what every forward and the rollout read); the trained
roles keep float32 master weights and Adam moments (``optim.precision="fp32"``, the default:
docs/training.md, "Mixed precision").  Each experiment's optimizer and algorithm settings
come from a published 70B-class recipe, cited beside them and in docs/plan.md, "Recipes"."""

import dataclasses

from jaxrlhf.config import (CheckpointConfig, DataConfig, ExperimentConfig, MeshConfig,
                            ModelConfig, OptimizerConfig, PlanConfig, RolloutConfig)

LLAMA3_70B = ModelConfig(
    vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
    mlp_dim=28672, max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5,
    param_dtype="bfloat16", compute_dtype="bfloat16", remat="full", scan_layers=True,
    # Activations in bf16, as Megatron and the peers keep them.  A float32 residual
    # (the default, which makes the CPU sampler's log-probs the trainer's bit for bit:
    # docs/rollout.md) would save each layer's input in float32 and send float32 over the tp
    # all-reduces: sft70b's peak 61 -> 73.5 GB (no longer fits 32 H100s), its step 5.8 ->
    # 6.5 s; on a GPU the Pallas log-prob and attention kernels round in their own order, so
    # the parity it buys is partial there.
    residual_dtype="compute")

# A 7B-class reward/value model (the seed analysis: reward models are typically 7-13B).
LLAMA_8B_SCORER = dataclasses.replace(
    LLAMA3_70B, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, mlp_dim=14336)


def base_70b(name: str, stages: tuple[str, ...], description: str) -> ExperimentConfig:
  return ExperimentConfig(
      name=name, description=description, stages=stages, model=LLAMA3_70B,
      mesh=MeshConfig(dp=-1, fsdp=4, tp=8),
      rollout=RolloutConfig(max_new_tokens=512, temperature=1.0),
      data=DataConfig(task="jsonl", max_prompt_len=512, max_response_len=512),
      checkpoint=CheckpointConfig(every_steps=100, keep=3),
      plan=PlanConfig(accelerator="h100", devices=32))


def warmup(steps: int, ratio: float) -> int:
  """A recipe's warm-up ratio as steps of this experiment's budget."""
  return max(1, round(steps * ratio))


# AdamW as Llama 2 trained its chat models (Touvron et al. 2023, arXiv 2307.09288, section 2.2
# and section 3.2.3: beta1 0.9, beta2 0.95, eps 1e-5, gradient clipping 1.0).
LLAMA2_ADAMW = OptimizerConfig(b1=0.9, b2=0.95, eps=1e-5, grad_clip=1.0)
