"""The paged KV cache (jaxrlhf/model/paged.py): page accounting under any sequence of
reservations and releases, and a forward through pages equal to a from-scratch forward over
each row's tokens laid end to end (decode steps and prefill blocks, sliding-window layers)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY
from jaxrlhf import model as M
from jaxrlhf.model.paged import init_paged
from jaxrlhf.model.transformer import forward, lm_logits, positions_from_mask

CFG = dataclasses.replace(TINY, max_seq_len=64)
GEMMA_LIKE = dataclasses.replace(CFG, sliding_window=3, layer_types=("sliding", "full"),
                                 rope_local_theta=100.0, init_std=0.3)


def _check_accounting(pg, lengths=None):
  """Every page is free or held by exactly one row, never both, never twice."""
  pages = pg.num_pages
  table = np.asarray(pg.table_RM)
  held = table[table < pages].tolist()
  free = np.asarray(pg.free_F)[:int(pg.n_free)].tolist()
  assert 0 <= int(pg.n_free) <= pages
  assert sorted(held + free) == list(range(pages)), (held, free)
  # A row's pages come first in its table, without gaps.
  for row in table:
    k = int((row < pages).sum())
    assert (row[:k] < pages).all() and (row[k:] == pages).all()
  if lengths is not None:
    assert (np.asarray(pg.held_R()) >= -(-np.asarray(lengths) // pg.page_size)).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pages_are_never_lost_or_shared_under_random_traffic(seed):
  rng = np.random.default_rng(seed)
  rows, pages, ps, max_len = 6, 13, 4, 24
  pg = init_paged(CFG, rows, pages, ps, max_len, per_layer=True)
  reserve, release = jax.jit(lambda p, n: p.reserve(n)), jax.jit(lambda p, r: p.release(r))
  grant = jax.jit(lambda p, n: p.replace(length_R=p.length_R + n))
  denied = 0
  for _ in range(60):
    if rng.random() < 0.25:
      pg = release(pg, jnp.asarray(rng.random(rows) < 0.4))
    else:
      need = rng.integers(0, 7, rows).astype(np.int32)
      before = int(pg.n_free)
      held0 = np.asarray(pg.held_R())
      pg, ok = reserve(pg, jnp.asarray(need))
      ok = np.asarray(ok)
      held1 = np.asarray(pg.held_R())
      # All or nothing: a refused row got no page; a served one holds what it needs.
      assert (held1[~ok] == held0[~ok]).all()
      want = -(-(np.asarray(pg.length_R) + need) // ps)
      assert (held1[ok] >= want[ok]).all()
      assert before - int(pg.n_free) == (held1 - held0).sum()
      denied += int((~ok).sum())
      pg = grant(pg, jnp.asarray(np.where(ok, need, 0)))
    _check_accounting(pg, np.asarray(pg.length_R))
  assert denied > 0  # the pool did run short


def test_a_row_is_never_served_past_its_page_limit():
  pg = init_paged(CFG, 2, 20, 4, 8, per_layer=True)  # 2 pages a row at most
  pg, ok = pg.reserve(jnp.asarray([8, 9], jnp.int32))
  assert np.asarray(ok).tolist() == [True, False]
  assert np.asarray(pg.held_R()).tolist() == [2, 0]
  _check_accounting(pg)


@pytest.mark.parametrize("cfg", [CFG, GEMMA_LIKE], ids=["llama", "sliding_window"])
@pytest.mark.parametrize("per_layer", [True, False], ids=["per_layer", "stacked"])
def test_a_paged_forward_equals_a_forward_over_each_row_alone(cfg, per_layer):
  params = M.init_params(cfg, jax.random.key(0))
  rows, P, ps = 3, 7, 4
  rng = np.random.default_rng(0)
  toks = rng.integers(3, 60, (rows, 24)).astype(np.int32)
  plen = np.array([7, 3, 5])
  pm = np.arange(P)[None, :] >= (P - plen)[:, None]
  pt = np.zeros((rows, P), np.int32)
  for r in range(rows):
    pt[r, pm[r]] = toks[r, :plen[r]]
  pg = init_paged(cfg, rows, 18, ps, 24, per_layer)
  step = jax.jit(lambda pg, t, pos, m: forward(params, t, pos, m, cfg=cfg, paged=pg))
  pg, ok = pg.reserve(jnp.asarray(plen, jnp.int32))
  assert np.asarray(ok).all()
  h, pg = step(pg, pt, positions_from_mask(pm), pm)
  got, lens = [], plen.copy()
  for i in range(8):
    # Rows advance on their own: row 1 every other step, row 2 a 3-token block at step 4.
    width = 3 if i == 4 else 1
    live = np.array([True, i % 2 == 0, i < 6])
    m = np.zeros((rows, width), bool)
    m[:, width - 1] = live
    if width == 3:
      m[2, :] = True
    t = np.zeros((rows, width), np.int32)
    for r in range(rows):
      k = int(m[r].sum())
      t[r, width - k:] = toks[r, lens[r]:lens[r] + k]
    pos = lens[:, None] + np.maximum(np.cumsum(m, 1) - 1, 0)
    pg, ok = pg.reserve(jnp.asarray(m.sum(1), jnp.int32))
    assert np.asarray(ok).all()
    h, pg = step(pg, t, pos, m)
    logits = np.asarray(lm_logits(params, h[:, -1:], cfg)[:, 0])
    lens = lens + m.sum(1)
    got += [(r, int(lens[r]), logits[r]) for r in range(rows) if m[r].any()]
  assert np.asarray(pg.length_R).tolist() == lens.tolist()
  _check_accounting(pg, lens)
  # The reference: each row's tokens from slot 0, one causal forward (right padding is unseen).
  full = np.arange(toks.shape[1])[None, :] < lens[:, None]
  h, _ = forward(params, toks, positions_from_mask(full), full, cfg=cfg)
  want = np.asarray(lm_logits(params, h, cfg))
  for r, n, logits in got:
    np.testing.assert_allclose(logits, want[r, n - 1], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_jax_s_pallas_paged_kernel_equals_the_gather_path(softcap):
  """The GPU kernel (jax.experimental.pallas.ops.gpu.paged_attention) run in the Pallas
  interpreter: the same attention as the XLA gather path, for rows with ragged lengths,
  pages in any order and unassigned table entries (clamped, never read)."""
  from kernels.attention.paged import paged_attention
  k_heads, pages, ps, d, b, h = 2, 20, 4, 16, 3, 8
  rng = np.random.default_rng(0)
  kp = jnp.asarray(rng.normal(size=(k_heads, pages, ps, d)), jnp.float32)
  vp = jnp.asarray(rng.normal(size=(k_heads, pages, ps, d)), jnp.float32)
  q = jnp.asarray(rng.normal(size=(b, 1, h, d)), jnp.float32)
  table = jnp.asarray([[3, 7, 1, 20, 20], [0, 2, 4, 6, 8], [19, 20, 20, 20, 20]], jnp.int32)
  length = jnp.asarray([10, 17, 3], jnp.int32)
  slot = (length - 1)[:, None]
  kw = dict(scale=0.3, softcap=softcap)
  want = paged_attention(q, kp, vp, table, slot, length, impl="xla", **kw)
  got = paged_attention(q, kp, vp, table, slot, length, impl="pallas_interpret", **kw)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_a_contiguous_pool_is_read_as_it_lies_with_the_gather_s_result():
  """Every row's pages reserved up front, in order (what partial rollouts do): the attention
  reads the pool without the table and computes what the gather path does."""
  params = M.init_params(CFG, jax.random.key(0))
  rows, ps, max_len = 3, 4, 12
  pg = init_paged(CFG, rows, rows * 3, ps, max_len, per_layer=True)
  pg, ok = pg.reserve(jnp.full((rows,), max_len, jnp.int32))
  assert np.asarray(ok).all()
  assert np.asarray(pg.table_RM).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
  toks = jnp.asarray(np.random.default_rng(1).integers(3, 60, (rows, 9)), jnp.int32)
  mask = jnp.asarray(np.arange(9)[None, :] < np.array([9, 4, 6])[:, None])
  out = []
  for view in (pg, pg.contiguous_view()):
    h, got = forward(params, toks, positions_from_mask(mask), mask, cfg=CFG, paged=view)
    out.append(np.asarray(h))
    assert np.asarray(got.length_R).tolist() == [9, 4, 6]
  np.testing.assert_allclose(out[1], out[0], atol=1e-6)


@pytest.mark.parametrize("per_layer", [True, False])
def test_a_contiguous_pool_is_split_over_the_data_shards_as_its_rows(per_layer):
  """A pool whose rows own their pages in order (kv_pages=0) lies split over the data axes as
  its rows are: on dp=2 x tp=2 each device holds half of the pages (and half of the KV
  heads), the writes and the reads stay on each shard's own rows, and the forward equals one
  device's."""
  from helpers import mesh
  from jaxrlhf.model.paged import constrain_paged
  params = M.init_params(CFG, jax.random.key(0))
  rows, ps, max_len = 4, 4, 12
  toks = jnp.asarray(np.random.default_rng(1).integers(3, 60, (rows, 9)), jnp.int32)
  mask = jnp.asarray(np.arange(9)[None, :] < np.array([9, 4, 6, 1])[:, None])

  def run(m):
    with jax.set_mesh(m):
      pg = init_paged(CFG, rows, rows * 3, ps, max_len, per_layer=per_layer, reserved=True)
      def step(p, pg):
        h, out = forward(p, toks, positions_from_mask(mask), mask, cfg=CFG, paged=pg)
        return h, constrain_paged(out)
      return jax.jit(step)(params, constrain_paged(pg))

  h1, one = run(mesh())
  h4, four = run(mesh(dp=2, tp=2))
  np.testing.assert_allclose(np.asarray(h4), np.asarray(h1), atol=1e-5)
  for a, b in zip(jax.tree.leaves((one.k, one.v)), jax.tree.leaves((four.k, four.v))):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)
    shard = b.addressable_shards[0].data.shape
    assert shard[-3] == b.shape[-3] // 2 and shard[-4] == b.shape[-4] // 2, (b.shape, shard)


def test_the_pallas_paged_kernel_reads_each_shard_s_own_rows_of_a_contiguous_pool():
  """jax's kernel (interpreted) over a contiguous pool split over dp=2: each device runs its
  own rows against its own part of the pool, and the result is the gather path's."""
  from helpers import mesh
  from jax.sharding import NamedSharding, PartitionSpec as PS
  from kernels.attention.paged import paged_attention
  k_heads, rows, m, ps, d, h = 2, 4, 3, 4, 16, 4
  rng = np.random.default_rng(2)
  kp, vp = (jnp.asarray(rng.normal(size=(k_heads, rows * m, ps, d)), jnp.float32)
            for _ in range(2))
  q = jnp.asarray(rng.normal(size=(rows, 1, h, d)), jnp.float32)
  length = jnp.asarray([10, 3, 12, 1], jnp.int32)
  want = paged_attention(q, kp, vp, None, (length - 1)[:, None], length, impl="xla")
  m2 = mesh(dp=2)
  pool = NamedSharding(m2, PS(None, "dp"))
  with jax.set_mesh(m2):
    fn = jax.jit(lambda q, k, v, n: paged_attention(q, k, v, None, (n - 1)[:, None], n,
                                                    impl="pallas_interpret"))
    args = (jax.device_put(q, NamedSharding(m2, PS("dp"))), jax.device_put(kp, pool),
            jax.device_put(vp, pool), jax.device_put(length, NamedSharding(m2, PS("dp"))))
    got = fn(*args)
    hlo = fn.lower(*args).compile().as_text()
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
  assert "all-gather" not in hlo


@pytest.mark.parametrize("longest", [1, 5, 9, 13, 23, 24])
def test_a_decode_step_gathers_pages_up_to_the_longest_row_with_the_same_bits(longest):
  # On the CPU a decode step gathers each row's pages only up to the longest row's length
  # (one of gathered_pages(M) page counts, picked at run time): the same bits as the gather
  # of all M pages, whichever count the lengths pick.
  from kernels.attention.paged import _paged_pages, gathered_pages, paged_attention
  rows, k_heads, g, d, page, m = 5, 2, 2, 8, 4, 6
  assert gathered_pages(m) == (2, 3, 5, 6)
  rng = np.random.default_rng(longest)
  pages = rows * m
  k_pool, v_pool = (jnp.asarray(rng.normal(size=(k_heads, pages, page, d)), jnp.float32)
                    for _ in range(2))
  table = jnp.asarray(rng.permutation(pages).reshape(rows, m), jnp.int32)
  length = jnp.asarray(list(rng.integers(1, longest + 1, rows - 1)) + [longest], jnp.int32)
  q = jnp.asarray(rng.normal(size=(rows, 1, k_heads * g, d)), jnp.float32)
  args = (q, k_pool, v_pool, table, (length - 1)[:, None], length)
  bounded = jax.jit(lambda *a: paged_attention(*a, impl="xla"))
  assert "stablehlo.case" in bounded.lower(*args).as_text()  # a count chosen at run time
  got = bounded(*args)
  full = jax.jit(lambda *a: _paged_pages(*a, None, scale=None, window=None, softcap=None))(
      *args)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(full))
