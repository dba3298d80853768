"""Sequence batches in either layout, for the SFT, reward-model and DPO steps.

Padded (``data.pack=false``): one sequence per row (``tokens, mask, loss_mask``; a pair batch
has ``chosen*`` and ``rejected*`` arrays).  Packed (``data.pack=true``, :mod:`jaxrlhf.data.
packing`): several sequences per row with ``segment_ids`` and ``sequence_ids``; a pair batch is
one set of rows holding both sides, sequence ``2i`` pair ``i``'s chosen side and ``2i + 1`` its
rejected side.  The functions here give the steps the same per-token targets and per-sequence
reductions in both; on a padded batch each is the expression the steps used before packing
existed, operation for operation, so those steps compute bit for bit what they did.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def is_packed(b: dict) -> bool:
  return "segment_ids" in b


def pair_rows(b: dict):
  """``(tokens, mask, loss_mask, segment_ids)`` of every sequence of a pair batch, one forward
  pass for both sides; ``segment_ids`` is None for a padded batch (every chosen row, then every
  rejected row: :func:`split_pairs` takes them apart)."""
  if is_packed(b):
    return b["tokens"], b["mask"], b["loss_mask"], b["segment_ids"]
  tokens, mask, loss_mask = (jnp.concatenate([b[f"chosen{s}"], b[f"rejected{s}"]])
                             for s in ("", "_mask", "_loss_mask"))
  return tokens, mask, loss_mask, None


def next_token_target(target_BL, b: dict):
  """``[B, L-1]``: which next-token predictions train, given the tokens ``target_BL`` that are
  targets: the predicting token must be real and, in packed rows, of the same sequence (the
  first token of a sequence is never predicted from the one before it)."""
  target = target_BL[:, 1:] & b["mask"][:, :-1]
  if is_packed(b):
    seg = b["segment_ids"]
    target = target & (seg[:, 1:] == seg[:, :-1])
  return target


def _local_ids(b: dict):
  """Sequence ids of the rows relative to their first sequence, and the sequence count: a
  micro-batch of a packed batch holds whole, consecutively numbered sequences (each group
  is packed into its own rows), so its smallest id is its first."""
  ids = b["sequence_ids"]
  n = b["sequence_lengths"].shape[0]
  first = jnp.min(jnp.where(ids >= 0, ids, jnp.iinfo(jnp.int32).max))
  return jnp.where(ids >= 0, ids - first, n), n


def sequence_sums(values_BL, where_BL, b: dict):
  """Per sequence of a packed batch ``[S]``: the sum of ``values_BL`` over ``where_BL``
  (``[B, L]`` or, for next-token quantities, ``[B, L-1]``: position ``t`` then belongs to the
  sequence of token ``t + 1``)."""
  ids, n = _local_ids(b)
  ids = ids[:, -values_BL.shape[1]:]
  v = jnp.where(where_BL, values_BL, 0.0)
  return jax.ops.segment_sum(v.reshape(-1), ids.reshape(-1), num_segments=n + 1)[:n]


def split_pairs(s_S, b: dict):
  """Per-sequence values ``[2n]`` -> ``(chosen [n], rejected [n])`` in either layout."""
  if is_packed(b):
    pairs = s_S.reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]
  n = b["chosen"].shape[0]
  return s_S[:n], s_S[n:]


def pair_logp_sums(logp_BL1, b: dict):
  """Summed response log-probs of each side of each pair (``logp_BL1``: the next-token
  log-probs of :func:`pair_rows`' tokens, ``start=1``)."""
  _, _, loss_mask, _ = pair_rows(b)
  if is_packed(b):
    return split_pairs(sequence_sums(logp_BL1, next_token_target(loss_mask, b), b), b)
  return split_pairs(jnp.sum(jnp.where(loss_mask[:, 1:], logp_BL1, 0.0), axis=-1), b)


def pair_response_lengths(b: dict):
  """Response tokens (the trained ones, EOS included) of each side: two float32 ``[n]``."""
  if is_packed(b):
    target = next_token_target(b["loss_mask"], b)
    ones = jnp.ones(target.shape, jnp.float32)
    return split_pairs(sequence_sums(ones, target, b), b)
  return (jnp.sum(b["chosen_loss_mask"][:, 1:], axis=-1).astype(jnp.float32),
          jnp.sum(b["rejected_loss_mask"][:, 1:], axis=-1).astype(jnp.float32))


def pooled_scores(scores_BL, b: dict, pool: str):
  """One score per sequence of a packed batch ``[S]`` from per-token scalar-head scores:
  ``"last"``, the score at its last real token; ``"mean"``, the mean over its response
  (``loss_mask``: a pair's response tokens, EOS included), as the padded layout's
  :func:`~jaxrlhf.model.sequence_scores` pools them."""
  seg = b["segment_ids"]
  if pool == "mean":
    pool_BL = b["loss_mask"]
    total = sequence_sums(scores_BL, pool_BL, b)
    return total / jnp.maximum(sequence_sums(jnp.ones_like(scores_BL), pool_BL, b), 1)
  nxt = jnp.concatenate([seg[:, 1:], jnp.zeros_like(seg[:, :1])], axis=1)
  last_BL = b["mask"] & (nxt != seg)
  return sequence_sums(scores_BL, last_BL, b)


def packing_metrics(b: dict) -> dict:
  """``pack/rows`` and ``pack/useful_fraction`` (real tokens over slots) of a packed batch; {}
  for a padded one, whose metrics stay as they were."""
  if not is_packed(b):
    return {}
  mask = b["mask"]
  return {"pack/rows": jnp.asarray(mask.shape[0], jnp.float32),
          "pack/useful_fraction": jnp.mean(mask.astype(jnp.float32))}
