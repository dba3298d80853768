"""Decode attention with a group-shared prefix (the cascade idea): the ``n`` samples of a prompt
read the prompt's keys and values once, as one batched matmul of their ``n`` queries, and
their own response slots apart; the two parts meet in one softmax (a shared maximum and one
denominator), so the result is attention over the prompt's slots followed by the response's,
to float rounding.  XLA path, every platform."""

import jax.numpy as jnp

from kernels.attention.paged import row_slots
from kernels.attention.reference import _MASKED, allowed_mask, softcap_logits


def shared_prefix_attention(q_BTHD, pk_GKPD, pv_GKPD, pmask_GP, k_BKSD, v_BKSD, kv_mask_BS,
                            q_offset, *, scale=None, window=None, softcap=None):
  """Causal GQA attention of ``B = G * n`` rows (prompt-major: rows ``g*n .. g*n + n - 1``
  are prompt ``g``'s samples) over their prompt's slots, then their own.

  q_BTHD: queries at response slots ``q_offset .. q_offset + T - 1`` (cache slots ``P +``
  those); pk/pv_GKPD: each prompt's keys/values ``[G, K, P, D]``, written once per group;
  pmask_GP: which prompt slots hold real tokens; k/v_BKSD: each row's response slots
  ``[B, K, S, D]``; kv_mask_BS: which of them hold real tokens.  ``scale``, ``window``
  (counted in cache slots, the prompt's included) and ``softcap`` as in
  :func:`kernels.attention.reference.attention_reference`.  Softmax in float32; output in the
  dtype of ``q``.
  """
  b, t, h, d = q_BTHD.shape
  g_count, k_heads, p_len, _ = pk_GKPD.shape
  n, gq = b // g_count, h // k_heads
  scale = d ** -0.5 if scale is None else scale
  q = q_BTHD.astype(pk_GKPD.dtype)
  # The prompt part: a group's n x T queries against its prompt's P slots, one matmul.
  q_g = q.reshape(g_count, n, t, k_heads, gq, d)
  s_pre = jnp.einsum("gntkqd,gkpd->gkqntp", q_g, pk_GKPD,
                     preferred_element_type=jnp.float32) * scale
  # The response part: each row's own slots.
  q_b = q.reshape(b, t, k_heads, gq, d)
  s_suf = jnp.einsum("btkqd,bksd->bkqts", q_b, k_BKSD.astype(q.dtype),
                     preferred_element_type=jnp.float32) * scale
  if softcap is not None:
    s_pre, s_suf = softcap_logits(s_pre, softcap), softcap_logits(s_suf, softcap)
  seen = pmask_GP.astype(bool)[:, None, None, None, None, :]  # [G, 1, 1, 1, 1, P]
  if window is not None:  # query slot P + q_offset + t sees slots above it minus the window
    q_slot = p_len + q_offset + jnp.arange(t)
    seen = seen & (jnp.arange(p_len)[None, :] > q_slot[:, None] - window)  # [.., T, P]
  s_pre = jnp.where(seen, s_pre, _MASKED)
  s_suf = jnp.where(allowed_mask(t, kv_mask_BS, q_offset, window)[:, None, None], s_suf,
                    _MASKED)
  # One softmax over both parts: the row maximum of either, one denominator.  Reductions
  # over the prompt's slots stay in the group layout; only their [.., T] results move.
  rows = lambda x: x.transpose(0, 3, 1, 2, 4).reshape(b, k_heads, gq, t)  # noqa: E731
  m = jnp.maximum(rows(jnp.max(s_pre, axis=-1)), jnp.max(s_suf, axis=-1))  # [B, K, q, T]
  m_g = m.reshape(g_count, n, k_heads, gq, t).transpose(0, 2, 3, 1, 4)[..., None]
  e_pre = jnp.exp(s_pre - m_g)
  e_suf = jnp.exp(s_suf - m[..., None])
  denom = rows(jnp.sum(e_pre, axis=-1)) + jnp.sum(e_suf, axis=-1)  # [B, K, q, T]
  o_pre = jnp.einsum("gkqntp,gkpd->gntkqd", e_pre.astype(pv_GKPD.dtype), pv_GKPD,
                     preferred_element_type=jnp.float32).reshape(b, t, k_heads, gq, d)
  o_suf = jnp.einsum("bkqts,bksd->btkqd", e_suf.astype(v_BKSD.dtype), v_BKSD,
                     preferred_element_type=jnp.float32)
  out = (o_pre + o_suf) / denom.transpose(0, 3, 1, 2)[..., None]
  return out.reshape(b, t, h, d).astype(q_BTHD.dtype)


def shared_prefix_paged_attention(q_BTHD, pk_GKPD, pv_GKPD, pmask_GP, k_pool, v_pool, table_BM,
                                  q_slot_BT, length_B, *, scale=None, window=None,
                                  softcap=None):
  """:func:`shared_prefix_attention` with per-row positions: each row's own slots live in a
  paged pool (:func:`kernels.attention.paged.paged_attention`'s ``k_pool``/``v_pool``,
  ``table_BM``, ``length_B``), the query ``t`` of row ``b`` at its own slot
  ``q_slot_BT[b, t]``.  A prompt's real tokens lie end to end from its slot 0
  (``pmask_GP`` true on ``[0, plen)``), so a row's token ``s`` is the prompt's ``plen + s``-th
  and a ``window`` counts tokens: the query at own slot ``s`` sees prompt slot ``p`` iff
  ``p > plen + s - window`` and own slot ``s'`` iff ``s' > s - window``.  Both parts meet in
  one softmax, as there.  Softmax in float32; output in the dtype of ``q``."""
  b, t, h, d = q_BTHD.shape
  g_count, k_heads, p_len, _ = pk_GKPD.shape
  n, gq = b // g_count, h // k_heads
  scale = d ** -0.5 if scale is None else scale
  q = q_BTHD.astype(pk_GKPD.dtype)
  kp, vp = row_slots(k_pool, v_pool, table_BM, b)  # [K, B, S, D]
  # The prompt part, one matmul per group as in shared_prefix_attention; the own part in the
  # pool's head-major order (no transpose of the rows' keys).
  s_pre = jnp.einsum("gntkqd,gkpd->gkqntp", q.reshape(g_count, n, t, k_heads, gq, d), pk_GKPD,
                     preferred_element_type=jnp.float32) * scale  # [G, K, q, n, T, P]
  q_k = q.reshape(b, t, k_heads, gq, d).transpose(2, 0, 1, 3, 4)  # [K, B, T, q, D]
  s_own = jnp.einsum("kbtqd,kbsd->kbqts", q_k, kp.astype(q.dtype),
                     preferred_element_type=jnp.float32) * scale  # [K, B, q, T, S]
  if softcap is not None:
    s_pre, s_own = softcap_logits(s_pre, softcap), softcap_logits(s_own, softcap)
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
  # One softmax over both parts: the prompt part's reductions stay in the group layout.
  kb = lambda x: x.transpose(1, 0, 3, 2, 4).reshape(k_heads, b, gq, t)  # noqa: E731
  m = jnp.maximum(kb(jnp.max(s_pre, axis=-1)), jnp.max(s_own, axis=-1))  # [K, B, q, T]
  m_g = m.reshape(k_heads, g_count, n, gq, t).transpose(1, 0, 3, 2, 4)[..., None]
  e_pre = jnp.exp(s_pre - m_g)
  e_own = jnp.exp(s_own - m[..., None])
  denom = kb(jnp.sum(e_pre, axis=-1)) + jnp.sum(e_own, axis=-1)  # [K, B, q, T]
  o_pre = jnp.einsum("gkqntp,gkpd->kgntqd", e_pre.astype(pv_GKPD.dtype), pv_GKPD,
                     preferred_element_type=jnp.float32).reshape(k_heads, b, t, gq, d)
  o_own = jnp.einsum("kbqts,kbsd->kbtqd", e_own.astype(vp.dtype), vp,
                     preferred_element_type=jnp.float32)
  out = (o_pre + o_own) / denom.transpose(0, 1, 3, 2)[..., None]  # [K, B, T, q, D]
  return out.transpose(1, 2, 0, 3, 4).reshape(b, t, h, d).astype(q_BTHD.dtype)
