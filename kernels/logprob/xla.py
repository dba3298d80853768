"""Blockwise log-prob + entropy in plain XLA, with a recomputing backward pass.

Forward: a scan over vocabulary tiles keeps, per token, the running max ``m``, the sum
``s = sum exp(z - m)``, ``u = sum exp(z - m) * z`` and the target logit; then
``lse = m + log s`` and ``entropy = lse - u / s``.
Backward (``custom_vjp``): the tiles are recomputed, so no residual of size ``B*T*V`` is kept:
with ``p = softmax(z)`` and ``mu = lse - entropy = E_p[z]``,
``dlogp/dz = onehot(target) - p`` and ``dentropy/dz = -p * (z - mu)``.

Memory: peak temporaries are O(N * block_v) plus an O(N * D) float32 accumulator for dh.  The
unembedding is never copied or padded: tiles are ``dynamic_slice``s of it, and the last tile,
when the vocabulary is not a multiple of ``block_v``, is shifted back to end at ``V`` with the
columns it shares with the previous tile masked.  Each column of dW is produced whole by one
tile (the sum over tokens is inside the matmul), so dW is written in place in W's own dtype.

With ``softcap`` the logits are ``c * tanh(z / c)`` (Gemma 2); the backward multiplies the
logit gradient by ``1 - tanh(z / c) ** 2``, read from the capped logits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels.numerics import fixed_order_sum


def _tile(w_DV, j, block_v):
  """Tile ``j`` of the vocabulary (of ``w_DV``, or of any ``[N, V]`` array): (w_DC, ids_C,
  fresh_C, start)."""
  v = w_DV.shape[1]
  start = jnp.minimum(j * block_v, v - block_v)
  ids = start + jnp.arange(block_v)
  # Only the last tile can be shifted back; the columns it re-reads belong to tile j-1.
  fresh = ids >= j * block_v
  return jax.lax.dynamic_slice_in_dim(w_DV, start, block_v, axis=1), ids, fresh, start


def _logits(h_ND, w_DC, fresh_C, softcap=None):
  z = jnp.dot(h_ND, w_DC, preferred_element_type=jnp.float32)
  if softcap is not None:
    z = jnp.tanh(z / softcap) * softcap
  return jnp.where(fresh_C[None, :], z, -jnp.inf)


def _forward(h_ND, w_DV, t_N, block_v, softcap=None):
  def tile_logits(j):
    w_DC, ids, fresh, _ = _tile(w_DV, j, block_v)
    return _logits(h_ND, w_DC, fresh, softcap), ids, fresh

  return _scan_tiles(tile_logits, -(-w_DV.shape[1] // block_v), h_ND.shape[0], t_N)


def logprob_from_logits(logits_NV, t_N, *, block_v: int = 8192):
  """``log softmax(logits)[target]`` ``[N]`` from float32 logits already computed, with the
  tile recurrence :func:`logprob_entropy_blockwise` runs: the same bits as it gives for the
  same logits, where ``jax.nn.log_softmax`` sums in another order (a sampler recording the
  log-probs of what it drew matches the trainer's recomputation exactly, docs/rollout.md)."""
  logits_NV = logits_NV.astype(jnp.float32)
  v = logits_NV.shape[1]
  block_v = min(block_v, v)

  def tile_logits(j):
    z_NC, ids, fresh, _ = _tile(logits_NV, j, block_v)
    return jnp.where(fresh[None, :], z_NC, -jnp.inf), ids, fresh

  return _scan_tiles(tile_logits, -(-v // block_v), logits_NV.shape[0],
                     t_N.astype(jnp.int32), entropy=False)[0]


def _scan_tiles(tile_logits, n_tiles, n_tok, t_N, entropy: bool = True):
  """The online log-sum-exp over vocabulary tiles: ``(logp, entropy, lse)``, each ``[N]``;
  ``tile_logits(j)`` gives tile ``j``'s ``(z_NC, ids_C, fresh_C)``.  ``entropy=False`` skips
  the entropy's pass over each tile (the entropy returned is then meaningless); logp and
  lse are the same bits."""

  def body(carry, j):
    m, s, u, zt = carry
    z, ids, fresh = tile_logits(j)
    m_new = jnp.maximum(m, jnp.max(z, axis=-1))
    rescale = jnp.exp(m - m_new)
    e = jnp.exp(z - m_new[:, None])
    s = s * rescale + fixed_order_sum(e)  # one order whatever N (kernels/numerics.py)
    if entropy:
      u = u * rescale + jnp.sum(e * jnp.where(fresh[None, :], z, 0.0), axis=-1)
    zt = zt + jnp.sum(jnp.where((ids[None, :] == t_N[:, None]) & fresh[None, :], z, 0.0), -1)
    return (m_new, s, u, zt), None

  zeros = jnp.zeros((n_tok,), jnp.float32)
  init = (jnp.full((n_tok,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
  (m, s, u, zt), _ = jax.lax.scan(body, init, jnp.arange(n_tiles))
  lse = m + jnp.log(s)
  return zt - lse, lse - u / s, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _logprob_entropy_flat(h_ND, w_DV, t_N, block_v, softcap):
  logp, ent, _ = _forward(h_ND, w_DV, t_N, block_v, softcap)
  return logp, ent


def _fwd(h_ND, w_DV, t_N, block_v, softcap):
  logp, ent, lse = _forward(h_ND, w_DV, t_N, block_v, softcap)
  return (logp, ent), (h_ND, w_DV, t_N, lse, ent)


def _backward(block_v, softcap, res, grads):
  return backward_blockwise(block_v, res, grads, softcap)


def backward_blockwise(block_v, res, grads, softcap=None):
  """The backward pass from the residuals (h, W, targets, lse, entropy), blockwise over the
  vocabulary; shared with the Pallas forward (`kernels.logprob.pallas`, backward="xla")."""
  h_ND, w_DV, t_N, lse, ent = res
  g_logp, g_ent = (g.astype(jnp.float32) for g in grads)
  n_tiles = -(-w_DV.shape[1] // block_v)
  mu = lse - ent

  def body(carry, j):
    dh, dw = carry
    w_DC, ids, fresh, start = _tile(w_DV, j, block_v)
    z = _logits(h_ND, w_DC, fresh, softcap)
    p = jnp.exp(z - lse[:, None])  # zero on masked columns
    zf = jnp.where(fresh[None, :], z, 0.0)
    onehot = ((t_N[:, None] == ids[None, :]) & fresh[None, :]).astype(jnp.float32)
    gz = g_logp[:, None] * (onehot - p) - g_ent[:, None] * p * (zf - mu[:, None])
    if softcap is not None:  # through the cap: d(c tanh(x/c))/dx = 1 - (capped / c)^2
      gz = gz * (1.0 - jnp.square(zf / softcap))
    dh = dh + jnp.dot(gz.astype(w_DC.dtype), w_DC.T, preferred_element_type=jnp.float32)
    dw_DC = jnp.dot(h_ND.T, gz.astype(h_ND.dtype), preferred_element_type=jnp.float32)
    old = jax.lax.dynamic_slice_in_dim(dw, start, block_v, axis=1)
    dw_DC = jnp.where(fresh[None, :], dw_DC.astype(dw.dtype), old)
    return (dh, jax.lax.dynamic_update_slice_in_dim(dw, dw_DC, start, axis=1)), None

  init = (jnp.zeros(h_ND.shape, jnp.float32), jnp.zeros(w_DV.shape, w_DV.dtype))
  (dh, dw), _ = jax.lax.scan(body, init, jnp.arange(n_tiles))
  return dh.astype(h_ND.dtype), dw, None


_logprob_entropy_flat.defvjp(_fwd, _backward)


def logprob_entropy_blockwise(h_BTD, w_DV, targets_BT, *, block_v: int = 8192, softcap=None):
  """(log p(target) [B,T], entropy [B,T]) in float32, blockwise over the vocabulary; with
  ``softcap``, of the soft-capped logits."""
  b, t, d = h_BTD.shape
  block_v = min(block_v, w_DV.shape[1])
  logp, ent = _logprob_entropy_flat(h_BTD.reshape(b * t, d), w_DV,
                                    targets_BT.reshape(b * t).astype(jnp.int32), block_v,
                                    softcap)
  return logp.reshape(b, t), ent.reshape(b, t)
