"""Reward post-processing and sources: normalisation (batch z-score, resumable Welford running
statistics, clipping) with non-finite rewards masked and counted, the reward-hacking guard,
missing-EOS handling, jittable rule rewards and host rewards, and weighted combination."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import mesh
from jaxrlhf import rewards as R
from jaxrlhf.config import ConfigError

RNG = np.random.default_rng(1)


def _close(a, b, **kw):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), **{"rtol": 1e-5, "atol": 1e-6, **kw})


def test_batch_normalisation_masks_and_counts_nonfinite():
  r = np.array([1.0, np.nan, 3.0, np.inf, 5.0, 100.0], np.float32)
  valid = np.array([1, 1, 1, 1, 1, 0], bool)  # the 100 is a padding row
  out, stats, met = R.normalize_rewards(r, valid, mode="batch", stats=None)
  # valid finite rewards [1, 3, 5]: mean 3, unbiased std 2
  _close(out, [-1.0, 0.0, 0.0, 0.0, 1.0, 0.0], atol=1e-6)
  assert stats is None
  assert float(met["reward/nonfinite"]) == 2
  assert float(met["reward/raw_mean"]) == pytest.approx(3.0)
  assert float(met["reward/raw_std"]) == pytest.approx(2.0)
  assert all(v.dtype == jnp.float32 and v.shape == () for v in met.values())
  r0, keep = R.finite_rewards(r, valid)
  np.testing.assert_array_equal(keep, [1, 0, 1, 0, 1, 0])
  assert np.all(np.isfinite(r0))
  # clip after normalisation; "none" leaves finite rewards alone
  out, _, met = R.normalize_rewards(r, valid, mode="batch", stats=None, clip=0.5)
  _close(out, [-0.5, 0, 0, 0, 0.5, 0])
  assert float(met["reward/clip_frac"]) == pytest.approx(2 / 3)
  out, _, _ = R.normalize_rewards(r, valid, mode="none", stats=None)
  _close(out, [1, 0, 3, 0, 5, 0])
  # equal rewards -> exactly 0
  out, _, _ = R.normalize_rewards(jnp.full((5,), 0.1), None, mode="batch", stats=None)
  assert np.all(np.asarray(out) == 0)


def test_batch_normalisation_is_global_over_dp_shards():
  r = RNG.normal(size=8).astype(np.float32) * 4 + 2
  valid = RNG.random(8) > 0.3
  f = jax.jit(lambda r, v: R.normalize_rewards(r, v, mode="batch", stats=None)[0])
  want = f(r, valid)
  m4 = mesh(dp=4)
  got = f(*(jax.device_put(a, NamedSharding(m4, P("dp"))) for a in (r, valid)))
  _close(got, want)
  vals = r[valid].astype(np.float64)
  _close(want, np.where(valid, (r - vals.mean()) / (vals.std(ddof=1) + 1e-8), 0), atol=1e-5)


def test_running_stats_match_numpy_and_resume():
  batches = [RNG.normal(size=6).astype(np.float32) * s + s for s in (1.0, 3.0, 0.5)]
  masks = [RNG.random(6) > 0.2 for _ in batches]
  batches[1][0] = np.nan
  stats = R.init_running_stats()
  update = jax.jit(lambda s, r, v: R.normalize_rewards(r, v, mode="running", stats=s))
  seen = []
  for b, m in zip(batches, masks):
    out, stats, _ = update(stats, b, m)
    keep = m & np.isfinite(b)
    seen.extend(b[keep].tolist())
    ref = np.asarray(seen, np.float64)
    assert int(stats.count) == len(ref)
    _close(stats.mean, ref.mean(), atol=1e-5)
    _close(stats.std, ref.std(ddof=1), rtol=1e-4)
    # each batch is normalised with the stats *after* its own update
    _close(out, np.where(keep, (np.nan_to_num(b) - ref.mean()) / (ref.std(ddof=1) + 1e-8), 0),
           atol=1e-4)
  # resumable: the state is a plain pytree of arrays; a restored copy continues identically
  restored = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), stats)
  a = update(stats, batches[0], masks[0])
  b = update(restored, batches[0], masks[0])
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), a, b)
  # constant rewards keep an exactly zero spread and normalise to exactly 0
  s = R.init_running_stats()
  for _ in range(3):
    out, s, _ = R.normalize_rewards(jnp.full((3,), 0.1), None, mode="running", stats=s)
    assert np.all(np.asarray(out) == 0) and float(s.m2) == 0
  with pytest.raises(ValueError, match="init_running_stats"):
    R.normalize_rewards(jnp.ones(3), None, mode="running", stats=None)


def test_guard_penalty_mask_and_flag_rate():
  r = jnp.array([1.0, 2.0, 3.0, 4.0])
  score = jnp.array([0.1, 0.9, jnp.nan, 0.5])  # 0.5 is not over a 0.5 threshold; NaN is flagged
  out, keep, met = R.apply_guard(r, score, threshold=0.5, action="penalty", penalty=-2.0)
  _close(out, [1.0, 0.0, 1.0, 4.0])
  assert np.all(np.asarray(keep))
  assert float(met["guard/flag_rate"]) == pytest.approx(0.5)
  out, keep, met = R.apply_guard(r, score, threshold=0.5, action="mask", penalty=-2.0,
                                 valid_B=jnp.array([1, 1, 0, 1], bool))
  _close(out, r)
  np.testing.assert_array_equal(keep, [1, 0, 0, 1])
  assert float(met["guard/flag_rate"]) == pytest.approx(1 / 3)
  with pytest.raises(ValueError, match="penalty"):
    R.apply_guard(r, score, threshold=0.5, action="drop", penalty=0.0)


def test_missing_eos_modes():
  r, eos = jnp.array([1.0, 2.0]), jnp.array([True, False])
  out, keep = R.apply_missing_eos(r, eos, mode="penalty", penalty=-1.0)
  _close(out, [1.0, 1.0])
  assert np.all(np.asarray(keep))
  out, keep = R.apply_missing_eos(r, eos, mode="mask", penalty=-1.0)
  _close(out, r)
  np.testing.assert_array_equal(keep, [True, False])
  out, keep = R.apply_missing_eos(r, eos, mode="none", penalty=-1.0)
  _close(out, r)
  assert np.all(np.asarray(keep))


EOS, PAD = 2, 0


def _np_exact(resp, rmask, ans, amask, eos_ids):
  out = []
  for i in range(len(resp)):
    toks = []
    for tok, ok in zip(resp[i], rmask[i]):
      if not ok:
        continue
      if tok in eos_ids:
        break
      toks.append(int(tok))
    out.append(float(toks == [int(a) for a, ok in zip(ans[i], amask[i]) if ok]))
  return np.array(out, np.float32)


def test_exact_match_rule_hand_cases_and_reference():
  ans = jnp.array([[5, 6, PAD]] * 7)
  amask = jnp.array([[1, 1, 0]] * 7, bool)
  resp = jnp.array([
      [5, 6, EOS, PAD, PAD],  # exact
      [5, 6, 7, EOS, PAD],  # extra token
      [5, EOS, 6, EOS, PAD],  # stops early: "5"
      [5, 6, PAD, PAD, PAD],  # no EOS: compared whole -> match
      [PAD, 5, 6, EOS, 9],  # left padding, token after EOS ignored
      [6, 5, EOS, PAD, PAD],  # wrong order
      [5, 6, 3, 3, 3],  # no EOS, garbage after: no match
  ])
  rmask = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0],
                     [0, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
  fn = jax.jit(lambda *a: R.RULES["exact_match"](*a, eos_id=EOS))
  want = [1, 0, 0, 1, 1, 0, 0]
  _close(fn(resp, rmask, ans, amask), want)
  _close(_np_exact(np.asarray(resp), np.asarray(rmask), np.asarray(ans), np.asarray(amask),
                   {EOS}), want)
  # several stop ids; a longer answer than response
  _close(R.RULES["exact_match"](jnp.array([[5, 9]]), jnp.ones((1, 2), bool),
                                jnp.array([[5, 0, 0, 0]]), jnp.array([[1, 0, 0, 0]], bool),
                                eos_id=(2, 9)), [1.0])
  acc = R.RULES["token_accuracy"](resp, rmask, ans, amask, eos_id=EOS)
  _close(acc, [1.0, 2 / 3, 0.5, 1.0, 1.0, 0.0, 0.4])
  # random cases against the reference
  resp = RNG.integers(0, 5, size=(32, 6))
  rmask = RNG.random((32, 6)) > 0.2
  ans = RNG.integers(3, 5, size=(32, 3))
  amask = RNG.random((32, 3)) > 0.3
  amask[:8] = True
  resp[:16, :3], rmask[:16, :4] = ans[:16], True  # make half of them likely matches
  resp[:16, 3] = EOS
  got = fn(resp, rmask, ans, amask)
  _close(got, _np_exact(resp, rmask, ans, amask, {EOS}))
  assert 0 < float(got.sum()) < 32


def test_has_eos():
  np.testing.assert_array_equal(
      R.has_eos(jnp.array([[1, 2], [2, 1], [1, 1]]), jnp.array([[1, 1], [0, 1], [1, 1]], bool),
                eos_id=2), [True, False, False])


def _score(name, responses, answers):
  """A registered host reward through the trainer's own path (stopping at a failure)."""
  return R.score_host(R.resolve_host_reward(f"host:{name}"), responses,
                      [{"answer": a} for a in answers], on_error="raise").scores


def test_host_rewards_registry_and_checks():
  rows = [{"answer": "42"}, {"answer": "42"}, {"answer": "y"}]
  assert R.HOST_RULES["exact_match"]([" 42\n", "41", "x"], rows) == [1.0, 0.0, 0.0]

  @R.register_host_reward("test_length")
  def _length(responses, examples):
    return [None if r == "?" else len(r) for r in responses]

  try:
    np.testing.assert_array_equal(_score("test_length", ["ab", "?"], ["", ""]),
                                  [2.0, np.nan])
    with pytest.raises(ValueError, match="already registered"):
      R.register_host_reward("test_length")(_length)
  finally:
    del R.HOST_RULES["test_length"]
  with pytest.raises(ValueError, match="registered host rewards: .*exact_match"):
    R.get_host_reward("nope")
  with pytest.raises(ValueError, match="registered rules"):
    R.get_rule("nope")
  with pytest.raises(ConfigError, match=r"no host reward 'nope' is registered .*"
                                        r"host:path/to/file.py:function"):
    R.resolve_host_reward("host:nope")

  @R.register_host_reward("test_short")
  def _short(responses, examples):
    return [1.0]

  try:
    # One score for two responses is a bug, never broadcast.
    with pytest.raises(ConfigError, match="returned 1 score.s. for 2 responses; return one float"):
      _score("test_short", ["a", "b"], ["a", "b"])
  finally:
    del R.HOST_RULES["test_short"]


def test_combine_rewards():
  a, b = jnp.array([1.0, 2.0]), jnp.array([10.0, jnp.nan])
  _close(R.combine_rewards([a, b[:1].repeat(2)], [1.0, 0.5]), [6.0, 7.0])
  _close(R.combine_rewards([a, b], [2.0, 0.0]), [2.0, 4.0])  # a switched-off NaN source
  out = R.combine_rewards([a, b], [1.0, 1.0])
  assert math.isnan(float(out[1]))  # a live NaN propagates, to be masked by normalisation
  with pytest.raises(ValueError, match="one weight per source"):
    R.combine_rewards([a, b], [1.0])
