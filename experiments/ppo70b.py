"""PPO of Llama-3-70B with an 8B-class reward and value model on a 64-GPU cluster.

64 GPUs (tp 8 x fsdp 8): with float32 masters and moments for the policy and the value model
(29.3 GB per H100 at 32 GPUs) the 32-GPU plan no longer fits beside the decode layout's copy
of the policy (generation 79.5 GB per H100 against 72 usable); 32 fit only by decoding in the
training layout, a weight gather per token: 320 s per step against 9.7 (docs/plan.md).

Recipe: Llama 2-Chat's PPO at 70B (Touvron et al. 2023, arXiv 2307.09288, section 3.2.3):
AdamW (0.9, 0.95, eps 1e-5), weight decay 0.1, clipping 1.0, a constant lr of 1e-6, clip
range 0.2, KL penalty 0.005 in the reward, minibatches of 64 with one gradient step each.
The value model's lr, 9e-6, is OpenRLHF's for Llama-3-70B
(examples/scripts/train_ppo_llama_ray_70b.sh, critic_learning_rate), which Llama 2 does not
report.  128 prompts per step (Llama 2 took 512) keep the rollout inside the 32-GPU plan."""

import dataclasses

from experiments._llama70b import LLAMA_8B_SCORER, LLAMA2_ADAMW, base_70b
from jaxrlhf.config import KLConfig, MeshConfig, PPOConfig
from jaxrlhf.registry import register


@register("ppo70b")
def build():
  cfg = base_70b("ppo70b", ("ppo",),
                 "PPO of Llama-3-70B: 128 prompts x 512 new tokens, 8B reward/value, 64 GPUs")
  # Each minibatch of 64 prompts in two micro-batches of 32 (the same update, half the
  # activations).
  optim = dataclasses.replace(LLAMA2_ADAMW, lr=1e-6, schedule="constant", warmup_steps=0,
                              weight_decay=0.1, grad_accum=2)
  return dataclasses.replace(
      cfg, reward_model=LLAMA_8B_SCORER, value_model=LLAMA_8B_SCORER,
      mesh=MeshConfig(dp=1, fsdp=-1, tp=8), plan=dataclasses.replace(cfg.plan, devices=64),
      ppo=PPOConfig(steps=5000, batch_size=128, num_minibatches=2, ppo_epochs=1,
                    clip_low=0.2, clip_high=0.2, optim=optim,
                    value_optim=dataclasses.replace(optim, lr=9e-6),
                    kl=KLConfig(coef=0.005, estimator="k1", placement="reward")))
