"""Attention over a paged KV cache: each row's keys and values live in fixed-size pages of a
shared pool, listed in order by the row's page table.  XLA path (a gather of the row's pages,
then the reference's arithmetic), every platform.

Slots are *logical*: slot ``s`` of a row is entry ``s % page`` of page ``table[s // page]``,
and a row's slots ``[0, length)`` hold its real tokens laid end to end (no padding, no holes).
So a query needs no key mask beyond its row's length and the causal bound by its own slot."""

import functools

import jax
import jax.numpy as jnp

from kernels._backend import resolve_impl, target_platform
from kernels._sharding import per_shard
from kernels.attention.dispatch import DECODE_MAX_T
from kernels.attention.reference import _MASKED, softcap_logits
from kernels.numerics import fixed_order_sum

IMPLS = ("auto", "xla", "pallas", "pallas_interpret", "cudnn")
# What "auto" runs: jax's own Pallas paged-attention kernels on GPU (Triton) and TPU (Mosaic)
# for a decode step (one query a row, no sliding window); the XLA gather path otherwise.
AUTO = {"gpu": "pallas", "tpu": "pallas"}
# Pages one kernel block reads (at most; the largest divisor of a row's page count).
PAGES_PER_BLOCK = 8


def paged_attention(q_BTHD, k_pool, v_pool, table_BM, q_slot_BT, length_B, *, scale=None,
                    window=None, softcap=None, impl: str = "auto"):
  """Causal GQA attention of ``B`` rows' ``T`` queries over their pages.

  q_BTHD: the queries, query ``t`` of row ``b`` at logical slot ``q_slot_BT[b, t]``;
  k_pool/v_pool: ``[K, pages, page, D]``, the pool every row's pages come from, head-major
  (a gather of a row's pages is then already in the ``[K, B, S, D]`` order the matmuls
  batch over: no transpose of the gathered keys); table_BM: each row's page ids in slot
  order (``M`` pages a row at most; an id out of range is clamped: its slots lie past the
  row's length and are never seen; None: row ``b`` holds pages ``b*M .. b*M + M - 1`` in
  order, ``M = pages / B``, read as they lie, without a gather); length_B: slots
  ``[0, length)`` of each row hold keys.
  A query sees slot ``s`` iff ``s < length`` and ``s <= q_slot``, and with a ``window`` iff
  also ``s > q_slot - window``.  ``scale`` and ``softcap`` as in
  :func:`kernels.attention.reference.attention_reference`.  Softmax in float32 (its sum in
  the order :func:`kernels.numerics.fixed_order_sum` fixes by the slot count); output in the
  dtype of ``q``.

  ``impl`` (``kernels.attention``): on GPU and TPU, "auto" and "pallas" run a decode step
  (``T = 1``, no window) on jax's Pallas paged-attention kernel for the platform
  (:func:`paged_decode_pallas`), which reads each row's pages in place; "pallas_interpret"
  runs the GPU kernel in the Pallas interpreter on any backend (tests); "xla" and every
  other call use the gather path below.
  """
  impl = resolve_impl("attention", impl, IMPLS, AUTO)
  if impl in ("pallas", "pallas_interpret") and q_BTHD.shape[1] == 1 and window is None:
    return paged_decode_pallas(q_BTHD, k_pool, v_pool, table_BM, length_B, scale=scale,
                               softcap=softcap, interpret=impl == "pallas_interpret")
  return _paged_xla(q_BTHD, k_pool, v_pool, table_BM, q_slot_BT, length_B, scale=scale,
                    window=window, softcap=softcap)


def _paged_xla(q_BTHD, k_pool, v_pool, table_BM, q_slot_BT, length_B, *, scale, window,
               softcap):
  read = functools.partial(_paged_pages, q_BTHD, k_pool, v_pool, table_BM, q_slot_BT,
                           length_B, scale=scale, window=window, softcap=softcap)
  counts = () if table_BM is None else gathered_pages(table_BM.shape[1])
  if len(counts) < 2 or q_BTHD.shape[1] > DECODE_MAX_T or target_platform() != "cpu":
    return read(None)
  # A decode step gathers each row's pages up to the longest row's length, not all M: the
  # slots past a row's length are never visible.  One of a few static page counts, picked at
  # run time; the same bits as reading all M (the pages left out hold only masked slots,
  # whose probability is an exact 0, and the softmax's sum is fixed_order_sum, which zero
  # lanes at the end do not move).  Only the CPU: there the gather is most of the call (the
  # episodes' decode 1.1-1.2x, the long-tail refill loop 1.2x; benchmarks/NOTES.md, change
  # 15), a GPU's conditional waits on its host every step, and the Pallas kernels read up
  # to the lengths on their own.  (A pool read as it lies has no gather to bound: its slice
  # would be a copy, which cost what it saved.)
  needed = -(-jnp.max(length_B) // k_pool.shape[2])
  index = jnp.sum(jnp.asarray(counts[:-1], jnp.int32) < needed)
  return jax.lax.switch(index, [functools.partial(read, n) for n in counts])


def gathered_pages(m: int) -> tuple[int, ...]:
  """The page counts a decode step on the CPU may gather of a row's ``m``: about a quarter,
  a half, three quarters, and all (few: each is one more compiled copy of the attention in
  every layer)."""
  return tuple(sorted({-(-m * i // 4) for i in (1, 2, 3, 4)}))


def _paged_pages(q_BTHD, k_pool, v_pool, table_BM, q_slot_BT, length_B, pages, *, scale,
                 window, softcap):
  """The attention over each row's first ``pages`` pages (None: all of them)."""
  b, t, h, d = q_BTHD.shape
  k_heads = k_pool.shape[0]
  g = h // k_heads
  scale = d ** -0.5 if scale is None else scale
  kp, vp = row_slots(k_pool, v_pool, table_BM, b, pages)
  q = q_BTHD.reshape(b, t, k_heads, g, d).transpose(2, 0, 1, 3, 4).astype(k_pool.dtype)
  scores = jnp.einsum("kbtgd,kbsd->kbgts", q, kp, preferred_element_type=jnp.float32) * scale
  if softcap is not None:
    scores = softcap_logits(scores, softcap)
  s = jnp.arange(kp.shape[2])
  q_slot = q_slot_BT[:, :, None]
  allowed = (s[None, None, :] < length_B[:, None, None]) & (s[None, None, :] <= q_slot)
  if window is not None:
    allowed = allowed & (s[None, None, :] > q_slot - window)
  scores = jnp.where(allowed[None, :, None], scores, _MASKED)  # [K, B, g, T, S]
  e = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
  probs = e / fixed_order_sum(e, keepdims=True)
  out = jnp.einsum("kbgts,kbsd->kbtgd", probs.astype(v_pool.dtype), vp,
                   preferred_element_type=jnp.float32)
  return out.transpose(1, 2, 0, 3, 4).reshape(b, t, h, d).astype(q_BTHD.dtype)


def row_slots(k_pool, v_pool, table_BM, rows: int, first: int | None = None):
  """Each row's keys and values in slot order, ``[K, B, M * page, D]``: the pool as it lies
  (``table_BM`` None: row ``b`` holds pages ``b*M .. b*M + M - 1``), or gathered through the
  table (ids past the pool clamped: their slots lie past the row's length; ``first``: only
  each row's first pages, that many)."""
  k_heads, pages, page, d = k_pool.shape
  if table_BM is None:
    m = pages // rows
    return tuple(x.reshape(k_heads, rows, m * page, d) for x in (k_pool, v_pool))
  table_BM = table_BM if first is None else table_BM[:, :first]
  m = table_BM.shape[1]
  return tuple(jnp.take(x, table_BM, axis=1, mode="clip").reshape(k_heads, rows, m * page, d)
               for x in (k_pool, v_pool))


def paged_decode_pallas(q_B1HD, k_pool, v_pool, table_BM, length_B, *, scale=None,
                        softcap=None, interpret: bool = False):
  """One decode step over the pages with jax's Pallas paged-attention kernel: Mosaic's
  (``jax.experimental.pallas.ops.tpu.paged_attention``) when the target is a TPU, else
  Triton's (``...ops.gpu.paged_attention``; ``interpret``: in the Pallas interpreter, on any
  backend).  Both take the pool in our layout, ``[K, pages, page, D]``, a page table and
  lengths; the query is pre-scaled (they apply no scale of their own), and the soft-cap is
  theirs.  Each row attends over its slots ``[0, length)``: for a decode step, its own token
  included (written before the call).  Under a mesh each device runs its own rows and KV
  heads (:func:`kernels._sharding.per_shard`), over the whole pool, or with ``table_BM`` None
  (row ``b``'s pages ``b*M ..``, a pool split over the data axes as the rows are:
  ``jaxrlhf.model.paged.constrain_paged``) over its own rows' part of it, in place."""
  b, _, h, d = q_B1HD.shape
  k_heads = k_pool.shape[0]
  scale = d ** -0.5 if scale is None else scale
  q = (q_B1HD.astype(jnp.float32) * scale).astype(k_pool.dtype)
  q = q.reshape(b, k_heads, h // k_heads, d)
  platform = "gpu" if interpret else target_platform()
  op = _paged_op(platform, interpret, softcap, table_BM is None)
  lengths = length_B.astype(jnp.int32)
  if table_BM is None:
    out = op(q, k_pool, v_pool, lengths)
  else:
    out = op(q, k_pool, v_pool, table_BM, lengths)
  return out.reshape(b, 1, h, d).astype(q_B1HD.dtype)


@functools.lru_cache(maxsize=None)
def _paged_op(platform: str, interpret: bool, softcap, own_rows: bool = False):
  local = functools.partial(_paged_local, platform=platform, interpret=interpret,
                            softcap=softcap)
  if own_rows:  # the pool's pages ("r") split as the rows are; the table made per shard
    return per_shard(lambda q, k, v, n: local(q, k, v, _row_major_table(q.shape[0], k), n),
                     "b k g d, k r s d, k r s d, b -> b k g d", replicated=("g", "d", "s"))
  return per_shard(local, "b k g d, k p s d, k p s d, b m, b -> b k g d",
                   replicated=("g", "d", "p", "s", "m"))


def _row_major_table(rows: int, k_pool):
  """Row ``b`` of ``rows`` holds pages ``b*M .. b*M + M - 1`` of ``k_pool``, ``M = pages /
  rows``: the table of a contiguous pool (of one shard's rows, on its part of the pool)."""
  m = k_pool.shape[1] // rows
  return jnp.arange(rows * m, dtype=jnp.int32).reshape(rows, m)


def _pages_per_block(m: int) -> int:
  return max(c for c in range(1, min(PAGES_PER_BLOCK, m) + 1) if m % c == 0)


def _paged_local(q_BKGD, k_pool, v_pool, table_BM, length_B, *, platform, interpret, softcap):
  b, k_heads, g, d = q_BKGD.shape
  q = q_BKGD.reshape(b, k_heads * g, d)
  # Ids past the pool (no page) are clamped: their slots lie past the row's length.
  table = jnp.clip(table_BM, 0, k_pool.shape[1] - 1).astype(jnp.int32)
  per_block = _pages_per_block(table.shape[1])
  if platform == "tpu":
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_op
    o = tpu_op(q, k_pool, v_pool, length_B, table, attn_logits_soft_cap=softcap,
               pages_per_compute_block=per_block)
  else:
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as gpu_op
    o = gpu_op(q, k_pool, v_pool, table, length_B, attn_logits_soft_cap=softcap,
               pages_per_compute_block=per_block, k_splits=1, interpret=interpret)
  return o.reshape(b, k_heads, g, d)
