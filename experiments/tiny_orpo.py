"""ORPO (SFT plus an odds-ratio term, no reference model) on 2-digit addition; CPU, minutes.

The tiny DPO task with ``dpo.loss=orpo``; ``dpo.beta`` is ORPO's lambda (0.1 as the paper and
TRL's default would give the odds-ratio term too little weight here, against an SFT term that
the SFT stage has already lowered: 1.0).
"""

import dataclasses

from experiments.tiny_dpo import build as tiny_dpo
from jaxrlhf.registry import register


@register("tiny_orpo")
def build():
  base = tiny_dpo()
  return dataclasses.replace(
      base, name="tiny_orpo",
      description="SFT, then ORPO (odds-ratio preference + SFT, no reference) on derived pairs",
      dpo=dataclasses.replace(base.dpo, loss="orpo", beta=1.0))
