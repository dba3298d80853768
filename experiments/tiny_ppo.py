"""The default experiment: SFT -> reward model -> PPO on 2-digit addition, on a laptop CPU."""

from jaxrlhf.config import DataConfig, ExperimentConfig, ModelConfig, RolloutConfig
from jaxrlhf.registry import register

# 2 layers, d_model 128: about 0.4M parameters; the char tokenizer has 48 tokens.
TINY = ModelConfig(vocab_size=48, d_model=128, n_layers=2, n_heads=4, n_kv_heads=4,
                   head_dim=32, mlp_dim=512, max_seq_len=64)
ADDITION = DataConfig(task="addition", digits=2, max_prompt_len=8, max_response_len=5,
                      eval_size=256)
GREEDY_LEN = RolloutConfig(max_new_tokens=5)


@register("tiny_ppo")
def build():
  return ExperimentConfig(
      name="tiny_ppo",
      description="SFT, reward model, then PPO (4 models) on 2-digit addition; CPU, minutes",
      stages=("sft", "rm", "ppo"), model=TINY, data=ADDITION, rollout=GREEDY_LEN)
