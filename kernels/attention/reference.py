"""Plain-jnp attention: the definition every other implementation is tested against."""

import jax
import jax.numpy as jnp

from kernels.numerics import fixed_order_sum


# Large negative instead of -inf: a row with no allowed key (a left-pad query) gets a uniform
# softmax rather than NaN; its output is never used.
_MASKED = -1e30


def allowed_mask(q_len: int, kv_mask_BS: jax.Array, q_offset, window=None,
                 segment_ids_BS=None) -> jax.Array:
  """[B, T, S] bool: key slot s is visible from query t iff s <= q_offset + t and it is valid;
  with a ``window`` (an int, possibly traced), also iff s > q_offset + t - window: the query
  sees the last ``window`` slots, itself included (transformers' sliding window, which counts
  cache slots, not rotary positions).  With ``segment_ids_BS`` (int ``[B, S]``, one id per
  packed sequence, 0 for padding), also iff slot s holds the query's own segment: the query
  at slot ``q_offset + t`` has the id stored at that slot."""
  s_len = kv_mask_BS.shape[1]
  q_slot = q_offset + jnp.arange(q_len)[:, None]
  causal_TS = jnp.arange(s_len)[None, :] <= q_slot
  if window is not None:
    causal_TS = causal_TS & (jnp.arange(s_len)[None, :] > q_slot - window)
  allowed = causal_TS[None] & kv_mask_BS[:, None, :].astype(bool)
  if segment_ids_BS is not None:
    q_seg_BT = jax.lax.dynamic_slice_in_dim(segment_ids_BS, q_offset, q_len, axis=1)
    allowed = allowed & (q_seg_BT[:, :, None] == segment_ids_BS[:, None, :])
  return allowed


def softcap_logits(x, cap):
  """``cap * tanh(x / cap)`` (Gemma 2's logit soft-capping), in the dtype of ``x``."""
  return jnp.tanh(x / cap) * cap


def attention_reference(q_BTHD, k_BSKD, v_BSKD, kv_mask_BS, q_offset=0, *, scale=None,
                        kv_layout: str = "bskd", window=None, softcap=None,
                        segment_ids=None):
  """Grouped-query causal attention.

  q_BTHD: queries at slots ``q_offset .. q_offset+T-1``; k/v_BSKD: keys/values at slots
  ``0 .. S-1`` with ``H`` a multiple of ``K``; kv_mask_BS: which key slots hold real tokens.
  ``kv_layout="bksd"``: k and v are ``[B, K, S, D]`` instead (the KV cache's layout: each
  head's slots contiguous, what the score and output matmuls read without a transpose).
  Softmax in float32; output in the dtype of ``q``.  A query row with no visible key gets
  the mean of V here; other implementations may differ on such rows (they are never used).
  ``window``: sliding-window attention (see :func:`allowed_mask`); ``softcap``: the scaled
  logits are soft-capped (:func:`softcap_logits`) before masking.  ``segment_ids``: int
  ``[B, S]`` ids of packed sequences (0: padding); a query sees only keys of its own segment
  (see :func:`allowed_mask`).  None: off.
  """
  check_layout(kv_layout)
  b, t, h, d = q_BTHD.shape
  kv = kv_layout  # the einsum spelling of k and v
  k_heads = k_BSKD.shape[kv.index("k")]
  g = h // k_heads
  scale = d ** -0.5 if scale is None else scale
  q = q_BTHD.reshape(b, t, k_heads, g, d)
  # 16-bit operands, float32 products: a query's scores and output come out the same bits
  # whatever the query count and the number of (masked) key slots after its last visible one,
  # so a decode step over the cache matches the full forward (docs/rollout.md).
  q = q.astype(k_BSKD.dtype)
  scores = jnp.einsum(f"btkgd,{kv}->bkgts", q, k_BSKD,
                      preferred_element_type=jnp.float32) * scale
  if softcap is not None:
    scores = softcap_logits(scores, softcap)
  allowed = allowed_mask(t, kv_mask_BS, q_offset, window, segment_ids)[:, None, None]
  scores = jnp.where(allowed, scores, _MASKED)
  # The softmax's sum in an order fixed by the key count (kernels/numerics.py).
  e = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
  probs = e / fixed_order_sum(e, keepdims=True)
  out = jnp.einsum(f"{kv},bkgts->btkgd", v_BSKD, probs.astype(v_BSKD.dtype),
                   preferred_element_type=jnp.float32)
  return out.reshape(b, t, h, d).astype(q_BTHD.dtype)


KV_LAYOUTS = ("bskd", "bksd")


def check_layout(kv_layout: str):
  if kv_layout not in KV_LAYOUTS:
    raise ValueError(f"attention: kv_layout={kv_layout!r}; choose from {', '.join(KV_LAYOUTS)}")


def to_bskd(x, kv_layout: str):
  """k or v in the ``[B, S, K, D]`` layout the flash and cuDNN kernels take."""
  return x if kv_layout == "bskd" else x.transpose(0, 2, 1, 3)
