"""Shared shape and cluster of the 70B experiments: Llama-3-70B on 4 nodes x 8 GPUs."""

import dataclasses

from jaxrlhf.config import (CheckpointConfig, DataConfig, ExperimentConfig, MeshConfig,
                            ModelConfig, PlanConfig, RolloutConfig)

LLAMA3_70B = ModelConfig(
    vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
    mlp_dim=28672, max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5,
    param_dtype="bfloat16", compute_dtype="bfloat16", remat="full", scan_layers=True)

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
