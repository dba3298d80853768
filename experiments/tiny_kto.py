"""KTO (desirable / undesirable examples, a KL reference point) on 2-digit addition; minutes.

The tiny DPO task with ``dpo.loss=kto``: each derived pair gives one desirable example (the
right sum) and one undesirable one (a wrong sum), trained as unpaired examples.
"""

import dataclasses

from experiments.tiny_dpo import build as tiny_dpo
from jaxrlhf.registry import register


@register("tiny_kto")
def build():
  base = tiny_dpo()
  return dataclasses.replace(
      base, name="tiny_kto",
      description="SFT, then KTO on the two sides of derived pairs as unpaired examples",
      dpo=dataclasses.replace(base.dpo, loss="kto", beta=0.2))
