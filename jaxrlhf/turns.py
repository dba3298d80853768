"""Multi-turn generation: the policy's actions and an environment's observations in one KV cache.

A conversation is decoded in lock step over a fixed buffer of ``S = P + N`` slots per row: the
prompt's ``P`` (left-padded), then ``N`` slots that actions, observations and holes share.  Every
row writes the same slot at the same time (the cache keeps one write index), so a row that has
finished its action while others still decode leaves masked slots (holes) behind.  Attention is
masked by slot and rotary positions count real tokens only, so a hole changes nothing: a row's
logits are those of its real tokens laid end to end (tested against a from-scratch forward over
the compacted conversation).

Three jittable pieces, all shapes static, driven turn by turn from the host (the environment is
Python) by :mod:`jaxrlhf.train.episodes`:

- :func:`start` prefills the prompts once into a cache of ``S`` slots;
- :func:`act` samples one action per live row, feeding each token into the cache as it goes,
  until EOS, a stop sequence, the action's token limit, or the end of the buffer;
- :func:`observe` prefills an observation block (each row's tokens right-aligned, one width for
  the batch) at the write index: incremental prefill, never the conversation from the start.

:func:`compact` (numpy, on the host) moves each row's real response tokens together, which is
the layout the update and the reference read (``prompt | response``, response from slot ``P``).
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.config import KernelsConfig, ModelConfig, RolloutConfig
from jaxrlhf.model.transformer import KVCache, forward, lm_logits
from jaxrlhf.rollout import (_constrain_cache, _grow, _prefill, _real_vocab, _rows,
                             decode_params, sample_logits, unrolled_decode)

# Why an action ended (``act``'s ``reason_R``).
NOT_LIVE, EOS, STOP, TURN_LIMIT, BUFFER_FULL = 0, 1, 2, 3, 4


@flax.struct.dataclass
class Conversation:
  """The decoding state of ``R`` conversations over ``S`` slots."""

  cache: KVCache  # [L, R, K, S, Dh] (or per layer); cache.index: the next slot every row writes
  tokens_RS: jax.Array  # int32: prompt, then actions and observations as written (pad in holes)
  mask_RS: jax.Array  # bool: real tokens
  policy_RS: jax.Array  # bool: tokens the policy sampled
  logp_RS: jax.Array  # f32: their log-prob under the policy at temperature 1 (0 elsewhere)
  pos_R: jax.Array  # int32: the rotary position of each row's next token (real tokens so far)
  logits_RV: jax.Array  # f32: each row's next-token logits (after its last real token)


def start(params, prompt_RP, pmask_RP, *, cfg: ModelConfig, total: int,
          kernels: KernelsConfig) -> Conversation:
  """Prefills ``[R, P]`` left-padded prompts into a cache of ``total`` slots (``P + N``)."""
  r, p = prompt_RP.shape
  tokens = _rows(prompt_RP.astype(jnp.int32))
  mask = _rows(pmask_RP.astype(bool))
  logits, cache = _prefill(params, tokens, mask, cfg=cfg, kernels=kernels)
  cache = _grow(cache, 1, total - p, per_layer=unrolled_decode(kernels))
  pad = lambda x, v: jnp.pad(x, ((0, 0), (0, total - p)), constant_values=v)
  return Conversation(cache=cache, tokens_RS=_rows(pad(tokens, 0)),
                      mask_RS=_rows(pad(mask, False)),
                      policy_RS=_rows(jnp.zeros((r, total), bool)),
                      logp_RS=_rows(jnp.zeros((r, total), jnp.float32)),
                      pos_R=jnp.sum(mask, axis=1, dtype=jnp.int32), logits_RV=_rows(logits))


def _stop_table(stop_seqs: Sequence[Sequence[int]]):
  """Stop sequences right-aligned in a ``[S, K]`` table (``-1`` before a shorter one: it
  matches anything) and ``K``, the longest."""
  k = max((len(s) for s in stop_seqs), default=1)
  table = np.full((max(len(stop_seqs), 1), k), -2, np.int32)  # -2 never matches (no stops)
  for i, s in enumerate(stop_seqs):
    table[i] = -1
    table[i, k - len(s):] = s
  return jnp.asarray(table), k


def act(params, conv: Conversation, key, live_R, *, cfg: ModelConfig, rollout: RolloutConfig,
        eos_id: int, pad_id: int, kernels: KernelsConfig, max_tokens: int,
        stop_seqs: tuple[tuple[int, ...], ...] = ()):
  """One action per ``live_R`` row: tokens sampled from the row's logits and fed into the cache
  one slot at a time, until EOS, a stop sequence (the token ids of a stop string; its last
  token is kept), ``max_tokens`` tokens, or the last slot.  Token ``j`` of the action draws
  with ``fold_in(key, j)``.

  Returns ``(conversation, reason_R, first_slot)``: why each row's action ended (``EOS``,
  ``STOP``, ``TURN_LIMIT``, ``BUFFER_FULL``; ``NOT_LIVE`` for rows that did not act) and the
  slot the action began at (its tokens are the row's policy slots from there on)."""
  total = conv.tokens_RS.shape[1]
  r = conv.tokens_RS.shape[0]
  table, k = _stop_table(stop_seqs)
  eos = jnp.asarray(eos_id, jnp.int32)
  first = conv.cache.index
  dparams = decode_params(params, cfg, kernels)

  def cond(s):
    j, c, active, _, _ = s
    return (j < max_tokens) & jnp.any(active) & (c.cache.index < total)

  def body(s):
    j, c, active, reason, tail = s
    tok, logp, _ = sample_logits(_real_vocab(c.logits_RV, cfg), jax.random.fold_in(key, j),
                                 rollout, block_v=kernels.logprob_block_v)
    tok = jnp.where(active, tok, pad_id)
    i = c.cache.index
    put = lambda buf, col: jax.lax.dynamic_update_slice_in_dim(buf, col[:, None], i, axis=1)
    h, cache = forward(dparams, tok[:, None], c.pos_R[:, None], active[:, None], cfg=cfg,
                       cache=c.cache, attn_impl=kernels.attention)
    logits = jnp.where(active[:, None], lm_logits(dparams, h, cfg)[:, 0], c.logits_RV)
    c = c.replace(cache=_constrain_cache(cache), tokens_RS=_rows(put(c.tokens_RS, tok)),
                  mask_RS=_rows(put(c.mask_RS, active)), policy_RS=_rows(put(c.policy_RS, active)),
                  logp_RS=_rows(put(c.logp_RS, jnp.where(active, logp, 0.0))),
                  pos_R=c.pos_R + active, logits_RV=_rows(logits))
    tail = jnp.concatenate([tail[:, 1:], tok[:, None]], axis=1)
    hit = jnp.all((table[None] == tail[:, None]) | (table[None] == -1), axis=-1).any(-1)
    now = jnp.where(tok == eos, EOS, jnp.where(hit, STOP, NOT_LIVE))
    now = jnp.where((now == NOT_LIVE) & (j + 1 >= max_tokens), TURN_LIMIT, now)
    now = jnp.where((now == NOT_LIVE) & (i + 1 >= total), BUFFER_FULL, now)
    reason = jnp.where(active, now, reason)
    return j + 1, c, active & (now == NOT_LIVE), reason, tail

  init = (jnp.zeros((), jnp.int32), conv, live_R.astype(bool), jnp.zeros((r,), jnp.int32),
          jnp.full((r, k), -3, jnp.int32))
  _, conv, active, reason, _ = jax.lax.while_loop(cond, body, init)
  # A live row the loop left still active ran out of slots before its first token.
  reason = jnp.where(active, BUFFER_FULL, reason)
  return conv, reason, first


def observe(params, conv: Conversation, obs_RW, obs_mask_RW, *, cfg: ModelConfig,
            kernels: KernelsConfig) -> Conversation:
  """Appends a ``[R, W]`` observation block at the write index (each row's tokens right-aligned:
  its last real token in the block's last slot; a row with none is all masked and keeps its
  logits).  The caller checks that ``W`` slots are left."""
  i = conv.cache.index
  mask = _rows(obs_mask_RW.astype(bool))
  tokens = _rows(jnp.where(mask, obs_RW.astype(jnp.int32), 0))
  pos = conv.pos_R[:, None] + jnp.maximum(jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1, 0)
  h, cache = forward(params, tokens, pos, mask, cfg=cfg, cache=conv.cache,
                     attn_impl=kernels.attention)
  some = jnp.any(mask, axis=1)
  logits = jnp.where(some[:, None], lm_logits(params, h[:, -1:], cfg)[:, 0], conv.logits_RV)
  put = lambda buf, blk: jax.lax.dynamic_update_slice_in_dim(buf, blk, i, axis=1)
  return conv.replace(cache=_constrain_cache(cache), tokens_RS=_rows(put(conv.tokens_RS, tokens)),
                      mask_RS=_rows(put(conv.mask_RS, mask)),
                      pos_R=conv.pos_R + jnp.sum(mask, axis=1, dtype=jnp.int32),
                      logits_RV=_rows(logits))


def compact(tokens_RS, mask_RS, *others_RS, start: int, pad_id: int):
  """Numpy: each row's real slots from ``start`` on, moved together (in order) to the front of
  the response region; the prompt region is left as it is.  Returns the compacted
  ``(tokens, mask, *others)`` (``others`` zero in the freed slots) and the gather order, so that
  per-slot data computed on the written layout (e.g. a turn's reward at its last action token)
  can follow."""
  resp = np.asarray(mask_RS)[:, start:]
  order = np.argsort(~resp, axis=1, kind="stable")  # real slots first, in order
  take = lambda x: np.take_along_axis(np.asarray(x)[:, start:], order, axis=1)
  kept = take(mask_RS)
  out = [np.concatenate([np.asarray(tokens_RS)[:, :start],
                         np.where(kept, take(tokens_RS), pad_id)], axis=1),
         np.concatenate([np.asarray(mask_RS)[:, :start], kept], axis=1)]
  for x in others_RS:
    x = np.asarray(x)
    out.append(np.concatenate([x[:, :start], np.where(kept, take(x), np.zeros((), x.dtype))],
                              axis=1))
  return out, order
