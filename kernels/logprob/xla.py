"""Blockwise log-prob + entropy in plain XLA, with a recomputing backward pass.

Forward: a scan over vocabulary tiles keeps, per token, the running max ``m``, the sum
``s = sum exp(z - m)`` and ``u = sum exp(z - m) * z``; then ``lse = m + log s`` and
``entropy = lse - u / s``.  The target logit is a dot with the gathered unembedding column.
Backward (``custom_vjp``): the tiles are recomputed, so no residual of size ``B*T*V`` is kept:
with ``p = softmax(z)`` and ``mu = lse - entropy``,
``dlogp/dz = onehot - p`` and ``dentropy/dz = -p * (z - mu)``.
Peak temporary memory is O(B*T*block_v).
"""

import functools

import jax
import jax.numpy as jnp


def _tiles(w_DV, block_v):
  d, v = w_DV.shape
  n = -(-v // block_v)
  pad = n * block_v - v
  w = jnp.pad(w_DV, ((0, 0), (0, pad)))
  return w.reshape(d, n, block_v).transpose(1, 0, 2), n, pad  # [n, D, block_v]


def _tile_logits(h_ND, w_tile_DC, tile_idx, block_v, vocab):
  z = jnp.dot(h_ND, w_tile_DC, preferred_element_type=jnp.float32)
  ids = tile_idx * block_v + jnp.arange(block_v)
  return jnp.where(ids[None, :] < vocab, z, -jnp.inf), ids


def _forward(h_ND, w_DV, t_N, block_v):
  vocab = w_DV.shape[1]
  tiles, n, _ = _tiles(w_DV, block_v)
  n_tok = h_ND.shape[0]

  def body(carry, xs):
    m, s, u = carry
    w_tile, idx = xs
    z, _ = _tile_logits(h_ND, w_tile, idx, block_v, vocab)
    m_new = jnp.maximum(m, jnp.max(z, axis=-1))
    scale = jnp.exp(m - m_new)
    e = jnp.exp(z - m_new[:, None])
    s = s * scale + jnp.sum(e, axis=-1)
    u = u * scale + jnp.sum(e * jnp.where(jnp.isfinite(z), z, 0.0), axis=-1)
    return (m_new, s, u), None

  init = (jnp.full((n_tok,), -jnp.inf, jnp.float32), jnp.zeros((n_tok,), jnp.float32),
          jnp.zeros((n_tok,), jnp.float32))
  (m, s, u), _ = jax.lax.scan(body, init, (tiles, jnp.arange(n)))
  lse = m + jnp.log(s)
  ent = lse - u / s
  w_t = jnp.take(w_DV, t_N, axis=1).T  # [N, D]
  z_t = jnp.sum(h_ND.astype(jnp.float32) * w_t.astype(jnp.float32), axis=-1)
  return z_t - lse, ent, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _logprob_entropy_flat(h_ND, w_DV, t_N, block_v):
  logp, ent, _ = _forward(h_ND, w_DV, t_N, block_v)
  return logp, ent


def _fwd(h_ND, w_DV, t_N, block_v):
  logp, ent, lse = _forward(h_ND, w_DV, t_N, block_v)
  return (logp, ent), (h_ND, w_DV, t_N, lse, ent)


def _bwd(block_v, res, grads):
  h_ND, w_DV, t_N, lse, ent = res
  g_logp, g_ent = grads
  vocab = w_DV.shape[1]
  tiles, n, pad = _tiles(w_DV, block_v)
  mu = lse - ent  # E_p[z]
  g_logp = g_logp.astype(jnp.float32)
  g_ent = g_ent.astype(jnp.float32)

  def body(dh, xs):
    w_tile, idx = xs
    z, ids = _tile_logits(h_ND, w_tile, idx, block_v, vocab)
    p = jnp.exp(z - lse[:, None])  # zero on padded ids
    zf = jnp.where(jnp.isfinite(z), z, 0.0)
    onehot = (t_N[:, None] == ids[None, :]).astype(jnp.float32)
    gz = g_logp[:, None] * (onehot - p) - g_ent[:, None] * p * (zf - mu[:, None])
    dh = dh + jnp.dot(gz, w_tile.T.astype(jnp.float32))
    dw_tile = jnp.dot(h_ND.T.astype(jnp.float32), gz)
    return dh, dw_tile

  dh, dw_tiles = jax.lax.scan(body, jnp.zeros(h_ND.shape, jnp.float32), (tiles, jnp.arange(n)))
  dw = dw_tiles.transpose(1, 0, 2).reshape(w_DV.shape[0], n * block_v)[:, :vocab]
  return dh.astype(h_ND.dtype), dw.astype(w_DV.dtype), None


_logprob_entropy_flat.defvjp(_fwd, _bwd)


def logprob_entropy_blockwise(h_BTD, w_DV, targets_BT, *, block_v: int = 8192):
  """(log p(target) [B,T], entropy [B,T]) in float32, blockwise over the vocabulary."""
  b, t, d = h_BTD.shape
  block_v = min(block_v, w_DV.shape[1])
  logp, ent = _logprob_entropy_flat(h_BTD.reshape(b * t, d), w_DV,
                                    targets_BT.reshape(b * t).astype(jnp.int32), block_v)
  return logp.reshape(b, t), ent.reshape(b, t)
