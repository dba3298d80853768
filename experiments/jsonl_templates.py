"""SFT, PPO, GRPO and DPO on a user's Hugging Face model (Llama, Qwen2, Mistral, Qwen3, Gemma 2
or Gemma 3 family) and data (JSONL, Parquet or a datasets folder; plain text or chat messages).

Templates: the architecture comes from the checkpoint at run time
(``jaxrlhf.model.hf.resolve_hf_config``), so the model fields here are placeholders; point
them at local directories and data on the command line, e.g.::

  python -m jaxrlhf.main --experiment=grpo_jsonl \\
      --set=model.hf_path=/ckpt/qwen2-0.5b-sft --set=data.tokenizer=/ckpt/qwen2-0.5b-sft \\
      --set=data.prompts_path=prompts.jsonl --mesh=dp=-1,tp=4

``grpo_math`` is GRPO with the built-in math verifier (``host:math_verify`` plus a small
``host:math_format`` term); your own reward is ``--set=grpo.reward.sources=host:my_reward.py:fn``.

The policy and the frozen reference both start from ``model.hf_path``.  PPO's reward and value
models start from ``reward_model.hf_path`` / ``value_model.hf_path`` (a reward model with a
``score.weight``, or a causal LM, which gets a new zero scalar head); unset, they start from
the policy's checkpoint.  See docs/hf.md.
"""

import dataclasses

from jaxrlhf.config import (DataConfig, DPOConfig, ExperimentConfig, GRPOConfig, ModelConfig,
                            OptimizerConfig, PPOConfig, RewardConfig, RolloutConfig, SFTConfig)
from jaxrlhf.registry import register

# Learning rates for full fine-tuning of a pretrained model, as published recipes set them:
#   RL (PPO / GRPO policy) 1e-6: TRL's GRPOConfig default (learning_rate=1e-6); verl's GRPO and
#     PPO examples (actor_rollout_ref.actor.optim.lr=1e-6, lr_warmup_steps=10); OpenRLHF's PPO
#     examples use 5e-7 for the actor and 9e-6 for the critic (--critic_learning_rate 9e-6).
#   DPO 1e-6: TRL's DPOConfig default (learning_rate=1e-6); Zephyr's recipe used 5e-7.
#   SFT 1e-5 (TRL's SFTConfig default is 2e-5).
# Warm-up: 10 steps (verl's lr_warmup_steps=10); warmup_start=first_step: the first step
# trains at lr/10, not at 0 (jaxrlhf.train.common.learning_rate).  1e-4, the stages' default
# for the tiny models, moves a pretrained model's weights about 100x too far per step.
RL_OPTIM = OptimizerConfig(lr=1e-6, warmup_steps=10, warmup_start="first_step",
                           schedule="constant")
VALUE_OPTIM = OptimizerConfig(lr=9e-6, warmup_steps=10, warmup_start="first_step",
                              schedule="constant")
DPO_OPTIM = OptimizerConfig(lr=1e-6, warmup_steps=10, warmup_start="first_step",
                            schedule="constant")
SFT_OPTIM = OptimizerConfig(lr=1e-5, warmup_steps=20, warmup_start="first_step")

# Training fields for a ~1-8B model; the architecture fields are replaced from model.hf_path.
HF_MODEL = ModelConfig(param_dtype="float32", compute_dtype="bfloat16", remat="full",
                       scan_layers=True)
HF_DATA = DataConfig(task="jsonl", tokenizer="", max_prompt_len=256, max_response_len=256,
                     overlong="truncate")


def _base(name: str, stages: tuple[str, ...], description: str) -> ExperimentConfig:
  # Without these the run would train the placeholder shape from a random init, on the
  # built-in character tokenizer: refused up front instead (config.validate).
  data_file = {("dpo",): "data.pairs_path", ("sft",): "data.sft_path"}.get(stages,
                                                                          "data.prompts_path")
  return ExperimentConfig(
      name=name, description=description, stages=stages, model=HF_MODEL, data=HF_DATA,
      required=("model.hf_path", "data.tokenizer", data_file),
      # Prompts padded to each batch's longest, in four buckets (64, 128, 192, 256 columns).
      rollout=RolloutConfig(max_new_tokens=256, temperature=1.0, prompt_buckets=4))


@register("sft_jsonl")
def build_sft():
  cfg = _base("sft_jsonl", ("sft",), "SFT on your HF model: --set=model.hf_path=DIR "
              "--set=data.tokenizer=DIR --set=data.sft_path=FILE (prompt/response or messages)")
  return dataclasses.replace(cfg, sft=SFTConfig(steps=500, batch_size=32, eval_every=100,
                                                optim=SFT_OPTIM))


@register("ppo_jsonl")
def build_ppo():
  cfg = _base("ppo_jsonl", ("ppo",), "PPO on your HF model: --set=model.hf_path=DIR "
              "--set=reward_model.hf_path=RM_DIR --set=data.tokenizer=DIR "
              "--set=data.prompts_path=FILE")
  return dataclasses.replace(cfg, ppo=PPOConfig(steps=500, batch_size=32, num_minibatches=4,
                                                optim=RL_OPTIM, value_optim=VALUE_OPTIM))


@register("grpo_jsonl")
def build_grpo():
  cfg = _base("grpo_jsonl", ("grpo",), "GRPO on your HF model: --set=model.hf_path=DIR "
              "--set=data.tokenizer=DIR --set=data.prompts_path=FILE (answers: exact match)")
  return dataclasses.replace(cfg, grpo=GRPOConfig(
      steps=500, batch_size=16, num_samples=8, num_minibatches=4, optim=RL_OPTIM,
      reward=RewardConfig(sources=("rule:exact_match",))))


@register("grpo_math")
def build_grpo_math():
  cfg = build_grpo()
  return dataclasses.replace(
      cfg, name="grpo_math",
      description="GRPO, math answers checked by value (host:math_verify + 0.1 x "
      "host:math_format): --set=model.hf_path=DIR --set=data.tokenizer=DIR "
      "--set=data.prompts_path=FILE",
      grpo=dataclasses.replace(cfg.grpo, reward=RewardConfig(
          sources=("host:math_verify", "host:math_format"), weights=(1.0, 0.1))))


@register("dpo_jsonl")
def build_dpo():
  cfg = _base("dpo_jsonl", ("dpo",), "DPO on your HF model: --set=model.hf_path=DIR "
              "--set=data.tokenizer=DIR --set=data.pairs_path=FILE")
  return dataclasses.replace(cfg, dpo=DPOConfig(steps=500, batch_size=32, optim=DPO_OPTIM))
