"""Picks the attention implementation by backend, with an explicit override."""

from kernels.attention.reference import attention_reference

IMPLS = ("auto", "xla")


def attention(q_BTHD, k_BSKD, v_BSKD, kv_mask_BS, q_offset=0, *, impl: str = "auto"):
  """Causal GQA attention; see :func:`attention_reference` for the contract."""
  if impl not in IMPLS:
    raise ValueError(f"kernels.attention={impl!r} is not available; choose one of {IMPLS}")
  return attention_reference(q_BTHD, k_BSKD, v_BSKD, kv_mask_BS, q_offset)
