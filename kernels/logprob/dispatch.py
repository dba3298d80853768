"""Picks the log-prob implementation by backend, with an explicit override
(``--set=kernels.logprob=auto|xla|pallas|pallas_interpret|naive``)."""

from __future__ import annotations

from kernels._backend import resolve_impl, target_platform
from kernels.logprob.mosaic import logprob_entropy_mosaic
from kernels.logprob.pallas import logprob_entropy_pallas
from kernels.logprob.reference import logprob_entropy_reference
from kernels.logprob.xla import logprob_entropy_blockwise

IMPLS = ("auto", "xla", "pallas", "pallas_interpret", "naive")
# What "auto" runs on each backend (anything unlisted: "xla"); see kernels/NOTES.md.  "pallas"
# is the Triton kernels on GPU, the Mosaic ones (``mosaic.py``) on TPU.
AUTO = {"gpu": "pallas", "tpu": "pallas"}


def logprob_entropy(h_BTD, w_DV, targets_BT, *, impl: str = "auto", block_v: int = 8192,
                    softcap=None):
  """Per-token (log p(target), entropy), float32 ``[B, T]`` each, never materialising
  ``[B, T, V]`` logits unless ``impl="naive"`` (the reference, for tests and tiny vocabularies).

  ``impl`` is one of :data:`IMPLS`; ``block_v`` is the XLA path's vocabulary tile (the Pallas
  kernels use their own on-chip tiles, :class:`kernels.logprob.pallas.BlockSizes` on GPU,
  :class:`kernels.logprob.mosaic.BlockSizes` on TPU).
  ``softcap``: the logits are ``softcap * tanh(logits / softcap)`` (Gemma 2), on every path.
  """
  impl = resolve_impl("logprob", impl, IMPLS, AUTO)
  if impl == "naive":
    if softcap is None:
      return logprob_entropy_reference(h_BTD, w_DV, targets_BT)
    return logprob_entropy_reference(h_BTD, w_DV, targets_BT, softcap)
  if impl in ("pallas", "pallas_interpret") and target_platform() == "tpu":
    kw = {} if softcap is None else {"softcap": softcap}
    return logprob_entropy_mosaic(h_BTD, w_DV, targets_BT, interpret=impl == "pallas_interpret",
                                  **kw)
  if impl in ("pallas", "pallas_interpret"):
    if softcap is None:
      return logprob_entropy_pallas(h_BTD, w_DV, targets_BT,
                                    interpret=impl == "pallas_interpret")
    return logprob_entropy_pallas(h_BTD, w_DV, targets_BT, interpret=impl == "pallas_interpret",
                                  softcap=softcap)
  if softcap is None:
    return logprob_entropy_blockwise(h_BTD, w_DV, targets_BT, block_v=block_v)
  return logprob_entropy_blockwise(h_BTD, w_DV, targets_BT, block_v=block_v, softcap=softcap)
