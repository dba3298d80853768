"""Decode attention over a KV cache as a Pallas kernel (Triton backend): a few new query tokens
(T = 1 when sampling, small T for speculative or chunked steps) against ``S`` cached slots, with
each sequence's valid slots given by ``kv_mask`` and the causal bound by ``q_offset``.

Decode is memory-bound: the work is reading K and V once.  So one program serves *all* the
``H/K`` query heads (times T tokens) that share a KV head, and reads that head's cache exactly
once, instead of once per query head.  When ``B * K`` programs are too few to fill the GPU the
key range is also split (flash-decoding): each split writes a partial output and its
log-sum-exp, and a tiny XLA epilogue combines them.  Only slots below ``q_offset + T`` (the
filled part of the cache) are read, whatever the cache's capacity.

Same contract as :func:`kernels.attention.reference.attention_reference`, except that a query
row with no visible key gets output 0.  A sliding ``window`` travels with the offset
(``off = [q_offset, window]``, may be traced; only the key blocks from the window's first on
are read); ``softcap`` is static.  Forward only: the backward of this op (nobody
differentiates through sampling) falls back to the reference's gradient.
Under a device mesh each kernel runs on every device's shard (``kernels/_sharding.py``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels._backend import cdiv, padded, triton_params
from kernels._sharding import per_shard
from kernels.attention.flash import (check_shapes, first_key_block, kernel_inputs, key_block,
                                     n_key_blocks, softmax_finish, softmax_init, softmax_step,
                                     visible)
from kernels.attention.reference import attention_reference, check_layout, to_bskd

_MASKED = -1e30


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
  """Key-block size, the program count to aim for (about 2 per SM on an H100/H200), the most
  query rows (tokens x query heads of a KV head) one program serves, and Triton launch
  settings."""

  block_k: int = 128
  target_programs: int = 264
  max_rows: int = 128
  num_warps: int = 4
  num_stages: int = 2


def _kernel(off_ref, q_ref, k_ref, v_ref, m_ref, o_ref, lse_ref, *, t, tc, s, g, d, dp, rp,
            scale, bk, n_split, softcap=None, windowed=False):
  # q_ref: [tc*G, D], this program's chunk of the T*G query rows (row r = token
  # chunk * tc + r // G, query head r % G of this KV head).
  off = off_ref[0]
  rows = jnp.arange(rp)
  first_token = pl.program_id(3) * tc
  row_ok = (rows < tc * g) & (first_token + rows // g < t)
  d_ok = jnp.arange(dp) < d
  q = plgpu.load(q_ref.at[pl.ds(0, rp), pl.ds(0, dp)], mask=row_ok[:, None] & d_ok[None, :],
                 other=0.0)
  q_slot = off + first_token + rows // g
  # This split's share of the key blocks holding the slots this chunk's queries can see,
  # [0, min(S, off + its last token + 1)) (with one chunk: off + T).
  n_blocks = n_key_blocks(off + jnp.minimum(t, first_token + tc), s, bk)
  if windowed:  # the splits share only the blocks from the window's first one on
    first = first_key_block(off_ref, off + first_token, bk, windowed)
    per_split = cdiv(n_blocks - first, n_split)
    lo = first + pl.program_id(2) * per_split
  else:
    per_split = cdiv(n_blocks, n_split)
    lo = pl.program_id(2) * per_split
  hi = jnp.minimum(lo + per_split, n_blocks)

  def body(j, carry):
    cols, key_ok, k, v = key_block(k_ref, v_ref, m_ref, j * bk, bk, s, dp, d)
    if windowed:
      vis = visible(cols, q_slot, key_ok, off_ref, windowed)
    else:
      vis = (cols[None, :] <= q_slot[:, None]) & key_ok[None, :]
    return softmax_step(carry, q, k, v, vis, scale, softcap)

  # An empty split gets lse = _MASKED, so its weight in the combination is 0.
  o, lse = softmax_finish(jax.lax.fori_loop(lo, hi, body, softmax_init(rp, dp)), _MASKED)
  plgpu.store(o_ref.at[pl.ds(0, rp), pl.ds(0, dp)], o, mask=row_ok[:, None] & d_ok[None, :])
  plgpu.store(lse_ref.at[pl.ds(0, rp)], lse, mask=row_ok)


def _decode_rows(off, q5, k, v, kv_mask, *, bs, interpret, scale, kv_layout, softcap=None):
  """One shard: q5 [B, T, K, G, D] (query heads grouped by their KV head); k, v [B, S, K, D]
  or, with ``kv_layout="bksd"`` / ``"kbsd"``, [B, K, S, D] / [K, B, S, D].  The output
  ``[B, K, T*G, D]`` in float32 and its log-sum-exp ``[B, K, T*G]`` (``_MASKED`` for a row
  that sees no key)."""
  b, t, kh, g, d = q5.shape
  s = k.shape[kv_layout.index("s")]
  scale = d ** -0.5 if scale is None else scale
  bk = min(bs.block_k, padded(s))
  n_split = max(1, min(cdiv(bs.target_programs, b * kh), cdiv(s, bk)))
  # A program serves up to bs.max_rows query rows (whole tokens); more are split in chunks.
  tc = max(1, min(t, bs.max_rows // g))
  chunks = cdiv(t, tc)
  rows = tc * g
  # [B, T, K, G, D] -> [B, K, chunks, tc*G, D]: one program's queries are contiguous (a small
  # copy; the last chunk's missing tokens are zeros, masked in the kernel).
  q_rows = jnp.pad(q5, ((0, 0), (0, chunks * tc - t), (0, 0), (0, 0), (0, 0)))
  q_rows = q_rows.transpose(0, 2, 1, 3, 4).reshape(b, kh, chunks, rows, d)
  if kv_layout == "bskd":
    kv_spec = pl.BlockSpec((None, s, None, d), lambda bi, ki, si, ci: (bi, 0, ki, 0))
  elif kv_layout == "bksd":  # one program's [S, D] block is contiguous
    kv_spec = pl.BlockSpec((None, None, s, d), lambda bi, ki, si, ci: (bi, ki, 0, 0))
  else:  # "kbsd": a paged pool's rows read in place, heads first
    kv_spec = pl.BlockSpec((None, None, s, d), lambda bi, ki, si, ci: (ki, bi, 0, 0))
  extra = {}
  if softcap is not None:
    extra["softcap"] = softcap
  if off.shape[0] == 2:  # [q_offset, window]
    extra["windowed"] = True
  kernel = functools.partial(_kernel, t=t, tc=tc, s=s, g=g, d=d, dp=padded(d), rp=padded(rows),
                             scale=scale, bk=bk, n_split=n_split, **extra)
  o_part, lse_part = pl.pallas_call(
      kernel,
      grid=(b, kh, n_split, chunks),
      in_specs=[
          pl.BlockSpec((off.shape[0],), lambda bi, ki, si, ci: (0,)),
          pl.BlockSpec((None, None, None, rows, d), lambda bi, ki, si, ci: (bi, ki, ci, 0, 0)),
          kv_spec,
          kv_spec,
          pl.BlockSpec((None, s), lambda bi, ki, si, ci: (bi, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, None, rows, d),
                       lambda bi, ki, si, ci: (bi, ki, si, ci, 0, 0)),
          pl.BlockSpec((None, None, None, None, rows), lambda bi, ki, si, ci: (bi, ki, si, ci, 0)),
      ],
      out_shape=[jax.ShapeDtypeStruct((b, kh, n_split, chunks, rows, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, n_split, chunks, rows), jnp.float32)],
      compiler_params=triton_params(bs.num_warps, bs.num_stages),
      interpret=interpret,
      name="decode_attention",
  )(off, q_rows, k, v, kv_mask)
  # Combine the splits: weights exp(lse_i - max lse); all-empty rows stay 0.
  top = jnp.max(lse_part, axis=2, keepdims=True)
  w = jnp.exp(lse_part - top)
  total = jnp.sum(w, axis=2)
  o = jnp.sum(o_part * w[..., None], axis=2) / total[..., None]
  lse = top[:, :, 0] + jnp.log(total)
  flat = lambda x: x.reshape(b, kh, chunks * rows, *x.shape[4:])[:, :, :t * g]  # noqa: E731
  return flat(o), flat(lse)


def _decode_local(off, q5, k, v, kv_mask, *, bs, interpret, scale, kv_layout, softcap=None,
                  with_lse=False):
  b, t, kh, g, d = q5.shape
  o, lse = _decode_rows(off, q5, k, v, kv_mask, bs=bs, interpret=interpret, scale=scale,
                        kv_layout=kv_layout, softcap=softcap)
  o = o.reshape(b, kh, t, g, d).transpose(0, 2, 1, 3, 4)
  if with_lse:  # float32 output and its log-sum-exp (decode_attention_lse)
    return o, lse.reshape(b, kh, t, g).transpose(0, 2, 1, 3)
  return o.astype(q5.dtype)


@functools.lru_cache(maxsize=None)
def _op(bs, interpret, scale, kv_layout, softcap=None, with_lse=False):
  kv = " ".join(kv_layout)
  extra = {} if softcap is None else {"softcap": softcap}
  out = "b t k g d, b t k g" if with_lse else "b t k g d"
  return per_shard(functools.partial(_decode_local, bs=bs, interpret=interpret, scale=scale,
                                     kv_layout=kv_layout, with_lse=with_lse, **extra),
                   f"x, b t k g d, {kv}, {kv}, b s -> {out}",
                   replicated=("x", "t", "g", "d", "s"))


def _decode(q, k, v, kv_mask, off, bs, interpret, scale, kv_layout, softcap):
  b, t, h, d = q.shape
  kh = k.shape[kv_layout.index("k")]
  q5 = q.reshape(b, t, kh, h // kh, d)
  return _op(bs, interpret, scale, kv_layout, softcap)(off, q5, k, v, kv_mask).reshape(q.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _decode_vjp(q, k, v, kv_mask, off, bs, interpret, scale, kv_layout, softcap):
  return _decode(q, k, v, kv_mask, off, bs, interpret, scale, kv_layout, softcap)


def _decode_fwd(q, k, v, kv_mask, off, bs, interpret, scale, kv_layout, softcap):
  return (_decode(q, k, v, kv_mask, off, bs, interpret, scale, kv_layout, softcap),
          (q, k, v, kv_mask, off))


def _decode_bwd(bs, interpret, scale, kv_layout, softcap, res, do):
  q, k, v, kv_mask, off = res
  window = off[1] if off.shape[0] == 2 else None
  _, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, kv_mask != 0, off[0],
                                                       scale=scale, kv_layout=kv_layout,
                                                       window=window, softcap=softcap),
                   q, k, v)
  return (*vjp(do), None, None)


_decode_vjp.defvjp(_decode_fwd, _decode_bwd)


def decode_attention(q_BTHD, k_BSKD, v_BSKD, kv_mask_BS, q_offset=0, *,
                     block_sizes: DecodeBlockSizes = DecodeBlockSizes(), interpret: bool = False,
                     scale: float | None = None, kv_layout: str = "bskd", window=None,
                     softcap: float | None = None):
  """Attention of T new tokens (slots ``q_offset ..``) over a KV cache; see the module doc.
  ``kv_layout="bksd"``: k and v are ``[B, K, S, D]`` (the cache's layout)."""
  check_layout(kv_layout)
  as_bskd = functools.partial(jax.eval_shape, functools.partial(to_bskd, kv_layout=kv_layout))
  check_shapes(q_BTHD, as_bskd(k_BSKD), as_bskd(v_BSKD), kv_mask_BS)
  mask, off = kernel_inputs(kv_mask_BS, q_offset, window)
  return _decode_vjp(q_BTHD, k_BSKD, v_BSKD, mask, off, block_sizes, interpret, scale,
                     kv_layout, softcap)


def decode_attention_lse(q_BTHD, k_BSKD, v_BSKD, kv_mask_BS, q_offset=0, *,
                         block_sizes: DecodeBlockSizes = DecodeBlockSizes(),
                         interpret: bool = False, scale: float | None = None,
                         kv_layout: str = "bskd", softcap: float | None = None):
  """:func:`decode_attention` as a part to merge with attention over other keys: its output
  ``[B, T, H, D]`` in float32 and the log-sum-exp of each query's scaled (soft-capped) scores
  over the keys it sees, ``[B, T, H]`` (about ``-1e30`` for a query that sees none, whose
  output is 0).  Attention over keys ``A`` then ``B`` is ``(o_A e^(lse_A - m) + o_B
  e^(lse_B - m)) / (e^(lse_A - m) + e^(lse_B - m))``, ``m`` the larger lse
  (:mod:`kernels.attention.shared_prefix`).  No window; forward only (sampling).
  ``kv_layout`` may also be ``"kbsd"``: ``[K, B, S, D]``, a paged pool's rows as they lie
  (:func:`kernels.attention.paged.row_slots`)."""
  perm = {"bskd": (0, 1, 2, 3), "bksd": (0, 2, 1, 3), "kbsd": (1, 2, 0, 3)}.get(kv_layout)
  if perm is None:
    raise ValueError(f"decode_attention_lse: kv_layout={kv_layout!r}; choose from bskd, bksd, "
                     "kbsd")
  as_bskd = lambda x: jax.ShapeDtypeStruct(tuple(x.shape[i] for i in perm), x.dtype)  # noqa: E731
  check_shapes(q_BTHD, as_bskd(k_BSKD), as_bskd(v_BSKD), kv_mask_BS)
  mask, off = kernel_inputs(kv_mask_BS, q_offset)
  b, t, h, d = q_BTHD.shape
  kh = k_BSKD.shape[kv_layout.index("k")]
  q5 = q_BTHD.reshape(b, t, kh, h // kh, d)
  o, lse = _op(block_sizes, interpret, scale, kv_layout, softcap, True)(off, q5, k_BSKD, v_BSKD,
                                                                         mask)
  return o.reshape(b, t, h, d), lse.reshape(b, t, h)
