"""Fused log-prob + entropy as Pallas kernels (Triton backend), with a recomputing backward.

Tokens are flattened to ``N = B*T`` rows.  Three kernels, each a loop nest whose innermost loop
is a matmul over ``block_d`` chunks of ``d_model`` (so no block ever holds a whole ``D``-wide
row, which would not fit on chip at D = 8192):

* forward, one program per ``block_n`` tokens: for every vocabulary tile, logits
  ``z = h @ W[:, tile]`` (``[block_n, block_v]`` float32, on chip only), folded into an online
  log-sum-exp ``(m, s)``, ``u = sum exp(z - m) z`` for the entropy, and the target's logit.
  Writes logp, entropy and lse (``[N]`` each): nothing of size ``N*V`` ever reaches memory.
* backward for dh, one program per ``block_n`` tokens: recompute each tile's ``z``, form
  ``gz = g_logp (onehot - p) - g_ent p (z - mu)``, and add ``gz @ W[:, tile].T`` into its own
  rows of a float32 dh.
* backward for dW, one program per vocabulary tile: loop over token blocks, recompute ``z``
  and ``gz``, add ``h.T @ gz`` into its own columns of a float32 dW.  It is launched once per
  ``vocab_chunk`` columns (a scan), so the float32 accumulator is ``[D, vocab_chunk]``, and
  each chunk is stored into dW in W's dtype.

Each program owns the rows (or columns) it writes, so there are no atomics and the result is
deterministic; the price is one extra recompute of the logits (4 matmul-equivalents instead of
the minimal 3) and float32 read-modify-writes of the accumulators; see ``kernels/NOTES.md``.
Ragged tails (N, V or D not multiples of the blocks) are handled with masked loads and stores,
so nothing is padded or copied.  ``interpret=True`` runs the same kernels on any backend.
With ``softcap`` (Gemma 2's final soft-capping) every tile's logits are ``c * tanh(z / c)``
and the backward kernels multiply their logit gradient by ``1 - (capped / c)^2``.
Under a device mesh each kernel runs on every device's shard (``kernels/_sharding.py``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels._backend import cdiv, dot, triton_params
from kernels._sharding import per_shard
from kernels.logprob.xla import backward_blockwise


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes (powers of two, each >= 16 for ``tl.dot``) and Triton launch settings."""

  block_n: int = 64
  block_v: int = 128
  block_d: int = 64
  num_warps: int = 4
  num_stages: int = 3
  # Vocabulary columns per dW launch: bounds the float32 dW accumulator to [D, vocab_chunk].
  vocab_chunk: int = 16384


def _params(bs: BlockSizes):
  return triton_params(bs.num_warps, bs.num_stages)


def _logits_tile(h_ref, w_ref, row0, row_ok, col0, col_ok, *, d, bs, cdt):
  """``h[rows] @ W[:, cols]`` as a float32 ``[block_n, block_v]`` tile, over d-chunks."""
  bn, bv, bd = bs.block_n, bs.block_v, bs.block_d

  def body(k, acc):
    d_ok = k * bd + jnp.arange(bd) < d
    h = plgpu.load(h_ref.at[pl.ds(row0, bn), pl.ds(k * bd, bd)],
                   mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    w = plgpu.load(w_ref.at[pl.ds(k * bd, bd), pl.ds(col0, bv)],
                   mask=d_ok[:, None] & col_ok[None, :], other=0.0)
    return acc + dot(h.astype(cdt), w.astype(cdt))

  return jax.lax.fori_loop(0, cdiv(d, bd), body, jnp.zeros((bn, bv), jnp.float32))


def _cap(z, softcap):
  return z if softcap is None else jnp.tanh(z / softcap) * softcap


def _grad_logits(z, cols, tgt, lse, mu, g_logp, g_ent, softcap=None):
  """dL/dz for one tile; zero on masked columns (z = -inf) and on masked rows (g = 0).  With
  ``softcap``, ``z`` is the capped logits and the gradient is taken through the cap."""
  p = jnp.exp(z - lse[:, None])
  zf = jnp.where(z > -jnp.inf, z, 0.0)
  onehot = (cols[None, :] == tgt[:, None]).astype(jnp.float32)
  gz = g_logp[:, None] * (onehot - p) - g_ent[:, None] * p * (zf - mu[:, None])
  if softcap is not None:
    gz = gz * (1.0 - jnp.square(zf / softcap))
  return gz


def _fwd_kernel(h_ref, w_ref, t_ref, logp_ref, ent_ref, lse_ref, *, n, d, v, bs, cdt,
                softcap=None):
  bn, bv = bs.block_n, bs.block_v
  row0 = pl.program_id(0) * bn
  row_ok = row0 + jnp.arange(bn) < n
  tgt = plgpu.load(t_ref.at[pl.ds(row0, bn)], mask=row_ok, other=-1)

  def body(j, carry):
    m, s, u, zt = carry
    cols = j * bv + jnp.arange(bv)
    col_ok = cols < v
    z = _logits_tile(h_ref, w_ref, row0, row_ok, j * bv, col_ok, d=d, bs=bs, cdt=cdt)
    z = jnp.where(col_ok[None, :], _cap(z, softcap), -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(z, axis=1))
    rescale = jnp.exp(m - m_new)
    e = jnp.exp(z - m_new[:, None])
    s = s * rescale + jnp.sum(e, axis=1)
    u = u * rescale + jnp.sum(e * jnp.where(col_ok[None, :], z, 0.0), axis=1)
    zt = zt + jnp.sum(jnp.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
    return m_new, s, u, zt

  zeros = jnp.zeros((bn,), jnp.float32)
  m, s, u, zt = jax.lax.fori_loop(0, cdiv(v, bv), body,
                                  (jnp.full((bn,), -jnp.inf, jnp.float32), zeros, zeros, zeros))
  lse = m + jnp.log(s)
  out = pl.ds(row0, bn)
  plgpu.store(logp_ref.at[out], zt - lse, mask=row_ok)
  plgpu.store(ent_ref.at[out], lse - u / s, mask=row_ok)
  plgpu.store(lse_ref.at[out], lse, mask=row_ok)


def _row_stats(refs, row0, row_ok, bn):
  t_ref, lse_ref, mu_ref, gl_ref, ge_ref = refs
  rows = pl.ds(row0, bn)
  return (plgpu.load(t_ref.at[rows], mask=row_ok, other=-1),
          plgpu.load(lse_ref.at[rows], mask=row_ok, other=0.0),
          plgpu.load(mu_ref.at[rows], mask=row_ok, other=0.0),
          plgpu.load(gl_ref.at[rows], mask=row_ok, other=0.0),
          plgpu.load(ge_ref.at[rows], mask=row_ok, other=0.0))


def _dh_kernel(h_ref, w_ref, t_ref, lse_ref, mu_ref, gl_ref, ge_ref, dh_ref, *, n, d, v, bs,
               cdt, softcap=None):
  bn, bv, bd = bs.block_n, bs.block_v, bs.block_d
  row0 = pl.program_id(0) * bn
  row_ok = row0 + jnp.arange(bn) < n
  tgt, lse, mu, g_logp, g_ent = _row_stats((t_ref, lse_ref, mu_ref, gl_ref, ge_ref),
                                           row0, row_ok, bn)

  def v_body(j, carry):
    cols = j * bv + jnp.arange(bv)
    col_ok = cols < v
    z = _logits_tile(h_ref, w_ref, row0, row_ok, j * bv, col_ok, d=d, bs=bs, cdt=cdt)
    z = jnp.where(col_ok[None, :], _cap(z, softcap), -jnp.inf)
    gz = _grad_logits(z, cols, tgt, lse, mu, g_logp, g_ent, softcap).astype(cdt)

    def d_body(k, carry):
      d_ok = k * bd + jnp.arange(bd) < d
      w = plgpu.load(w_ref.at[pl.ds(k * bd, bd), pl.ds(j * bv, bv)],
                     mask=d_ok[:, None] & col_ok[None, :], other=0.0)
      at = dh_ref.at[pl.ds(row0, bn), pl.ds(k * bd, bd)]
      mask = row_ok[:, None] & d_ok[None, :]
      # The first tile writes instead of adding: the output starts uninitialised.
      old = plgpu.load(at, mask=mask & (j > 0), other=0.0)
      plgpu.store(at, old + dot(gz, w.astype(cdt), trans_b=True), mask=mask)
      return carry

    return jax.lax.fori_loop(0, cdiv(d, bd), d_body, carry)

  jax.lax.fori_loop(0, cdiv(v, bv), v_body, 0)


def _dw_kernel(off_ref, h_ref, w_ref, t_ref, lse_ref, mu_ref, gl_ref, ge_ref, dw_ref, *, n, d,
               v, bs, cdt, softcap=None):
  # dw_ref: float32 [D, vc], the columns off .. off+vc of dW (one vocabulary chunk).
  bn, bv, bd = bs.block_n, bs.block_v, bs.block_d
  # program_id only at the top level: the interpreter does not substitute it inside loops.
  local0 = pl.program_id(0) * bv
  col_ok = local0 + jnp.arange(bv) < dw_ref.shape[1]
  col0 = off_ref[0] + local0
  cols = col0 + jnp.arange(bv)

  def n_body(i, carry):
    row0 = i * bn
    row_ok = row0 + jnp.arange(bn) < n
    tgt, lse, mu, g_logp, g_ent = _row_stats((t_ref, lse_ref, mu_ref, gl_ref, ge_ref),
                                             row0, row_ok, bn)
    z = _logits_tile(h_ref, w_ref, row0, row_ok, col0, col_ok, d=d, bs=bs, cdt=cdt)
    z = jnp.where(col_ok[None, :], _cap(z, softcap), -jnp.inf)
    gz = _grad_logits(z, cols, tgt, lse, mu, g_logp, g_ent, softcap).astype(cdt)

    def d_body(k, carry):
      d_ok = k * bd + jnp.arange(bd) < d
      h = plgpu.load(h_ref.at[pl.ds(row0, bn), pl.ds(k * bd, bd)],
                     mask=row_ok[:, None] & d_ok[None, :], other=0.0)
      at = dw_ref.at[pl.ds(k * bd, bd), pl.ds(local0, bv)]
      mask = d_ok[:, None] & col_ok[None, :]
      old = plgpu.load(at, mask=mask & (i > 0), other=0.0)
      plgpu.store(at, old + dot(h.astype(cdt), gz, trans_a=True), mask=mask)
      return carry

    return jax.lax.fori_loop(0, cdiv(d, bd), d_body, carry)

  jax.lax.fori_loop(0, cdiv(n, bn), n_body, 0)


def _check(bs: BlockSizes):
  for name in ("block_n", "block_v", "block_d"):
    size = getattr(bs, name)
    if size < 16 or size & (size - 1):
      raise ValueError(f"logprob BlockSizes.{name}={size}: must be a power of two >= 16")


def _statics(h_ND, w_DV, bs, softcap=None):
  n, d = h_ND.shape
  st = dict(n=n, d=d, v=w_DV.shape[1], bs=bs, cdt=jnp.promote_types(h_ND.dtype, w_DV.dtype))
  if softcap is not None:
    st["softcap"] = softcap
  return st


def _forward_local(h_ND, w_DV, t_N, *, bs, interpret, softcap=None):
  st = _statics(h_ND, w_DV, bs, softcap)
  f32 = jax.ShapeDtypeStruct((st["n"],), jnp.float32)
  return pl.pallas_call(
      functools.partial(_fwd_kernel, **st),
      grid=(cdiv(st["n"], bs.block_n),),
      out_shape=(f32, f32, f32),
      compiler_params=_params(bs),
      interpret=interpret,
      name="logprob_entropy_fwd",
  )(h_ND, w_DV, t_N)


def _dh_local(h_ND, w_DV, t_N, lse, mu, g_logp, g_ent, *, bs, interpret, softcap=None):
  st = _statics(h_ND, w_DV, bs, softcap)
  return pl.pallas_call(
      functools.partial(_dh_kernel, **st),
      grid=(cdiv(st["n"], bs.block_n),),
      out_shape=jax.ShapeDtypeStruct(h_ND.shape, jnp.float32),
      compiler_params=_params(bs),
      interpret=interpret,
      name="logprob_entropy_bwd_dh",
  )(h_ND, w_DV, t_N, lse, mu, g_logp, g_ent).astype(h_ND.dtype)


def _dw_local(h_ND, w_DV, t_N, lse, mu, g_logp, g_ent, *, bs, interpret, softcap=None):
  # dW one vocabulary chunk at a time: the float32 accumulator is [D, vocab_chunk], not
  # [D, V], and each finished chunk is stored in W's dtype.  Each column's gradient is whole
  # within one call (the sum over tokens is inside it), so the last chunk may be shifted back
  # to end at V and simply rewrite the columns it shares with the previous one.
  st = _statics(h_ND, w_DV, bs, softcap)
  vc = min(bs.vocab_chunk, st["v"])
  dw_chunk = pl.pallas_call(
      functools.partial(_dw_kernel, **st),
      grid=(cdiv(vc, bs.block_v),),
      out_shape=jax.ShapeDtypeStruct((st["d"], vc), jnp.float32),
      compiler_params=_params(bs),
      interpret=interpret,
      name="logprob_entropy_bwd_dw",
  )

  def chunk(dw, c):
    start = jnp.minimum(c * vc, st["v"] - vc)
    part = dw_chunk(jnp.reshape(start, (1,)).astype(jnp.int32), h_ND, w_DV, t_N, lse, mu,
                    g_logp, g_ent)
    return jax.lax.dynamic_update_slice_in_dim(dw, part.astype(dw.dtype), start, axis=1), None

  dw, _ = jax.lax.scan(chunk, jnp.zeros(w_DV.shape, w_DV.dtype), jnp.arange(cdiv(st["v"], vc)))
  return dw


@functools.lru_cache(maxsize=None)
def _ops(bs, interpret, softcap=None):
  """The kernels as per-shard ops (tokens stay sharded; W is needed whole), built once per
  static configuration.  dW sums over tokens, so it is also summed across token shards."""
  kw = dict(bs=bs, interpret=interpret)
  if softcap is not None:
    kw["softcap"] = softcap
  grads_in = "n d, d v, n, n, n, n, n"
  return (per_shard(functools.partial(_forward_local, **kw), "n d, d v, n -> n, n, n",
                    replicated=("d", "v")),
          per_shard(functools.partial(_dh_local, **kw), grads_in + " -> n d",
                    replicated=("d", "v")),
          per_shard(functools.partial(_dw_local, **kw), grads_in + " -> d v",
                    replicated=("d", "v"), reduced="n"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fused(h_ND, w_DV, t_N, bs, interpret, backward, softcap):
  logp, ent, _ = _ops(bs, interpret, softcap)[0](h_ND, w_DV, t_N)
  return logp, ent


def _fused_fwd(h_ND, w_DV, t_N, bs, interpret, backward, softcap):
  logp, ent, lse = _ops(bs, interpret, softcap)[0](h_ND, w_DV, t_N)
  return (logp, ent), (h_ND, w_DV, t_N, lse, ent)


def _fused_bwd(bs, interpret, backward, softcap, res, grads):
  if backward == "xla":  # same residuals; recomputes tiles in XLA with cuBLAS matmuls
    if softcap is None:
      return backward_blockwise(min(bs.vocab_chunk, res[1].shape[1]), res, grads)
    return backward_blockwise(min(bs.vocab_chunk, res[1].shape[1]), res, grads, softcap)
  h_ND, w_DV, t_N, lse, ent = res
  g_logp, g_ent = (g.astype(jnp.float32) for g in grads)
  _, dh_op, dw_op = _ops(bs, interpret, softcap)
  args = (h_ND, w_DV, t_N, lse, lse - ent, g_logp, g_ent)
  return dh_op(*args), dw_op(*args), None


_fused.defvjp(_fused_fwd, _fused_bwd)


def logprob_entropy_pallas(h_BTD, w_DV, targets_BT, *, block_sizes: BlockSizes = BlockSizes(),
                           interpret: bool = False, backward: str = "pallas", softcap=None):
  """(log p(target) [B,T], entropy [B,T]) in float32 from the fused Pallas kernels; with
  ``softcap``, of the soft-capped logits.

  ``backward="pallas"`` differentiates with the two backward kernels; ``"xla"`` with the
  blockwise XLA backward over ``vocab_chunk``-wide tiles (same residuals), for comparison on
  a GPU: see kernels/NOTES.md.
  """
  _check(block_sizes)
  if backward not in ("pallas", "xla"):
    raise ValueError(f"logprob backward={backward!r}: choose 'pallas' or 'xla'")
  b, t, d = h_BTD.shape
  logp, ent = _fused(h_BTD.reshape(b * t, d), w_DV,
                     targets_BT.reshape(b * t).astype(jnp.int32), block_sizes, interpret,
                     backward, softcap)
  return logp.reshape(b, t), ent.reshape(b, t)
