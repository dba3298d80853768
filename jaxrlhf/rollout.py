"""Generation for RL: prefill ragged prompts once, then decode with a preallocated KV cache.

:func:`generate` is a pure, jittable function (all shapes static) that can sit inside a larger
``jax.jit`` such as a PPO/GRPO training step.  It prefills each prompt once, replicates the
prompt's cache for the ``num_samples`` responses of its group, and decodes one token per
``lax.while_loop`` iteration, leaving the loop as soon as every row has stopped.  It returns
a :class:`Rollout` (the one rollout type, from here to the update): the tokens, masks and two
kinds of log-probs per sampled token, under the policy at temperature 1 (what KL and the PPO
ratio need) and under the distribution actually sampled from (temperature, top-k, top-p).

:func:`generate_uncached` has the same contract but recomputes the full forward pass over the
whole sequence at every step: the slow reference the cached decoder is tested and benchmarked
against.  Both share the sampler (:func:`sample_logits`) and the bookkeeping, so they differ
only in how the next-token logits are computed.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp

from jaxrlhf.config import ConfigError, KernelsConfig, ModelConfig, RolloutConfig
from jaxrlhf.mesh import constrain
from jaxrlhf.model.paged import PagedKV, constrain_paged, init_paged, write_layer
from jaxrlhf.model.transformer import (KVCache, SharedPrefix, forward, init_cache,
                                       last_valid_index, lm_logits, positions_from_mask,
                                       unstack_layers)
from kernels._backend import target_platform
from kernels.logprob.xla import logprob_from_logits

# Static arguments of the jitted entry points (hashable frozen configs and ints).
_STATIC = ("cfg", "rollout", "eos_id", "pad_id", "num_samples", "kernels")


@flax.struct.dataclass
class Rollout:
  """Generated sequences and everything the update needs of them: the one rollout type from
  generation (:func:`generate`, :func:`generate_refill`, multi-turn episodes) through the RL
  step's phases to the update, and over the pools' wire.

  Shape suffixes name the axes: ``B`` rows (prompts x samples, prompt-major: rows
  ``i*n .. i*n+n-1`` are the ``n`` samples of prompt ``i``), ``T`` prompt + response slots
  (``P + N``), ``N = max_new_tokens`` response slots, ``R`` answer slots.
  ``behaviour_logp_BN`` are the log-probs of the policy that sampled the rollout.
  """

  tokens_BT: jax.Array  # int32 prompt (as given, pads -> pad_id), then the response
  mask_BT: jax.Array  # bool: real prompt tokens + response tokens up to and incl. the stop
  response_mask_BN: jax.Array  # bool: generated tokens up to and including EOS / stop
  behaviour_logp_BN: jax.Array  # f32: log p(token) under the sampling policy at temperature 1
  lengths_B: jax.Array  # int32 response lengths (incl. the stop token)
  finished_B: jax.Array  # bool: ended by EOS / stop (False: ran into max_new_tokens)
  # Multi-turn episodes (env.name): each turn's environment reward at its action's last token.
  # The response then holds actions and observations; response_mask_BN marks the actions.
  turn_rewards_BN: Optional[jax.Array] = None
  # In-flight refill (rollout.refill): each row's prompt in the step's queue (int32).
  prompt_index_B: Optional[jax.Array] = None
  # Refill: each row's answer, from the step's queue (with carry-over the queue is not the
  # batch: the carried prompts come first) (``R`` answer slots).
  answer_BR: Optional[jax.Array] = None  # int32
  answer_mask_BR: Optional[jax.Array] = None  # bool
  # Filled by the reference phase:
  ref_logp_BN: Optional[jax.Array] = None  # f32 under the frozen reference
  # f32 per-token KL(behaviour || reference), 0 where masked; exactly 0 while the policy's
  # weights are the reference's (phases.reference)
  kl_BN: Optional[jax.Array] = None
  # f32 under the distribution actually sampled from (temperature, top-k, top-p), 0 where
  # masked: what generation reports beside behaviour_logp_BN (the step drops it).
  sample_logp_BN: Optional[jax.Array] = None

  @property
  def prompt_len(self) -> int:
    """The prompt's columns: ``data.max_prompt_len``, or the batch's prompt bucket
    (``rollout.prompt_buckets``); the response starts there."""
    return self.tokens_BT.shape[1] - self.response_mask_BN.shape[1]


@flax.struct.dataclass
class Refill:
  """What the in-flight refill loop (:func:`generate_refill`) reports beside its rollout,
  per decoded group ``G``."""

  prompt_index_G: jax.Array  # int32: each group's prompt in the queue (completion order)
  stats: dict  # scalar counts: started, completed, decode steps, busy slots (and carry-over)
  # Carry-over only (``num_carried`` given): the queue index of each group started but not
  # trained, in queue order (the first ``stats["carried_out"]`` are valid, 0 after).
  leftover_index_G: Optional[jax.Array] = None
  # Partial rollouts only (``partial`` given): those groups' rows as the loop left them, in
  # the same order (``[G * n, ...]``; :data:`PARTIAL_FIELDS`), for the next step to continue.
  partial: Optional[dict] = None


# A partial response's state (rollout.refill_leftover=continue): its tokens so far
# ("resp", int32 [rows, N]), which are real ("rmask"), their behaviour and sampling log-probs
# under the policy that sampled each ("lp", "slp", f32), whether it has ended ("done") and by
# a stop token ("stopped") (bool [rows]).
PARTIAL_FIELDS = ("resp", "rmask", "lp", "slp", "done", "stopped")
# With rollout.continue_kv=keep, also each row's keys and values as its page held them
# ("k", "v": [L, K, rows, S, Dh], S its slots) and how many slots hold keys ("kv_len", int32
# [rows]): the row's prompt (unless shared) and its response but the last token, which the
# next step feeds first.
KV_FIELDS = ("k", "v", "kv_len")


def partial_kv_slots(cfg: RolloutConfig, prompt_len: int) -> int:
  """The slots of a kept row's page: its response, after its prompt unless the prompt is
  shared (``rollout.prefix_sharing``)."""
  return cfg.max_new_tokens + (0 if cfg.prefix_sharing else prompt_len)


def empty_partial(rows: int, n_new: int, pad_id: int = 0, kv=None) -> dict:
  """No partial responses: the buffers :func:`generate_refill` takes, all empty; ``kv`` =
  ``(model_cfg, slots)``: with a row's keys and values (:data:`KV_FIELDS`)."""
  out = {"resp": jnp.full((rows, n_new), pad_id, jnp.int32),
         "rmask": jnp.zeros((rows, n_new), bool),
         "lp": jnp.zeros((rows, n_new), jnp.float32),
         "slp": jnp.zeros((rows, n_new), jnp.float32),
         "done": jnp.zeros((rows,), bool), "stopped": jnp.zeros((rows,), bool)}
  if kv is not None:
    mc, slots = kv
    shape = (mc.n_layers, mc.n_kv_heads, rows, slots, mc.head_dim)
    out.update(k=jnp.zeros(shape, jnp.dtype(mc.compute_dtype)),
               v=jnp.zeros(shape, jnp.dtype(mc.compute_dtype)),
               kv_len=jnp.zeros((rows,), jnp.int32))
  return out


# -------------------------------------------------------------------------------- sampling


def argmax_last(x_BV: jax.Array) -> jax.Array:
  """``jnp.argmax(x, axis=-1)`` (int32), the same index for every input (the first maximum;
  the first NaN where there is one), computed as a max and then the smallest index holding it.
  XLA's CPU backend emits argmax as one variadic (value, index) reduction that runs at about
  half the speed of these two plain ones: 31 draws over ``[32, 512]`` took 6.9 ms as argmax,
  3.5 ms this way (benchmarks/NOTES.md, change 11)."""
  m_B1 = jnp.max(x_BV, axis=-1, keepdims=True)
  iota_BV = jax.lax.broadcasted_iota(jnp.int32, x_BV.shape, x_BV.ndim - 1)
  hit_BV = (x_BV == m_B1) | jnp.isnan(x_BV)
  return jnp.min(jnp.where(hit_BV, iota_BV, x_BV.shape[-1]), axis=-1)


def categorical(key: jax.Array, z_BV: jax.Array) -> jax.Array:
  """``jax.random.categorical(key, z, axis=-1)``: the same draw (the Gumbel-max trick with
  the same Gumbel noise), through :func:`argmax_last`."""
  return argmax_last(z_BV + jax.random.gumbel(key, z_BV.shape, z_BV.dtype))


def sample_logits(logits_BV: jax.Array, key: jax.Array, rollout: RolloutConfig, *,
                  block_v: int = KernelsConfig.logprob_block_v):
  """Draws one token per row from float32 ``logits_BV``.

  Returns ``(tokens_B int32, logp_B, sample_logp_B)``: the log-prob of each token under
  ``softmax(logits)`` (temperature 1) and under the distribution sampled from.  Temperature 0
  is greedy (argmax; ``sample_logp`` is 0, the log of a point mass) and ignores top-k/top-p.
  Otherwise logits are divided by the temperature, then top-k keeps the ``k`` largest, then
  top-p keeps the smallest prefix (by decreasing probability, renormalised after top-k) whose
  mass reaches ``p`` -- always at least one token.  ``logp`` sums over the vocabulary in the
  trainer's order (tiles of ``block_v``, ``kernels.logprob_block_v``: the XLA log-prob op's
  recurrence), so with the same logits the trainer recomputes the same bits.
  """
  logits_BV = logits_BV.astype(jnp.float32)
  vocab = logits_BV.shape[-1]
  if rollout.temperature == 0:
    tok_B = argmax_last(logits_BV)
    sample_logp_B = jnp.zeros(tok_B.shape, jnp.float32)
  else:
    z_BV = logits_BV / rollout.temperature
    if rollout.top_k > 0 or rollout.top_p < 1.0:
      # Work on the sorted candidates: top-k needs no full sort, and top-p's prefix rule is a
      # cumulative sum over them.  top_k = 0 with top-p sorts the whole vocabulary.
      k = min(rollout.top_k, vocab) if rollout.top_k > 0 else vocab
      cand_BK, idx_BK = jax.lax.top_k(z_BV, k)
      if rollout.top_p < 1.0:
        p_BK = jax.nn.softmax(cand_BK, axis=-1)
        mass_before_BK = jnp.cumsum(p_BK, axis=-1) - p_BK
        cand_BK = jnp.where(mass_before_BK < rollout.top_p, cand_BK, -jnp.inf)
      choice_B = categorical(key, cand_BK)
      tok_B = jnp.take_along_axis(idx_BK, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)
      chosen_B = jnp.take_along_axis(cand_BK, choice_B[:, None], axis=-1)[:, 0]
      sample_logp_B = chosen_B - jax.nn.logsumexp(cand_BK, axis=-1)
    else:
      tok_B = categorical(key, z_BV)
      chosen_B = jnp.take_along_axis(z_BV, tok_B[:, None], axis=-1)[:, 0]
      sample_logp_B = chosen_B - jax.nn.logsumexp(z_BV, axis=-1)
  logp_B = logprob_from_logits(logits_BV, tok_B, block_v=block_v)
  return tok_B, logp_B, sample_logp_B


def row_keys(key: jax.Array, response_B: jax.Array, token_B: jax.Array) -> jax.Array:
  """The per-response sampling keys ``fold_in(fold_in(key, response), token)`` (``[B]``
  keys): a response's draws depend on its id and token index only, not on its row or the
  loop step (``rollout.row_keys``, and always under refill)."""
  return jax.vmap(lambda r, j: jax.random.fold_in(jax.random.fold_in(key, r), j))(
      response_B, token_B)


def sample_rows(logits_BV: jax.Array, keys_B: jax.Array, rollout: RolloutConfig, *,
                block_v: int = KernelsConfig.logprob_block_v):
  """:func:`sample_logits` with one key per row (``keys_B`` from :func:`row_keys`)."""
  one = lambda l_V, k: tuple(x[0] for x in sample_logits(l_V[None], k, rollout,
                                                         block_v=block_v))
  return jax.vmap(one)(logits_BV, keys_B)


def _real_vocab(logits_BV, cfg: ModelConfig):
  """Probability 0 for the ids of a padded vocabulary (``>= cfg.unpadded_vocab_size``)."""
  if not cfg.unpadded_vocab_size:
    return logits_BV
  real_V = jnp.arange(logits_BV.shape[-1]) < cfg.unpadded_vocab_size
  return jnp.where(real_V[None, :], logits_BV, -jnp.inf)


def _stop_ids(eos_id: int, rollout: RolloutConfig):
  return jnp.asarray(sorted({eos_id, *rollout.stop_token_ids} - {-1}) or [-1], jnp.int32)


# ---------------------------------------------------------------------------- validation


def _check(prompt_tokens_BP, prompt_mask_BP, cfg: ModelConfig, rollout: RolloutConfig,
           eos_id: int, pad_id: int, num_samples: int):
  """Raises ConfigError for settings no generation can honour (static checks only)."""
  if prompt_tokens_BP.ndim != 2 or prompt_mask_BP.shape != prompt_tokens_BP.shape:
    raise ConfigError(f"generate: prompt tokens {prompt_tokens_BP.shape} and mask "
                      f"{prompt_mask_BP.shape} must both be [batch, prompt_len]")
  n_new, vocab = rollout.max_new_tokens, cfg.unpadded_vocab_size or cfg.vocab_size
  if n_new < 1:
    raise ConfigError(f"rollout.max_new_tokens={n_new}: must be at least 1")
  if rollout.temperature < 0:
    raise ConfigError(f"rollout.temperature={rollout.temperature}: must be >= 0 (0 is greedy)")
  if rollout.top_k < 0:
    raise ConfigError(f"rollout.top_k={rollout.top_k}: must be >= 0 (0 turns top-k off)")
  if not 0.0 < rollout.top_p <= 1.0:
    raise ConfigError(f"rollout.top_p={rollout.top_p}: must be in (0, 1] (1 turns top-p off)")
  bad_stops = [t for t in rollout.stop_token_ids if not 0 <= t < vocab]
  if bad_stops:
    raise ConfigError(f"rollout.stop_token_ids: {bad_stops} outside the vocabulary "
                      f"[0, {vocab}); use ids below the model's vocabulary size {vocab}")
  if not (eos_id == -1 or 0 <= eos_id < vocab):
    raise ConfigError(f"generate: eos_id={eos_id} is outside the vocabulary [0, {vocab}); "
                      f"pass the tokenizer's EOS id, or -1 for no EOS")
  if not 0 <= pad_id < cfg.vocab_size:
    raise ConfigError(f"generate: pad_id={pad_id} is outside the vocabulary "
                      f"[0, {cfg.vocab_size})")
  if num_samples < 1:
    raise ConfigError(f"generate: num_samples={num_samples} must be at least 1")
  total = prompt_tokens_BP.shape[1] + n_new
  if total > cfg.max_seq_len:
    raise ConfigError(
        f"generate: prompt length {prompt_tokens_BP.shape[1]} + rollout.max_new_tokens={n_new} "
        f"= {total} exceeds model.max_seq_len={cfg.max_seq_len}; lower rollout.max_new_tokens "
        f"or data.max_prompt_len, or raise model.max_seq_len")


# ----------------------------------------------------------------------------- the loop


def _constrain_cache(cache: KVCache) -> KVCache:
  axes = KVCache.axes()
  if cache.per_layer:  # each layer's buffer: the stacked axes less "layers"
    kv = lambda xs, ax: tuple(constrain(x, ax[1:]) for x in xs)
    return KVCache(k=kv(cache.k, axes.k), v=kv(cache.v, axes.v),
                   mask=constrain(cache.mask, axes.mask), index=cache.index)
  return KVCache(k=constrain(cache.k, axes.k), v=constrain(cache.v, axes.v),
                 mask=constrain(cache.mask, axes.mask), index=cache.index)


def unrolled_decode(kernels: KernelsConfig) -> bool:
  """Whether decoding runs its layers unrolled over per-layer weights and cache
  (``kernels.decode``; "auto": on CPU, the platform of the program being traced)."""
  if kernels.decode == "auto":
    return target_platform() == "cpu"
  return kernels.decode == "unrolled"


def decode_params(params, cfg: ModelConfig, kernels: KernelsConfig):
  """The policy's parameters as the decode loop reads them: per-layer copies in
  ``compute_dtype`` when it is unrolled (:func:`unrolled_decode`), else as they are."""
  return unstack_layers(params, cfg) if unrolled_decode(kernels) else params


def _rows(x):
  """Constrains a ``[batch, ...]`` array to the data axes (a no-op outside a mesh)."""
  return constrain(x, ("batch",) + (None,) * (x.ndim - 1))


# Computes the next-token logits ``[B*n, V]`` for step ``i``: (state, prev_tok_B, prev_valid_B,
# i) -> (logits, state).  The previous token is response token ``i - 1``.
Advance = Callable[[object, jax.Array, jax.Array, jax.Array], tuple[jax.Array, object]]


def _decode(first_logits_BV, advance: Advance, model_state, key, *, cfg: ModelConfig,
            rollout: RolloutConfig, eos_id: int, pad_id: int,
            block_v: int = KernelsConfig.logprob_block_v):
  """Samples response token 0 from ``first_logits_BV``, then tokens 1.. with ``advance``,
  until ``max_new_tokens`` or every row has emitted a stop token.  Ids of a padded vocabulary
  (``>= cfg.unpadded_vocab_size``) get probability 0, in the log-probs as in the draws.
  ``rollout.row_keys``: row ``r`` is response ``r`` (prompt-major) for :func:`row_keys`.
  ``block_v``: the trainer's vocabulary tile (``kernels.logprob_block_v``, :func:`sample_logits`).

  Returns (response_BN, response_mask_BN, logprobs_BN, sample_logprobs_BN, finished_B, steps).
  """
  rows, n_new = first_logits_BV.shape[0], rollout.max_new_tokens
  stop_ids = _stop_ids(eos_id, rollout)

  def record(carry, logits_BV, i):
    """Samples step ``i`` for rows still running and writes it into the buffers."""
    resp, rmask, lp, slp, done = carry
    logits_BV = _real_vocab(logits_BV, cfg)
    if rollout.row_keys:
      step_B = jnp.full((rows,), i, jnp.int32)
      tok, logp, slogp = sample_rows(logits_BV, row_keys(key, jnp.arange(rows), step_B),
                                     rollout, block_v=block_v)
    else:
      tok, logp, slogp = sample_logits(logits_BV, jax.random.fold_in(key, i), rollout,
                                       block_v=block_v)
    live = ~done
    tok = jnp.where(live, tok, pad_id)
    put = lambda buf, col: jax.lax.dynamic_update_slice_in_dim(buf, col[:, None], i, axis=1)
    resp = _rows(put(resp, tok))
    rmask = _rows(put(rmask, live))
    lp = _rows(put(lp, jnp.where(live, logp, 0.0)))
    slp = _rows(put(slp, jnp.where(live, slogp, 0.0)))
    done = done | (live & jnp.any(tok[:, None] == stop_ids[None, :], axis=-1))
    return (resp, rmask, lp, slp, done), tok, live

  carry = (jnp.full((rows, n_new), pad_id, jnp.int32), jnp.zeros((rows, n_new), bool),
           jnp.zeros((rows, n_new), jnp.float32), jnp.zeros((rows, n_new), jnp.float32),
           jnp.zeros((rows,), bool))
  carry, tok, live = record(carry, first_logits_BV, 0)

  def cond(state):
    i, _, _, _, carry = state
    return (i < n_new) & ~jnp.all(carry[-1])

  def body(state):
    i, model_state, tok, live, carry = state
    logits_BV, model_state = advance(model_state, tok, live, i)
    carry, tok, live = record(carry, logits_BV, i)
    return i + 1, model_state, tok, live, carry

  init = (jnp.ones((), jnp.int32), model_state, tok, live, carry)
  steps, _, _, _, (resp, rmask, lp, slp, done) = jax.lax.while_loop(cond, body, init)
  return resp, rmask, lp, slp, done, steps


def _assemble(prompt_BP, pmask_BP, decoded, num_samples: int, pad_id: int) -> Rollout:
  resp, rmask, lp, slp, done, _ = decoded
  pmask = jnp.repeat(pmask_BP, num_samples, axis=0)
  prompt = jnp.where(pmask, jnp.repeat(prompt_BP, num_samples, axis=0), pad_id)
  return Rollout(tokens_BT=jnp.concatenate([prompt, resp], axis=1),
                 mask_BT=jnp.concatenate([pmask, rmask], axis=1), response_mask_BN=rmask,
                 behaviour_logp_BN=lp, sample_logp_BN=slp,
                 lengths_B=jnp.sum(rmask, axis=1, dtype=jnp.int32), finished_B=done)


# ---------------------------------------------------------------------- cached decoding


def _prefill(params, tokens_XP, mask_XP, *, cfg: ModelConfig, kernels: KernelsConfig):
  """Prefills ``[X, P]`` prompts into a cache only as long as the prompt (attention over P
  slots, not P + N): ``([X, V] logits at each row's last real token, cache)``."""
  cache = _constrain_cache(init_cache(cfg, tokens_XP.shape[0], tokens_XP.shape[1]))
  h, cache = forward(params, tokens_XP, positions_from_mask(mask_XP), mask_XP, cfg=cfg,
                     cache=cache, attn_impl=kernels.attention)
  h_X1D = jnp.take_along_axis(h, last_valid_index(mask_XP)[:, None, None], axis=1)
  return lm_logits(params, h_X1D, cfg)[:, 0], cache


def _grow(cache: KVCache, n: int, extra: int, per_layer: bool = False) -> KVCache:
  """Each prompt's cache replicated for its ``n`` samples and extended with ``extra`` empty
  slots (the ``N - 1`` decoding writes: the last sampled token is never fed back).  Slots past
  a row's stop stay masked out.  ``per_layer``: the result holds one buffer per layer (for an
  unrolled decode, :func:`unrolled_decode`)."""
  if per_layer:
    grow1 = lambda x: jnp.pad(jnp.repeat(x, n, axis=0), ((0, 0), (0, 0), (0, extra), (0, 0)))
    grow = lambda x: tuple(grow1(x[i]) for i in range(x.shape[0]))
  else:
    grow = lambda x: jnp.pad(jnp.repeat(x, n, axis=1), ((0, 0), (0, 0), (0, 0), (0, extra),
                                                        (0, 0)))
  return _constrain_cache(KVCache(
      k=grow(cache.k), v=grow(cache.v),
      mask=jnp.pad(jnp.repeat(cache.mask, n, axis=0), ((0, 0), (0, extra))),
      index=cache.index))


def _share(cache: KVCache, n: int, slots: int, per_layer: bool):
  """``(prefix, cache)``: the prompts' prefilled cache as each group's shared prefix (one copy,
  not ``n``), and an empty cache of ``slots`` decoding slots per row (``n`` per prompt)."""
  prefix = _shared_prefix(cache.k, cache.v, cache.mask, per_layer)
  l, g, heads, _, dh = cache.k.shape
  slots = max(slots, 1)  # (one new token: the loop body is traced, never run)
  shape = (g * n, heads, slots, dh)
  zeros = (lambda: tuple(jnp.zeros(shape, cache.k.dtype) for _ in range(l))) if per_layer else (
      lambda: jnp.zeros((l,) + shape, cache.k.dtype))
  own = KVCache(k=zeros(), v=zeros(), mask=jnp.zeros((g * n, slots), bool),
                index=jnp.zeros((), jnp.int32))
  return prefix, _constrain_cache(own)


def _fit_slots(x_LKRSD, slots: int):
  """Kept pages ``[L, K, rows, S, Dh]`` cut or zero-padded to ``slots`` slots: a step's page is
  its queue's prompt width plus ``N``, which prompt buckets change from step to step (a
  carried row's keys never reach past the narrower one: its prompt is in both queues)."""
  s = x_LKRSD.shape[3]
  if s >= slots:
    return x_LKRSD[:, :, :, :slots]
  return jnp.pad(x_LKRSD, ((0, 0),) * 3 + ((0, slots - s), (0, 0)))


def _compact_prompts(cache: KVCache, mask_XP):
  """A prefilled cache's keys/values ``[L, X, K, P, Dh]`` with each prompt's real tokens moved
  to its slots ``[0, plen)``, in order, and the mask of those slots ``[X, P]``."""
  src_XP = jnp.argsort(~mask_XP.astype(bool), axis=1, stable=True)  # real slots first
  take = lambda x: jnp.take_along_axis(x, src_XP[None, :, None, :, None], axis=3)  # noqa: E731
  plen_X = jnp.sum(mask_XP, axis=1, dtype=jnp.int32)
  return take(cache.k), take(cache.v), jnp.arange(mask_XP.shape[1])[None, :] < plen_X[:, None]


def _constrain_prefix(prefix: SharedPrefix) -> SharedPrefix:
  axes = KVCache.axes()
  kv = lambda x: constrain(x, axes.k[1:] if prefix.per_layer else axes.k)  # noqa: E731
  k = tuple(kv(x) for x in prefix.k) if prefix.per_layer else kv(prefix.k)
  v = tuple(kv(x) for x in prefix.v) if prefix.per_layer else kv(prefix.v)
  return prefix.replace(k=k, v=v, mask=constrain(prefix.mask, axes.mask))


def _shared_prefix(k_LGKPD, v_LGKPD, mask_GP, per_layer: bool) -> SharedPrefix:
  if per_layer:
    k_LGKPD = tuple(k_LGKPD[i] for i in range(k_LGKPD.shape[0]))
    v_LGKPD = tuple(v_LGKPD[i] for i in range(v_LGKPD.shape[0]))
  return _constrain_prefix(SharedPrefix(k=k_LGKPD, v=v_LGKPD, mask=mask_GP))


def _prefix_groups(prefix: SharedPrefix, count: int) -> SharedPrefix:
  """The first ``count`` groups of a shared prefix."""
  if prefix.per_layer:
    k, v = tuple(x[:count] for x in prefix.k), tuple(x[:count] for x in prefix.v)
  else:
    k, v = prefix.k[:, :count], prefix.v[:, :count]
  return prefix.replace(k=k, v=v, mask=prefix.mask[:count])


def _put_prefix_group(prefix: SharedPrefix, g, k_L1KPD, v_L1KPD, mask_1P) -> SharedPrefix:
  """``prefix`` with group ``g``'s prompt replaced (:func:`_compact_prompts` of one prompt)."""
  put = lambda buf, new, at: jax.lax.dynamic_update_slice(  # noqa: E731
      buf, new.astype(buf.dtype), at)
  if prefix.per_layer:
    k = tuple(put(b, k_L1KPD[i], (g, 0, 0, 0)) for i, b in enumerate(prefix.k))
    v = tuple(put(b, v_L1KPD[i], (g, 0, 0, 0)) for i, b in enumerate(prefix.v))
  else:
    k, v = put(prefix.k, k_L1KPD, (0, g, 0, 0, 0)), put(prefix.v, v_L1KPD, (0, g, 0, 0, 0))
  return _constrain_prefix(prefix.replace(k=k, v=v, mask=put(prefix.mask, mask_1P, (g, 0))))


def _generate(params, prompt_tokens_BP, prompt_mask_BP, key, *,
              cfg: ModelConfig, rollout: RolloutConfig, eos_id: int, pad_id: int,
              num_samples: int, kernels: KernelsConfig):
  """:func:`generate`, also returning the number of sampling steps taken (for tests)."""
  _check(prompt_tokens_BP, prompt_mask_BP, cfg, rollout, eos_id, pad_id, num_samples)
  n, n_new = num_samples, rollout.max_new_tokens
  tokens_BP = _rows(prompt_tokens_BP.astype(jnp.int32))
  mask_BP = _rows(prompt_mask_BP.astype(bool))

  # Prefill once per prompt, then replicate for the group with the decoding slots (or, with
  # rollout.prefix_sharing, keep one copy per group beside each row's own decoding slots).
  last_logits, cache = _prefill(params, tokens_BP, mask_BP, cfg=cfg, kernels=kernels)
  first_logits = jnp.repeat(last_logits, n, axis=0)
  per_layer = unrolled_decode(kernels)
  prefix = None
  if rollout.prefix_sharing:
    prefix, cache = _share(cache, n, n_new - 1, per_layer)
  else:
    cache = _grow(cache, n, n_new - 1, per_layer=per_layer)
  dparams = decode_params(params, cfg, kernels)
  # Rotary positions continue from each row's number of real prompt tokens.
  start_B = jnp.repeat(jnp.sum(mask_BP, axis=1, dtype=jnp.int32), n)

  def advance(cache, tok_B, live_B, i):
    pos_B1 = (start_B + i - 1)[:, None]
    h, cache = forward(dparams, tok_B[:, None], pos_B1, live_B[:, None], cfg=cfg, cache=cache,
                       attn_impl=kernels.attention, prefix=prefix)
    return _rows(lm_logits(dparams, h, cfg)[:, 0]), _constrain_cache(cache)

  decoded = _decode(_rows(first_logits), advance, cache, key, cfg=cfg, rollout=rollout,
                    eos_id=eos_id, pad_id=pad_id, block_v=kernels.logprob_block_v)
  return _assemble(tokens_BP, mask_BP, decoded, n, pad_id), decoded[-1]


@functools.partial(jax.jit, static_argnames=_STATIC)
def generate(params, prompt_tokens_BP, prompt_mask_BP, key, *,
             cfg: ModelConfig, rollout: RolloutConfig, eos_id: int, pad_id: int = 0,
             num_samples: int = 1, kernels: KernelsConfig = KernelsConfig()) -> Rollout:
  """Samples ``num_samples`` responses per prompt with a KV cache.

  params: policy parameters (LM head); prompt_tokens_BP / prompt_mask_BP: ``[B, P]`` prompts,
  left-padded (any ragged mask works: positions come from the mask); every row needs at least
  one real token.  key: the RNG key; the result is a deterministic function of it.
  eos_id: ends a response (with ``rollout.stop_token_ids``); -1 means no EOS token.
  pad_id: written after a response ends.  Rows of the result are prompt-major.

  Jitted with the configs static; calling it inside another ``jax.jit`` inlines it.  Under a
  mesh (``jax.set_mesh``), rows are sharded over the data axes and the KV cache over ``tp``
  by kv head, following :meth:`KVCache.axes`.
  """
  return _generate(params, prompt_tokens_BP, prompt_mask_BP, key, cfg=cfg,
                   rollout=rollout, eos_id=eos_id, pad_id=pad_id, num_samples=num_samples,
                   kernels=kernels)[0]


# ------------------------------------------------------------------ in-flight refill


def _check_refill(prompt_tokens_QP, num_groups: int):
  q = prompt_tokens_QP.shape[0]
  if not 1 <= num_groups <= q:
    raise ConfigError(f"generate_refill: num_groups={num_groups} must be in [1, {q}] (the "
                      f"queue's prompts); queue at least as many prompts as groups train")


def _generate_refill(params, prompt_tokens_QP, prompt_mask_QP, key, num_carried=None,
                     partial=None, *, cfg: ModelConfig, rollout: RolloutConfig, eos_id: int,
                     pad_id: int, num_samples: int, num_groups: int,
                     kernels: KernelsConfig) -> tuple[Rollout, Refill]:
  """:func:`generate_refill` (docs/rollout.md, "In-flight refill").

  Layout: ``G = num_groups`` groups of ``n`` rows, a cache of ``P + N - 1`` slots with one
  write index shared by every row (as :func:`generate`).  A group refilled at loop step ``i``
  (after that step's write: index ``P + i``) gets its prompt's keys/values in slots
  ``[i, P + i)`` and every earlier slot masked; its rotary positions restart from the
  prompt's own.  Attention is causal by slot and masked by the cache's key mask, so the
  group's logits are those of a fresh decode of that prompt.  The loop ends when ``G``
  groups have completed, at the latest at step ``N`` (the first ``G`` groups all end by
  then), so ``P + N - 1`` slots always suffice.  (On a paged pool by live tokens,
  ``rollout.kv_pages``, that holds fewer groups at once, later: ``_RefillLoop.max_steps``.)

  Carry-over (``num_carried`` = ``c``, a traced count): queue prompts ``[0, c)`` are carried
  from the previous step; they sit in the first groups from step 0 and are always harvested.
  Other groups are harvested while fewer than ``G - c`` of them are (the rest of the batch),
  and no prompt starts once that many have been; the loop ends when all ``G`` are harvested
  (still by step ``N``: the carried groups and the first ``G - c`` others started at step 0).
  ``leftover_index_G`` names the started groups not harvested (at most ``G``: each held a slot
  when the last prompt started).

  Partial rollouts (``partial``): the cache is a :class:`~jaxrlhf.model.paged.PagedKV` with
  per-row positions, one page of ``P + N`` slots owned by each row for good.  A row writes
  its prompt's real tokens from slot 0 (a carried row then its response so far) and each
  decoded token at its own length, so a continued response needs no more slots than a fresh
  one.  A started group keeps its slot until it is harvested and trained: a group finished
  past the quota stops the refills, so every leftover group's rows are still in their slots
  when the loop ends (``owner`` maps slots to queue prompts).
  """
  if partial is not None and num_carried is None:
    raise ValueError("generate_refill: partial responses are carried over (num_carried)")
  _check(prompt_tokens_QP, prompt_mask_QP, cfg, rollout, eos_id, pad_id, num_samples)
  _check_refill(prompt_tokens_QP, num_groups)
  loop = _RefillLoop(params, prompt_tokens_QP, prompt_mask_QP, key, num_carried, partial,
                     cfg=cfg, rollout=rollout, eos_id=eos_id, pad_id=pad_id, n=num_samples,
                     g_n=num_groups, kernels=kernels)
  steps, cache, slots, _, _, out, group = jax.lax.while_loop(loop.cond, loop.body,
                                                             loop.init())
  return loop.result(steps, out, group, slots, cache)


def write_prompts(pg: PagedKV, small: KVCache, mask_XP, r0, n: int,
                  cfg: ModelConfig) -> PagedKV:
  """``X`` prefilled prompts (``small``: ``[L, X, K, P, Dh]``) written into the pages of
  rows ``r0 .. r0 + X * n`` (``n`` rows a prompt, which must hold the pages: reserve them
  first), each prompt's real tokens from slot 0; those rows' lengths are the prompts'."""
  x = mask_XP.shape[0]
  slot = jnp.where(mask_XP, jnp.cumsum(mask_XP, axis=1, dtype=jnp.int32) - 1, -1)
  slot_RP = jnp.repeat(slot, n, axis=0)
  table = jax.lax.dynamic_slice_in_dim(pg.table_RM, r0, x * n, axis=0)
  rows_kv = lambda a: jnp.repeat(a, n, axis=0).transpose(0, 2, 1, 3)  # noqa: E731 [R,P,K,D]
  # Every row of a contiguous pool: written in place, row by row (a pool split over the data
  # axes takes its own rows' prompts, nothing gathered).
  whole = pg.contiguous and isinstance(r0, int) and r0 == 0 and x * n == pg.rows
  if pg.per_layer:
    ks, vs = list(pg.k), list(pg.v)
    for li in range(cfg.n_layers):
      ks[li], vs[li] = write_layer(ks[li], vs[li], table, slot_RP, rows_kv(small.k[li]),
                                   rows_kv(small.v[li]), contiguous=whole)
    k, v = tuple(ks), tuple(vs)
  else:
    k, v = pg.k, pg.v
    for li in range(cfg.n_layers):
      k, v = write_layer(k, v, table, slot_RP, rows_kv(small.k[li]), rows_kv(small.v[li]),
                         li, contiguous=whole)
  length = jax.lax.dynamic_update_slice_in_dim(
      pg.length_R, jnp.repeat(jnp.sum(mask_XP, axis=1, dtype=jnp.int32), n), r0, 0)
  return constrain_paged(pg.replace(k=k, v=v, length_R=length))


class _RefillLoop:
  """The pieces of :func:`_generate_refill`'s decode loop over one trace: the queue, the
  settings, and the per-row slot, per-group and output state the loop carries."""

  def __init__(self, params, prompt_tokens_QP, prompt_mask_QP, key, num_carried, partial, *,
               cfg, rollout, eos_id, pad_id, n, g_n, kernels):
    self.cfg, self.rollout, self.kernels, self.key = cfg, rollout, kernels, key
    self.eos_id, self.pad_id = eos_id, pad_id
    self.q_len, self.p = prompt_tokens_QP.shape
    self.n, self.n_new, self.g_n = n, rollout.max_new_tokens, g_n
    self.rows = g_n * n
    self.tokens_QP = prompt_tokens_QP.astype(jnp.int32)
    self.mask_QP = prompt_mask_QP.astype(bool)
    self.plen_Q = jnp.sum(self.mask_QP, axis=1, dtype=jnp.int32)
    self.stop_ids = _stop_ids(eos_id, rollout)
    self.sample_n = jnp.arange(n, dtype=jnp.int32)
    self.row_R = jnp.arange(self.rows, dtype=jnp.int32)
    self.prefill = functools.partial(_prefill, params, cfg=cfg, kernels=kernels)
    self.carry = num_carried is not None
    if self.carry:
      self.n_carried = jnp.clip(jnp.asarray(num_carried, jnp.int32), 0, g_n)
      self.carried_R = self.row_R < self.n_carried * n  # the rows of the carried groups
    # The first G prompts, prefilled together as generate does, then the slots decoding writes.
    first_logits, cache = self.prefill(_rows(self.tokens_QP[:g_n]), _rows(self.mask_QP[:g_n]))
    self.first_logits_R = jnp.repeat(first_logits, n, axis=0)
    self.partial = partial
    self.continuing = partial is not None
    # Per-row positions (a PagedKV of one page a row) for partial rollouts and for shared
    # prompts: with rollout.prefix_sharing each group's prompt is written once, in its own
    # buffer (a SharedPrefix, slot g for group g), and a row's page holds its response only.
    self.shared = rollout.prefix_sharing
    self.paged = self.continuing or self.shared or rollout.kv_page_size > 0
    # rollout.continue_kv=keep: the carried rows' pages come from the previous step.
    self.keep = self.continuing and "k" in partial
    # rollout.kv_pages > 0: pages handed out as tokens need them and returned when a row
    # ends.  rollout.kv_admit: a queued prompt starts once the pool holds its prompt and a
    # page for each running row ("live": when rows find no page, the youngest group is put
    # back, to restart later), or its group's worst case beside every running row's
    # ("worst": no row ever waits).  (``_room``, ``_preempt``.)
    self.lazy = rollout.kv_page_size > 0 and rollout.kv_pages > 0
    self.optimistic = self.lazy and rollout.kv_admit == "live"
    self.page_size, self.pool, group_pages = rollout.refill_pages(self.p, self.rows, n)
    self.fit = min(g_n, self.pool // group_pages)  # groups that always fit at once
    if self.lazy and self.keep:
      raise ConfigError("generate_refill: rollout.kv_pages > 0 with rollout.continue_kv=keep: "
                        "the kept pages are each row's whole buffer; set rollout.kv_pages=0 "
                        "or rollout.continue_kv=recompute")
    if self.fit < 1:
      raise ConfigError(f"generate_refill: rollout.kv_pages={self.pool} cannot hold one group "
                        f"({group_pages} pages of {self.page_size} slots); raise it")
    # The loop's bound: the first G groups end within N steps when all of them fit at once.
    # With fewer, under "worst" G groups still end within ceil(G / fit) waves of N steps (and
    # the admissions); under "live" the oldest running group never stops for long (it is
    # never put back while another runs, and no prompt starts while a row waits: at most one
    # step a running group between two of its tokens), so G groups end within G (N + 1)
    # (G + 1) steps.
    if self.fit >= g_n:
      self.max_steps = self.n_new
    elif self.optimistic:
      self.max_steps = g_n * (self.n_new + 1) * (g_n + 1)
    else:
      self.max_steps = (self.n_new + 1 + g_n) * -(-g_n // self.fit)
    self.admit_G = jnp.ones((g_n,), bool)  # the first G prompts that start at step 0
    if self.lazy:
      # (A carried group needs pages for its response so far too; one that does not fit
      # starts later from its prompt, its partial response dropped.)
      self.admit_G = jnp.cumsum(self._need_start()) <= self.pool
    if self.continuing:  # the carried rows that go on where they stopped
      self.going_on_R = self.carried_R & jnp.repeat(self.admit_G, n)
    if self.paged:
      self.cache = self._paged_start(params, cache)
    else:
      self.cache = _grow(cache, n, self.n_new - 1, per_layer=unrolled_decode(kernels))
    self.dparams = decode_params(params, cfg, kernels)

  # ----------------------------------------- per-row positions: partial rollouts, sharing
  def _budget(self, plen):
    """The pages a row of a prompt of ``plen`` tokens may come to hold."""
    own = self.n_new + plen * (not self.shared)
    return -(-own // self.page_size)

  def _need(self, plen):
    """The free pages a group of a prompt of ``plen`` tokens needs to start (beyond
    :meth:`_room`'s reserve): its worst case, or ("live") its prompt's pages and one a row."""
    if not self.optimistic:
      return self.n * self._budget(plen)
    return self.n * (-(-plen * (not self.shared) // self.page_size) + 1)

  def _need_start(self):
    """:meth:`_need` of the first G prompts, a carried partial response's tokens included
    ("live": each row's pages for its prompt and response so far, and one more)."""
    plen_G = self.plen_Q[:self.g_n]
    if not (self.optimistic and self.continuing):
      return self._need(plen_G)
    carried_len_R = jnp.sum(self.partial["rmask"] & self.carried_R[:, None], axis=1,
                            dtype=jnp.int32)
    own_R = jnp.repeat(plen_G * (not self.shared), self.n) + carried_len_R
    return (-(-own_R // self.page_size) + 1).reshape(self.g_n, self.n).sum(axis=1)

  def _room(self, cache, slots):
    """Free pages beyond what the running rows may still take: all of their worst cases, or
    ("live") one page each, for their next token."""
    pg, _ = self._split(cache)
    running = ~slots["done"]
    if self.optimistic:
      return pg.n_free - jnp.sum(running, dtype=jnp.int32)
    # (a row's response starts at its prompt's length: its budget follows from it)
    owed = jnp.where(running, jnp.maximum(self._budget(slots["start"]) - pg.held_R(), 0), 0)
    return pg.n_free - jnp.sum(owed, dtype=jnp.int32)

  def _preempt(self, pg: PagedKV, slots, group, wait_R):
    """("live") When a row found no page: the youngest running group that holds pages is put
    back (its pages freed, its rows ended, ``parked``), never the only one; it restarts from
    its prompt once there is room (per-response keys: the same tokens again).  Returns the
    cache, slots and group, and the rows put back."""
    n, g_n = self.n, self.g_n
    holds_G = jnp.any((pg.held_R() > 0).reshape(g_n, n), axis=1)
    cand_G = holds_G & (group["prompt"] >= 0) & ~group["parked"]
    age_G = jnp.where(cand_G, group["age"], -1)
    go = jnp.any(wait_R) & (jnp.sum(cand_G) > 1)
    victim_G = go & (jnp.arange(g_n) == jnp.argmax(age_G))
    victim_R = jnp.repeat(victim_G, n)
    slots = {**slots, "done": slots["done"] | victim_R}
    group = {**group, "parked": group["parked"] | victim_G,
             "kv_preempted": group["kv_preempted"] + go}
    return pg.release(victim_R), slots, group, victim_R

  def _release(self, cache, slots, group):
    """Every ended row's pages back in the pool (``rollout.kv_pages`` > 0)."""
    if not self.lazy:
      return cache, group
    pg, prefix = self._split(cache)
    group = {**group, "kv_peak": jnp.maximum(group["kv_peak"], pg.in_use())}
    return self._join(pg.release(slots["done"] & (pg.held_R() > 0)), prefix), group

  def _split(self, cache):
    """The loop cache's ``(PagedKV, SharedPrefix or None)``."""
    return cache if self.shared else (cache, None)

  def _join(self, pg: PagedKV, prefix):
    return (constrain_paged(pg), prefix) if self.shared else constrain_paged(pg)

  def _paged_start(self, params, cache: KVCache):
    """The loop's cache with per-row positions: one page a row, of ``P + N`` slots with the
    first G prompts written from slot 0 of their rows, or with shared prompts of ``N`` slots
    beside the prompts' own buffer; then each carried row's response so far (one forward over
    them, under the current weights: their next-token logits replace the prompt's)."""
    n, rows = self.n, self.rows
    total = self.n_new if self.shared else self.p + self.n_new
    # With rollout.kv_pages=0 each row owns its pages for good (row r's in order from page
    # r * M, one page of them all by default), read without a gather; else pages are taken
    # as the row's tokens need them.
    pg = init_paged(self.cfg, rows, self.pool, self.page_size, total,
                    per_layer=unrolled_decode(self.kernels), reserved=not self.lazy)
    prefix = None
    if self.shared:
      k, v, mask = _compact_prompts(cache, self.mask_QP[:self.g_n])
      prefix = _shared_prefix(k, v, mask, pg.per_layer)
    else:
      mask = self.mask_QP[:self.g_n] & self.admit_G[:, None]
      pg, _ = pg.reserve(jnp.repeat(jnp.sum(mask, axis=1, dtype=jnp.int32), n))
      pg = write_prompts(pg, cache, mask, 0, n, self.cfg)
    if not self.continuing:
      return self._join(pg, prefix)
    if self.keep:
      return self._join(self._kept_pages(pg), prefix)
    # The carried groups that start now (all of them, but on a pool by live tokens those it
    # has room for: the others start later from their prompts).
    rmask = self.partial["rmask"] & self.going_on_R[:, None]
    resp = jnp.where(rmask, self.partial["resp"], 0)
    start_R = jnp.repeat(self.plen_Q[:self.g_n], n)
    if self.lazy:  # pages for the carried tokens, after the prompt's
      pg, _ = pg.reserve(jnp.sum(rmask, axis=1, dtype=jnp.int32))

    pos = start_R[:, None] + jnp.maximum(jnp.cumsum(rmask, axis=1, dtype=jnp.int32) - 1, 0)
    last = last_valid_index(rmask)

    def go_on(b, w):
      """The forward over the first ``b`` rows (the carried ones are rows ``[0, c * n)``) and
      the first ``w`` response columns (their tokens are left-aligned)."""
      def run(pg):
        sub = pg.replace(table_RM=pg.table_RM[:b], length_R=pg.length_R[:b], contiguous=False)
        pre = None if prefix is None else _prefix_groups(prefix, b // n)
        h, sub = forward(params, resp[:b, :w], pos[:b, :w], rmask[:b, :w], cfg=self.cfg,
                         paged=sub, prefix=pre, attn_impl=self.kernels.attention)
        h = jnp.take_along_axis(h, jnp.minimum(last[:b], w - 1)[:, None, None], axis=1)
        logits = jnp.zeros_like(self.first_logits_R).at[:b].set(
            lm_logits(params, h, self.cfg)[:, 0])
        pg = pg.replace(k=sub.k, v=sub.v, length_R=pg.length_R.at[:b].set(sub.length_R))
        return constrain_paged(pg), logits
      return run

    # The block: half the rows or all (a whole number of groups), a quarter, half or all of
    # the columns; the smallest that holds every carried token.  None when nothing is carried.
    shapes = sorted({(-(-self.g_n * i // 2) * n, -(-self.n_new * j // 4))
                     for i in (1, 2) for j in (1, 2, 4)}, key=lambda s: (s[0] * s[1], s))
    rows_need = jnp.where(jnp.any(rmask), self.n_carried * n, 0)
    cols_need = jnp.max(jnp.sum(rmask, axis=1, dtype=jnp.int32))
    fits = jnp.asarray([(rows_need <= b) & (cols_need <= w) for b, w in shapes])
    which = jnp.where(rows_need == 0, 0, 1 + jnp.argmax(fits))
    pg, logits_R = jax.lax.switch(
        which, [lambda pg: (pg, jnp.zeros_like(self.first_logits_R))]
        + [go_on(b, w) for b, w in shapes], pg)
    self.first_logits_R = jnp.where(jnp.any(rmask, axis=1)[:, None], logits_R,
                                    self.first_logits_R)
    return self._join(pg, prefix)

  def _kept_pages(self, pg: PagedKV) -> PagedKV:
    """The carried rows' pages as the previous step left them (``rollout.continue_kv=keep``):
    keys and values and their lengths, no forward pass."""
    carried_R = self.carried_R
    sel = carried_R[None, :, None, None]
    k_old, v_old = (_fit_slots(self.partial[x], pg.page_size) for x in ("k", "v"))
    if pg.per_layer:
      k = tuple(jnp.where(sel, k_old[i].astype(x.dtype), x) for i, x in enumerate(pg.k))
      v = tuple(jnp.where(sel, v_old[i].astype(x.dtype), x) for i, x in enumerate(pg.v))
    else:
      k = jnp.where(sel[None], k_old.astype(pg.k.dtype), pg.k)
      v = jnp.where(sel[None], v_old.astype(pg.v.dtype), pg.v)
    return pg.replace(k=k, v=v,
                      length_R=jnp.where(carried_R, self.partial["kv_len"], pg.length_R))

  def init(self):
    """The loop's first state: token 0 of the first G groups sampled, any of them harvested."""
    n, g_n, rows, n_new = self.n, self.g_n, self.rows, self.n_new
    # Per-row slot state (the response running in each row) and per-group state.
    slots = dict(
        resp=jnp.full((rows, n_new), self.pad_id, jnp.int32),
        rmask=jnp.zeros((rows, n_new), bool),
        lp=jnp.zeros((rows, n_new), jnp.float32), slp=jnp.zeros((rows, n_new), jnp.float32),
        done=~jnp.repeat(self.admit_G, n), stopped=jnp.zeros((rows,), bool),
        j=jnp.zeros((rows,), jnp.int32),  # tokens sampled so far
        start=jnp.repeat(self.plen_Q[:g_n], n),  # rotary position of response token 0
        rid=self.row_R)  # response id: prompt index x n + sample
    out = dict(resp=slots["resp"], rmask=slots["rmask"], lp=slots["lp"], slp=slots["slp"],
               stopped=slots["stopped"], prompt=jnp.zeros((g_n,), jnp.int32))
    if self.continuing:  # carried rows go on from their partial responses (those started)
      for k in PARTIAL_FIELDS:
        x = self.partial[k]
        sel = self.going_on_R.reshape((rows,) + (1,) * (x.ndim - 1))
        slots[k] = jnp.where(sel, x.astype(slots[k].dtype), slots[k])
      slots["rmask"] = slots["rmask"] & self.going_on_R[:, None]
      slots["j"] = jnp.sum(slots["rmask"], axis=1, dtype=jnp.int32)
    first_G = jnp.where(self.admit_G, jnp.arange(g_n, dtype=jnp.int32), -1)
    group = dict(prompt=first_G,  # -1: idle (harvested, or not started for want of pages)
                 owner=first_G,  # the prompt a slot holds or held
                 next=jnp.sum(self.admit_G, dtype=jnp.int32), completed=jnp.int32(0),
                 busy=jnp.int32(0))
    if self.lazy:  # the most pages in use; refills put off, rows that waited, for pages
      group.update(kv_peak=jnp.int32(0), kv_waits=jnp.int32(0), kv_deferred=jnp.int32(0))
    if self.optimistic:  # when each slot's group started; groups put back; any row waiting
      group.update(age=first_G, stamp=jnp.sum(self.admit_G, dtype=jnp.int32),
                   parked=jnp.zeros((g_n,), bool), kv_preempted=jnp.int32(0),
                   short=jnp.zeros((), bool))
    if self.carry:  # groups harvested: all, and those not carried; which queue prompts trained
      group.update(kept=jnp.int32(0), others=jnp.int32(0),
                   trained=jnp.zeros((self.q_len,), bool))
    pending_R = jnp.zeros((rows,), bool)
    if self.keep:  # carried rows mid-response: their last token, sampled, not yet fed
      pending_R = self.carried_R & ~slots["done"] & (slots["j"] > 0)
    slots, tok_R, live_R = self.record(slots, _rows(self.first_logits_R),
                                       ~slots["done"] & ~pending_R)
    if self.keep:
      last_R = jnp.take_along_axis(slots["resp"], jnp.maximum(slots["j"] - 1, 0)[:, None],
                                   axis=1)[:, 0]
      tok_R, live_R = jnp.where(pending_R, last_R, tok_R), live_R | pending_R
    out, group = self.harvest(slots, out, group)
    cache, group = self._release(self.cache, slots, group)
    return (jnp.ones((), jnp.int32), cache, slots, tok_R, live_R, out, group)

  def record(self, slots, logits_RV, live_R):
    """Samples token ``j`` of each live row's response and writes it at column ``j``."""
    n_new, row_R = self.n_new, self.row_R
    logits_RV = _real_vocab(logits_RV, self.cfg)
    tok, logp, slogp = sample_rows(logits_RV, row_keys(self.key, slots["rid"], slots["j"]),
                                   self.rollout, block_v=self.kernels.logprob_block_v)
    tok = jnp.where(live_R, tok, self.pad_id)
    col = jnp.where(live_R, slots["j"], n_new)  # out of bounds: not written
    put = lambda buf, x: _rows(buf.at[row_R, col].set(x, mode="drop"))  # noqa: E731
    stop = live_R & jnp.any(tok[:, None] == self.stop_ids[None, :], axis=-1)
    j = slots["j"] + live_R
    slots = {**slots, "resp": put(slots["resp"], tok), "rmask": put(slots["rmask"], live_R),
             "lp": put(slots["lp"], logp), "slp": put(slots["slp"], slogp), "j": j,
             "stopped": slots["stopped"] | stop,
             "done": slots["done"] | stop | (live_R & (j >= n_new))}
    return slots, tok, live_R

  def _destinations(self, done_G, group):
    """Where each completed group goes in the batch (>= G: not kept), and with carry-over
    which are kept and which were carried."""
    g_n = self.g_n
    if not self.carry:
      rank_G = jnp.cumsum(done_G.astype(jnp.int32)) - done_G
      return jnp.where(done_G, group["completed"] + rank_G, g_n), None, None
    # Carried groups always; the others (in slot order) up to the G - c places left.
    prompt_G = group["prompt"]
    carried_G = (prompt_G >= 0) & (prompt_G < self.n_carried)
    other_G = done_G & ~carried_G
    other_rank_G = jnp.cumsum(other_G.astype(jnp.int32)) - other_G
    keep_G = done_G & (carried_G | (group["others"] + other_rank_G < g_n - self.n_carried))
    rank_G = jnp.cumsum(keep_G.astype(jnp.int32)) - keep_G
    return jnp.where(keep_G, group["kept"] + rank_G, g_n), keep_G, carried_G

  def harvest(self, slots, out, group):
    """Copies every group whose rows have all ended into the batch (in completion order, up
    to G of them) and marks its slots idle."""
    n, g_n = self.n, self.g_n
    done_G = jnp.all(slots["done"].reshape(g_n, n), axis=1) & (group["prompt"] >= 0)
    if self.optimistic:  # (a group put back is not done)
      done_G = done_G & ~group["parked"]
    dest_G, keep_G, carried_G = self._destinations(done_G, group)
    dest_R = (dest_G[:, None] * n + self.sample_n[None, :]).reshape(self.rows)
    take = lambda buf, x: buf.at[dest_R].set(x, mode="drop")  # noqa: E731
    out = {"resp": take(out["resp"], slots["resp"]), "rmask": take(out["rmask"], slots["rmask"]),
           "lp": take(out["lp"], slots["lp"]), "slp": take(out["slp"], slots["slp"]),
           "stopped": take(out["stopped"], slots["stopped"]),
           "prompt": out["prompt"].at[dest_G].set(group["prompt"], mode="drop")}
    prompt_G = group["prompt"]
    group = {**group, "prompt": jnp.where(done_G, -1, group["prompt"]),
             "completed": group["completed"] + jnp.sum(done_G, dtype=jnp.int32)}
    if self.carry:
      group = {**group, "kept": group["kept"] + jnp.sum(keep_G, dtype=jnp.int32),
               "others": group["others"] + jnp.sum(keep_G & ~carried_G, dtype=jnp.int32),
               "trained": group["trained"].at[jnp.where(keep_G, prompt_G, self.q_len)].set(
                   True, mode="drop")}
    return out, group

  def refill(self, cache, slots, tok_R, live_R, group):
    """The next queued prompt into the first idle group's rows, if any and the quota is not
    met: its [1, P] prefill written at slots [index - P, index), its token 0 sampled.  A
    group put back for pages ("live") restarts first, in its own slot."""
    idle_G = group["prompt"] < 0
    g, q = jnp.argmax(idle_G).astype(jnp.int32), group["next"]
    if self.carry:  # no start once the others' places are all taken
      go = (jnp.any(idle_G) & (group["next"] < self.q_len)
            & (group["others"] < self.g_n - self.n_carried))
    else:
      go = jnp.any(idle_G) & (group["next"] < self.q_len) & (group["completed"] < self.g_n)
    if self.optimistic:  # put-back groups first; nothing starts while a row waits
      back = jnp.any(group["parked"])
      g = jnp.where(back, jnp.argmax(group["parked"]).astype(jnp.int32), g)
      q = jnp.where(back, group["prompt"][g], q)
      go = (go | back) & ~group["short"]
    if self.lazy:  # and only once the pool has room for it
      room = self._room(cache, slots) >= self._need(self.plen_Q[jnp.minimum(q, self.q_len - 1)])
      group = {**group, "kv_waits": group["kv_waits"] + (go & ~room)}
      go = go & room
    return jax.lax.cond(go, functools.partial(self._fill, g, q), lambda a: a,
                        (cache, slots, tok_R, live_R, group))

  def _fill(self, g, q, args):
    cache, slots, tok_R, live_R, group = args
    n = self.n
    tok_1P = jax.lax.dynamic_slice_in_dim(self.tokens_QP, q, 1, axis=0)
    mask_1P = jax.lax.dynamic_slice_in_dim(self.mask_QP, q, 1, axis=0)
    logits_1V, small = self.prefill(tok_1P, mask_1P)
    r0 = g * n
    if self.shared:  # the prompt into the group's prefix slot; its rows' pages emptied
      pg, prefix = cache
      prefix = _put_prefix_group(prefix, g, *_compact_prompts(small, mask_1P))
      mine_R = (self.row_R >= r0) & (self.row_R < r0 + n)
      pg = pg.replace(length_R=jnp.where(mine_R, 0, pg.length_R))
      return self._filled((pg, prefix), slots, tok_R, live_R, group, g, q, logits_1V)
    if self.paged:
      mine_R = (self.row_R >= r0) & (self.row_R < r0 + n)
      cache, _ = cache.reserve(jnp.where(mine_R, self.plen_Q[q], 0))  # (contiguous: no-op)
      cache = write_prompts(cache, small, mask_1P, r0, n, self.cfg)
      return self._filled(cache, slots, tok_R, live_R, group, g, q, logits_1V)
    at = cache.index - self.p
    if cache.per_layer:
      kv = lambda big, new: tuple(  # noqa: E731
          jax.lax.dynamic_update_slice(b, jnp.repeat(new[i], n, axis=0), (r0, 0, at, 0))
          for i, b in enumerate(big))
    else:
      kv = lambda big, new: jax.lax.dynamic_update_slice(  # noqa: E731
          big, jnp.repeat(new, n, axis=1), (0, r0, 0, at, 0))
    rmask_nS = jax.lax.dynamic_update_slice_in_dim(
        jnp.zeros((n, cache.mask.shape[1]), bool), jnp.repeat(mask_1P, n, axis=0), at, 1)
    cache = _constrain_cache(KVCache(
        k=kv(cache.k, small.k), v=kv(cache.v, small.v),
        mask=jax.lax.dynamic_update_slice_in_dim(cache.mask, rmask_nS, r0, 0),
        index=cache.index))
    return self._filled(cache, slots, tok_R, live_R, group, g, q, logits_1V)

  def _filled(self, cache, slots, tok_R, live_R, group, g, q, logits_1V):
    """Group ``g``'s rows reset for queue prompt ``q`` (its cache written) and its token 0
    sampled."""
    n, rows, row_R = self.n, self.rows, self.row_R
    r0 = g * n
    mine_R = (row_R >= r0) & (row_R < r0 + n)
    fresh = lambda x, v: jnp.where(mine_R.reshape((rows,) + (1,) * (x.ndim - 1)), v, x)  # noqa
    slots = {**slots, "resp": fresh(slots["resp"], self.pad_id),
             "rmask": fresh(slots["rmask"], False), "lp": fresh(slots["lp"], 0.0),
             "slp": fresh(slots["slp"], 0.0), "done": fresh(slots["done"], False),
             "stopped": fresh(slots["stopped"], False), "j": fresh(slots["j"], 0),
             "start": fresh(slots["start"], self.plen_Q[q]),
             "rid": fresh(slots["rid"], q * n + row_R - r0)}
    # Token 0 of the group's rows (every row samples; only these rows keep theirs).
    logits_RV = jnp.zeros((rows, logits_1V.shape[-1]), logits_1V.dtype)
    logits_RV = jnp.where(mine_R[:, None], logits_1V, logits_RV)
    new, tok0, _ = self.record(slots, logits_RV, mine_R)
    slots = {k: jnp.where(mine_R.reshape((rows,) + (1,) * (v.ndim - 1)), new[k], v)
             for k, v in slots.items()}
    group = {**group, "prompt": group["prompt"].at[g].set(q),
             "owner": group["owner"].at[g].set(q), "next": jnp.maximum(group["next"], q + 1)}
    if self.optimistic:
      group.update(parked=group["parked"].at[g].set(False), age=group["age"].at[g].set(
          group["stamp"]), stamp=group["stamp"] + 1)
    return (cache, slots, jnp.where(mine_R, tok0, tok_R), live_R | mine_R, group)

  def cond(self, state):
    i, _, _, _, _, _, group = state
    return (i < self.max_steps) & (group["kept" if self.carry else "completed"] < self.g_n)

  def body(self, state):
    i, cache, slots, tok_R, live_R, out, group = state
    cfg = self.cfg
    pos_R1 = (slots["start"] + slots["j"] - 1)[:, None]
    wait_R = jnp.zeros_like(live_R)
    if self.paged:  # each row writes at its own length
      pg, prefix = self._split(cache)
      if self.lazy:  # a page for each live row at a page's end
        pg, ok_R = pg.reserve(live_R.astype(jnp.int32))
        # A row without one waits, its token fed a later step ("worst": never happens).
        wait_R = live_R & ~ok_R
        group = {**group, "kv_deferred": group["kv_deferred"] + jnp.sum(wait_R, dtype=jnp.int32),
                 "kv_peak": jnp.maximum(group["kv_peak"], pg.in_use())}
        if self.optimistic:
          group = {**group, "short": jnp.any(wait_R)}
          pg, slots, group, back_R = self._preempt(pg, slots, group, wait_R)
          wait_R, live_R = wait_R & ~back_R, live_R & ~back_R
      h, pg = forward(self.dparams, tok_R[:, None], pos_R1, (live_R & ~wait_R)[:, None],
                      cfg=cfg, paged=pg, prefix=prefix, attn_impl=self.kernels.attention)
      cache = self._join(pg, prefix)
    else:
      h, cache = forward(self.dparams, tok_R[:, None], pos_R1, live_R[:, None], cfg=cfg,
                         cache=cache, attn_impl=self.kernels.attention)
      cache = _constrain_cache(cache)
    group = {**group, "busy": group["busy"] + jnp.sum(live_R & ~wait_R, dtype=jnp.int32)}
    slots, new_R, fed_R = self.record(slots, _rows(lm_logits(self.dparams, h, cfg)[:, 0]),
                                      ~slots["done"] & ~wait_R)
    tok_R, live_R = jnp.where(wait_R, tok_R, new_R), fed_R | wait_R
    out, group = self.harvest(slots, out, group)
    cache, group = self._release(cache, slots, group)
    cache, slots, tok_R, live_R, group = self.refill(cache, slots, tok_R, live_R, group)
    out, group = self.harvest(slots, out, group)
    cache, group = self._release(cache, slots, group)  # (a refilled row may stop at once)
    return i + 1, cache, slots, tok_R, live_R, out, group

  def result(self, steps, out, group, slots, cache=None) -> tuple[Rollout, "Refill"]:
    """The harvested groups as the rollout, and the refill's report."""
    n, g_n, q_len = self.n, self.g_n, self.q_len
    prompt_G = out["prompt"]
    pmask = jnp.repeat(self.mask_QP[prompt_G], n, axis=0)
    prompt = jnp.where(pmask, jnp.repeat(self.tokens_QP[prompt_G], n, axis=0), self.pad_id)
    rmask = out["rmask"]
    stats = {"started": group["next"], "completed": group["completed"], "steps": steps,
             "busy": group["busy"]}
    if self.lazy:  # the pool's use: its most pages in use, of how many; the waits for it
      stats.update(kv_peak=group["kv_peak"], kv_pages=jnp.int32(self.pool),
                   kv_waits=group["kv_waits"], kv_deferred=group["kv_deferred"])
    if self.optimistic:  # groups put back for pages (restarted, or left at the end)
      stats.update(kv_preempted=group["kv_preempted"])
    leftover_G = partial = None
    if self.carry:
      # Started, not trained: in queue order into the first places (at most G of them).
      left_Q = (jnp.arange(q_len) < group["next"]) & ~group["trained"]
      dest_Q = jnp.where(left_Q, jnp.cumsum(left_Q.astype(jnp.int32)) - left_Q, g_n)
      leftover_G = jnp.zeros((g_n,), jnp.int32).at[dest_Q].set(
          jnp.arange(q_len, dtype=jnp.int32), mode="drop")
      stats.update(carried_in=self.n_carried, trained=group["kept"],
                   carried_out=jnp.minimum(jnp.sum(left_Q, dtype=jnp.int32), g_n))
    if self.continuing:  # each leftover group's rows, from the slot it still holds
      valid_G = jnp.arange(g_n) < stats["carried_out"]
      slot_G = jnp.argmax(group["owner"][None, :] == leftover_G[:, None], axis=1)
      rows_R = (slot_G[:, None] * n + self.sample_n[None, :]).reshape(self.rows)
      valid_R = jnp.repeat(valid_G, n)
      partial = {k: jnp.where(valid_R.reshape((self.rows,) + (1,) * (slots[k].ndim - 1)),
                              slots[k][rows_R], jnp.zeros((), slots[k].dtype))
                 for k in PARTIAL_FIELDS}
      partial["resp"] = jnp.where(partial["rmask"], partial["resp"], self.pad_id)
      if self.keep:  # and their pages, to decode on from next step
        pg, _ = self._split(cache)
        stack = lambda x: jnp.stack(x) if pg.per_layer else x  # noqa: E731 [L, K, rows, S, D]

        def keep(x):
          x = _fit_slots(jnp.take(stack(x), rows_R, axis=2), self.partial["k"].shape[3])
          return jnp.where(valid_R[None, None, :, None, None], x, 0).astype(
              self.partial["k"].dtype)

        partial.update(k=keep(pg.k), v=keep(pg.v),
                       kv_len=jnp.where(valid_R, pg.length_R[rows_R], 0))
      # (the carried groups that started where they stopped: on a pool by live tokens one
      # it could not hold started again from its prompt)
      stats.update(continued=jnp.sum(self.partial["rmask"] & self.going_on_R[:, None],
                                     dtype=jnp.int32))
    rollout = Rollout(tokens_BT=jnp.concatenate([prompt, out["resp"]], axis=1),
                      mask_BT=jnp.concatenate([pmask, rmask], axis=1), response_mask_BN=rmask,
                      behaviour_logp_BN=out["lp"], sample_logp_BN=out["slp"],
                      lengths_B=jnp.sum(rmask, axis=1, dtype=jnp.int32),
                      finished_B=out["stopped"], prompt_index_B=jnp.repeat(prompt_G, n))
    return rollout, Refill(prompt_index_G=prompt_G, stats=stats, leftover_index_G=leftover_G,
                           partial=partial)


@functools.partial(jax.jit, static_argnames=_STATIC + ("num_groups",))
def generate_refill(params, prompt_tokens_QP, prompt_mask_QP, key, num_carried=None,
                    partial=None, *, cfg: ModelConfig, rollout: RolloutConfig, eos_id: int,
                    pad_id: int = 0, num_samples: int = 1, num_groups: int = 1,
                    kernels: KernelsConfig = KernelsConfig()) -> tuple[Rollout, Refill]:
  """Continuous batching on fixed shapes: ``num_groups`` groups of ``num_samples`` rows
  decode the queue of ``Q`` prompts ``prompt_tokens_QP``; when every row of a group has
  stopped, the group's rows take the next queued prompt, prefilled inside the loop.  Returns
  ``(rollout, refill)``: the first ``num_groups`` groups to complete, in completion order
  (``refill.prompt_index_G``: each one's prompt in the queue; ``rollout.prompt_index_B`` the
  same per row), each response equal (tokens; log-probs up to float rounding) to
  :func:`generate` of its prompt with ``rollout.row_keys``.  ``refill.stats``: prompts started,
  groups completed (past the quota too), sampling steps (the decode loop ran ``steps - 1``
  forward passes), and ``busy``: row-steps of those passes that fed a running response's
  token (the rest were idle slots).

  ``num_carried`` (an int32 scalar, or None for drop semantics): carry-over.  The queue's
  first ``num_carried`` prompts were started but not trained last step (:func:`carry_queue`
  puts them there); they are trained this step, whatever their length, beside the first
  ``num_groups - num_carried`` others to complete.  ``refill.leftover_index_G`` and
  ``stats["carried_out"]`` then name the groups started but not trained, for
  :func:`carry_take`; ``stats`` also holds ``carried_in`` and ``trained``.

  ``partial`` (with ``num_carried``; :data:`PARTIAL_FIELDS`, ``[num_groups * n, ...]``):
  partial rollouts (``rollout.refill_leftover=continue``).  The carried groups' rows go on
  from where the previous step left them instead of restarting: their tokens so far are
  prefilled after their prompts under the current weights, and decoding continues at their
  next token; the tokens keep the log-probs of the policy that sampled them.
  ``refill.partial`` holds the leftover groups' rows in the same form, in the order of
  ``refill.leftover_index_G``."""
  return _generate_refill(params, prompt_tokens_QP, prompt_mask_QP, key, num_carried, partial,
                          cfg=cfg, rollout=rollout, eos_id=eos_id, pad_id=pad_id,
                          num_samples=num_samples, num_groups=num_groups, kernels=kernels)


def carry_queue(carried: dict, count, new: dict) -> dict:
  """The queue of a step with carry-over: the ``count`` carried prompts first (``carried``:
  ``[G, ...]`` arrays, the first ``count`` valid), then the new ones (``new``: ``[Q, ...]``
  arrays with the same keys), ``Q`` in all: the last ``count`` new prompts are left out (as
  unstarted queued prompts are)."""
  q_len = jax.tree.leaves(new)[0].shape[0]
  g_n = jax.tree.leaves(carried)[0].shape[0]
  j = jnp.arange(q_len, dtype=jnp.int32)
  from_carry_Q = j < count
  ci, ni = jnp.minimum(j, g_n - 1), jnp.maximum(j - count, 0)

  def pick(c, x):
    sel = from_carry_Q.reshape((q_len,) + (1,) * (x.ndim - 1))
    return jnp.where(sel, c[ci].astype(x.dtype), x[ni])

  return {k: pick(carried[k], new[k]) for k in new}


def carry_take(queue: dict, leftover_index, count) -> dict:
  """The carry buffers for the next step: the queue's rows at ``leftover_index``
  (``[G]``, from :func:`generate_refill`), zero past ``count``."""
  g_n = leftover_index.shape[0]
  valid_G = jnp.arange(g_n) < count

  def take(x):
    return jnp.where(valid_G.reshape((g_n,) + (1,) * (x.ndim - 1)), x[leftover_index],
                     jnp.zeros((), x.dtype))

  return {k: take(v) for k, v in queue.items()}


# ------------------------------------------------------------- recompute-everything decoding


@functools.partial(jax.jit, static_argnames=_STATIC)
def generate_uncached(params, prompt_tokens_BP, prompt_mask_BP, key, *, cfg: ModelConfig,
                      rollout: RolloutConfig, eos_id: int, pad_id: int = 0,
                      num_samples: int = 1, kernels: KernelsConfig = KernelsConfig()) -> Rollout:
  """:func:`generate` without a KV cache: every step runs the full forward pass over the
  whole ``[B*n, P+N]`` buffer.  Same sampler, same keys, so the same result up to float
  rounding; O(N) times the work.  The reference for tests and the benchmark's baseline."""
  _check(prompt_tokens_BP, prompt_mask_BP, cfg, rollout, eos_id, pad_id, num_samples)
  n, n_new = num_samples, rollout.max_new_tokens
  p = prompt_tokens_BP.shape[1]
  pmask = jnp.repeat(prompt_mask_BP.astype(bool), n, axis=0)
  rows = pmask.shape[0]
  buf = jnp.concatenate([jnp.repeat(prompt_tokens_BP.astype(jnp.int32), n, axis=0),
                         jnp.full((rows, n_new), pad_id, jnp.int32)], axis=1)
  bmask = jnp.concatenate([pmask, jnp.zeros((rows, n_new), bool)], axis=1)

  def logits_at_last(buf, bmask):
    h, _ = forward(params, buf, positions_from_mask(bmask), bmask, cfg=cfg,
                   attn_impl=kernels.attention)
    h_B1D = jnp.take_along_axis(h, last_valid_index(bmask)[:, None, None], axis=1)
    return lm_logits(params, h_B1D, cfg)[:, 0]

  def advance(state, tok_B, live_B, i):
    buf, bmask = state
    put = lambda x, col: jax.lax.dynamic_update_slice_in_dim(x, col[:, None], p + i - 1, axis=1)
    buf, bmask = put(buf, tok_B), put(bmask, live_B)
    return logits_at_last(buf, bmask), (buf, bmask)

  decoded = _decode(logits_at_last(buf, bmask), advance, (buf, bmask), key, cfg=cfg,
                    rollout=rollout, eos_id=eos_id, pad_id=pad_id,
                    block_v=kernels.logprob_block_v)
  return _assemble(prompt_tokens_BP, prompt_mask_BP, decoded, n, pad_id)
