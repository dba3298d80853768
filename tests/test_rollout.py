"""The rollout engine: cached decoding equals recomputing everything, log-probs equal
teacher-forced scoring, the sampler's filters hold, sharding and grouping change nothing."""

import dataclasses
import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY, mesh, ragged_batch
from kernels._backend import platform_of
from jaxrlhf import model as M
from jaxrlhf import rollout as R
from jaxrlhf.config import ConfigError, KernelsConfig, RolloutConfig
from jaxrlhf.mesh import PARAM_RULES, batch_sharding, tree_shardings

# Larger init than TINY's so next-token distributions are peaked (greedy paths vary and
# top-k/top-p sets are neither everything nor one token).
CFG = dataclasses.replace(TINY, init_std=0.3)
P, N = 8, 12


@pytest.fixture(scope="module")
def params():
  return M.init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def prompts():
  return ragged_batch(jax.random.key(1), 4, P, CFG.vocab_size)


def _run(params, prompts, key=0, fn=R.generate, cfg=CFG, **kw):
  ro = dict(max_new_tokens=N)
  ro.update({k: kw.pop(k) for k in list(kw) if k in ("temperature", "top_k", "top_p",
                                                        "stop_token_ids")})
  return fn(params, *prompts, jax.random.key(key), cfg=cfg, rollout=RolloutConfig(**ro),
            eos_id=kw.pop("eos_id", -1), **kw)


def _steps(params, prompts, **kw):
  """The cached decoder's result and how many sampling steps its loop ran."""
  ro = RolloutConfig(max_new_tokens=N, temperature=0.0,
                     stop_token_ids=kw.pop("stop_token_ids", ()))
  fn = jax.jit(functools.partial(R._generate, cfg=CFG, rollout=ro, pad_id=0, num_samples=1,
                                 kernels=KernelsConfig(), **kw))
  return fn(params, *prompts, jax.random.key(0))


def _full_logits(params, r, cfg=CFG):
  """Teacher-forced logits ``[B, N, V]`` predicting each response slot, from a plain forward."""
  h, _ = M.forward(params, r.tokens_BT, M.positions_from_mask(r.mask_BT), r.mask_BT, cfg=cfg)
  return np.asarray(M.lm_logits(params, h, cfg)[:, P - 1:-1], np.float64)


def _check_padding(r, eos_ids, pad_id=0):
  """After a stop token, responses hold pad, masks are off and log-probs are 0."""
  rmask = np.asarray(r.response_mask_BN)
  resp = np.asarray(r.tokens_BT[:, P:])
  lengths = np.asarray(r.lengths_B)
  np.testing.assert_array_equal(rmask, np.arange(N)[None] < lengths[:, None])
  np.testing.assert_array_equal(np.asarray(r.mask_BT[:, P:]), rmask)
  assert np.all(resp[~rmask] == pad_id)
  assert np.all(np.asarray(r.behaviour_logp_BN)[~rmask] == 0) and np.all(
      np.asarray(r.sample_logp_BN)[~rmask] == 0)
  for row in range(resp.shape[0]):
    body = resp[row, :lengths[row]]
    stops = np.isin(body, list(eos_ids))
    # Finished rows end with their first stop token; the others never emitted one.
    assert bool(r.finished_B[row]) == bool(stops.any())
    if stops.any():
      assert stops[-1] and not stops[:-1].any()
    else:
      assert lengths[row] == N


def test_cached_greedy_equals_recompute_everything_on_ragged_prompts(params, prompts):
  assert len(set(np.asarray(prompts[1]).sum(1).tolist())) > 1  # prompts really are ragged
  free, steps = _steps(params, prompts, eos_id=-1)
  assert int(steps) == N and not np.any(free.finished_B)
  # An EOS that row 1 emits at response index 4 (or earlier): some rows stop, some do not.
  eos = int(free.tokens_BT[1, P + 4])
  cached = _run(params, prompts, temperature=0.0, eos_id=eos)
  ref = _run(params, prompts, temperature=0.0, eos_id=eos, fn=R.generate_uncached)
  assert cached.finished_B[1] and cached.lengths_B[1] <= 5
  np.testing.assert_array_equal(cached.tokens_BT, ref.tokens_BT)
  np.testing.assert_array_equal(cached.mask_BT, ref.mask_BT)
  np.testing.assert_array_equal(cached.lengths_B, ref.lengths_B)
  np.testing.assert_array_equal(cached.finished_B, ref.finished_B)
  np.testing.assert_allclose(cached.behaviour_logp_BN, ref.behaviour_logp_BN, atol=1e-5)
  _check_padding(cached, {eos})
  # Stopping early changes nothing before the stop.
  rm = np.asarray(cached.response_mask_BN)
  np.testing.assert_array_equal(np.asarray(cached.tokens_BT[:, P:])[rm],
                                np.asarray(free.tokens_BT[:, P:])[rm])
  # Early exit: once every row has stopped, the loop ends before max_new_tokens.
  all_stop = tuple(sorted(set(np.asarray(free.tokens_BT[:, P + 1]).tolist())))
  stopped, steps = _steps(params, prompts, eos_id=-1, stop_token_ids=all_stop)
  assert int(steps) == 2 and np.all(stopped.finished_B) and np.all(stopped.lengths_B <= 2)


def test_logprobs_equal_teacher_forced_scoring(params, prompts):
  # Inside an outer jit with a traced key, as in a training step.
  def step(key, stop_token_ids=(), eos_id=-1):
    ro = RolloutConfig(max_new_tokens=N, temperature=1.0, stop_token_ids=stop_token_ids)
    fn = lambda p, t, m, k: R.generate(p, t, m, k, cfg=CFG, rollout=ro, eos_id=eos_id,
                                       num_samples=2)
    return jax.jit(fn)(params, *prompts, key)

  free = step(jax.random.key(7))
  # Stop tokens that rows 0 and 3 sample at response index 2: the same key reproduces the
  # same draws, so those rows now stop by index 2 while EOS and stop ids both count.
  eos, stop = int(free.tokens_BT[0, P + 2]), int(free.tokens_BT[3, P + 2])
  r = step(jax.random.key(7), stop_token_ids=(stop,), eos_id=eos)
  assert r.finished_B[0] and r.finished_B[3] and r.lengths_B[0] <= 3 and r.lengths_B[3] <= 3
  assert not np.all(r.finished_B)
  _check_padding(r, {eos, stop})
  want, _ = M.token_logprobs(params, r.tokens_BT, r.mask_BT, cfg=CFG, start=P)
  rm = np.asarray(r.response_mask_BN)
  np.testing.assert_allclose(np.asarray(r.behaviour_logp_BN)[rm], np.asarray(want)[rm], atol=2e-5)
  # At temperature 1 without filters the sampling distribution is the policy.
  np.testing.assert_allclose(r.sample_logp_BN, r.behaviour_logp_BN, atol=1e-5)


def test_bf16_sampler_logprobs_are_the_trainer_s_bit_for_bit(params, prompts):
  """With bf16 compute the decode step's log-probs are the trainer's teacher-forced log-probs
  exactly (the residual in float32, bf16 operands with float32 products everywhere, one
  log-softmax recurrence: docs/rollout.md), so PPO's ratio starts at exactly 1. Rounding every
  activation to bf16 (``residual_dtype="compute"``) is what made them differ."""
  ro = RolloutConfig(max_new_tokens=N, temperature=1.0)

  def gaps(residual_dtype):
    cfg = dataclasses.replace(CFG, compute_dtype="bfloat16", residual_dtype=residual_dtype)
    fn = lambda p, t, m, k: R.generate(p, t, m, k, cfg=cfg, rollout=ro, eos_id=-1,
                                       num_samples=2)
    r = jax.jit(fn)(params, *prompts, jax.random.key(3))
    want, _ = jax.jit(functools.partial(M.token_logprobs, cfg=cfg, start=P))(
        params, r.tokens_BT, r.mask_BT)
    rm = np.asarray(r.response_mask_BN)
    assert rm.sum() == rm.size
    return np.abs(np.asarray(r.behaviour_logp_BN, np.float64) - np.asarray(want, np.float64))[rm]

  assert gaps("float32").max() == 0.0
  assert gaps("compute").mean() > 1e-4


def test_sampler_argmax_and_draws_are_jax_s_own():
  """The sampler's argmax (a max then the first index holding it, faster on CPU) picks what
  ``jnp.argmax`` picks -- ties, NaNs and fully masked rows included -- and its categorical
  draws the very token ``jax.random.categorical`` draws from the same key."""
  x = jax.random.normal(jax.random.key(5), (64, 37))
  x = x.at[1, 3].set(x[1].max() + 1).at[1, 9].set(x[1].max() + 1)  # a tie: the first wins
  x = x.at[2, 7].set(jnp.nan).at[2, 11].set(jnp.nan).at[3].set(-jnp.inf)
  x = x.at[4].set(jnp.round(x[4]))  # many ties
  got = jax.jit(R.argmax_last)(x)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, jnp.argmax(x, axis=-1))
  assert int(got[1]) == 3 and int(got[2]) == 7
  z = jax.random.normal(jax.random.key(6), (32, 512)) * 3
  draw = jax.jit(R.categorical)
  for k in range(20):
    key = jax.random.key(100 + k)
    np.testing.assert_array_equal(draw(key, z), jax.random.categorical(key, z, axis=-1))


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 5, 1.0), (1.3, 0, 0.6),
                                                     (0.7, 6, 0.7)])
def test_sampler_draws_only_from_the_allowed_set_in_proportion(temperature, top_k, top_p):
  vocab, draws = 16, 8192
  logits = 2.0 * np.asarray(jax.random.normal(jax.random.key(3), (vocab,)), np.float64)
  ro = RolloutConfig(temperature=temperature, top_k=top_k, top_p=top_p)
  tok, logp, slogp = jax.jit(lambda k: R.sample_logits(
      jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (draws, vocab)), k, ro))(
          jax.random.key(4))
  # The filtered distribution, computed independently in float64.
  z = logits / temperature
  order = np.argsort(-z)
  keep = np.zeros(vocab, bool)
  keep[order[:top_k or vocab]] = True
  pz = np.where(keep, np.exp(z - z.max()), 0)
  pz /= pz.sum()
  sorted_p = pz[order]
  before = np.cumsum(sorted_p) - sorted_p
  keep[order[before >= top_p]] = False
  expect = np.where(keep, pz, 0)
  expect /= expect.sum()
  assert 1 < keep.sum() < vocab  # the filter matters for this case
  tok = np.asarray(tok)
  assert keep[tok].all(), f"drew {sorted(set(tok[~keep[tok]]))} outside {np.flatnonzero(keep)}"
  freq = np.bincount(tok, minlength=vocab) / draws
  assert np.abs(freq - expect).max() < 0.025, (freq, expect)
  np.testing.assert_allclose(slogp, np.log(expect[tok]), atol=1e-5)
  np.testing.assert_allclose(logp, (logits - np.logaddexp.reduce(logits))[tok], atol=1e-5)


def test_generate_respects_top_k_and_top_p_at_every_step(params, prompts):
  temperature, top_k, top_p = 0.7, 5, 0.8
  r = _run(params, prompts, key=11, temperature=temperature, top_k=top_k, top_p=top_p,
           num_samples=4)
  z = _full_logits(params, r) / temperature
  order = np.argsort(-z, axis=-1)
  rank = np.argsort(order, axis=-1)  # rank of every token at every step
  p = np.exp(z - z.max(-1, keepdims=True))
  p = np.where(rank < top_k, p, 0)
  p /= p.sum(-1, keepdims=True)
  sorted_p = np.take_along_axis(p, order, -1)
  before = np.take_along_axis(np.cumsum(sorted_p, -1) - sorted_p, rank, -1)
  allowed = (rank < top_k) & (before < top_p + 1e-5)
  tok = np.asarray(r.tokens_BT[:, P:])
  assert np.take_along_axis(allowed, tok[..., None], -1).all()
  assert len(set(tok.ravel().tolist())) > 4  # it did sample, not collapse to greedy
  # sample_logprobs: the log of the renormalised, filtered distribution at the drawn token.
  filt = np.where(allowed, p, 0)
  filt /= filt.sum(-1, keepdims=True)
  np.testing.assert_allclose(r.sample_logp_BN, np.log(np.take_along_axis(filt, tok[..., None],
                                                                          -1)[..., 0]),
                             atol=1e-4)


def test_temperature_zero_is_greedy_whatever_the_key_and_filters(params, prompts):
  a = _run(params, prompts, key=1, temperature=0.0, top_k=3, top_p=0.5)
  b = _run(params, prompts, key=2, temperature=0.0, top_k=3, top_p=0.5)
  np.testing.assert_array_equal(a.tokens_BT, b.tokens_BT)
  np.testing.assert_array_equal(np.asarray(a.tokens_BT[:, P:]),
                                np.argmax(_full_logits(params, a), axis=-1))
  assert np.all(np.asarray(a.sample_logp_BN) == 0)


def test_deterministic_given_the_key(params, prompts):
  a = _run(params, prompts, key=5, temperature=1.0, num_samples=2)
  b = _run(params, prompts, key=5, temperature=1.0, num_samples=2)
  c = _run(params, prompts, key=6, temperature=1.0, num_samples=2)
  jax.tree.map(np.testing.assert_array_equal, a, b)
  assert not np.array_equal(a.tokens_BT, c.tokens_BT)


def test_num_samples_share_one_prefill(params, prompts):
  one = _run(params, prompts, temperature=0.0)
  three = _run(params, prompts, temperature=0.0, num_samples=3)
  # Greedy: the three rows of each group are identical and equal the single sample.
  for field in ("tokens_BT", "mask_BT", "behaviour_logp_BN", "lengths_B"):
    np.testing.assert_array_equal(getattr(three, field),
                                  np.repeat(getattr(one, field), 3, axis=0))
  # Sampled: prompt-major groups, the samples of a group differ.
  s = _run(params, prompts, key=3, temperature=1.0, num_samples=3)
  np.testing.assert_array_equal(s.tokens_BT[:, :P], np.repeat(prompts[0], 3, axis=0))
  groups = np.asarray(s.tokens_BT[:, P:]).reshape(4, 3, N)
  assert all(len({g.tobytes() for g in grp}) > 1 for grp in groups)
  # The prompt's forward pass runs on B rows, never on B*n: no [B*n, P, D] value exists.
  ro = RolloutConfig(max_new_tokens=N)
  jaxpr = jax.make_jaxpr(functools.partial(R.generate, cfg=CFG, rollout=ro, eos_id=-1,
                                           num_samples=3))(params, *prompts, jax.random.key(0))
  shapes = _all_shapes(jaxpr.jaxpr)
  assert (4, P, CFG.d_model) in shapes and (12, P, CFG.d_model) not in shapes


def _all_shapes(jaxpr, out=None):
  out = set() if out is None else out
  for eqn in jaxpr.eqns:
    out.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      _all_shapes(sub, out)
  return out


@pytest.mark.parametrize("decode", ["scanned", "unrolled"])
def test_sharded_generation_equals_unsharded(decode):
  cfg = dataclasses.replace(CFG, n_kv_heads=4)
  params = M.init_params(cfg, jax.random.key(0))
  prompts = ragged_batch(jax.random.key(2), 4, P, cfg.vocab_size)
  ref = _run(params, prompts, key=9, cfg=cfg, temperature=1.0, top_k=20, num_samples=2)
  m = mesh(dp=2, tp=4)
  with jax.set_mesh(m):
    sp = jax.device_put(params, tree_shardings(m, M.param_axes(cfg), params, PARAM_RULES))
    st = tuple(jax.device_put(x, batch_sharding(m, 2, x.shape)) for x in prompts)
    ro = RolloutConfig(max_new_tokens=N, temperature=1.0, top_k=20)
    compiled = R.generate.lower(sp, *st, jax.random.key(9), cfg=cfg, rollout=ro, eos_id=-1,
                                num_samples=2, kernels=KernelsConfig(decode=decode)).compile()
    got = compiled(sp, *st, jax.random.key(9))
    hlo = compiled.as_text()
  np.testing.assert_array_equal(got.tokens_BT, ref.tokens_BT)
  np.testing.assert_array_equal(got.mask_BT, ref.mask_BT)
  np.testing.assert_allclose(got.behaviour_logp_BN, ref.behaviour_logp_BN, atol=1e-5)
  np.testing.assert_allclose(got.sample_logp_BN, ref.sample_logp_BN, atol=1e-5)
  # The per-device KV cache is [layers, rows/dp, kv_heads/tp, P+N-1, head_dim], or that per
  # layer when the decode loop is unrolled.
  if decode == "scanned":
    assert f"f32[{cfg.n_layers},4,1,{P + N - 1},{cfg.head_dim}]" in hlo
  else:
    assert f"f32[4,1,{P + N - 1},{cfg.head_dim}]" in hlo
    assert f"f32[{cfg.n_layers},4,1,{P + N - 1},{cfg.head_dim}]" not in hlo
  assert f"f32[{cfg.n_layers},8,{P + N - 1},4,{cfg.head_dim}]" not in hlo


def test_padded_vocabulary_ids_are_never_sampled(params, prompts):
  # As jaxrlhf.model.hf loads a vocabulary padded for tp: zero LM-head columns, logit 0.
  cfg = dataclasses.replace(CFG, unpadded_vocab_size=CFG.vocab_size - 4)
  padded = dict(params, unembed=params["unembed"].at[:, cfg.unpadded_vocab_size:].set(0.0))
  r = _run(padded, prompts, key=4, cfg=cfg, temperature=1.5, num_samples=4)
  assert np.all(np.asarray(r.tokens_BT[:, P:]) < cfg.unpadded_vocab_size)
  # The policy's log-probs normalise over the real vocabulary only.
  logits = _full_logits(padded, r, cfg)[..., :cfg.unpadded_vocab_size]
  want = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
  tok = np.asarray(r.tokens_BT[:, P:])
  np.testing.assert_allclose(r.behaviour_logp_BN, np.take_along_axis(want, tok[..., None], -1)[..., 0],
                             atol=2e-5)


@pytest.mark.parametrize("change,match", [
    (dict(top_p=0.0), "rollout.top_p"),
    (dict(temperature=-1.0), "rollout.temperature"),
    (dict(stop_token_ids=(999,)), "rollout.stop_token_ids"),
    (dict(eos_id=64), "eos_id=64"),
    (dict(max_new_tokens=40), "model.max_seq_len=32"),
])
def test_settings_that_cannot_work_fail_with_the_field_named(params, prompts, change, match):
  change = dict(change)
  eos_id = change.pop("eos_id", -1)
  ro = dataclasses.replace(RolloutConfig(max_new_tokens=N), **change)
  with pytest.raises(ConfigError, match=match):
    R.generate(params, *prompts, jax.random.key(0), cfg=CFG, rollout=ro, eos_id=eos_id)


# A Gemma-shaped config (interleaved sliding / full layers, a local rotary base, soft-capping):
# the unrolled loop reads the layer index as a Python int where the scan traces it.
GEMMA_LIKE = dataclasses.replace(CFG, sliding_window=3, layer_types=("sliding", "full"),
                                 rope_local_theta=100.0, attn_softcap=50.0)


@pytest.mark.parametrize("cfg", [CFG, GEMMA_LIKE])
def test_unrolled_decode_is_the_scanned_decode_bit_for_bit(prompts, cfg):
  # kernels.decode only moves data (per-layer copies of the weights and cache): every token and
  # log-prob is the scanned loop's exactly, for generate and for in-flight refill.  (With a
  # 16-bit compute_dtype too, under XLA_FLAGS=--xla_allow_excess_precision=false; by default
  # XLA may skip the scanned loop's per-token rounding of the weights to bfloat16, which the
  # unrolled loop does once, as written: benchmarks/NOTES.md, change 14.)
  params = M.init_params(cfg, jax.random.key(0))
  # A third of the ids stop a response: early ends, so that groups are refilled.
  ro = RolloutConfig(max_new_tokens=N, temperature=1.0, top_k=20,
                     stop_token_ids=tuple(range(8, 8 + cfg.vocab_size // 3)))
  outs = {}
  for decode in ("scanned", "unrolled"):
    kern = KernelsConfig(decode=decode)
    plain = R.generate(params, *prompts, jax.random.key(5), cfg=cfg, rollout=ro, eos_id=3,
                       num_samples=2, kernels=kern)
    refill = R.generate_refill(params, *prompts, jax.random.key(5), cfg=cfg,
                               rollout=ro, eos_id=3, num_samples=2, num_groups=2, kernels=kern)
    outs[decode] = (plain, refill[0])
    stats = refill[1].stats
  for got, want in zip(outs["unrolled"], outs["scanned"]):
    np.testing.assert_array_equal(got.tokens_BT, want.tokens_BT)
    np.testing.assert_array_equal(got.behaviour_logp_BN, want.behaviour_logp_BN)
    np.testing.assert_array_equal(got.sample_logp_BN, want.sample_logp_BN)
  assert int(stats["started"]) > 2  # refill did refill


def test_unrolled_decode_holds_a_buffer_per_layer(params, prompts):
  # What makes it fast on a CPU: no [L, ...] cache in the decode loop, so no layer slice is
  # copied out per token, and the loop reads per-layer weights.
  ro = RolloutConfig(max_new_tokens=N)
  lower = lambda decode: R.generate.lower(params, *prompts, jax.random.key(0), cfg=CFG,
                                          rollout=ro, eos_id=-1,
                                          kernels=KernelsConfig(decode=decode)).compile()
  stacked = f"f32[{CFG.n_layers},4,{CFG.n_kv_heads},{P + N - 1},{CFG.head_dim}]"
  assert stacked in lower("scanned").as_text()
  unrolled = lower("unrolled").as_text()
  assert stacked not in unrolled
  assert f"f32[4,{CFG.n_kv_heads},{P + N - 1},{CFG.head_dim}]" in unrolled
  device = jax.devices()[0]  # "auto" follows the platform of the program being traced
  with jax.default_device(device):
    assert R.unrolled_decode(KernelsConfig()) == (platform_of(device) == "cpu")
