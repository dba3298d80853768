"""Training and prefill attention on TPU: jax's own splash attention (Mosaic kernels forward and
backward, ``jax.experimental.pallas.ops.tpu.splash_attention``), adapted to our contract.

Our flash kernels are written for Triton (masked loads at any offset, grouped-head blocks that
break Mosaic's (8, 128) rule on the last two block dimensions); splash is the TPU kernel
MaxText trains with, and it has what the models use: GQA (query heads grouped over KV heads),
logit soft-capping, a sliding window (a static ``LocalMask``) and segment ids, with block
skipping from a static causal / local mask.  What maps how:

* causal by slot with a static ``q_offset``: ``CausalMask(offset=q_offset)``; a sliding window
  (a static int) is ``LocalMask(window_size=(window - 1, 0))``.
* the key mask (padding) and packing are both segment ids: a key slot's id is its segment
  (1 without packing) where ``kv_mask`` holds and 0 where it does not; a query's id is the one
  at its own slot, so a real query never sees a padding key, and a left-pad query sees at
  least itself (its row is unspecified, as on every path).
* ``scale`` is folded into q (splash has none); soft-capping applies to the scaled logits, as in
  the reference.
* sequences are padded to a multiple of 128 (splash's blocks and its segment-id tiles are
  multiples of 128 lanes) with id-0 keys and queries, sliced off after.

What it does not take, and so the dispatcher keeps on the XLA path (``fits``): a traced
``q_offset`` (the KV-cache prefill: the mask must be static to skip blocks), a traced window
(the interleaved sliding layers of a scanned stack pass it as data), and query blocks of at
most ``DECODE_MAX_T`` tokens (decode: see ``kernels/NOTES.md``).

Batch is a ``vmap`` of the per-sequence kernel.  Under a device mesh it runs per shard
(``kernels/_sharding.py``'s ``per_shard_manual``, a ``shard_map``: ``custom_partitioning``
does not compile on TPU), batch and KV heads split, sequence and head_dim whole; splash's own
``custom_vjp`` differentiates it (the backward is its dQ and dK/dV kernels).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as sa

from kernels._sharding import per_shard_manual
from kernels.attention.flash import check_shapes

_LANES = 128


def fits(q_offset, window) -> str | None:
  """Why splash cannot take this call (a sentence), or None when it can."""
  if not isinstance(q_offset, (int, np.integer)):
    return "a traced q_offset (KV-cache prefill): splash's mask is static"
  if window is not None and not isinstance(window, (int, np.integer)):
    return "a traced sliding window: splash's LocalMask is static"
  return None


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _block(n: int, largest: int = 512) -> int:
  """The largest of 512, 256, 128 dividing ``n`` (a multiple of 128)."""
  for b in (largest, 256, 128):
    if n % b == 0:
      return b
  raise AssertionError(n)


def _kernel(heads: int, t: int, s: int, q_offset: int, window, softcap, interpret: bool):
  """The splash kernel for one sequence of ``heads`` query heads, ``t`` queries (padded) over
  ``s`` keys (padded).  Built in every trace: it holds its mask tables as arrays of that
  trace (splash caches the numpy work of processing a mask itself)."""
  if window is None:
    mask = sa.CausalMask((t, s), offset=q_offset)
  else:
    mask = sa.LocalMask((t, s), window_size=(window - 1, 0), offset=q_offset)
  bq, bkv = _block(t), _block(s)
  blocks = sa.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                         block_kv_dkv=bkv, block_kv_dkv_compute=bkv, block_q_dq=bq,
                         block_kv_dq=bkv)
  return sa.make_splash_mha(sa.MultiHeadMask([mask] * heads), block_sizes=blocks,
                            attn_logits_soft_cap=softcap, head_shards=1, q_seq_shards=1,
                            interpret=interpret)


def _local(q_BKGTD, k_BKSD, v_BKSD, qseg_BT, kvseg_BS, *, q_offset, window, softcap, interpret):
  """One shard: the padded, head-major operands through the vmapped kernel."""
  b, kh, g, t, d = q_BKGTD.shape
  kernel = _kernel(kh * g, t, k_BKSD.shape[2], q_offset, window, softcap, interpret)
  run = jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=sa.SegmentIds(q=qs, kv=ks)))
  return run(q_BKGTD.reshape(b, kh * g, t, d), k_BKSD, v_BKSD, qseg_BT, kvseg_BS).reshape(
      q_BKGTD.shape)


@functools.lru_cache(maxsize=None)
def _op(q_offset, window, softcap, interpret):
  local = functools.partial(_local, q_offset=q_offset, window=window, softcap=softcap,
                            interpret=interpret)
  return per_shard_manual(local,
                          "b k g t d, b k s d, b k s d, b t, b s -> b k g t d",
                          replicated=("g", "t", "s", "d"))


def splash_attention(q_BTHD, k_BSKD, v_BSKD, kv_mask_BS, q_offset: int = 0, *,
                     kv_layout: str = "bskd", scale=None, window=None, softcap=None,
                     segment_ids=None, interpret: bool = False):
  """Causal GQA attention on splash's TPU kernels, the contract of
  :func:`kernels.attention.reference.attention_reference` (``kv_layout``, ``scale``, ``window``,
  ``softcap``, ``segment_ids`` as there); ``q_offset`` and ``window`` static (:func:`fits`).
  Rows with no visible key are unspecified."""
  why = fits(q_offset, window)
  if why is not None:
    raise ValueError(f"splash attention cannot take {why}; use the XLA path")
  if kv_layout == "bskd":
    k_BKSD, v_BKSD = k_BSKD.transpose(0, 2, 1, 3), v_BSKD.transpose(0, 2, 1, 3)
  else:
    k_BKSD, v_BKSD = k_BSKD, v_BSKD
  b, t, h, d = q_BTHD.shape
  kh, s = k_BKSD.shape[1], k_BKSD.shape[2]
  check_shapes(q_BTHD, k_BKSD.transpose(0, 2, 1, 3), v_BKSD.transpose(0, 2, 1, 3), kv_mask_BS)
  q_offset = int(q_offset)
  scale = d ** -0.5 if scale is None else scale
  kv_seg = kv_mask_BS.astype(jnp.int32)
  if segment_ids is not None:
    kv_seg = jnp.where(kv_mask_BS.astype(bool), segment_ids.astype(jnp.int32), 0)
  q_seg = jax.lax.slice_in_dim(kv_seg, q_offset, q_offset + t, axis=1)
  tp, sp = _round_up(t, _LANES), _round_up(s, _LANES)
  q = (q_BTHD.astype(jnp.float32) * scale).astype(q_BTHD.dtype)
  q = q.reshape(b, t, kh, h // kh, d).transpose(0, 2, 3, 1, 4)  # b k g t d
  if tp != t:
    q = jnp.pad(q, [(0, 0)] * 3 + [(0, tp - t), (0, 0)])
    q_seg = jnp.pad(q_seg, [(0, 0), (0, tp - t)])
  if sp != s:
    k_BKSD, v_BKSD = (jnp.pad(x, [(0, 0), (0, 0), (0, sp - s), (0, 0)]) for x in (k_BKSD, v_BKSD))
    kv_seg = jnp.pad(kv_seg, [(0, 0), (0, sp - s)])
  out = _op(q_offset, None if window is None else int(window), softcap, interpret)(
      q, k_BKSD, v_BKSD, q_seg, kv_seg)
  return out[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
