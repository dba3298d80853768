"""Teacher-forced scoring shared by rollout, training and tests: per-token log-probs (and
entropies) of given tokens, and scalar-head scores at the last valid token."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrlhf.config import KernelsConfig, ModelConfig
from jaxrlhf.model.transformer import (forward, last_valid_index, positions_from_mask,
                                       positions_from_segments, scalar_head, unembedding)
from kernels.logprob import logprob_entropy


def _hidden(params, tokens_BL, mask_BL, cfg, kernels, segment_ids_BL):
  """The backbone's final hidden states; packed rows (``segment_ids_BL``) attend within each
  sequence, with positions restarting at each."""
  if segment_ids_BL is None:
    h, _ = forward(params, tokens_BL, positions_from_mask(mask_BL), mask_BL, cfg=cfg,
                   attn_impl=kernels.attention)
  else:
    h, _ = forward(params, tokens_BL, positions_from_segments(segment_ids_BL), mask_BL,
                   cfg=cfg, attn_impl=kernels.attention, segment_ids_BT=segment_ids_BL)
  return h


def token_logprobs(params: dict, tokens_BL: jax.Array, mask_BL: jax.Array, *, cfg: ModelConfig,
                   start: int = 1, kernels: KernelsConfig = KernelsConfig(),
                   segment_ids_BL=None):
  """log p(tokens[:, t] | tokens[:, :t]) and the entropy of that distribution, for
  ``t = start .. L-1``: two float32 ``[B, L - start]`` arrays (temperature 1).

  Computed blockwise over the vocabulary (never ``[B, L, V]`` logits).  Positions where
  ``mask`` is false hold meaningless values; callers mask them.  ``segment_ids_BL``: packed
  rows (see :func:`~jaxrlhf.model.transformer.forward`); the log-prob of a segment's first
  token is then predicted from the previous segment and means nothing either.
  """
  if start < 1:
    raise ValueError(f"start={start}: the first token has no prediction; use start >= 1")
  h = _hidden(params, tokens_BL, mask_BL, cfg, kernels, segment_ids_BL)
  if cfg.final_softcap:
    return logprob_entropy(h[:, start - 1:-1], unembedding(params, cfg), tokens_BL[:, start:],
                           impl=kernels.logprob, block_v=kernels.logprob_block_v,
                           softcap=cfg.final_softcap)
  return logprob_entropy(h[:, start - 1:-1], unembedding(params, cfg), tokens_BL[:, start:],
                         impl=kernels.logprob, block_v=kernels.logprob_block_v)


def sequence_scores(params: dict, tokens_BL: jax.Array, mask_BL: jax.Array, *, cfg: ModelConfig,
                    kernels: KernelsConfig = KernelsConfig(), start: int = 0) -> jax.Array:
  """One float32 score per row ``[B]`` (reward models): the scalar head at the row's last real
  token (``cfg.score_pool="last"``), or its mean over the real tokens from column ``start``
  on, i.e. the response (``"mean"``)."""
  return pool_scores(token_scores(params, tokens_BL, mask_BL, cfg=cfg, kernels=kernels),
                     mask_BL, cfg=cfg, start=start)


def pool_scores(scores_BL: jax.Array, mask_BL: jax.Array, *, cfg: ModelConfig,
                start: int = 0) -> jax.Array:
  """Per-token scalar-head scores ``[B, L]`` pooled as :func:`sequence_scores` does."""
  if cfg.score_pool == "mean":
    pool_BL = mask_BL.astype(bool) & (jnp.arange(mask_BL.shape[1]) >= start)
    return jnp.sum(jnp.where(pool_BL, scores_BL, 0.0), axis=1) / jnp.maximum(
        jnp.sum(pool_BL, axis=1), 1)
  return jnp.take_along_axis(scores_BL, last_valid_index(mask_BL)[:, None], axis=1)[:, 0]


def token_scores(params: dict, tokens_BL: jax.Array, mask_BL: jax.Array, *, cfg: ModelConfig,
                 kernels: KernelsConfig = KernelsConfig(), segment_ids_BL=None) -> jax.Array:
  """Scalar-head score at every position, float32 ``[B, L]`` (value models; packed rows with
  ``segment_ids_BL``)."""
  h = _hidden(params, tokens_BL, mask_BL, cfg, kernels, segment_ids_BL)
  return scalar_head(params, h)
