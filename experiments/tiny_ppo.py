"""The default experiment: SFT -> reward model -> PPO on 2-digit addition, on a laptop CPU."""

from jaxrlhf.config import ExperimentConfig, ModelConfig
from jaxrlhf.registry import register

TINY = ModelConfig(vocab_size=32, d_model=128, n_layers=2, n_heads=4, n_kv_heads=4,
                   head_dim=32, mlp_dim=512, max_seq_len=64)


@register("tiny_ppo")
def build():
  return ExperimentConfig(
      name="tiny_ppo",
      description="SFT, reward model, then PPO (4 models) on 2-digit addition; CPU, minutes",
      stages=("sft", "rm", "ppo"), model=TINY)
