"""Multi-turn generation: the policy's actions and an environment's observations in one KV cache.

A conversation lives in a fixed buffer of ``S = P + N`` columns per row: the prompt's ``P``
(left-padded), then ``N`` columns that actions and observations share.  Two engines:

- **Lock step** (``rollout.kv_page_size=0``): one contiguous cache of ``S`` slots a row, one
  write index for the batch.  Every row writes the same slot at the same time, so a row that
  has finished its action while others still decode leaves masked slots (holes) behind.
  Attention is masked by slot and rotary positions count real tokens only, so a hole changes
  nothing: a row's logits are those of its real tokens laid end to end.
- **Paged** (``rollout.kv_page_size > 0``, :mod:`jaxrlhf.model.paged`): each row has its own
  write position and writes only its real tokens, end to end.  No holes: the response columns
  are already compact, and a row's ``N`` columns are all its own.  With ``rollout.kv_pages=0``
  every row's pages are reserved up front and read without a gather; with ``kv_pages=k`` a
  row takes pages of a pool of ``k`` as its tokens fill them, and when the pool runs out the
  segment stops and :attr:`Conversation.starved` says so; the host raises an error naming the
  setting (nothing written is lost or overwritten).
- **Shared prompts** (``rollout.prefix_sharing``, paged): the ``n`` episodes of an example
  start from the same first observation; it is prefilled once per group into a
  :class:`~jaxrlhf.model.transformer.SharedPrefix` and each row's pages hold only what
  follows it (actions and observations), the attention reading the prompt once per group.

Both are tested against a from-scratch forward over the compacted conversation.

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
from jaxrlhf.model.paged import PagedKV, constrain_paged, init_paged
from jaxrlhf.model.transformer import KVCache, SharedPrefix, forward, lm_logits
from jaxrlhf.rollout import (_compact_prompts, _constrain_cache, _grow, _prefill, _real_vocab,
                             _rows, _shared_prefix, decode_params, sample_logits,
                             unrolled_decode, write_prompts)

# Why an action ended (``act``'s ``reason_R``).
NOT_LIVE, EOS, STOP, TURN_LIMIT, BUFFER_FULL = 0, 1, 2, 3, 4


@flax.struct.dataclass
class Conversation:
  """The decoding state of ``R`` conversations over ``S`` slots."""

  # Lock step: [L, R, K, S, Dh] (or per layer), cache.index the next slot every row writes.
  # Paged: the pool, each row's page table and length (its real tokens so far).
  cache: KVCache | PagedKV
  tokens_RS: jax.Array  # int32: prompt, then actions and observations as written (pad in holes)
  mask_RS: jax.Array  # bool: real tokens
  policy_RS: jax.Array  # bool: tokens the policy sampled
  logp_RS: jax.Array  # f32: their log-prob under the policy at temperature 1 (0 elsewhere)
  pos_R: jax.Array  # int32: the rotary position of each row's next token (real tokens so far)
  logits_RV: jax.Array  # f32: each row's next-token logits (after its last real token)
  write_R: jax.Array  # int32: the column each row writes next (lock step: cache.index for all)
  starved: jax.Array  # bool: the page pool ran out (paged; never true in lock step)
  # Shared prompts (paged): each group's first observation, once; the pages hold the rest.
  prefix: SharedPrefix | None = None

  @property
  def paged(self) -> bool:
    return isinstance(self.cache, PagedKV)

  def kv_slots(self) -> jax.Array:
    """KV slots held: the pages in use times their size (paged, and the shared prompts'
    buffer), the whole buffer (lock step)."""
    if self.paged:
      held = self.cache.in_use() * self.cache.page_size
      return held if self.prefix is None else held + self.prefix.mask.size
    return jnp.asarray(self.tokens_RS.size, jnp.int32)

  def kv_tokens(self, prompt_len: int) -> jax.Array:
    """Real tokens the cache holds (a shared prompt once per group)."""
    if self.prefix is None:
      return jnp.sum(self.mask_RS, dtype=jnp.int32)
    return (jnp.sum(self.mask_RS[:, prompt_len:], dtype=jnp.int32)
            + jnp.sum(self.prefix.mask, dtype=jnp.int32))


def pool_pages(rows: int, total: int, page_size: int, kv_pages: int = 0) -> int:
  """The paged pool's size: ``kv_pages``, or with 0 enough for every row to fill its
  ``total`` slots (it never runs out)."""
  return kv_pages or rows * -(-total // page_size)


def start(params, prompt_RP, pmask_RP, *, cfg: ModelConfig, total: int,
          kernels: KernelsConfig, page_size: int = 0, kv_pages: int = 0,
          group: int = 0, shared: bool = False) -> Conversation:
  """Prefills ``[R, P]`` left-padded prompts into a cache of ``total`` slots (``P + N``) a
  row: a contiguous lock-step cache, or with ``page_size`` a paged one of ``kv_pages`` pages
  (:func:`pool_pages`; 0: every row's pages reserved up front and read without a gather,
  ``PagedKV.contiguous``; k > 0: pages handed out as tokens need them).  ``group`` = n > 0:
  rows ``[g n, g n + n)`` hold the same prompt (the caller's promise), prefilled once: in
  lock step its cache copied to the group's rows, paged written into each row's pages
  (:func:`~jaxrlhf.rollout.write_prompts`); with ``shared`` (shared prompts) kept
  once in the conversation's :attr:`Conversation.prefix`, the pages (of ``page_size``, or
  with 0 one page of ``N`` a row) holding only what follows it."""
  r, p = prompt_RP.shape
  tokens = _rows(prompt_RP.astype(jnp.int32))
  mask = _rows(pmask_RP.astype(bool))
  starved = jnp.zeros((), bool)
  prefix = None
  n = group or 1
  per_layer = unrolled_decode(kernels)
  # Each distinct prompt prefilled once (then written to each of its rows' pages, copied to
  # its rows' lock-step cache, or kept once as a shared prefix).
  logits, small = _prefill(params, tokens[::n], mask[::n], cfg=cfg, kernels=kernels)
  logits = jnp.repeat(logits, n, axis=0)
  if shared:  # kept once; the rows' pages hold what follows it
    own = total - p
    page_size = page_size or own
    cache = constrain_paged(init_paged(cfg, r, pool_pages(r, own, page_size, kv_pages),
                                       page_size, own, per_layer, reserved=not kv_pages))
    prefix = _shared_prefix(*_compact_prompts(small, mask[::n]), per_layer)
  elif page_size:  # each row's prompt into its own pages (all reserved up front with 0)
    cache = init_paged(cfg, r, pool_pages(r, total, page_size, kv_pages), page_size, total,
                       per_layer, reserved=not kv_pages)
    cache, ok = cache.reserve(jnp.sum(mask, axis=1, dtype=jnp.int32))  # (contiguous: no-op)
    starved = ~jnp.all(ok)
    cache = write_prompts(cache, small, mask[::n], 0, n, cfg)
    # A row the pool could not serve holds nothing (its writes were dropped; the host stops).
    cache = cache.replace(length_R=jnp.where(ok, cache.length_R, 0))
  else:  # lock step: the prompt's cache copied to its rows
    cache = _grow(small, n, total - p, per_layer=per_layer)
  pad = lambda x, v: jnp.pad(x, ((0, 0), (0, total - p)), constant_values=v)
  return Conversation(cache=cache, tokens_RS=_rows(pad(tokens, 0)),
                      mask_RS=_rows(pad(mask, False)),
                      policy_RS=_rows(jnp.zeros((r, total), bool)),
                      logp_RS=_rows(jnp.zeros((r, total), jnp.float32)),
                      pos_R=jnp.sum(mask, axis=1, dtype=jnp.int32), logits_RV=_rows(logits),
                      write_R=jnp.full((r,), p, jnp.int32), starved=starved, prefix=prefix)


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
  token is kept), ``max_tokens`` tokens, or the row's last column.  Token ``j`` of the action
  draws with ``fold_in(key, j)``.  Paged: a row that needs a page the pool cannot give stops
  the segment (``starved``; its token is not written).

  Returns ``(conversation, reason_R, first_R)``: why each row's action ended (``EOS``,
  ``STOP``, ``TURN_LIMIT``, ``BUFFER_FULL``; ``NOT_LIVE`` for rows that did not act) and the
  column each row's action began at (its tokens are the row's policy columns from there on)."""
  total = conv.tokens_RS.shape[1]
  r = conv.tokens_RS.shape[0]
  table, k = _stop_table(stop_seqs)
  eos = jnp.asarray(eos_id, jnp.int32)
  first = conv.write_R
  dparams = decode_params(params, cfg, kernels)
  row_R = jnp.arange(r)

  def cond(s):
    j, c, active, _, _ = s
    return (j < max_tokens) & jnp.any(active & (c.write_R < total)) & ~c.starved

  def body(s):
    j, c, active, reason, tail = s
    tok, logp, _ = sample_logits(_real_vocab(c.logits_RV, cfg), jax.random.fold_in(key, j),
                                 rollout, block_v=kernels.logprob_block_v)
    cache, starved = c.cache, c.starved
    if c.paged:
      cache, ok = cache.reserve(active.astype(jnp.int32))
      starved = starved | jnp.any(active & ~ok)
      active = active & ok
    tok = jnp.where(active, tok, pad_id)
    if c.paged:
      h, cache = forward(dparams, tok[:, None], c.pos_R[:, None], active[:, None], cfg=cfg,
                         paged=cache, prefix=c.prefix, attn_impl=kernels.attention)
      cache = constrain_paged(cache)
      step_R = active.astype(jnp.int32)  # each row advances by its own token
    else:
      h, cache = forward(dparams, tok[:, None], c.pos_R[:, None], active[:, None], cfg=cfg,
                         cache=c.cache, attn_impl=kernels.attention)
      cache = _constrain_cache(cache)
      step_R = jnp.ones((r,), jnp.int32)  # one shared index: every row's column moves
    col = jnp.where(active, c.write_R, total)  # out of range: not written
    put = lambda buf, x: _rows(buf.at[row_R, col].set(x, mode="drop"))  # noqa: E731
    logits = jnp.where(active[:, None], lm_logits(dparams, h, cfg)[:, 0], c.logits_RV)
    c = c.replace(cache=cache, tokens_RS=put(c.tokens_RS, tok), mask_RS=put(c.mask_RS, active),
                  policy_RS=put(c.policy_RS, active), logp_RS=put(c.logp_RS, logp),
                  pos_R=c.pos_R + active, logits_RV=_rows(logits),
                  write_R=c.write_R + step_R, starved=starved)
    tail = jnp.where(active[:, None], jnp.concatenate([tail[:, 1:], tok[:, None]], axis=1), tail)
    hit = jnp.all((table[None] == tail[:, None]) | (table[None] == -1), axis=-1).any(-1)
    now = jnp.where(tok == eos, EOS, jnp.where(hit, STOP, NOT_LIVE))
    now = jnp.where((now == NOT_LIVE) & (j + 1 >= max_tokens), TURN_LIMIT, now)
    now = jnp.where((now == NOT_LIVE) & (c.write_R >= total), BUFFER_FULL, now)
    reason = jnp.where(active, now, reason)
    return j + 1, c, active & (now == NOT_LIVE), reason, tail

  init = (jnp.zeros((), jnp.int32), conv, live_R.astype(bool), jnp.zeros((r,), jnp.int32),
          jnp.full((r, k), -3, jnp.int32))
  _, conv, active, reason, _ = jax.lax.while_loop(cond, body, init)
  # A live row the loop left still active ran out of slots before its first token (or, paged,
  # is the row the pool could not serve: conv.starved).
  reason = jnp.where(active, BUFFER_FULL, reason)
  return conv, reason, first


def observe(params, conv: Conversation, obs_RW, obs_mask_RW, *, cfg: ModelConfig,
            kernels: KernelsConfig) -> Conversation:
  """Appends a ``[R, W]`` observation block (each row's tokens right-aligned: its last real
  token in the block's last slot; a row with none is all masked and keeps its logits).  Lock
  step: the block takes ``W`` columns of every row at the write index.  Paged: each row's real
  tokens only, at its own write column.  The caller checks that the row has room."""
  mask = _rows(obs_mask_RW.astype(bool))
  tokens = _rows(jnp.where(mask, obs_RW.astype(jnp.int32), 0))
  pos = conv.pos_R[:, None] + jnp.maximum(jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1, 0)
  count_R = jnp.sum(mask, axis=1, dtype=jnp.int32)
  if conv.paged:
    cache, ok = conv.cache.reserve(count_R)
    starved = conv.starved | ~jnp.all(ok)
    mask = mask & ok[:, None]
    h, cache = forward(params, tokens, pos, mask, cfg=cfg, paged=cache, prefix=conv.prefix,
                       attn_impl=kernels.attention)
    cache = constrain_paged(cache)
    count_R = jnp.sum(mask, axis=1, dtype=jnp.int32)
    # Each row's real tokens at its own columns, in order.
    col = jnp.where(mask, conv.write_R[:, None] + jnp.cumsum(mask, axis=1) - 1,
                    conv.tokens_RS.shape[1])
    row = jnp.broadcast_to(jnp.arange(mask.shape[0])[:, None], col.shape)
    put = lambda buf, blk: buf.at[row, col].set(blk, mode="drop")  # noqa: E731
    write_R = conv.write_R + count_R
  else:
    i = conv.cache.index
    h, cache = forward(params, tokens, pos, mask, cfg=cfg, cache=conv.cache,
                       attn_impl=kernels.attention)
    cache, starved = _constrain_cache(cache), conv.starved
    put = lambda buf, blk: jax.lax.dynamic_update_slice_in_dim(buf, blk, i, axis=1)  # noqa
    write_R = conv.write_R + mask.shape[1]
  some = count_R > 0
  logits = jnp.where(some[:, None], lm_logits(params, h[:, -1:], cfg)[:, 0], conv.logits_RV)
  return conv.replace(cache=cache, tokens_RS=_rows(put(conv.tokens_RS, tokens)),
                      mask_RS=_rows(put(conv.mask_RS, mask)),
                      pos_R=conv.pos_R + count_R, logits_RV=_rows(logits), write_R=write_R,
                      starved=starved)


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
