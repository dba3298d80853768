"""SimPO (reference-free, length-normalised, target margin) on 2-digit addition; CPU, minutes.

The tiny DPO task with ``dpo.loss=simpo``: no reference model in the plan or in memory.
beta and the margin are the SimPO paper's order (beta 2, gamma 1 = gamma/beta 0.5).
"""

import dataclasses

from experiments.tiny_dpo import build as tiny_dpo
from jaxrlhf.registry import register


@register("tiny_simpo")
def build():
  base = tiny_dpo()
  return dataclasses.replace(
      base, name="tiny_simpo",
      description="SFT, then SimPO (no reference model) on derived preference pairs",
      dpo=dataclasses.replace(base.dpo, loss="simpo", beta=2.0, simpo_gamma=1.0))
