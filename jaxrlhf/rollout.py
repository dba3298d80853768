"""Generation for RL: prefill ragged prompts once, then decode with a preallocated KV cache.

:func:`generate` is a pure, jittable function (all shapes static) that can sit inside a larger
``jax.jit`` such as a PPO/GRPO training step.  It prefills each prompt once, replicates the
prompt's cache for the ``num_samples`` responses of its group, and decodes one token per
``lax.while_loop`` iteration, leaving the loop as soon as every row has stopped.  It returns
the tokens, masks and two kinds of log-probs per sampled token: under the policy at
temperature 1 (what KL and the PPO ratio need) and under the distribution actually sampled
from (temperature, top-k, top-p).

:func:`generate_uncached` has the same contract but recomputes the full forward pass over the
whole sequence at every step: the slow reference the cached decoder is tested and benchmarked
against.  Both share the sampler (:func:`sample_logits`) and the bookkeeping, so they differ
only in how the next-token logits are computed.
"""

from __future__ import annotations

import functools
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from jaxrlhf.config import ConfigError, KernelsConfig, ModelConfig, RolloutConfig
from jaxrlhf.mesh import constrain
from jaxrlhf.model.transformer import (KVCache, forward, init_cache, last_valid_index,
                                       lm_logits, positions_from_mask)

# Static arguments of the jitted entry points (hashable frozen configs and ints).
_STATIC = ("cfg", "rollout", "eos_id", "pad_id", "num_samples", "kernels")


@flax.struct.dataclass
class Rollout:
  """Sampled responses, ``B*n`` rows ordered prompt-major (rows ``i*n .. i*n+n-1`` are the
  ``n`` samples of prompt ``i``); ``P`` prompt slots, ``N = max_new_tokens`` response slots."""

  tokens: jax.Array  # [B*n, P+N] int32: prompt (as given, pads -> pad_id), then the response
  mask: jax.Array  # [B*n, P+N] bool: real prompt tokens + response tokens up to and incl. stop
  response_mask: jax.Array  # [B*n, N] bool: generated tokens up to and including EOS/stop
  logprobs: jax.Array  # [B*n, N] f32: log p(token) under the policy at temperature 1; 0 if masked
  sample_logprobs: jax.Array  # [B*n, N] f32: under the sampling distribution; 0 if masked
  lengths: jax.Array  # [B*n] int32: response lengths (incl. the stop token)
  finished: jax.Array  # [B*n] bool: ended by EOS/stop (False: ran into max_new_tokens)


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


def sample_logits(logits_BV: jax.Array, key: jax.Array, rollout: RolloutConfig):
  """Draws one token per row from float32 ``logits_BV``.

  Returns ``(tokens_B int32, logp_B, sample_logp_B)``: the log-prob of each token under
  ``softmax(logits)`` (temperature 1) and under the distribution sampled from.  Temperature 0
  is greedy (argmax; ``sample_logp`` is 0, the log of a point mass) and ignores top-k/top-p.
  Otherwise logits are divided by the temperature, then top-k keeps the ``k`` largest, then
  top-p keeps the smallest prefix (by decreasing probability, renormalised after top-k) whose
  mass reaches ``p`` -- always at least one token.
  """
  logits_BV = logits_BV.astype(jnp.float32)
  vocab = logits_BV.shape[-1]
  lse_B = jax.nn.logsumexp(logits_BV, axis=-1)
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
  logp_B = jnp.take_along_axis(logits_BV, tok_B[:, None], axis=-1)[:, 0] - lse_B
  return tok_B, logp_B, sample_logp_B


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
  return KVCache(k=constrain(cache.k, axes.k), v=constrain(cache.v, axes.v),
                 mask=constrain(cache.mask, axes.mask), index=cache.index)


def _rows(x):
  """Constrains a ``[batch, ...]`` array to the data axes (a no-op outside a mesh)."""
  return constrain(x, ("batch",) + (None,) * (x.ndim - 1))


# Computes the next-token logits ``[B*n, V]`` for step ``i``: (state, prev_tok_B, prev_valid_B,
# i) -> (logits, state).  The previous token is response token ``i - 1``.
Advance = Callable[[object, jax.Array, jax.Array, jax.Array], tuple[jax.Array, object]]


def _decode(first_logits_BV, advance: Advance, model_state, key, *, cfg: ModelConfig,
            rollout: RolloutConfig, eos_id: int, pad_id: int):
  """Samples response token 0 from ``first_logits_BV``, then tokens 1.. with ``advance``,
  until ``max_new_tokens`` or every row has emitted a stop token.  Ids of a padded vocabulary
  (``>= cfg.unpadded_vocab_size``) get probability 0, in the log-probs as in the draws.

  Returns (response_BN, response_mask_BN, logprobs_BN, sample_logprobs_BN, finished_B, steps).
  """
  rows, n_new = first_logits_BV.shape[0], rollout.max_new_tokens
  stop_ids = jnp.asarray(sorted({eos_id, *rollout.stop_token_ids} - {-1}) or [-1], jnp.int32)

  def record(carry, logits_BV, i):
    """Samples step ``i`` for rows still running and writes it into the buffers."""
    resp, rmask, lp, slp, done = carry
    if cfg.unpadded_vocab_size:
      real_V = jnp.arange(logits_BV.shape[-1]) < cfg.unpadded_vocab_size
      logits_BV = jnp.where(real_V[None, :], logits_BV, -jnp.inf)
    tok, logp, slogp = sample_logits(logits_BV, jax.random.fold_in(key, i), rollout)
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
  return Rollout(tokens=jnp.concatenate([prompt, resp], axis=1),
                 mask=jnp.concatenate([pmask, rmask], axis=1), response_mask=rmask, logprobs=lp,
                 sample_logprobs=slp, lengths=jnp.sum(rmask, axis=1, dtype=jnp.int32),
                 finished=done)


# ---------------------------------------------------------------------- cached decoding


def _generate(params, prompt_tokens_BP, prompt_mask_BP, key, *, cfg: ModelConfig,
              rollout: RolloutConfig, eos_id: int, pad_id: int, num_samples: int,
              kernels: KernelsConfig):
  """:func:`generate`, also returning the number of sampling steps taken (for tests)."""
  _check(prompt_tokens_BP, prompt_mask_BP, cfg, rollout, eos_id, pad_id, num_samples)
  b, p = prompt_tokens_BP.shape
  n, n_new = num_samples, rollout.max_new_tokens
  tokens_BP = _rows(prompt_tokens_BP.astype(jnp.int32))
  mask_BP = _rows(prompt_mask_BP.astype(bool))
  pos_BP = positions_from_mask(mask_BP)

  # Prefill once per prompt, into a cache only as long as the prompt (attention over P slots,
  # not P + N); logits only at each row's last real token.
  cache = _constrain_cache(init_cache(cfg, b, p))
  h_BPD, cache = forward(params, tokens_BP, pos_BP, mask_BP, cfg=cfg, cache=cache,
                         attn_impl=kernels.attention)
  last_B = last_valid_index(mask_BP)
  h_B1D = jnp.take_along_axis(h_BPD, last_B[:, None, None], axis=1)
  first_logits = jnp.repeat(lm_logits(params, h_B1D, cfg)[:, 0], n, axis=0)

  # Replicate for the group and extend with the N - 1 slots decoding writes (the last sampled
  # token is never fed back).  Slots past a row's stop stay masked out.
  grow = lambda x: jnp.pad(jnp.repeat(x, n, axis=1), ((0, 0), (0, 0), (0, 0), (0, n_new - 1),
                                                      (0, 0)))
  cache = _constrain_cache(KVCache(
      k=grow(cache.k), v=grow(cache.v),
      mask=jnp.pad(jnp.repeat(cache.mask, n, axis=0), ((0, 0), (0, n_new - 1))),
      index=cache.index))
  # Rotary positions continue from each row's number of real prompt tokens.
  start_B = jnp.repeat(jnp.sum(mask_BP, axis=1, dtype=jnp.int32), n)

  def advance(cache, tok_B, live_B, i):
    pos_B1 = (start_B + i - 1)[:, None]
    h, cache = forward(params, tok_B[:, None], pos_B1, live_B[:, None], cfg=cfg, cache=cache,
                       attn_impl=kernels.attention)
    return _rows(lm_logits(params, h, cfg)[:, 0]), _constrain_cache(cache)

  decoded = _decode(_rows(first_logits), advance, cache, key, cfg=cfg, rollout=rollout,
                    eos_id=eos_id, pad_id=pad_id)
  return _assemble(tokens_BP, mask_BP, decoded, n, pad_id), decoded[-1]


@functools.partial(jax.jit, static_argnames=_STATIC)
def generate(params, prompt_tokens_BP, prompt_mask_BP, key, *, cfg: ModelConfig,
             rollout: RolloutConfig, eos_id: int, pad_id: int = 0, num_samples: int = 1,
             kernels: KernelsConfig = KernelsConfig()) -> Rollout:
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
  return _generate(params, prompt_tokens_BP, prompt_mask_BP, key, cfg=cfg, rollout=rollout,
                   eos_id=eos_id, pad_id=pad_id, num_samples=num_samples, kernels=kernels)[0]


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
                    rollout=rollout, eos_id=eos_id, pad_id=pad_id)
  return _assemble(prompt_tokens_BP, prompt_mask_BP, decoded, n, pad_id)
