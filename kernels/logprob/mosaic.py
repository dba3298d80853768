"""Fused log-prob + entropy as Pallas kernels for TPU (Mosaic), with a recomputing backward.

The Triton kernels (``pallas.py``) index whole-array refs with masked loads at arbitrary
offsets, which Mosaic does not lower.  These take the TPU's shape instead: every operand moves
in blocks given by ``BlockSpec``s over a grid, the reduction axis of each kernel is the last
grid axis ("arbitrary", so the accumulators persist in VMEM scratch across it), and block
shapes keep the (8, 128) rule on their last two dimensions (a multiple of 8 by 128, or the
whole dimension).  Tokens are flattened to ``N = B*T`` rows; a row's statistics travel as
``[N, 1]`` columns (the whole last dimension, so any block height is legal).

* forward, grid ``(token blocks, vocabulary tiles)``: ``z = h @ W[:, tile]`` (``h`` is
  ``[block_n, D]``, the whole of d_model; W's tile ``[D, block_v]``), folded into an online
  log-sum-exp ``(m, s)``, ``u = sum e^(z - m) z`` for the entropy, and the target's logit
  picked by comparing the tile's column iota with the target.  Writes logp, entropy and lse.
* backward dh, same grid: recompute ``z``, ``gz = g_logp (onehot - p) - g_ent p (z - mu)``,
  accumulate ``gz @ W_tile^T`` into a float32 ``[block_n, D]`` scratch; stored in h's dtype
  after the last tile.
* backward dW, grid ``(vocabulary tiles, token blocks)``: recompute ``z`` and ``gz``,
  accumulate ``h^T @ gz`` into a float32 ``[D, block_v]`` scratch; stored in W's dtype after
  the last token block.  The float32 accumulator is one tile in VMEM, never ``[D, V]``.

Each program owns what it writes (no atomics, deterministic); the backward recomputes the
logits twice (4 matmul-equivalents, the minimum being 3), as the Triton version does.
Ragged sizes: the token axis is padded with zero rows to a whole block (zero ``h`` rows have
zero cotangents, so they add nothing to dW); a vocabulary that no tile width divides runs a
partial last tile whose columns past V are masked (logits to -inf, W's padding to 0).  D is
always whole.  ``softcap`` as in ``pallas.py``.  Under a device mesh each kernel runs on
every device's shard (``kernels/_sharding.py``), with the same rules as the Triton kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels._backend import cdiv, dot
from kernels._sharding import per_shard

_MiB = 2**20


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes (``block_n`` a multiple of 16, ``block_v`` of 128; either is cut down to the
  whole axis when that is smaller) and the VMEM budget the tiles are shrunk to fit.

  At D = 4096 in bf16 the defaults hold, double-buffered: h 2 x 2 MiB, W 2 x 4 MiB, and in dW a
  float32 accumulator of 8 MiB plus its bf16 output 2 x 4 MiB: 28 MiB.  Larger D halves
  ``block_v`` then ``block_n`` until the estimate is under ``vmem_budget``; the compiler is
  given ``vmem_limit`` (Mosaic's default scoped limit is 16-32 MiB, v5e and v5p have 128 and
  95 MiB of VMEM)."""

  block_n: int = 256
  block_v: int = 512
  vmem_budget: int = 40 * _MiB
  vmem_limit: int = 64 * _MiB


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _vmem_estimate(bn: int, bv: int, d: int, itemsize: int) -> int:
  """Bytes of VMEM the largest kernel (dW) holds: double-buffered h and W blocks, the float32
  accumulator, the double-buffered output tile, and a few [bn, bv] float32 temporaries."""
  return 2 * (bn * d + d * bv) * itemsize + d * bv * 4 + 2 * d * bv * itemsize + 4 * bn * bv * 4


def tiles(n: int, d: int, v: int, itemsize: int, bs: BlockSizes) -> tuple[int, int, int]:
  """(block_n, block_v, padded N) for an ``[n, d] @ [d, v]`` problem: the blocks shrunk to
  the VMEM budget, a vocabulary tile that divides V where one of block_v, block_v/2, .. 128
  does, and N padded to a whole number of token blocks."""
  bn, bv = bs.block_n, bs.block_v
  if bn % 16 or bv % 128:
    raise ValueError(f"logprob TPU BlockSizes: block_n={bn} must be a multiple of 16 and "
                     f"block_v={bv} of 128")
  while _vmem_estimate(bn, bv, d, itemsize) > bs.vmem_budget and (bv > 128 or bn > 16):
    if bv > 128:
      bv //= 2
    else:
      bn //= 2
  if v <= bv:
    bv = v  # one tile: the whole axis, legal at any width
  else:
    for cand in (bv, bv // 2, bv // 4, bv // 8):
      if cand >= 128 and cand % 128 == 0 and v % cand == 0:
        bv = cand
        break
  bn = min(bn, _round_up(n, 16))
  return bn, bv, _round_up(n, bn)



def _cap(z, softcap):
  return z if softcap is None else jnp.tanh(z / softcap) * softcap


def _logits(h_ref, w_ref, j, *, v, bv, softcap, cdt):
  """The tile's float32 logits (capped; -inf past V) and its global column ids."""
  z = _cap(dot(h_ref[...].astype(cdt), w_ref[...].astype(cdt)), softcap)
  cols = j * bv + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
  if v % bv:
    z = jnp.where(cols < v, z, -jnp.inf)
  return z, cols


def _w_tile(w_ref, j, *, v, bv, cdt):
  """W's tile for the backward matmuls; columns past V (unspecified padding of the last,
  partial tile) zeroed so that 0 * garbage cannot poison the sum."""
  w = w_ref[...].astype(cdt)
  if v % bv:
    cols = j * bv + jax.lax.broadcasted_iota(jnp.int32, w.shape, 1)
    w = jnp.where(cols < v, w, jnp.zeros_like(w))
  return w


def _grad_logits(z, cols, t, stats, softcap):
  """dL/dz for one tile from the row statistics ``[lse, mu, g_logp, g_ent]`` (``[bn, 4]``)."""
  lse, mu, g_logp, g_ent = (stats[:, i:i + 1] for i in range(4))
  p = jnp.exp(z - lse)  # 0 on masked columns
  zf = jnp.where(z > -jnp.inf, z, 0.0)
  onehot = (cols == t).astype(jnp.float32)
  gz = g_logp * (onehot - p) - g_ent * p * (zf - mu)
  if softcap is not None:
    gz = gz * (1.0 - jnp.square(zf / softcap))
  return gz


def _fwd_kernel(t_ref, h_ref, w_ref, logp_ref, ent_ref, lse_ref, m_sc, s_sc, u_sc, zt_sc, *, v,
                bv, softcap, cdt):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    s_sc[...] = jnp.zeros(s_sc.shape, jnp.float32)
    u_sc[...] = jnp.zeros(u_sc.shape, jnp.float32)
    zt_sc[...] = jnp.zeros(zt_sc.shape, jnp.float32)

  z, cols = _logits(h_ref, w_ref, j, v=v, bv=bv, softcap=softcap, cdt=cdt)
  m = m_sc[...]
  m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=True))
  rescale = jnp.exp(m - m_new)
  e = jnp.exp(z - m_new)
  zf = jnp.where(cols < v, z, 0.0) if v % bv else z
  s_sc[...] = s_sc[...] * rescale + jnp.sum(e, axis=1, keepdims=True)
  u_sc[...] = u_sc[...] * rescale + jnp.sum(e * zf, axis=1, keepdims=True)
  zt_sc[...] += jnp.sum(jnp.where(cols == t_ref[...], z, 0.0), axis=1, keepdims=True)
  m_sc[...] = m_new

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    lse = m_sc[...] + jnp.log(s_sc[...])
    logp_ref[...] = zt_sc[...] - lse
    ent_ref[...] = lse - u_sc[...] / s_sc[...]
    lse_ref[...] = lse


def _dh_kernel(t_ref, st_ref, h_ref, w_ref, dh_ref, acc_sc, *, v, bv, softcap, cdt):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _():
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  z, cols = _logits(h_ref, w_ref, j, v=v, bv=bv, softcap=softcap, cdt=cdt)
  gz = _grad_logits(z, cols, t_ref[...], st_ref[...], softcap).astype(cdt)
  acc_sc[...] += dot(gz, _w_tile(w_ref, j, v=v, bv=bv, cdt=cdt), trans_b=True)

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    dh_ref[...] = acc_sc[...].astype(dh_ref.dtype)


def _dw_kernel(t_ref, st_ref, h_ref, w_ref, dw_ref, acc_sc, *, v, bv, softcap, cdt):
  j, i = pl.program_id(0), pl.program_id(1)

  @pl.when(i == 0)
  def _():
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  z, cols = _logits(h_ref, w_ref, j, v=v, bv=bv, softcap=softcap, cdt=cdt)
  gz = _grad_logits(z, cols, t_ref[...], st_ref[...], softcap).astype(cdt)
  acc_sc[...] += dot(h_ref[...].astype(cdt), gz, trans_a=True)

  @pl.when(i == pl.num_programs(1) - 1)
  def _():
    dw_ref[...] = acc_sc[...].astype(dw_ref.dtype)


def _statics(h_ND, w_DV, bs, softcap):
  n, d = h_ND.shape
  v = w_DV.shape[1]
  cdt = jnp.promote_types(h_ND.dtype, w_DV.dtype)
  bn, bv, n_pad = tiles(n, d, v, jnp.dtype(cdt).itemsize, bs)
  return dict(n=n, d=d, v=v, bn=bn, bv=bv, n_pad=n_pad, cdt=cdt, softcap=softcap)


def _pad_rows(x, n_pad):
  if x.shape[0] == n_pad:
    return x
  return jnp.pad(x, [(0, n_pad - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _forward_local(h_ND, w_DV, t_N, *, bs, interpret, softcap=None):
  st = _statics(h_ND, w_DV, bs, softcap)
  n, d, bn, bv, n_pad = st["n"], st["d"], st["bn"], st["bv"], st["n_pad"]
  col = jax.ShapeDtypeStruct((n_pad, 1), jnp.float32)
  row = lambda i, j: (i, 0)
  logp, ent, lse = pl.pallas_call(
      functools.partial(_fwd_kernel, v=st["v"], bv=bv, softcap=softcap, cdt=st["cdt"]),
      grid=(n_pad // bn, cdiv(st["v"], bv)),
      in_specs=[pl.BlockSpec((bn, 1), row), pl.BlockSpec((bn, d), row),
                pl.BlockSpec((d, bv), lambda i, j: (0, j))],
      out_specs=[pl.BlockSpec((bn, 1), row)] * 3,
      out_shape=(col, col, col),
      scratch_shapes=[pltpu.VMEM((bn, 1), jnp.float32)] * 4,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                           vmem_limit_bytes=bs.vmem_limit),
      interpret=interpret,
      name="logprob_entropy_tpu_fwd",
  )(_pad_rows(t_N[:, None], n_pad), _pad_rows(h_ND, n_pad), w_DV)
  return logp[:n, 0], ent[:n, 0], lse[:n, 0]


def _bwd_inputs(h_ND, t_N, lse, mu, g_logp, g_ent, n_pad):
  """Padded operands of the backward kernels: targets ``[N, 1]``, the row statistics packed
  ``[N, 4]`` (one block each, instead of four), h.  Padded rows have zero h and zero
  cotangents: nothing flows from them."""
  stats = jnp.stack([lse, mu, g_logp, g_ent], axis=1).astype(jnp.float32)
  return _pad_rows(t_N[:, None], n_pad), _pad_rows(stats, n_pad), _pad_rows(h_ND, n_pad)


def _dh_local(h_ND, w_DV, t_N, lse, mu, g_logp, g_ent, *, bs, interpret, softcap=None):
  st = _statics(h_ND, w_DV, bs, softcap)
  n, d, bn, bv, n_pad = st["n"], st["d"], st["bn"], st["bv"], st["n_pad"]
  row = lambda i, j: (i, 0)
  dh = pl.pallas_call(
      functools.partial(_dh_kernel, v=st["v"], bv=bv, softcap=softcap, cdt=st["cdt"]),
      grid=(n_pad // bn, cdiv(st["v"], bv)),
      in_specs=[pl.BlockSpec((bn, 1), row), pl.BlockSpec((bn, 4), row),
                pl.BlockSpec((bn, d), row), pl.BlockSpec((d, bv), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((bn, d), row),
      out_shape=jax.ShapeDtypeStruct((n_pad, d), h_ND.dtype),
      scratch_shapes=[pltpu.VMEM((bn, d), jnp.float32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                           vmem_limit_bytes=bs.vmem_limit),
      interpret=interpret,
      name="logprob_entropy_tpu_bwd_dh",
  )(*_bwd_inputs(h_ND, t_N, lse, mu, g_logp, g_ent, n_pad), w_DV)
  return dh[:n]


def _dw_local(h_ND, w_DV, t_N, lse, mu, g_logp, g_ent, *, bs, interpret, softcap=None):
  st = _statics(h_ND, w_DV, bs, softcap)
  d, bn, bv, n_pad = st["d"], st["bn"], st["bv"], st["n_pad"]
  row = lambda j, i: (i, 0)
  tile = pl.BlockSpec((d, bv), lambda j, i: (0, j))
  return pl.pallas_call(
      functools.partial(_dw_kernel, v=st["v"], bv=bv, softcap=softcap, cdt=st["cdt"]),
      grid=(cdiv(st["v"], bv), n_pad // bn),
      in_specs=[pl.BlockSpec((bn, 1), row), pl.BlockSpec((bn, 4), row),
                pl.BlockSpec((bn, d), row), tile],
      out_specs=tile,
      out_shape=jax.ShapeDtypeStruct(w_DV.shape, w_DV.dtype),
      scratch_shapes=[pltpu.VMEM((d, bv), jnp.float32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                           vmem_limit_bytes=bs.vmem_limit),
      interpret=interpret,
      name="logprob_entropy_tpu_bwd_dw",
  )(*_bwd_inputs(h_ND, t_N, lse, mu, g_logp, g_ent, n_pad), w_DV)


@functools.lru_cache(maxsize=None)
def _ops(bs, interpret, softcap=None):
  """The kernels as per-shard ops (tokens stay sharded; W is needed whole; dW is summed over
  the token shards), the same rules as the Triton kernels'."""
  kw = dict(bs=bs, interpret=interpret, softcap=softcap)
  grads_in = "n d, d v, n, n, n, n, n"
  return (per_shard(functools.partial(_forward_local, **kw), "n d, d v, n -> n, n, n",
                    replicated=("d", "v")),
          per_shard(functools.partial(_dh_local, **kw), grads_in + " -> n d",
                    replicated=("d", "v")),
          per_shard(functools.partial(_dw_local, **kw), grads_in + " -> d v",
                    replicated=("d", "v"), reduced="n"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(h_ND, w_DV, t_N, bs, interpret, softcap):
  logp, ent, _ = _ops(bs, interpret, softcap)[0](h_ND, w_DV, t_N)
  return logp, ent


def _fused_fwd(h_ND, w_DV, t_N, bs, interpret, softcap):
  logp, ent, lse = _ops(bs, interpret, softcap)[0](h_ND, w_DV, t_N)
  return (logp, ent), (h_ND, w_DV, t_N, lse, ent)


def _fused_bwd(bs, interpret, softcap, res, grads):
  h_ND, w_DV, t_N, lse, ent = res
  g_logp, g_ent = (g.astype(jnp.float32) for g in grads)
  _, dh_op, dw_op = _ops(bs, interpret, softcap)
  args = (h_ND, w_DV, t_N, lse, lse - ent, g_logp, g_ent)
  return dh_op(*args), dw_op(*args), None


_fused.defvjp(_fused_fwd, _fused_bwd)


def logprob_entropy_mosaic(h_BTD, w_DV, targets_BT, *, block_sizes: BlockSizes = BlockSizes(),
                           interpret: bool = False, softcap=None):
  """(log p(target) [B,T], entropy [B,T]) in float32 from the TPU kernels; with ``softcap``,
  of the soft-capped logits.  ``interpret=True`` runs them in the Pallas interpreter."""
  b, t, d = h_BTD.shape
  logp, ent = _fused(h_BTD.reshape(b * t, d), w_DV,
                     targets_BT.reshape(b * t).astype(jnp.int32), block_sizes, interpret,
                     softcap)
  return logp.reshape(b, t), ent.reshape(b, t)
