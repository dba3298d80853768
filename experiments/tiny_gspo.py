"""GSPO (sequence-level ratio and clip) on 2-digit addition from a short SFT; CPU, minutes.

The tiny GRPO task with ``grpo.policy_loss=gspo``: the paper's clip range (3e-4 / 4e-4 on
the length-normalised sequence ratio) and its aggregation, the mean over sequences of each
sequence's token mean.  ``--set=grpo.policy_loss=gspo_token`` runs the token variant.
"""

import dataclasses

from experiments.tiny_grpo import build as tiny_grpo
from jaxrlhf.registry import register


@register("tiny_gspo")
def build():
  base = tiny_grpo()
  return dataclasses.replace(
      base, name="tiny_gspo",
      description="SFT, then GSPO (sequence-level importance ratio and clipping) on addition",
      grpo=dataclasses.replace(base.grpo, policy_loss="gspo", clip_low=3e-4, clip_high=4e-4,
                               loss_agg="seq_mean_token_mean"))
