"""A decoder whose response lengths are set by its own weights: the long tail of the
benchmarks' workloads and the lengths the refill, carry-over and bucket tests need, with no
length oracle in the sampler.

Its layers add nothing (every attention and MLP output projection is zero), so each token's
next-token logits depend on that token alone.  The other tokens are spread over levels: a
token at level ``c > 1`` is followed by one of level ``c - 1`` (sampled among them), one at
level 1 by EOS, and a *free* token (level 0) by another free token, never stopping.  So a
prompt whose last token is at level ``L`` gets a response of exactly ``L`` tokens, EOS
included (``L = 0``: it runs to ``max_new_tokens``), at any temperature, top-k or top-p:
every other token is ``e^-40`` times less likely.  A *start* token is followed by a level drawn
from a given distribution: the lengths of a workload whose prompts all end alike (the
addition prompts end in ``=``).

The attention and MLP weights other than the output projections stay as initialised, so a
forward pass costs what the same model's always does, and training moves the weights (a few
steps at a small learning rate leave the lengths as they were).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import model as M
from jaxrlhf.config import ModelConfig

MARGIN = 40.0  # the logit gap between the planned next tokens and every other


@dataclasses.dataclass(frozen=True)
class Levels:
  """Which tokens sit at which level (``0``: free, never stopping)."""

  tokens: Mapping[int, tuple]

  def token(self, length: int, i: int = 0) -> int:
    """A prompt's last token whose response is ``length`` tokens long, EOS included (``0``:
    no EOS, to the limit); ``i`` picks among the level's tokens."""
    level = self.tokens[length]
    return level[i % len(level)]


def length_params(cfg: ModelConfig, key, *, eos_id: int, max_len: int,
                  reserved: Sequence[int] = (),
                  start: Mapping[int, Sequence[float]] | None = None):
  """``(params, Levels)`` of ``cfg``'s decoder for responses of up to ``max_len`` tokens.

  ``reserved``: tokens kept out of the levels (padding, stop tokens, the tokenizer's prompt
  characters); the model never samples them.  ``start``: token -> ``probs``, where
  ``probs[L]`` is the chance that a prompt ending in that token gets an ``L``-token response
  (``probs[0]``: none, to the limit; ``len(probs) == max_len + 1``).
  """
  start = dict(start or {})
  if cfg.tie_embeddings:
    raise ValueError("length_params needs untied embeddings (tie_embeddings=False)")
  d, v = cfg.d_model, cfg.vocab_size
  if max_len + 1 + len(start) > d:
    raise ValueError(f"{max_len + 1} levels and {len(start)} start tokens need d_model >= "
                     f"{max_len + 1 + len(start)}, not {d}")
  kept = set(reserved) | {eos_id} | set(start)
  free = [t for t in range(v) if t not in kept]
  if len(free) < max_len + 1:
    raise ValueError(f"{len(free)} tokens for {max_len + 1} levels: raise vocab_size")
  tokens = {c: tuple(free[c::max_len + 1]) for c in range(max_len + 1)}
  # The one-hot residual normalises to h * e_k with h = 1 / sqrt(1/d + eps) (final_norm 1).
  h = 1.0 / math.sqrt(1.0 / d + cfg.norm_eps)
  embed = np.zeros((v, d), np.float32)
  unembed = np.zeros((d, v), np.float32)
  for c, ts in tokens.items():
    embed[list(ts), c] = 1.0
    if c >= 2:
      unembed[c, list(tokens[c - 1])] = MARGIN / h
  unembed[1, eos_id] = MARGIN / h
  unembed[0, list(tokens[0])] = MARGIN / h
  for t in (set(reserved) | {eos_id}) - set(start):
    embed[t, 0] = 1.0  # followed by free tokens (after EOS nothing is sampled anyway)
  for j, (t, probs) in enumerate(start.items()):
    if len(probs) != max_len + 1 or not math.isclose(sum(probs), 1.0, rel_tol=1e-6):
      raise ValueError(f"start token {t}: {max_len + 1} probabilities summing to 1 expected")
    row = max_len + 1 + j
    embed[t, row] = 1.0
    for length, p in enumerate(probs):
      if p <= 0:
        continue
      # A response of ``length`` tokens starts at level length - 1 (length 1: EOS at once).
      nxt = [eos_id] if length == 1 else list(tokens[0 if length == 0 else length - 1])
      unembed[row, nxt] = (MARGIN + math.log(p) - math.log(len(nxt))) / h
  params = M.init_params(cfg, key)
  dtype = params["embed"].dtype
  layers = dict(params["layers"])
  for name in ("wo", "w_down"):
    layers[name] = jnp.zeros_like(layers[name])
  params = {**params, "layers": layers, "embed": jnp.asarray(embed, dtype),
            "unembed": jnp.asarray(unembed, dtype),
            "final_norm": jnp.ones_like(params["final_norm"])}
  return params, Levels(tokens)


def pareto_lengths(limit: int, shortest: int) -> list[float]:
  """``probs`` (see :func:`length_params`) of a Pareto tail of index 1: the length is
  ``ceil(shortest / u)`` for ``u`` uniform in (0, 1], median ``2 x shortest``, and every length
  of ``limit`` or more runs to the limit (``probs[0]``: ``shortest / (limit - 1)`` of them)."""
  probs = [0.0] * (limit + 1)
  for length in range(shortest, limit):
    # P(ceil(s/u) = L) = P(s/L <= u < s/(L - 1)), the first length taking u in [s/L, 1].
    hi = 1.0 if length == shortest else shortest / (length - 1)
    probs[length] = hi - shortest / length
  probs[0] = 1.0 - sum(probs)
  return probs


def place(params, like):
  """``params`` with ``like``'s shardings and dtypes (a stage's initialised role), in buffers
  of their own (a donated train state may not share them with a frozen role)."""
  return jax.tree.map(lambda p, x: jax.device_put(np.asarray(jax.device_get(p)).astype(x.dtype),
                                                  x.sharding), params, like)
