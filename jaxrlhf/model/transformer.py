"""A Llama-family decoder as pure functions over a parameter pytree.

The same functions run Qwen3 (q/k norms) and Gemma 2 / 3 (GeGLU, (1 + w) norms around
attention and the MLP, scaled embeddings, soft-capping, interleaved sliding-window layers, a
local rotary base): each variant is a :class:`~jaxrlhf.config.ModelConfig` field, off by
default, and with all of them off the computation is the Llama one, operation for operation.

Parameters are a dict of arrays; :func:`param_axes` gives the parallel tree of logical axes
(see :mod:`jaxrlhf.mesh`).  Layers are stacked on a leading ``layers`` axis and scanned.
Two heads share the backbone: ``"lm"`` (unembedding to the vocabulary: policy, reference) and
``"scalar"`` (one score per token: reward, value, guard), or both at once, ``"lm+scalar"`` (a PPO
policy whose backbone the value head shares).

Attention is causal by *slot* (position in the padded array or KV cache) and masked by
validity, so left-padded prompts work; rotary positions are passed explicitly.  With a
:class:`KVCache`, :func:`forward` writes the new keys/values at ``cache.index`` and attends
over the whole cache.
"""

from __future__ import annotations

import functools
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.config import ModelConfig
from jaxrlhf.mesh import constrain
from jaxrlhf.model.paged import PagedKV, write_layer
from kernels.attention import attention
from kernels.attention.paged import paged_attention
from kernels.attention.shared_prefix import (shared_prefix_attention,
                                             shared_prefix_paged_attention)
from kernels.numerics import fixed_order_sum

HEADS = ("lm", "scalar", "lm+scalar")


def _dtype(name: str):
  return jnp.dtype(name)


# --------------------------------------------------------------------------- parameters


def param_axes(cfg: ModelConfig, head: str = "lm") -> dict:
  """The logical axes of every parameter, as a tree parallel to :func:`init_params`."""
  _check_head(head)
  layers = {
      "attn_norm": ("layers", "embed"),
      "wq": ("layers", "embed", "heads", "head_dim"),
      "wk": ("layers", "embed", "kv_heads", "head_dim"),
      "wv": ("layers", "embed", "kv_heads", "head_dim"),
      "wo": ("layers", "heads", "head_dim", "embed"),
      "mlp_norm": ("layers", "embed"),
      "w_gate": ("layers", "embed", "mlp"),
      "w_up": ("layers", "embed", "mlp"),
      "w_down": ("layers", "mlp", "embed"),
  }
  if cfg.qkv_bias:
    layers.update(bq=("layers", "heads", "head_dim"), bk=("layers", "kv_heads", "head_dim"),
                  bv=("layers", "kv_heads", "head_dim"))
  if cfg.qk_norm:
    layers.update(q_norm=("layers", "head_dim"), k_norm=("layers", "head_dim"))
  if cfg.post_norms:
    layers.update(post_attn_norm=("layers", "embed"), post_mlp_norm=("layers", "embed"))
  axes = {"embed": ("vocab", "embed"), "layers": layers, "final_norm": ("embed",)}
  if head in ("lm", "lm+scalar") and not cfg.tie_embeddings:
    axes["unembed"] = ("embed", "vocab")
  if head in ("scalar", "lm+scalar"):
    axes["score"] = {"w": ("embed",), "b": ()}
  return axes


def _check_head(head: str):
  if head not in HEADS:
    raise ValueError(f"unknown head {head!r}; valid: {HEADS}")


def param_shapes(cfg: ModelConfig, head: str = "lm") -> dict:
  """Shapes of every parameter, parallel to :func:`param_axes`."""
  sizes = {"layers": cfg.n_layers, "embed": cfg.d_model, "heads": cfg.n_heads,
           "kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "mlp": cfg.mlp_dim,
           "vocab": cfg.vocab_size}
  return jax.tree.map(lambda axes: tuple(sizes[a] for a in axes), param_axes(cfg, head),
                      is_leaf=lambda x: isinstance(x, tuple))


def init_params(cfg: ModelConfig, key: jax.Array, head: str = "lm") -> dict:
  """Random init: N(0, init_std) matrices, unit norms (weights ``1 - norm_offset``), zero
  biases."""
  _check_head(head)
  if cfg.n_heads % cfg.n_kv_heads:
    raise ValueError(f"n_heads={cfg.n_heads} must be a multiple of n_kv_heads={cfg.n_kv_heads}")
  problems = cfg.architecture_problems()
  if problems:
    raise ValueError("; ".join(problems))
  shapes = param_shapes(cfg, head)
  dtype = _dtype(cfg.param_dtype)
  flat, treedef = jax.tree_util.tree_flatten_with_path(
      shapes, is_leaf=lambda x: isinstance(x, tuple))
  leaves = []
  for i, (path, shape) in enumerate(flat):
    leaf_name = path[-1].key
    if "norm" in leaf_name:
      leaves.append(jnp.full(shape, 1.0 - cfg.norm_offset, dtype) if cfg.norm_offset else
                    jnp.ones(shape, dtype))
    elif leaf_name in ("b", "bq", "bk", "bv"):
      leaves.append(jnp.zeros(shape, dtype))
    else:
      k = jax.random.fold_in(key, i)
      leaves.append((cfg.init_std * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
  return jax.tree_util.tree_unflatten(treedef, leaves)


# ------------------------------------------------------------------------------ KV cache


@flax.struct.dataclass
class KVCache:
  """Per-layer keys/values ``[L, B, K, S, Dh]``, which slots hold real tokens ``[B, S]``,
  and the next slot to write (a scalar shared by the batch).  Head-major, so each head's slots
  are contiguous: the attention matmuls (and the decode kernel's per-head programs) read a
  layer's cache as it is; slot-major, every decode step copied it into this order first
  (benchmarks/NOTES.md, change 6).

  Or *per layer*: ``k`` and ``v`` tuples of ``L`` arrays ``[B, K, S, Dh]``, each its own
  buffer, which :func:`forward` runs with its layers unrolled (``kernels.decode``): a layer
  writes and reads its own buffer in place, where a stacked cache's layer is a slice that
  XLA's CPU runtime copies out at every decode step (benchmarks/NOTES.md, change 14)."""

  k: jax.Array
  v: jax.Array
  mask: jax.Array
  index: jax.Array

  @staticmethod
  def axes() -> "KVCache":
    kv = ("layers", "batch", "kv_heads", "seq", "head_dim")
    return KVCache(k=kv, v=kv, mask=("batch", "seq"), index=())

  @property
  def per_layer(self) -> bool:
    """Whether ``k`` and ``v`` are tuples of per-layer buffers."""
    return isinstance(self.k, tuple)


@flax.struct.dataclass
class SharedPrefix:
  """The prompt's keys/values of each group, written once and read by its ``n`` samples
  (``rollout.prefix_sharing``, docs/rollout.md): ``k``/``v`` ``[L, G, K, P, Dh]`` (or tuples of
  ``L`` per-layer ``[G, K, P, Dh]`` buffers, with a per-layer :class:`KVCache`) and which
  slots hold real tokens ``[G, P]``.  The rows of the batch are prompt-major, ``n = B // G``
  per prompt; the :class:`KVCache` beside it holds each row's own (response) slots, which
  come after the prompt's ``P``."""

  k: jax.Array
  v: jax.Array
  mask: jax.Array

  @property
  def per_layer(self) -> bool:
    return isinstance(self.k, tuple)

  def layer(self, li):
    """Layer ``li``'s ``(k, v, mask)``."""
    if self.per_layer:
      return self.k[li], self.v[li], self.mask
    return (jax.lax.dynamic_index_in_dim(self.k, li, 0, keepdims=False),
            jax.lax.dynamic_index_in_dim(self.v, li, 0, keepdims=False), self.mask)


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
  shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
  dtype = _dtype(cfg.compute_dtype)
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                 mask=jnp.zeros((batch, max_len), bool), index=jnp.zeros((), jnp.int32))


def unstack_layers(params: dict, cfg: ModelConfig) -> dict:
  """``params`` with the stacked layers split into a tuple of per-layer dicts, each cast to
  ``compute_dtype``: what an unrolled decode loop reads (``kernels.decode``).  Made once per
  generation, outside the decode loop, it costs one copy of the layers' weights for the
  generation's lifetime and saves a slice copy (and a cast) of every layer at every token."""
  cdt = _dtype(cfg.compute_dtype)
  layers = params["layers"]
  per = tuple(jax.tree.map(lambda p, i=i: p[i].astype(cdt), layers)
              for i in range(cfg.n_layers))
  return {**params, "layers": per}


# ------------------------------------------------------------------------------- forward


def rms_norm(x, w, eps, offset: float = 0.0):
  """RMSNorm over the last axis, scaled by ``w`` (``offset + w`` with an offset: Gemma's
  ``1 + w``), in float32; the result in the dtype of ``x``."""
  xf = x.astype(jnp.float32)
  # The mean square in an order fixed by the width alone (kernels/numerics.py): a row
  # normalises to the same bits in a decode step and in the full forward.
  ms = fixed_order_sum(xf * xf, keepdims=True) / xf.shape[-1]
  y = xf * jax.lax.rsqrt(ms + eps)
  if offset:
    return (y * (offset + w.astype(jnp.float32))).astype(x.dtype)
  return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(cfg: ModelConfig, local: bool = False) -> jax.Array:
  """The rotary inverse frequencies ``[head_dim / 2]``, with the checkpoint's scaling (see
  ``ModelConfig.rope_scaling``); computed in float64 numpy so they match the reference
  implementations bit for bit before the cast.  ``local``: those of the sliding-window layers
  (``rope_local_theta``, unscaled), when the config gives them their own base."""
  d = cfg.head_dim
  if local and cfg.rope_local_theta:
    return jnp.asarray(cfg.rope_local_theta ** (-np.arange(0, d, 2, dtype=np.float64) / d),
                       jnp.float32)
  inv = cfg.rope_theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
  if cfg.rope_scaling == "linear":
    inv = inv / cfg.rope_factor
  elif cfg.rope_scaling == "llama3":
    wavelen = 2 * np.pi / inv
    low_wavelen = cfg.rope_original_max_len / cfg.rope_low_freq_factor
    high_wavelen = cfg.rope_original_max_len / cfg.rope_high_freq_factor
    # 0 at the long-wavelength end (fully scaled), 1 at the short end (kept as is).
    ramp = (cfg.rope_original_max_len / wavelen - cfg.rope_low_freq_factor) / (
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
    smooth = (1 - ramp) * inv / cfg.rope_factor + ramp * inv
    inv = np.where(wavelen > low_wavelen, inv / cfg.rope_factor,
                   np.where(wavelen < high_wavelen, inv, smooth))
  return jnp.asarray(inv, jnp.float32)


def rope_tables(positions_BT, inv_freq):
  """The rotary ``(cos, sin)`` tables ``[B, T, 1, D/2]`` for these positions.  They depend on
  the positions only, so :func:`forward` builds them once for every layer: built inside a
  rematerialised layer, XLA recomputed ``cos``/``sin`` per element of every head, inside the
  backward's layout fusions (benchmarks/NOTES.md, change 13)."""
  ang = positions_BT.astype(jnp.float32)[..., None] * inv_freq  # [B,T,D/2]
  return jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]


def apply_rope(x_BTHD, cos, sin):
  """Rotary embedding with tables from :func:`rope_tables`, half-split convention (as Hugging
  Face Llama)."""
  d = x_BTHD.shape[-1]
  x = x_BTHD.astype(jnp.float32)
  x1, x2 = x[..., : d // 2], x[..., d // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHD.dtype)


def rope(x_BTHD, positions_BT, inv_freq):
  """Rotary embedding, half-split convention (as Hugging Face Llama); ``inv_freq`` from
  :func:`rope_frequencies`."""
  return apply_rope(x_BTHD, *rope_tables(positions_BT, inv_freq))


_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def _residual_dtype(cfg: ModelConfig):
  """What the residual stream and the matmuls' outputs are held in (``cfg.residual_dtype``)."""
  return jnp.float32 if cfg.residual_dtype == "float32" else _dtype(cfg.compute_dtype)


def _matmul(x_BTI, w, out_dtype=None):
  """``x [B, T, ...in] @ w [...in, ...out] -> [B, T, ...out]`` as one 2-D matmul over the
  ``B*T`` rows.  The same product as an einsum with the batch dimensions kept apart, but its
  weight gradient contracts one row dimension instead of two: with two, XLA's CPU backend
  transposes the ``[B*T, F]`` output gradient through a slow strided copy (2x the MLP's
  backward time at the benchmark shape, benchmarks/NOTES.md).  ``x`` is rounded to ``w``'s
  dtype (the compute dtype) and the product accumulated into ``out_dtype`` (default: ``w``'s):
  a 16-bit operand pair with a float32 result gives the same bits for a row whatever the other
  rows are (one decoded token or a whole sequence) on XLA's CPU backend, one row excepted
  (docs/rollout.md)."""
  b, t = x_BTI.shape[:2]
  n_in = x_BTI.ndim - 2
  out_shape = w.shape[n_in:]
  x2 = x_BTI.reshape(b * t, -1).astype(w.dtype)
  y = jnp.dot(x2, w.reshape(x2.shape[1], -1), preferred_element_type=out_dtype or w.dtype)
  return y.reshape((b, t) + out_shape)


def _proj(x_BTI, lp, name: str, out_dtype):
  """The layer's projection ``name`` (e.g. ``"wq"``), plus its LoRA adapter's ``(x @ a) @ b``
  when ``lp["lora"]`` has one (:mod:`jaxrlhf.model.lora`; ``b`` already scaled), in
  ``out_dtype`` (:func:`_residual_dtype`)."""
  y = _matmul(x_BTI, lp[name], out_dtype)
  ad = lp.get("lora", {}).get(name)
  if ad is not None:
    y = y + _matmul(_matmul(x_BTI, ad["a"], out_dtype), ad["b"], out_dtype)
  return y


def _sliding(cfg: ModelConfig, li):
  """Whether layer ``li`` (an int, or traced inside the layer scan) uses the sliding window:
  a Python bool when every layer is alike or ``li`` is static, else a traced bool."""
  if not cfg.sliding_window:
    return False
  if not cfg.layer_types:
    return True
  flags = [t == "sliding" for t in cfg.layer_types]
  if all(flags) or not any(flags):
    return flags[0]
  if isinstance(li, int):
    return flags[li]
  return jnp.asarray(flags)[li]


# A window no sequence reaches: what a full-attention layer gets when the window is traced.
_NO_WINDOW = 2 ** 30


def _attention_settings(cfg: ModelConfig, sliding, rope_cs, kv_mask):
  """``(rope_cs, attention keywords, kv_mask)`` of one layer: its rotary tables (local or
  global base), its score scale, soft-cap and window (``sliding``: a bool, or traced in a
  scanned stack of mixed layers), and packed rows' segment ids (an integer ``kv_mask``)."""
  if cfg.rope_local_theta:
    global_cs, local_cs = rope_cs
    if isinstance(sliding, bool):
      rope_cs = local_cs if sliding else global_cs
    else:
      rope_cs = tuple(jnp.where(sliding, a, b) for a, b in zip(local_cs, global_cs))
  attn_kw = {}
  if cfg.query_pre_attn_scalar:
    attn_kw["scale"] = cfg.query_pre_attn_scalar ** -0.5
  if cfg.attn_softcap:
    attn_kw["softcap"] = cfg.attn_softcap
  if isinstance(sliding, bool):
    if sliding:
      attn_kw["window"] = cfg.sliding_window
  else:
    attn_kw["window"] = jnp.where(sliding, cfg.sliding_window, _NO_WINDOW)
  if jnp.issubdtype(kv_mask.dtype, jnp.integer):  # packed rows: segment ids, 0 for padding
    attn_kw["segment_ids"], kv_mask = kv_mask, kv_mask != 0
  return rope_cs, attn_kw, kv_mask


def _layer(cfg: ModelConfig, attn_impl: str, h_BTD, lp, rope_cs, kv_mask, q_offset, cache_kv,
           prefix=None, paged=None):
  """One decoder layer.  ``rope_cs``: the ``(cos, sin)`` pair of :func:`rope_tables`, or
  ``((cos, sin) global, (cos, sin) local)`` with a local rotary base.
  ``cache_kv`` is None or ``(k_LBKSD, v_LBKSD, layer)``: the *whole* cache and this layer's
  index; the new keys/values are written into it in place (one slot range of one layer) and it
  is returned whole.  Or ``(k_BKSD, v_BKSD, layer)``: this layer's own cache (a per-layer
  :class:`KVCache`), written and returned the same way.  Without a cache, ``cache_kv`` may be
  ``(None, None, layer)``: the layer index alone, for configs whose layers differ (sliding /
  full).  ``prefix``: this layer's :class:`SharedPrefix` ``(k, v, mask)``, the slots before
  the cache's, shared by each group of rows.  ``paged``: ``(read_table, slot_RT, length_R,
  table_RM)`` of a :class:`~jaxrlhf.model.paged.PagedKV` whose pools ``cache_kv`` holds
  (``read_table``: None for a contiguous pool, read without a gather): the new tokens are
  written at their logical slots ``slot_RT`` through the page table, and attend over each
  row's ``length_R`` slots."""
  cdt, rdt = _dtype(cfg.compute_dtype), _residual_dtype(cfg)
  lp = jax.tree.map(lambda p: p.astype(cdt), lp)
  proj = lambda x, name: _proj(x, lp, name, rdt)
  off = cfg.norm_offset
  rope_cs, attn_kw, kv_mask = _attention_settings(
      cfg, _sliding(cfg, None if cache_kv is None else cache_kv[2]), rope_cs, kv_mask)
  x = rms_norm(h_BTD, lp["attn_norm"], cfg.norm_eps, off)
  q = proj(x, "wq")
  k = proj(x, "wk")
  v = proj(x, "wv")
  if cfg.qkv_bias:
    q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
  if cfg.qk_norm:
    q = rms_norm(q, lp["q_norm"], cfg.norm_eps, off)
    k = rms_norm(k, lp["k_norm"], cfg.norm_eps, off)
  # Attention reads q, k and v in the compute dtype (k and v as the cache holds them).
  q = constrain(apply_rope(q, *rope_cs).astype(cdt), ("batch", "seq", "heads", "head_dim"))
  k = constrain(apply_rope(k, *rope_cs).astype(cdt), ("batch", "seq", "kv_heads", "head_dim"))
  v = constrain(v.astype(cdt), ("batch", "seq", "kv_heads", "head_dim"))
  if paged is not None:
    ck, cv, li = cache_kv
    read_table, slot_RT, length_R, table_RM = paged
    if ck.ndim == 4:  # this layer's own pool
      k_pool, v_pool = ck, cv = write_layer(ck, cv, table_RM, slot_RT, k, v,
                                            contiguous=read_table is None)
    else:
      ck, cv = write_layer(ck, cv, table_RM, slot_RT, k, v, li, contiguous=read_table is None)
      k_pool = jax.lax.dynamic_index_in_dim(ck, li, 0, keepdims=False)
      v_pool = jax.lax.dynamic_index_in_dim(cv, li, 0, keepdims=False)
    if prefix is not None:  # the group's prompt, then the row's own pages
      pk, pv, pmask = prefix
      o = shared_prefix_paged_attention(q, pk, pv, pmask, k_pool, v_pool, read_table, slot_RT,
                                        length_R, impl=attn_impl, **attn_kw)
    else:
      o = paged_attention(q, k_pool, v_pool, read_table, slot_RT, length_R, impl=attn_impl,
                          **attn_kw)
    new_kv = (ck, cv)
  elif cache_kv is not None and cache_kv[0] is not None:
    ck, cv, li = cache_kv
    if ck.ndim == 4:  # this layer's own buffer
      at = (0, 0, q_offset, 0)
      head_major = lambda x: x.astype(ck.dtype).transpose(0, 2, 1, 3)  # [B, K, T, D]
      k_all = ck = jax.lax.dynamic_update_slice(ck, head_major(k), at)
      v_all = cv = jax.lax.dynamic_update_slice(cv, head_major(v), at)
    else:
      at = (li, 0, 0, q_offset, 0)
      head_major = lambda x: x.astype(ck.dtype).transpose(0, 2, 1, 3)[None]  # [1, B, K, T, D]
      ck = jax.lax.dynamic_update_slice(ck, head_major(k), at)
      cv = jax.lax.dynamic_update_slice(cv, head_major(v), at)
      k_all = jax.lax.dynamic_index_in_dim(ck, li, 0, keepdims=False)
      v_all = jax.lax.dynamic_index_in_dim(cv, li, 0, keepdims=False)
    if prefix is not None:
      pk, pv, pmask = prefix
      o = shared_prefix_attention(q, pk, pv, pmask, k_all, v_all, kv_mask, q_offset,
                                  impl=attn_impl, **attn_kw)
    else:
      o = attention(q, k_all, v_all, kv_mask, q_offset, impl=attn_impl, kv_layout="bksd",
                    **attn_kw)
    new_kv = (ck, cv)
  else:
    o, new_kv = attention(q, k, v, kv_mask, q_offset, impl=attn_impl, **attn_kw), None
  if cfg.post_norms:
    a = rms_norm(proj(o, "wo"), lp["post_attn_norm"], cfg.norm_eps, off)
    h_BTD = h_BTD + constrain(a, ("batch", "seq", "embed"))
  else:
    h_BTD = h_BTD + constrain(proj(o, "wo"), ("batch", "seq", "embed"))
  x = rms_norm(h_BTD, lp["mlp_norm"], cfg.norm_eps, off)
  gate = proj(x, "w_gate")
  up = proj(x, "w_up")
  if cfg.mlp_activation == "gelu_tanh":
    act = constrain(jax.nn.gelu(gate, approximate=True) * up, ("batch", "seq", "mlp"))
  else:
    act = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
  if cfg.post_norms:
    h_BTD = h_BTD + rms_norm(proj(act, "w_down"), lp["post_mlp_norm"], cfg.norm_eps, off)
  else:
    h_BTD = h_BTD + proj(act, "w_down")
  return constrain(h_BTD, ("batch", "seq", "embed")), new_kv


def forward(params: dict, tokens_BT: jax.Array, positions_BT: jax.Array, mask_BT: jax.Array, *,
            cfg: ModelConfig, cache: Optional[KVCache] = None, attn_impl: str = "auto",
            segment_ids_BT: Optional[jax.Array] = None, prefix: Optional[SharedPrefix] = None,
            paged: Optional[PagedKV] = None):
  """Final hidden states ``[B, T, D]`` (after the final norm) and the updated cache.

  tokens_BT, positions_BT: token ids and rotary positions; mask_BT: which tokens are real.
  Without a cache the T tokens attend causally among themselves; with one, they are written at
  slots ``cache.index .. +T`` and attend to every valid earlier slot.  The layers run in a
  ``lax.scan`` over the stacked weights (``cfg.scan_layers``), or unrolled, one after
  another: without ``scan_layers``, with a per-layer cache, or with ``params["layers"]`` a
  tuple of per-layer dicts (:func:`unstack_layers`).
  ``segment_ids_BT`` (int, without a cache): packed rows, several sequences per row, each
  token attending only to its own sequence (id >= 1; 0 for padding, where ``mask_BT`` must be
  false); the positions should restart at each sequence (:func:`positions_from_segments`).
  ``prefix`` (with a cache): each group's shared prompt slots before the cache's
  (:class:`SharedPrefix`), read once per group by the attention of its rows.
  ``paged`` (in place of ``cache``): a :class:`~jaxrlhf.model.paged.PagedKV`; each row's real
  tokens (``mask_BT``) are written from its own length on, end to end, and attend causally
  over its slots; returned with the lengths advanced.  The caller reserves the pages first
  (:meth:`~jaxrlhf.model.paged.PagedKV.reserve`).  With a ``prefix`` too, its prompts' real
  tokens lie end to end from slot 0 and each row's own slots continue them
  (:func:`~kernels.attention.shared_prefix.shared_prefix_paged_attention`).
  """
  if paged is not None and (cache is not None or segment_ids_BT is not None):
    raise ValueError("forward: a paged cache replaces the KV cache (no packing)")
  if prefix is not None and ((cache is None and paged is None) or segment_ids_BT is not None):
    raise ValueError("forward: a shared prefix is read beside a KV cache (decoding)")
  if segment_ids_BT is not None and cache is not None:
    raise ValueError("forward: segment_ids_BT (packed rows) is for teacher-forced passes "
                     "without a KV cache")
  cdt = _dtype(cfg.compute_dtype)
  if cfg.embed_scale:  # Gemma: the scale rounded to the weights' dtype, as transformers does
    emb = jnp.take(params["embed"], tokens_BT, axis=0)
    h = (emb * jnp.asarray(cfg.d_model ** 0.5, emb.dtype)).astype(cdt)
  else:
    h = jnp.take(params["embed"], tokens_BT, axis=0).astype(cdt)
  h = constrain(h.astype(_residual_dtype(cfg)), ("batch", "seq", "embed"))
  if cache is None:
    q_offset, kv_mask = 0, mask_BT.astype(bool)
    if segment_ids_BT is not None:  # the layers read the ids in place of the mask
      kv_mask = jnp.where(kv_mask, segment_ids_BT.astype(jnp.int32), 0)
  else:
    q_offset = cache.index
    kv_mask = jax.lax.dynamic_update_slice_in_dim(cache.mask, mask_BT.astype(bool), q_offset, 1)
  view = None
  if paged is not None:
    slot_BT = paged.slots(mask_BT)
    length_B = paged.length_R + jnp.sum(mask_BT, axis=1, dtype=jnp.int32)
    # A contiguous pool (each row its own pages, in order) is read without the table.
    view = (None if paged.contiguous else paged.table_RM, slot_BT, length_B, paged.table_RM)

  rope_cs = rope_tables(positions_BT, rope_frequencies(cfg))
  if cfg.rope_local_theta:
    rope_cs = (rope_cs, rope_tables(positions_BT, rope_frequencies(cfg, local=True)))
  # Layers that differ (sliding / full attention) need their index even without a cache.
  per_layer = cfg.sliding_window > 0 or cfg.rope_local_theta > 0
  layer = functools.partial(_layer, cfg, attn_impl)
  if cfg.remat != "none":
    layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[cfg.remat], static_argnums=())

  # The cache rides in the loop's carry and each layer writes its new slots into it in place:
  # as a scanned input/output it would be rebuilt ([L, B, K, S, Dh] copied) at every decode step.
  def step(carry, xs):
    h, kv = carry
    lp, li = xs
    if kv is not None:
      layer_kv = (*kv, li)
    else:
      layer_kv = (None, None, li) if per_layer else None
    h, kv = layer(h, lp, rope_cs, kv_mask, q_offset, layer_kv,
                  None if prefix is None else prefix.layer(li), view)
    return (h, kv), None

  store = paged if paged is not None else cache
  kv = None if store is None else (store.k, store.v)
  unstacked = isinstance(params["layers"], (tuple, list))
  per_layer_kv = store is not None and store.per_layer
  if cfg.scan_layers and not unstacked and not per_layer_kv:
    (h, kv), _ = jax.lax.scan(step, (h, kv), (params["layers"], jnp.arange(cfg.n_layers)))
  elif per_layer_kv:
    ks, vs = list(kv[0]), list(kv[1])
    for i in range(cfg.n_layers):
      lp = params["layers"][i] if unstacked else jax.tree.map(lambda p: p[i], params["layers"])
      h, (ks[i], vs[i]) = layer(h, lp, rope_cs, kv_mask, q_offset, (ks[i], vs[i], i),
                                None if prefix is None else prefix.layer(i), view)
    kv = (tuple(ks), tuple(vs))
  else:
    for i in range(cfg.n_layers):
      lp = params["layers"][i] if unstacked else jax.tree.map(lambda p: p[i], params["layers"])
      (h, kv), _ = step((h, kv), (lp, i))
  h = rms_norm(h, params["final_norm"].astype(cdt), cfg.norm_eps, cfg.norm_offset).astype(cdt)
  new_cache = None
  if paged is not None:
    return h, paged.replace(k=kv[0], v=kv[1], length_R=view[2])
  if cache is not None:
    new_cache = KVCache(k=kv[0], v=kv[1], mask=kv_mask,
                        index=cache.index + tokens_BT.shape[1])
  return h, new_cache


# --------------------------------------------------------------------------------- heads


def unembedding(params: dict, cfg: ModelConfig) -> jax.Array:
  """The ``[D, V]`` output matrix of the LM head (the embedding, transposed, when tied)."""
  w = params["embed"].T if cfg.tie_embeddings else params["unembed"]
  return w.astype(_dtype(cfg.compute_dtype))


def lm_logits(params: dict, h_BTD: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Full logits in float32 (soft-capped with ``cfg.final_softcap``).  Only for a few
  positions (sampling); training code uses the blockwise log-prob op instead."""
  logits = jnp.einsum("btd,dv->btv", h_BTD, unembedding(params, cfg),
                      preferred_element_type=jnp.float32)
  # Vocabulary-sharded like the unembedding: left free, XLA:GPU's partitioner all-gathered the
  # whole [D, V] matrix at every decoded token (2.1 GB a token for a 70B model, docs/plan.md)
  # where the logits' rows are what needs moving.
  logits = constrain(logits, ("batch", "seq", "vocab"))
  if cfg.final_softcap:
    logits = jnp.tanh(logits / cfg.final_softcap) * cfg.final_softcap
  return logits


def scalar_head(params: dict, h_BTD: jax.Array) -> jax.Array:
  """One float32 score per token ``[B, T]``."""
  w = params["score"]["w"].astype(jnp.float32)
  return jnp.einsum("btd,d->bt", h_BTD.astype(jnp.float32), w) + params["score"]["b"].astype(
      jnp.float32)


def positions_from_mask(mask_BT: jax.Array) -> jax.Array:
  """Rotary positions for left- (or right-) padded rows: 0 at the first real token."""
  return jnp.maximum(jnp.cumsum(mask_BT.astype(jnp.int32), axis=-1) - 1, 0)


def positions_from_segments(segment_ids_BT: jax.Array) -> jax.Array:
  """Rotary positions for packed rows: 0 at the first token of each segment (a change of id),
  counting up within it; padding gets positions too (they are masked)."""
  t = jnp.arange(segment_ids_BT.shape[-1])
  start = jnp.concatenate([jnp.ones_like(segment_ids_BT[:, :1], bool),
                           segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=-1)
  first_BT = jax.lax.cummax(jnp.where(start, t, 0), axis=segment_ids_BT.ndim - 1)
  return (t - first_BT).astype(jnp.int32)


def last_valid_index(mask_BT: jax.Array) -> jax.Array:
  """Index of the last real token of each row ``[B]`` (0 for an empty row)."""
  t = mask_BT.shape[-1]
  idx = jnp.where(mask_BT.astype(bool), jnp.arange(t), -1)
  return jnp.maximum(jnp.max(idx, axis=-1), 0)
