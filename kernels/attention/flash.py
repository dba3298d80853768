"""Flash attention for training and prefill as Pallas kernels (Triton backend): causal by slot,
masked by key validity, grouped-query heads, with a Pallas backward pass.

The contract is :func:`kernels.attention.reference.attention_reference`'s: query ``t`` sits at
slot ``q_offset + t`` and sees key slot ``s`` iff ``s <= q_offset + t`` and ``kv_mask[b, s]``.
``q_offset`` may be traced (a KV-cache index); it is passed to the kernels as data.  A query row
with no visible key (a left-pad query) gets output 0 and zero gradient; the reference gives it
the mean of V instead.  Callers never use those rows.

Gemma's variants, both off unless given: a sliding ``window`` (may be traced: it travels with
the offset, ``off = [q_offset, window]``; the forward and dQ kernels skip the key blocks wholly
before the window) and logit soft-capping ``softcap`` (static; the backward kernels multiply
the score gradient by ``1 - (capped / cap)^2``).  Without them the kernels are the plain ones.

Kernels (FlashAttention-2 layout):
* forward, grid ``(query blocks, B, H)``: online softmax over key blocks up to the causal
  bound (blocks wholly in the future are never visited); writes O and the row log-sum-exp.
* backward dQ, same grid: recompute ``P = exp(S - lse)``, ``dS = P (dO V^T - delta)``,
  ``dQ = dS K``.
* backward dK/dV, grid ``(key blocks, B, K)``: each program owns one block of one KV head and
  loops over the ``H/K`` query heads that share it and over the query blocks that can see it,
  so GQA gradients are summed without atomics.
``delta = rowsum(O * dO)`` is a plain XLA reduction.  The head dimension is padded to a power
of two (>= 16) with masked loads; sequence tails are masked, so no input is padded or copied.
Under a device mesh each kernel runs on every device's shard (``kernels/_sharding.py``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels._backend import cdiv, dot, padded, triton_params
from kernels._sharding import per_shard

# Finite stand-ins for -inf / +inf: no inf - inf = NaN in the online softmax, and a row with
# no visible key stores lse = +BIG so that the backward's exp(s - lse) is exactly 0.
_MASKED = -1e30
_BIG = 1e30


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes (powers of two >= 16) and Triton launch settings."""

  block_q: int = 64
  block_k: int = 64
  block_q_bwd: int = 32
  block_k_bwd: int = 32
  num_warps: int = 4
  num_stages: int = 2


def _params(bs):
  return triton_params(bs.num_warps, bs.num_stages)


def _load_rows(ref, row0, rows_ok, n_rows, dp, d, *, index=()):
  """``ref[index..., row0:row0+n_rows, :dp]`` with out-of-range rows and head-dims as 0."""
  d_ok = jnp.arange(dp) < d
  return plgpu.load(ref.at[(pl.ds(row0, n_rows),) + index + (pl.ds(0, dp),)],
                    mask=rows_ok[:, None] & d_ok[None, :], other=0.0)


def key_block(k_ref, v_ref, m_ref, s0, bk, s, dp, d):
  """The key block at slots ``s0 .. s0+bk``: (slots, which hold a real key, K, V); slots past
  ``s`` read as zeros and count as invalid."""
  cols = s0 + jnp.arange(bk)
  col_ok = cols < s
  kv_ok = plgpu.load(m_ref.at[pl.ds(s0, bk)], mask=col_ok, other=0) != 0
  return (cols, col_ok & kv_ok, _load_rows(k_ref, s0, col_ok, bk, dp, d),
          _load_rows(v_ref, s0, col_ok, bk, dp, d))


def n_key_blocks(last_slot, s, bk):
  """Key blocks to visit for queries whose last slot is ``last_slot - 1``: later ones are all
  in the future (causal), so they are skipped."""
  return jnp.minimum(cdiv(last_slot, bk), cdiv(s, bk))


def scores(q, k, scale, softcap):
  """The scaled (and, with ``softcap``, soft-capped) scores of a block, float32."""
  sc = dot(q, k, trans_b=True) * scale
  if softcap is not None:
    sc = jnp.tanh(sc / softcap) * softcap
  return sc


def visible(cols, q_slot, key_ok, off_ref, windowed):
  """[rows, keys] bool: causal, valid and (``windowed``: ``off_ref[1]`` is the window) within
  the window."""
  vis = (cols[None, :] <= q_slot[:, None]) & key_ok[None, :]
  if windowed:
    vis = vis & (cols[None, :] > q_slot[:, None] - off_ref[1])
  return vis


def segments_at(m_ref, start, n, ok):
  """The segment ids (the int key mask, 0: padding) of slots ``start .. start+n``; 0 where not
  ``ok``."""
  return plgpu.load(m_ref.at[pl.ds(start, n)], mask=ok, other=0)


def same_segment(vis, q_seg, m_ref, s0, bk, s):
  """``vis`` restricted to keys of block ``s0`` in the query row's own segment (packed rows:
  the key mask holds segment ids, and a query's id is the one at its own slot)."""
  k_seg = segments_at(m_ref, s0, bk, s0 + jnp.arange(bk) < s)
  return vis & (k_seg[None, :] == q_seg[:, None])


def first_key_block(off_ref, first_slot, bk, windowed):
  """The first key block a query at ``first_slot`` or later can see: 0 without a window."""
  if not windowed:
    return 0
  return jnp.maximum(first_slot - off_ref[1] + 1, 0) // bk


def softmax_step(carry, q, k, v, vis, scale, softcap=None):
  """One key block of the online softmax; carry = (acc, running max m, running sum l)."""
  acc, m, l = carry
  if softcap is None:
    sc = jnp.where(vis, dot(q, k, trans_b=True) * scale, _MASKED)
  else:
    sc = jnp.where(vis, scores(q, k, scale, softcap), _MASKED)
  m_new = jnp.maximum(m, jnp.max(sc, axis=1))
  rescale = jnp.exp(m - m_new)
  p = jnp.where(vis, jnp.exp(sc - m_new[:, None]), 0.0)
  return (acc * rescale[:, None] + dot(p.astype(v.dtype), v), m_new,
          l * rescale + jnp.sum(p, axis=1))


def softmax_init(rows, dp):
  return (jnp.zeros((rows, dp), jnp.float32), jnp.full((rows,), _MASKED, jnp.float32),
          jnp.zeros((rows,), jnp.float32))


def softmax_finish(carry, lse_if_empty):
  """(output, lse) from the online-softmax state; a row that saw no key gets output 0."""
  acc, m, l = carry
  seen = l > 0
  l_safe = jnp.where(seen, l, 1.0)
  return acc / l_safe[:, None], jnp.where(seen, m + jnp.log(l_safe), lse_if_empty)


def _fwd_kernel(off_ref, q_ref, k_ref, v_ref, m_ref, o_ref, lse_ref, *, t, s, d, dp, scale,
                bq, bk, softcap=None, windowed=False, segmented=False):
  off = off_ref[0]
  t0 = pl.program_id(0) * bq
  rows = t0 + jnp.arange(bq)
  row_ok = rows < t
  q = _load_rows(q_ref, t0, row_ok, bq, dp, d)
  q_seg = segments_at(m_ref, off + t0, bq, row_ok) if segmented else None

  def body(j, carry):
    cols, key_ok, k, v = key_block(k_ref, v_ref, m_ref, j * bk, bk, s, dp, d)
    if windowed:
      vis = visible(cols, off + rows, key_ok, off_ref, windowed)
    else:
      vis = (cols[None, :] <= off + rows[:, None]) & key_ok[None, :]
    if segmented:
      vis = same_segment(vis, q_seg, m_ref, j * bk, bk, s)
    return softmax_step(carry, q, k, v, vis, scale, softcap)

  n_blocks = n_key_blocks(off + jnp.minimum(t, t0 + bq), s, bk)
  first = first_key_block(off_ref, off + t0, bk, windowed)
  o, lse = softmax_finish(jax.lax.fori_loop(first, n_blocks, body, softmax_init(bq, dp)), _BIG)
  d_ok = jnp.arange(dp) < d
  plgpu.store(o_ref.at[pl.ds(t0, bq), pl.ds(0, dp)], o.astype(o_ref.dtype),
              mask=row_ok[:, None] & d_ok[None, :])
  plgpu.store(lse_ref.at[pl.ds(t0, bq)], lse, mask=row_ok)


def _dq_kernel(off_ref, q_ref, k_ref, v_ref, m_ref, do_ref, lse_ref, delta_ref, dq_ref, *, t, s,
               d, dp, scale, bq, bk, softcap=None, windowed=False, segmented=False):
  off = off_ref[0]
  t0 = pl.program_id(0) * bq
  rows = t0 + jnp.arange(bq)
  row_ok = rows < t
  q = _load_rows(q_ref, t0, row_ok, bq, dp, d)
  do = _load_rows(do_ref, t0, row_ok, bq, dp, d)
  q_seg = segments_at(m_ref, off + t0, bq, row_ok) if segmented else None
  lse = plgpu.load(lse_ref.at[pl.ds(t0, bq)], mask=row_ok, other=_BIG)
  delta = plgpu.load(delta_ref.at[pl.ds(t0, bq)], mask=row_ok, other=0.0)

  def body(j, dq):
    cols, key_ok, k, v = key_block(k_ref, v_ref, m_ref, j * bk, bk, s, dp, d)
    if windowed:
      vis = visible(cols, off + rows, key_ok, off_ref, windowed)
    else:
      vis = (cols[None, :] <= off + rows[:, None]) & key_ok[None, :]
    if segmented:
      vis = same_segment(vis, q_seg, m_ref, j * bk, bk, s)
    if softcap is None:
      sc = jnp.where(vis, dot(q, k, trans_b=True) * scale, _MASKED)
    else:
      capped = scores(q, k, scale, softcap)
      sc = jnp.where(vis, capped, _MASKED)
    p = jnp.where(vis, jnp.exp(sc - lse[:, None]), 0.0)
    ds = p * (dot(do, v, trans_b=True) - delta[:, None])
    if softcap is not None:
      ds = ds * (1.0 - jnp.square(capped / softcap))
    return dq + dot(ds.astype(k.dtype), k)

  n_blocks = n_key_blocks(off + jnp.minimum(t, t0 + bq), s, bk)
  first = first_key_block(off_ref, off + t0, bk, windowed)
  dq = jax.lax.fori_loop(first, n_blocks, body, jnp.zeros((bq, dp), jnp.float32))
  d_ok = jnp.arange(dp) < d
  plgpu.store(dq_ref.at[pl.ds(t0, bq), pl.ds(0, dp)], (dq * scale).astype(dq_ref.dtype),
              mask=row_ok[:, None] & d_ok[None, :])


def _dkv_kernel(off_ref, q_ref, k_ref, v_ref, m_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
                *, t, s, d, dp, scale, bq, bk, groups, softcap=None, windowed=False,
                segmented=False):
  # q_ref / do_ref: [T, G, D] (the query heads of this KV head); lse/delta: [G, T].
  off = off_ref[0]
  s0 = pl.program_id(0) * bk
  cols, key_ok, k, v = key_block(k_ref, v_ref, m_ref, s0, bk, s, dp, d)
  k_seg = segments_at(m_ref, s0, bk, cols < s) if segmented else None
  # Query blocks wholly before this key block cannot see it: start at the first that can.
  first = jnp.where(s0 > off, jax.lax.div(s0 - off, bq), 0)

  def head_body(g, carry):
    def q_body(i, carry):
      dk, dv = carry
      t0 = i * bq
      rows = t0 + jnp.arange(bq)
      row_ok = rows < t
      q = _load_rows(q_ref, t0, row_ok, bq, dp, d, index=(g,))
      do = _load_rows(do_ref, t0, row_ok, bq, dp, d, index=(g,))
      lse = plgpu.load(lse_ref.at[g, pl.ds(t0, bq)], mask=row_ok, other=_BIG)
      delta = plgpu.load(delta_ref.at[g, pl.ds(t0, bq)], mask=row_ok, other=0.0)
      if windowed:
        vis = visible(cols, off + rows, key_ok, off_ref, windowed) & row_ok[:, None]
      else:
        vis = (cols[None, :] <= off + rows[:, None]) & key_ok[None, :] & row_ok[:, None]
      if segmented:
        q_seg = segments_at(m_ref, off + t0, bq, row_ok)
        vis = vis & (k_seg[None, :] == q_seg[:, None])
      if softcap is None:
        sc = jnp.where(vis, dot(q, k, trans_b=True) * scale, _MASKED)
      else:
        capped = scores(q, k, scale, softcap)
        sc = jnp.where(vis, capped, _MASKED)
      p = jnp.where(vis, jnp.exp(sc - lse[:, None]), 0.0)
      dv = dv + dot(p.astype(do.dtype), do, trans_a=True)
      ds = p * (dot(do, v, trans_b=True) - delta[:, None])
      if softcap is not None:
        ds = ds * (1.0 - jnp.square(capped / softcap))
      dk = dk + dot(ds.astype(q.dtype), q, trans_a=True)
      return dk, dv

    return jax.lax.fori_loop(first, cdiv(t, bq), q_body, carry)

  zeros = jnp.zeros((bk, dp), jnp.float32)
  dk, dv = jax.lax.fori_loop(0, groups, head_body, (zeros, zeros))
  mask = (cols < s)[:, None] & (jnp.arange(dp) < d)[None, :]
  plgpu.store(dk_ref.at[pl.ds(s0, bk), pl.ds(0, dp)], (dk * scale).astype(dk_ref.dtype), mask=mask)
  plgpu.store(dv_ref.at[pl.ds(s0, bk), pl.ds(0, dp)], dv.astype(dv_ref.dtype), mask=mask)


# The pallas_calls below take one shard's arrays with the query heads grouped by the KV head
# they share: q/o/dO [B, T, K, G, D], lse/delta [B, K, G, T]; K and V [B, S, K, D].  Grouping
# lets one sharding rule tie the query heads to their KV head (kernels/_sharding.py).
_RULE_IN = "x, b t k g d, b s k d, b s k d, b s"
_WHOLE = ("x", "t", "g", "d", "s")  # needed whole by every kernel


def _statics(q5, k, scale, bq, bk, off=None, softcap=None, segmented=False):
  b, t, kh, g, d = q5.shape
  s = k.shape[1]
  scale = d ** -0.5 if scale is None else scale
  bq, bk = min(bq, padded(t)), min(bk, padded(s))
  st = dict(t=t, s=s, d=d, dp=padded(d), scale=scale, bq=bq, bk=bk)
  if softcap is not None:
    st["softcap"] = softcap
  if off is not None and off.shape[0] == 2:  # [q_offset, window]
    st["windowed"] = True
  if segmented:
    st["segmented"] = True
  return (b, t, kh, g, d, s), st


# BlockSpecs over the grouped layout, for grids (blocks, B, H) and (blocks, B, K).
def _head_specs(t, s, d, g, n_off=1):
  return dict(
      off=pl.BlockSpec((n_off,), lambda *_: (0,)),
      q=pl.BlockSpec((None, t, None, None, d), lambda i, bi, hi: (bi, 0, hi // g, hi % g, 0)),
      kv=pl.BlockSpec((None, s, None, d), lambda i, bi, hi: (bi, 0, hi // g, 0)),
      mask=pl.BlockSpec((None, s), lambda i, bi, hi: (bi, 0)),
      rows=pl.BlockSpec((None, None, None, t), lambda i, bi, hi: (bi, hi // g, hi % g, 0)))


def _forward_local(off, q5, k, v, kv_mask, *, bs, interpret, scale, softcap=None,
                   segmented=False):
  (b, t, kh, g, d, s), st = _statics(q5, k, scale, bs.block_q, bs.block_k, off, softcap,
                                     segmented)
  sp = _head_specs(t, s, d, g, off.shape[0])
  return pl.pallas_call(
      functools.partial(_fwd_kernel, **st),
      grid=(cdiv(t, st["bq"]), b, kh * g),
      in_specs=[sp["off"], sp["q"], sp["kv"], sp["kv"], sp["mask"]],
      out_specs=[sp["q"], sp["rows"]],
      out_shape=[jax.ShapeDtypeStruct(q5.shape, q5.dtype),
                 jax.ShapeDtypeStruct((b, kh, g, t), jnp.float32)],
      compiler_params=_params(bs),
      interpret=interpret,
      name="flash_attention_fwd",
  )(off, q5, k, v, kv_mask)


def _dq_local(off, q5, k, v, kv_mask, do5, lse4, delta4, *, bs, interpret, scale, softcap=None,
              segmented=False):
  (b, t, kh, g, d, s), st = _statics(q5, k, scale, bs.block_q_bwd, bs.block_k_bwd, off, softcap,
                                     segmented)
  sp = _head_specs(t, s, d, g, off.shape[0])
  return pl.pallas_call(
      functools.partial(_dq_kernel, **st),
      grid=(cdiv(t, st["bq"]), b, kh * g),
      in_specs=[sp["off"], sp["q"], sp["kv"], sp["kv"], sp["mask"], sp["q"], sp["rows"],
                sp["rows"]],
      out_specs=sp["q"],
      out_shape=jax.ShapeDtypeStruct(q5.shape, q5.dtype),
      compiler_params=_params(bs),
      interpret=interpret,
      name="flash_attention_bwd_dq",
  )(off, q5, k, v, kv_mask, do5, lse4, delta4)


def _dkv_local(off, q5, k, v, kv_mask, do5, lse4, delta4, *, bs, interpret, scale,
               softcap=None, segmented=False):
  (b, t, kh, g, d, s), st = _statics(q5, k, scale, bs.block_q_bwd, bs.block_k_bwd, off, softcap,
                                     segmented)
  group = pl.BlockSpec((None, t, None, g, d), lambda j, bi, ki: (bi, 0, ki, 0, 0))
  group_rows = pl.BlockSpec((None, None, g, t), lambda j, bi, ki: (bi, ki, 0, 0))
  kv = pl.BlockSpec((None, s, None, d), lambda j, bi, ki: (bi, 0, ki, 0))
  return pl.pallas_call(
      functools.partial(_dkv_kernel, groups=g, **st),
      grid=(cdiv(s, st["bk"]), b, kh),
      in_specs=[pl.BlockSpec((off.shape[0],), lambda *_: (0,)), group, kv, kv,
                pl.BlockSpec((None, s), lambda j, bi, ki: (bi, 0)), group, group_rows,
                group_rows],
      out_specs=[kv, kv],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_params(bs),
      interpret=interpret,
      name="flash_attention_bwd_dkv",
  )(off, q5, k, v, kv_mask, do5, lse4, delta4)


@functools.lru_cache(maxsize=None)
def _ops(bs, interpret, scale, softcap=None, segmented=False):
  """The three kernels as per-shard ops, built once per static configuration."""
  kw = dict(bs=bs, interpret=interpret, scale=scale)
  if softcap is not None:
    kw["softcap"] = softcap
  if segmented:
    kw["segmented"] = True
  grads_in = _RULE_IN + ", b t k g d, b k g t, b k g t"
  return (
      per_shard(functools.partial(_forward_local, **kw), _RULE_IN + " -> b t k g d, b k g t",
                replicated=_WHOLE),
      per_shard(functools.partial(_dq_local, **kw), grads_in + " -> b t k g d",
                replicated=_WHOLE),
      per_shard(functools.partial(_dkv_local, **kw), grads_in + " -> b s k d, b s k d",
                replicated=_WHOLE))


def _group(x_BTHD, kh):
  b, t, h, d = x_BTHD.shape
  return x_BTHD.reshape(b, t, kh, h // kh, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _flash(q, k, v, kv_mask, off, bs, interpret, scale, softcap, segmented):
  o5, _ = _ops(bs, interpret, scale, softcap, segmented)[0](off, _group(q, k.shape[2]), k, v,
                                                            kv_mask)
  return o5.reshape(q.shape)


def _flash_fwd(q, k, v, kv_mask, off, bs, interpret, scale, softcap, segmented):
  q5 = _group(q, k.shape[2])
  o5, lse4 = _ops(bs, interpret, scale, softcap, segmented)[0](off, q5, k, v, kv_mask)
  return o5.reshape(q.shape), (q5, k, v, kv_mask, off, o5, lse4)


def _flash_bwd(bs, interpret, scale, softcap, segmented, res, do):
  q5, k, v, kv_mask, off, o5, lse4 = res
  do5 = do.reshape(q5.shape)
  delta4 = jnp.einsum("btkgd,btkgd->bkgt", o5.astype(jnp.float32), do5.astype(jnp.float32))
  _, dq_op, dkv_op = _ops(bs, interpret, scale, softcap, segmented)
  args = (off, q5, k, v, kv_mask, do5, lse4, delta4)
  dq5 = dq_op(*args)
  dk, dv = dkv_op(*args)
  return dq5.reshape(do.shape), dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def check_shapes(q_BTHD, k_BSKD, v_BSKD, kv_mask_BS):
  """A ValueError naming the mismatch, for shapes the kernels cannot take."""
  b, _, h, d = q_BTHD.shape
  if k_BSKD.shape != v_BSKD.shape or k_BSKD.shape[0] != b or k_BSKD.shape[3] != d:
    raise ValueError(f"attention: k {k_BSKD.shape} and v {v_BSKD.shape} must both be "
                     f"[B={b}, S, K, D={d}] for q {q_BTHD.shape}")
  if h % k_BSKD.shape[2]:
    raise ValueError(f"attention: {h} query heads is not a multiple of {k_BSKD.shape[2]} KV heads")
  if kv_mask_BS.shape != k_BSKD.shape[:2]:
    raise ValueError(f"attention: kv_mask {kv_mask_BS.shape} must be [B, S] = {k_BSKD.shape[:2]}")


def kernel_inputs(kv_mask_BS, q_offset, window=None, segment_ids_BS=None):
  """The key mask as int32 (Triton has no bool memory) and the offset as an int32 [1] array,
  or ``[q_offset, window]`` [2] with a sliding window.  With segment ids the mask holds them
  (0 where the key is not valid), so the kernels read validity and segment from one array."""
  if segment_ids_BS is not None:
    mask = jnp.where(kv_mask_BS.astype(bool), segment_ids_BS.astype(jnp.int32), 0)
  else:
    mask = kv_mask_BS.astype(jnp.int32)
  off = jnp.reshape(jnp.asarray(q_offset, jnp.int32), (1,))
  if window is not None:
    off = jnp.concatenate([off, jnp.reshape(jnp.asarray(window, jnp.int32), (1,))])
  return mask, off


def flash_attention(q_BTHD, k_BSKD, v_BSKD, kv_mask_BS, q_offset=0, *,
                    block_sizes: BlockSizes = BlockSizes(), interpret: bool = False,
                    scale: float | None = None, window=None, softcap: float | None = None,
                    segment_ids=None):
  """Causal GQA attention with a key mask (see the module docstring); differentiable in
  q, k and v through the Pallas backward kernels.  ``window`` (may be traced), ``softcap`` and
  ``segment_ids`` (packed rows: int ``[B, S]``, ids >= 1, 0 for padding; ids must be
  positive where ``kv_mask`` is true) as in
  :func:`kernels.attention.reference.attention_reference`."""
  check_shapes(q_BTHD, k_BSKD, v_BSKD, kv_mask_BS)
  if segment_ids is not None and segment_ids.shape != kv_mask_BS.shape:
    raise ValueError(f"attention: segment_ids {segment_ids.shape} must be [B, S] = "
                     f"{kv_mask_BS.shape}")
  mask, off = kernel_inputs(kv_mask_BS, q_offset, window, segment_ids)
  return _flash(q_BTHD, k_BSKD, v_BSKD, mask, off, block_sizes, interpret, scale, softcap,
                segment_ids is not None)
