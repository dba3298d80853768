"""Group-shared prompts (``rollout.prefix_sharing``): attention over one copy of each prompt's
keys/values, merged with each sample's own slots in one softmax, equals dense attention over
the prompt repeated per sample; generation with it gives today's tokens and log-probs to float
rounding, on one device and on dp2 x tp2.  The same over a paged cache (per-row positions, as
refill runs it: tests/test_refill.py runs the loop)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import mesh
from jaxrlhf import model as M
from jaxrlhf.config import KernelsConfig, ModelConfig, RolloutConfig
from jaxrlhf.rollout import generate
from kernels.attention.reference import attention_reference
from kernels.attention.paged import paged_attention
from kernels.attention.shared_prefix import shared_prefix_attention, shared_prefix_paged_attention


def _dense(q, pk, pv, pmask, k, v, kmask, q_offset, n, **kw):
  """The prompt repeated for each of its n rows, then the rows' own slots: today's cache."""
  rep = lambda x: jnp.repeat(x, n, axis=0)  # noqa: E731
  k_all = jnp.concatenate([rep(pk), k], axis=2)
  v_all = jnp.concatenate([rep(pv), v], axis=2)
  m_all = jnp.concatenate([rep(pmask), kmask], axis=1)
  return attention_reference(q, k_all, v_all, m_all, pk.shape[2] + q_offset, kv_layout="bksd",
                             **kw)


@pytest.mark.parametrize("n", [1, 4, 16])
@pytest.mark.parametrize("kw", [{}, {"window": 5}, {"softcap": 3.0, "scale": 0.3}])
def test_shared_prefix_attention_equals_dense_attention(n, kw):
  g, h, kh, d, p, s, t = 3, 4, 2, 8, 9, 6, 1
  keys = jax.random.split(jax.random.key(n), 6)
  q = jax.random.normal(keys[0], (g * n, t, h, d))
  pk, pv = (jax.random.normal(k, (g, kh, p, d)) for k in keys[1:3])
  k, v = (jax.random.normal(kk, (g * n, kh, s, d)) for kk in keys[3:5])
  # Ragged prompts (left padding of 0, 3 and 6 slots) and responses of ragged length.
  pmask = jnp.arange(p)[None, :] >= jnp.array([0, 3, 6])[:, None]
  q_offset = 3
  kmask = (jnp.arange(s)[None, :] <= q_offset) & (
      jnp.arange(s)[None, :] < 1 + jnp.arange(g * n)[:, None] % 4)
  got = shared_prefix_attention(q, pk, pv, pmask, k, v, kmask, q_offset, **kw)
  want = _dense(q, pk, pv, pmask, k, v, kmask, q_offset, n, **kw)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


TINY = ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   mlp_dim=64, max_seq_len=32)
SLIDING = dataclasses.replace(TINY, sliding_window=6, layer_types=("sliding", "full"),
                              attn_softcap=20.0)


def _rollouts(cfg, m, n=4, **ro):
  params = M.init_params(cfg, jax.random.key(0))
  prompts = jax.random.randint(jax.random.key(1), (4, 8), 3, cfg.vocab_size)
  mask = jnp.arange(8)[None, :] >= jnp.array([0, 2, 5, 7])[:, None]  # ragged prompts
  outs = []
  for share in (False, True):
    rollout = RolloutConfig(max_new_tokens=10, prefix_sharing=share, **ro)
    with jax.set_mesh(m):
      outs.append(jax.device_get(generate(params, prompts, mask, jax.random.key(2), cfg=cfg,
                                          rollout=rollout, eos_id=1, num_samples=n)))
  return outs


@pytest.mark.parametrize("cfg", [TINY, SLIDING], ids=["full", "sliding"])
@pytest.mark.parametrize("n", [1, 4])
def test_generation_with_shared_prompts_gives_todays_tokens(cfg, n):
  dense, shared = _rollouts(cfg, mesh(), n=n)
  np.testing.assert_array_equal(shared.tokens_BT, dense.tokens_BT)
  np.testing.assert_array_equal(shared.mask_BT, dense.mask_BT)
  np.testing.assert_allclose(shared.behaviour_logp_BN, dense.behaviour_logp_BN, atol=2e-5)
  np.testing.assert_allclose(shared.sample_logp_BN, dense.sample_logp_BN, atol=2e-5)
  assert dense.response_mask_BN.sum() > 4 * n  # the responses are not all empty


def test_generation_with_shared_prompts_on_dp2_tp2():
  dense, shared = _rollouts(TINY, mesh(dp=2, tp=2), n=4, row_keys=True)
  single, _ = _rollouts(TINY, mesh(), n=4, row_keys=True)
  np.testing.assert_array_equal(shared.tokens_BT, dense.tokens_BT)
  np.testing.assert_array_equal(shared.tokens_BT, single.tokens_BT)
  np.testing.assert_allclose(shared.behaviour_logp_BN, dense.behaviour_logp_BN, atol=2e-5)


def _paged_reference(q, pk, pv, plen, own_k, own_v, q_slot, length, n, page, **kw):
  """Each row's prompt then its own tokens end to end in one row of pages: the paged cache
  without sharing (the prompt copied into every row)."""
  kh, b, s, d = own_k.shape
  p = pk.shape[2]
  plen_B = jnp.repeat(plen, n)
  slot = jnp.arange(-(-(p + s) // page) * page)
  from_prompt = slot[None, :, None] < plen_B[:, None, None]  # [B, S', 1]

  def row(pre, own):
    pre_B = jnp.repeat(pre, n, axis=0).transpose(1, 0, 2, 3)  # [K, B, P, D]
    a = jnp.take(pre_B, jnp.clip(slot, 0, p - 1), axis=2)
    o = jnp.take_along_axis(own, jnp.clip(slot[None] - plen_B[:, None], 0, s - 1)[None, :, :,
                                                                                     None],
                            axis=2)
    return jnp.where(from_prompt[None], a, o).reshape(kh, -1, page, d)

  return paged_attention(q, row(pk, own_k), row(pv, own_v), None, q_slot + plen_B[:, None],
                         length + plen_B, impl="xla", **kw)


@pytest.mark.parametrize("n", [1, 4, 16])
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("kw", [{}, {"window": 5}, {"softcap": 3.0, "scale": 0.3}])
def test_shared_prefix_over_pages_equals_the_prompt_in_every_row(n, t, kw):
  """Per-row positions (refill with shared prompts): a group's prompt read once, each row's
  own slots from a pool of pages, equals each row holding the prompt then its own tokens;
  ragged prompts (9, 6 and 3 tokens), ragged own lengths, decode and block queries."""
  g, h, kh, d, p, s, page = 3, 4, 2, 8, 9, 8, 4
  keys = jax.random.split(jax.random.key(n + t), 6)
  q = jax.random.normal(keys[0], (g * n, t, h, d))
  pk, pv = (jax.random.normal(k, (g, kh, p, d)) for k in keys[1:3])
  plen = jnp.array([9, 6, 3])
  pmask = jnp.arange(p)[None] < plen[:, None]
  own_k, own_v = (jax.random.normal(k, (kh, g * n, s, d)) for k in keys[3:5])
  length = jnp.maximum(1 + (jnp.arange(g * n) * 3) % s, t)
  q_slot = length[:, None] - t + jnp.arange(t)[None]
  pool = lambda x: x.reshape(kh, g * n * s // page, page, d)  # noqa: E731 row b: its pages
  got = shared_prefix_paged_attention(q, pk, pv, pmask, pool(own_k), pool(own_v), None, q_slot,
                                      length, **kw)
  want = _paged_reference(q, pk, pv, plen, own_k, own_v, q_slot, length, n, page, **kw)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def _prefix_case(n, t, g=3, h=4, kh=2, d=8, p=9, s=8, plen=(9, 6, 0)):
  """Ragged prompts (the last one empty), own keys and values of ragged length."""
  keys = jax.random.split(jax.random.key(10 * n + t), 6)
  q = jax.random.normal(keys[0], (g * n, t, h, d))
  pk, pv = (jax.random.normal(k, (g, kh, p, d)) for k in keys[1:3])
  pmask = jnp.arange(p)[None] < jnp.array(plen)[:, None]
  own_k, own_v = (jax.random.normal(k, (kh, g * n, s, d)) for k in keys[3:5])
  return q, pk, pv, pmask, own_k, own_v


@pytest.mark.parametrize("n,kw", [(1, {}), (16, {}), (4, {"softcap": 3.0, "scale": 0.3})])
def test_the_pallas_shared_prefix_decode_equals_the_xla_path(n, kw):
  """The GPU path (the Pallas decode kernel, here in the Pallas interpreter): the prompt part
  as one kernel call per group (n x T queries against the prompt), the own part a second,
  merged by log-sum-exp, equals the XLA path's one softmax; on a contiguous cache (T = 1
  and a block of 3 queries) and over pages (a decode step)."""
  q, pk, pv, pmask, own_k, own_v = _prefix_case(n, 1)
  page = 4
  g, kh, s, d = pk.shape[0], pk.shape[1], own_k.shape[2], pk.shape[3]
  length = 1 + (jnp.arange(g * n) * 3) % s
  pool = lambda x: x.reshape(kh, g * n * s // page, page, d)  # noqa: E731
  args = (q, pk, pv, pmask, pool(own_k), pool(own_v), None, length[:, None] - 1, length)
  want = shared_prefix_paged_attention(*args, impl="xla", **kw)
  got = shared_prefix_paged_attention(*args, impl="pallas_interpret", **kw)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
  # A page table: the rows' pages in reverse order in the pool.
  m = s // page
  table = (g * n * m - 1 - jnp.arange(g * n * m)).reshape(g * n, m)
  flipped = lambda x: pool(x)[:, ::-1]  # noqa: E731
  args = (q, pk, pv, pmask, flipped(own_k), flipped(own_v), table, length[:, None] - 1, length)
  np.testing.assert_allclose(shared_prefix_paged_attention(*args, impl="pallas_interpret", **kw),
                             want, rtol=2e-5, atol=2e-6)
  for t in (1, 3):
    q, pk, pv, pmask, own_k, own_v = _prefix_case(n, t)
    k, v = own_k.transpose(1, 0, 2, 3), own_v.transpose(1, 0, 2, 3)
    q_offset = 3
    kmask = (jnp.arange(s)[None, :] <= q_offset + t - 1) & (
        jnp.arange(s)[None, :] < 1 + jnp.arange(g * n)[:, None] % 4 + t)
    want = shared_prefix_attention(q, pk, pv, pmask, k, v, kmask, q_offset, impl="xla", **kw)
    got = shared_prefix_attention(q, pk, pv, pmask, k, v, kmask, q_offset,
                                  impl="pallas_interpret", **kw)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_generation_with_shared_prompts_on_the_pallas_path_gives_the_xla_tokens(monkeypatch):
  """The model's decode loop with ``kernels.attention=pallas_interpret`` (the GPU's kernels,
  interpreted) and shared prompts samples the XLA path's tokens, log-probs within 2e-5."""
  import kernels.attention.shared_prefix as sp
  calls = []
  real = sp.decode_attention_lse
  monkeypatch.setattr(sp, "decode_attention_lse", lambda *a, **k: calls.append(1) or real(*a, **k))
  params = M.init_params(TINY, jax.random.key(0))
  prompts = jax.random.randint(jax.random.key(1), (2, 8), 3, TINY.vocab_size)
  mask = jnp.arange(8)[None, :] >= jnp.array([0, 5])[:, None]
  rollout = RolloutConfig(max_new_tokens=6, prefix_sharing=True)
  outs = [jax.device_get(generate(params, prompts, mask, jax.random.key(2), cfg=TINY,
                                  rollout=rollout, eos_id=1, num_samples=4,
                                  kernels=KernelsConfig(attention=impl)))
          for impl in ("xla", "pallas_interpret")]
  assert calls  # the kernel path was traced (the prompt and own parts of each layer)
  np.testing.assert_array_equal(outs[1].tokens_BT, outs[0].tokens_BT)
  np.testing.assert_allclose(outs[1].behaviour_logp_BN, outs[0].behaviour_logp_BN, atol=2e-5)


def test_decode_bytes_count_the_prompt_once_per_group():
  """What perf/* and the planner charge decoding (``generation_bytes``): with shared prompts
  the prompt's slots are read once per group, not once per sample."""
  from jaxrlhf.data import DataSource
  from jaxrlhf.train.spec import build_stage
  from jaxrlhf.train.work import generation_bytes
  from test_train import config
  got = {}
  for share in (False, True):
    cfg = config()
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout,
                                                               prefix_sharing=share))
    stage = build_stage("grpo", cfg, None, DataSource(cfg.data, cfg.seed))
    got[share] = generation_bytes(stage, 1, 1)
  m, b, n = cfg.model, stage.scfg.batch_size, stage.n
  per_slot = 2 * m.n_layers * m.n_kv_heads * m.head_dim * 4
  assert got[False] - got[True] == (stage.N - 1) * (b * n - b) * stage.P * per_slot
