"""Picks the log-prob implementation by backend, with an explicit override."""

from kernels.logprob.reference import logprob_entropy_reference
from kernels.logprob.xla import logprob_entropy_blockwise

IMPLS = ("auto", "xla", "naive")


def logprob_entropy(h_BTD, w_DV, targets_BT, *, impl: str = "auto", block_v: int = 8192):
  """Per-token (log p(target), entropy) in float32; never ``[B,T,V]`` logits unless
  ``impl="naive"`` (the reference, for tests and tiny vocabularies)."""
  if impl not in IMPLS:
    raise ValueError(f"kernels.logprob={impl!r} is not available; choose one of {IMPLS}")
  if impl == "naive":
    return logprob_entropy_reference(h_BTD, w_DV, targets_BT)
  return logprob_entropy_blockwise(h_BTD, w_DV, targets_BT, block_v=block_v)
