"""DAPO's pieces on 2-digit addition from a short SFT; CPU, minutes.

Each piece is a setting of GRPO: clip-higher (``clip_low=0.2``, ``clip_high=0.28``),
token-level aggregation (``loss_agg=token_mean``), no KL, dynamic sampling (twice the prompts
generated, the first 16 groups whose rewards differ trained), and the soft overlong penalty
over the last token before ``rollout.max_new_tokens`` (a sum needs 3 digits + EOS = 4 of the
5; a response that runs into the limit loses 0.5).
"""

import dataclasses

from experiments.tiny_grpo import build as tiny_grpo
from jaxrlhf.config import KLConfig
from jaxrlhf.registry import register


@register("tiny_dapo")
def build():
  base = tiny_grpo()
  g = base.grpo
  return dataclasses.replace(
      base, name="tiny_dapo",
      description="SFT, then DAPO (clip-higher, dynamic sampling, overlong shaping) on addition",
      grpo=dataclasses.replace(
          g, clip_low=0.2, clip_high=0.28, loss_agg="token_mean", dynamic_sampling=True,
          max_oversample=2.0, kl=KLConfig(coef=0.0, estimator="k3", placement="loss"),
          reward=dataclasses.replace(g.reward, overlong_buffer=1, overlong_penalty=0.5)))
