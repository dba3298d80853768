"""What happens to a sequence score after its sources: weighted combination, missing-EOS
handling, the reward-hacking guard, and normalisation (batch or running statistics) with
non-finite rewards masked out and counted.  Pure array functions."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrlhf.algorithms.stats import masked_moments


NORMALIZE_MODES = ("none", "batch", "running")


GUARD_ACTIONS = ("penalty", "mask")


MISSING_EOS_MODES = ("none", "penalty", "mask")


def _check(name, value, choices):
  if value not in choices:
    raise ValueError(f"{name}={value!r} is not valid; choose one of {choices}")


@struct.dataclass
class RunningStats:
  """Running reward mean/variance (Welford / Chan et al. merge), kept in the train state."""
  count: jax.Array  # int32 scalar: rewards seen
  mean: jax.Array  # float32 scalar
  m2: jax.Array  # float32 scalar: sum of squared deviations from the mean

  @property
  def std(self):
    """Unbiased (ddof=1) standard deviation; 0 before two rewards were seen."""
    n = self.count.astype(jnp.float32)
    return jnp.where(n > 1, jnp.sqrt(jnp.maximum(self.m2, 0.0) / jnp.maximum(n - 1.0, 1.0)), 0.0)


def init_running_stats() -> RunningStats:
  return RunningStats(count=jnp.zeros((), jnp.int32), mean=jnp.zeros((), jnp.float32),
                      m2=jnp.zeros((), jnp.float32))


def update_running_stats(stats: RunningStats, r_B, valid_B) -> RunningStats:
  """Merges the valid rewards of a batch (under jit on a sharded array: the global batch)."""
  valid_B = jnp.asarray(valid_B).astype(bool)
  r_B = jnp.where(valid_B, jnp.asarray(r_B, jnp.float32), 0.0)
  mean_b, _, n_b = (v.reshape(()) for v in masked_moments(r_B, valid_B))
  m2_b = jnp.sum(jnp.square(jnp.where(valid_B, r_B - mean_b, 0.0)))
  n_a = stats.count.astype(jnp.float32)
  n = n_a + n_b
  delta = mean_b - stats.mean
  frac = n_b / jnp.maximum(n, 1.0)
  return RunningStats(count=stats.count + n_b.astype(jnp.int32),
                      mean=stats.mean + delta * frac,
                      m2=stats.m2 + m2_b + jnp.square(delta) * n_a * frac)


def finite_rewards(r_B, valid_B=None):
  """``(r_B, valid_B)`` with non-finite rewards set to 0 and marked invalid.  Rows to keep in
  the update after :func:`normalize_rewards` are exactly these ``valid_B``."""
  r_B = jnp.asarray(r_B, jnp.float32)
  valid_B = jnp.ones(r_B.shape, bool) if valid_B is None else jnp.asarray(valid_B).astype(bool)
  finite_B = jnp.isfinite(r_B)
  return jnp.where(finite_B & valid_B, r_B, 0.0), valid_B & finite_B


def normalize_rewards(r_B, valid_B, *, mode: str = "none", stats: Optional[RunningStats] = None,
                      clip: float = 0.0, eps: float = 1e-8):
  """Normalises sequence rewards; returns ``(r_B, stats, metrics)``.

  Non-finite rewards are masked out first (reward 0, excluded from every statistic, counted in
  ``metrics["reward/nonfinite"]``); the caller drops them from the update with
  ``finite_rewards(r_in, valid_B)[1]``.  Then:
    none:     unchanged.
    batch:    ``(r - mean) / (std + eps)`` over the valid rows of the whole (global) batch.
    running:  ``stats`` is first updated with this batch, then ``(r - mean) / (std + eps)`` with
              the running mean and unbiased std.
  ``clip > 0`` clips the result to ``[-clip, clip]``.  Invalid rows come back as 0.  Metrics
  (float32): ``reward/nonfinite``, ``reward/raw_mean``, ``reward/raw_std``, ``reward/mean``,
  ``reward/clip_frac``.
  """
  _check("reward normalize", mode, NORMALIZE_MODES)
  r_in = jnp.asarray(r_B, jnp.float32)
  given_B = jnp.ones(r_in.shape, bool) if valid_B is None else jnp.asarray(valid_B).astype(bool)
  r_B, valid_B = finite_rewards(r_in, given_B)
  raw_mean, raw_std, _ = (v.reshape(()) for v in masked_moments(r_B, valid_B))
  if mode == "batch":
    out_B = (r_B - raw_mean) / (raw_std + eps)
  elif mode == "running":
    if stats is None:
      raise ValueError("reward normalize='running' needs stats=init_running_stats() (kept in "
                       "the train state)")
    stats = update_running_stats(stats, r_B, valid_B)
    out_B = (r_B - stats.mean) / (stats.std + eps)
  else:
    out_B = r_B
  if clip and clip > 0:
    clipped_B = jnp.abs(out_B) > clip
    out_B = jnp.clip(out_B, -clip, clip)
  else:
    clipped_B = jnp.zeros(out_B.shape, bool)
  out_B = jnp.where(valid_B, out_B, 0.0)
  n_valid = jnp.maximum(jnp.sum(valid_B), 1).astype(jnp.float32)
  metrics = {
      "reward/nonfinite": jnp.sum(given_B & ~jnp.isfinite(r_in)).astype(jnp.float32),
      "reward/raw_mean": raw_mean,
      "reward/raw_std": raw_std,
      "reward/mean": jnp.sum(out_B) / n_valid,
      "reward/clip_frac": jnp.sum(clipped_B & valid_B).astype(jnp.float32) / n_valid,
  }
  return out_B, stats, metrics


def apply_guard(r_B, guard_score_B, *, threshold: float, action: str = "penalty",
                penalty: float = -1.0, valid_B=None):
  """Reward-hacking guard: a generation whose guard score exceeds ``threshold`` (or is NaN: an
  unscorable generation is not trusted) is flagged.  ``penalty`` adds ``penalty`` to its reward;
  ``mask`` drops it from the update.  Returns ``(r_B, keep_B, metrics)`` with
  ``guard/flag_rate`` (over ``valid_B`` rows, default all) and ``guard/score_mean``."""
  _check("guard action", action, GUARD_ACTIONS)
  r_B = jnp.asarray(r_B, jnp.float32)
  score_B = jnp.asarray(guard_score_B, jnp.float32)
  valid_B = jnp.ones(r_B.shape, bool) if valid_B is None else jnp.asarray(valid_B).astype(bool)
  flagged_B = (score_B > threshold) | jnp.isnan(score_B)
  if action == "penalty":
    r_B = r_B + jnp.where(flagged_B, jnp.float32(penalty), 0.0)
    keep_B = jnp.ones(r_B.shape, bool)
  else:
    keep_B = ~flagged_B
  n_valid = jnp.maximum(jnp.sum(valid_B), 1).astype(jnp.float32)
  metrics = {
      "guard/flag_rate": jnp.sum(flagged_B & valid_B).astype(jnp.float32) / n_valid,
      "guard/score_mean": jnp.sum(jnp.where(valid_B & ~jnp.isnan(score_B), score_B, 0.0))
                          / n_valid,
  }
  return r_B, keep_B, metrics


def apply_missing_eos(r_B, has_eos_B, *, mode: str = "none", penalty: float = -1.0):
  """Sequences that ended without EOS (over-long): ``penalty`` adds ``penalty`` to the reward,
  ``mask`` drops them from the update, ``none`` leaves them.  Returns ``(r_B, keep_B)``."""
  _check("missing_eos", mode, MISSING_EOS_MODES)
  r_B = jnp.asarray(r_B, jnp.float32)
  has_eos_B = jnp.asarray(has_eos_B).astype(bool)
  keep_B = jnp.ones(r_B.shape, bool)
  if mode == "penalty":
    r_B = r_B + jnp.where(has_eos_B, 0.0, jnp.float32(penalty))
  elif mode == "mask":
    keep_B = has_eos_B
  return r_B, keep_B


def is_eos(tokens, eos_id: Union[int, Sequence[int]]):
  """True where ``tokens`` is an end token; ``eos_id`` is one id or several (stop tokens)."""
  ids = (eos_id,) if isinstance(eos_id, (int, np.integer)) else tuple(eos_id)
  if not ids:
    raise ValueError("eos_id: give at least one end-of-sequence token id")
  out = jnp.zeros(jnp.shape(tokens), bool)
  for i in ids:
    out = out | (tokens == i)
  return out


def has_eos(response_BN, response_mask_BN, *, eos_id):
  """Whether each response contains an end token among its valid positions, ``[B]`` bool."""
  return jnp.any(is_eos(response_BN, eos_id) & jnp.asarray(response_mask_BN).astype(bool), -1)


def combine_rewards(rewards: Sequence, weights: Sequence[float]):
  """``sum_i weights[i] * rewards[i]`` over ``[B]`` arrays.  Zero-weight sources are skipped,
  so a NaN from a source switched off cannot poison the sum (0 * NaN = NaN)."""
  if len(rewards) == 0 or len(rewards) != len(weights):
    raise ValueError(f"reward sources and weights must align: {len(rewards)} sources, "
                     f"{len(weights)} weights (set reward.weights to one weight per source)")
  total = jnp.zeros(jnp.shape(rewards[0]), jnp.float32)
  for r, w in zip(rewards, weights):
    if w != 0:
      total = total + jnp.float32(w) * jnp.asarray(r, jnp.float32)
  return total
