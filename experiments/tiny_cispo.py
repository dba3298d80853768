"""CISPO (clipped, stopped importance weights on REINFORCE) on 2-digit addition; CPU, minutes.

The tiny GRPO task with ``grpo.policy_loss=cispo``: no lower bound on the weight
(``clip_low=1``) and an upper bound of 1.28, as MiniMax-M1 keeps only the upper one; token-level
aggregation.  Two minibatches make the later one off-policy, so the weight is not always 1.
"""

import dataclasses

from experiments.tiny_grpo import build as tiny_grpo
from jaxrlhf.registry import register


@register("tiny_cispo")
def build():
  base = tiny_grpo()
  return dataclasses.replace(
      base, name="tiny_cispo",
      description="SFT, then CISPO (clipped stop-gradient IS weight, REINFORCE) on addition",
      grpo=dataclasses.replace(base.grpo, policy_loss="cispo", clip_low=1.0, clip_high=0.28,
                               num_minibatches=2, loss_agg="token_mean"))
