"""GRPO of Llama-3-70B (policy, reference, 8B reward model) on a 32-GPU cluster.

Recipe: veRL's 70B-class GRPO example (volcengine/verl
examples/tuning/70b/qwen2-70b_grpo_32_h800_fsdp_vllm.sh, Qwen2-72B on 32 GPUs): lr 1e-6
constant, the KL to the reference in the loss at 0.001 with the k3 ("low_var_kl") estimator,
clip range 0.2, weight decay 0.01, four updates per step; a warm-up of 20 steps as DAPO
(Yu et al. 2025, arXiv 2503.14476, section 4.1).  16 prompts x 8 samples per step (veRL took
1024 x 5) keep the rollout inside the 32-GPU plan."""

import dataclasses

from experiments._llama70b import LLAMA_8B_SCORER, LLAMA2_ADAMW, base_70b
from jaxrlhf.config import GRPOConfig, KLConfig, RewardConfig
from jaxrlhf.registry import register


@register("grpo70b")
def build():
  cfg = base_70b("grpo70b", ("grpo",),
                 "GRPO of Llama-3-70B: 16 prompts x 8 samples x 512 new tokens, 32 GPUs")
  optim = dataclasses.replace(LLAMA2_ADAMW, lr=1e-6, schedule="constant", warmup_steps=20,
                              warmup_start="first_step", weight_decay=0.01)
  return dataclasses.replace(
      cfg, reward_model=LLAMA_8B_SCORER,
      grpo=GRPOConfig(steps=5000, batch_size=16, num_samples=8, num_minibatches=4,
                      clip_low=0.2, clip_high=0.2, optim=optim,
                      kl=KLConfig(coef=0.001, estimator="k3", placement="loss"),
                      reward=RewardConfig(sources=("model",))))


@register("grpo70b_longprompt")
def build_longprompt():
  """grpo70b with long prompts and large groups (issue 42's long-prompt workload): 2,048-token
  prompts x 16 samples x 512 new tokens, 8 prompts per step (the same 128 rollouts).  Each
  prompt's KV is most of what decoding reads; ``--set=rollout.prefix_sharing=true`` reads it
  once per group (docs/rollout.md, "Shared prefixes")."""
  cfg = build()
  return dataclasses.replace(
      cfg, name="grpo70b_longprompt",
      description="GRPO of Llama-3-70B: 8 prompts of 2,048 tokens x 16 samples x 512 new "
                  "tokens, 32 GPUs",
      data=dataclasses.replace(cfg.data, max_prompt_len=2048),
      grpo=dataclasses.replace(cfg.grpo, batch_size=8, num_samples=16))
