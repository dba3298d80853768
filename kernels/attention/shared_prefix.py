"""Decode attention with a group-shared prefix (the cascade idea): the ``n`` samples of a prompt
read the prompt's keys and values once, as one batched matmul of their ``n`` queries, and
their own response slots apart; the two parts meet in one softmax (a shared maximum and one
denominator), so the result is attention over the prompt's slots followed by the response's,
to float rounding.

Two paths (``impl``, as :func:`kernels.attention.paged.paged_attention`'s): the XLA one, every
platform, and on GPU targets a decode step (``T <= DECODE_MAX_T``, no window; per-row
positions: ``T = 1``) on the Pallas decode kernel (:mod:`kernels.attention.decode`): the
prompt part as one call whose "tokens" are a group's ``n x T`` queries against its prompt
(each prompt read once per group, its scores never leaving the chip), the own part as a
second call over the rows' own slots, the two merged by their log-sum-exps.  TPU targets and
windowed layers take the XLA path."""

import jax.numpy as jnp

from kernels._backend import resolve_impl, target_platform
from kernels.attention.decode import decode_attention_lse
from kernels.attention.dispatch import DECODE_MAX_T
from kernels.attention.paged import AUTO, IMPLS, row_slots
from kernels.attention.reference import _MASKED, allowed_mask, softcap_logits


def shared_prefix_attention(q_BTHD, pk_GKPD, pv_GKPD, pmask_GP, k_BKSD, v_BKSD, kv_mask_BS,
                            q_offset, *, scale=None, window=None, softcap=None,
                            impl: str = "auto"):
  """Causal GQA attention of ``B = G * n`` rows (prompt-major: rows ``g*n .. g*n + n - 1``
  are prompt ``g``'s samples) over their prompt's slots, then their own.

  q_BTHD: queries at response slots ``q_offset .. q_offset + T - 1`` (cache slots ``P +``
  those); pk/pv_GKPD: each prompt's keys/values ``[G, K, P, D]``, written once per group;
  pmask_GP: which prompt slots hold real tokens; k/v_BKSD: each row's response slots
  ``[B, K, S, D]``; kv_mask_BS: which of them hold real tokens.  ``scale``, ``window``
  (counted in cache slots, the prompt's included) and ``softcap`` as in
  :func:`kernels.attention.reference.attention_reference`.  Softmax in float32; output in the
  dtype of ``q``.  ``impl``: see the module doc (a query that sees no key: the XLA path gives
  the mean of its values, the Pallas path 0).
  """
  interpret = _pallas(impl, q_BTHD.shape[1], window, DECODE_MAX_T)
  if interpret is not None:
    own = decode_attention_lse(q_BTHD, k_BKSD, v_BKSD, kv_mask_BS, q_offset, kv_layout="bksd",
                               interpret=interpret, scale=scale, softcap=softcap)
    return _merge_parts(_prefix_part(q_BTHD, pk_GKPD, pv_GKPD, pmask_GP, interpret, scale,
                                     softcap), own, q_BTHD.dtype)
  p_len = pk_GKPD.shape[2]
  s_pre, s_own = _scores(q_BTHD, pk_GKPD, k_BKSD, "bksd", scale, softcap)
  seen = pmask_GP.astype(bool)[:, None, None, None, None, :]  # [G, 1, 1, 1, 1, P]
  if window is not None:  # query slot P + q_offset + t sees slots above it minus the window
    q_slot = p_len + q_offset + jnp.arange(q_BTHD.shape[1])
    seen = seen & (jnp.arange(p_len)[None, :] > q_slot[:, None] - window)  # [.., T, P]
  s_pre = jnp.where(seen, s_pre, _MASKED)
  own = allowed_mask(q_BTHD.shape[1], kv_mask_BS, q_offset, window)  # [B, T, S]
  s_own = jnp.where(own[None, :, None], s_own, _MASKED)
  return _merge(s_pre, s_own, pv_GKPD, v_BKSD, "bksd", q_BTHD.dtype)


def _pallas(impl: str, t: int, window, max_t: int):
  """Whether the call runs on the Pallas decode kernel: None (the XLA path), or the kernel's
  ``interpret`` flag."""
  impl = resolve_impl("attention", impl, IMPLS, AUTO)
  if impl not in ("pallas", "pallas_interpret") or window is not None or t > max_t:
    return None
  if impl == "pallas" and target_platform() == "tpu":  # the decode kernel is Triton's
    return None
  return impl == "pallas_interpret"


def _prefix_part(q_BTHD, pk_GKPD, pv_GKPD, pmask_GP, interpret, scale, softcap):
  """Attention over each group's prompt alone, on the decode kernel: a group's ``n`` rows'
  ``T`` queries are one sequence's ``n * T`` tokens, all after the prompt (offset ``P``), so
  the kernel reads the prompt once per group (per KV head and key split).  The output
  (float32) and its log-sum-exp, ``[B, T, H, D]`` and ``[B, T, H]``."""
  b, t, h, d = q_BTHD.shape
  g_count, _, p_len, _ = pk_GKPD.shape
  o, lse = decode_attention_lse(q_BTHD.reshape(g_count, b // g_count * t, h, d), pk_GKPD,
                                pv_GKPD, pmask_GP, p_len, kv_layout="bksd",
                                interpret=interpret, scale=scale, softcap=softcap)
  return o.reshape(b, t, h, d), lse.reshape(b, t, h)


def _merge_parts(part_a, part_b, dtype):
  """Attention over two disjoint sets of keys from each set's (output, log-sum-exp): the
  outputs weighted by their share of the one softmax's denominator."""
  (o_a, lse_a), (o_b, lse_b) = part_a, part_b
  m = jnp.maximum(lse_a, lse_b)
  w_a, w_b = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
  out = (o_a * w_a[..., None] + o_b * w_b[..., None]) / (w_a + w_b)[..., None]
  return out.astype(dtype)


def _scores(q_BTHD, pk_GKPD, k_own, own_spec: str, scale, softcap):
  """The scaled (soft-capped) scores of both parts: the prompt's ``[G, K, q, n, T, P]``, one
  batched matmul of a group's ``n x T`` queries against its prompt (the prompt read once per
  group), and each row's own ``[K, B, q, T, S]`` (``own_spec``: the own keys' layout,
  ``"bksd"`` or ``"kbsd"``)."""
  b, t, h, d = q_BTHD.shape
  g_count, k_heads = pk_GKPD.shape[:2]
  n, gq = b // g_count, h // k_heads
  scale = d ** -0.5 if scale is None else scale
  q = q_BTHD.astype(pk_GKPD.dtype)
  s_pre = jnp.einsum("gntkqd,gkpd->gkqntp", q.reshape(g_count, n, t, k_heads, gq, d), pk_GKPD,
                     preferred_element_type=jnp.float32) * scale
  s_own = jnp.einsum(f"btkqd,{own_spec}->kbqts", q.reshape(b, t, k_heads, gq, d),
                     k_own.astype(q.dtype), preferred_element_type=jnp.float32) * scale
  if softcap is not None:
    s_pre, s_own = softcap_logits(s_pre, softcap), softcap_logits(s_own, softcap)
  return s_pre, s_own


def _merge(s_pre, s_own, pv_GKPD, v_own, own_spec: str, dtype):
  """Attention over both parts from their masked scores (:func:`_scores`): one softmax, the
  row maximum of either part and one denominator; the prompt part's reductions stay in the
  group layout, only their ``[.., T]`` results move.  ``[B, T, H, D]`` in ``dtype``."""
  g_count, k_heads, gq, n, t, _ = s_pre.shape
  b, d = g_count * n, pv_GKPD.shape[-1]
  kb = lambda x: x.transpose(1, 0, 3, 2, 4).reshape(k_heads, b, gq, t)  # noqa: E731
  m = jnp.maximum(kb(jnp.max(s_pre, axis=-1)), jnp.max(s_own, axis=-1))  # [K, B, q, T]
  m_g = m.reshape(k_heads, g_count, n, gq, t).transpose(1, 0, 3, 2, 4)[..., None]
  e_pre = jnp.exp(s_pre - m_g)
  e_own = jnp.exp(s_own - m[..., None])
  denom = kb(jnp.sum(e_pre, axis=-1)) + jnp.sum(e_own, axis=-1)  # [K, B, q, T]
  o_pre = jnp.einsum("gkqntp,gkpd->kgntqd", e_pre.astype(pv_GKPD.dtype), pv_GKPD,
                     preferred_element_type=jnp.float32).reshape(k_heads, b, t, gq, d)
  o_own = jnp.einsum(f"kbqts,{own_spec}->kbtqd", e_own.astype(v_own.dtype), v_own,
                     preferred_element_type=jnp.float32)
  out = (o_pre + o_own) / denom.transpose(0, 1, 3, 2)[..., None]  # [K, B, T, q, D]
  return out.transpose(1, 2, 0, 3, 4).reshape(b, t, k_heads * gq, d).astype(dtype)


def shared_prefix_paged_attention(q_BTHD, pk_GKPD, pv_GKPD, pmask_GP, k_pool, v_pool, table_BM,
                                  q_slot_BT, length_B, *, scale=None, window=None,
                                  softcap=None, impl: str = "auto"):
  """:func:`shared_prefix_attention` with per-row positions: each row's own slots live in a
  paged pool (:func:`kernels.attention.paged.paged_attention`'s ``k_pool``/``v_pool``,
  ``table_BM``, ``length_B``), the query ``t`` of row ``b`` at its own slot
  ``q_slot_BT[b, t]``.  A prompt's real tokens lie end to end from its slot 0
  (``pmask_GP`` true on ``[0, plen)``), so a row's token ``s`` is the prompt's ``plen + s``-th
  and a ``window`` counts tokens: the query at own slot ``s`` sees prompt slot ``p`` iff
  ``p > plen + s - window`` and own slot ``s'`` iff ``s' > s - window``.  Both parts meet in
  one softmax, as there.  Softmax in float32; output in the dtype of ``q``.  ``impl``: see
  the module doc; the Pallas path takes a decode step (``T = 1``), the own part reading each
  row's slots ``[0, length)`` up to its query's, and no key block past the longest row's
  length (its pages gathered as the XLA path does, or in place without a table)."""
  b, t = q_BTHD.shape[:2]
  g_count, _, p_len, _ = pk_GKPD.shape
  n = b // g_count
  kp, vp = row_slots(k_pool, v_pool, table_BM, b)  # [K, B, S, D]: no transpose of the pool
  interpret = _pallas(impl, t, window, 1)
  if interpret is not None:
    o_slot = jnp.arange(kp.shape[2])
    own_mask = (o_slot < length_B[:, None]) & (o_slot <= q_slot_BT[:, :1])  # [B, S]
    # The offset is the longest row's last slot: the kernel reads the key blocks up to it and
    # no further (the rows' own slots past every length are never read); the mask above
    # bounds each row.
    own = decode_attention_lse(q_BTHD, kp, vp, own_mask, jnp.max(length_B) - 1,
                               kv_layout="kbsd", interpret=interpret, scale=scale,
                               softcap=softcap)
    return _merge_parts(_prefix_part(q_BTHD, pk_GKPD, pv_GKPD, pmask_GP, interpret, scale,
                                     softcap), own, q_BTHD.dtype)
  s_pre, s_own = _scores(q_BTHD, pk_GKPD, kp, "kbsd", scale, softcap)
  plen_G = jnp.sum(pmask_GP, axis=1, dtype=jnp.int32)
  p_slot = jnp.arange(p_len)
  seen = pmask_GP.astype(bool)[:, None, None, :]  # [G, 1, 1, P]
  if window is not None:  # the query's token index plen + s
    tok_GnT = plen_G[:, None, None] + q_slot_BT.reshape(g_count, n, t)
    seen = seen & (p_slot > tok_GnT[..., None] - window)  # [G, n, T, P]
  s_pre = jnp.where(seen[:, None, None], s_pre, _MASKED)
  o_slot = jnp.arange(kp.shape[2])
  q_slot = q_slot_BT[:, :, None]
  own = (o_slot < length_B[:, None, None]) & (o_slot <= q_slot)  # [B, T, S]
  if window is not None:
    own = own & (o_slot > q_slot - window)
  s_own = jnp.where(own[None, :, None], s_own, _MASKED)
  return _merge(s_pre, s_own, pv_GKPD, vp, "kbsd", q_BTHD.dtype)
