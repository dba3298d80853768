"""Picks the attention implementation by backend, with an explicit override
(``--set=kernels.attention=auto|xla|pallas|pallas_interpret|cudnn``)."""

from __future__ import annotations

from kernels._backend import resolve_impl, target_platform
from kernels.attention.cudnn import attention_cudnn
from kernels.attention.decode import decode_attention
from kernels.attention.flash import flash_attention
from kernels.attention.reference import attention_reference, check_layout, to_bskd
from kernels.attention.splash import fits as splash_fits
from kernels.attention.splash import splash_attention

IMPLS = ("auto", "xla", "pallas", "pallas_interpret", "cudnn")
# What "auto" runs on each backend (anything unlisted: "xla").  One line to change once the
# GPU benchmark (kernels/bench_gpu.py) says cuDNN or XLA is faster.  "pallas" on TPU is jax's
# splash attention where it fits the call (``_tpu_impl``), the XLA path elsewhere.
AUTO = {"gpu": "pallas", "tpu": "pallas"}
# Up to this many new tokens per step the Pallas path uses the decode kernel (one program per
# KV head, reading the cache once); longer query blocks use flash attention.
DECODE_MAX_T = 16


def attention(q_BTHD, k_BSKD, v_BSKD, kv_mask_BS, q_offset=0, *, impl: str = "auto",
              kv_layout: str = "bskd", scale=None, window=None, softcap=None,
              segment_ids=None):
  """Causal GQA attention; see :func:`attention_reference` for the contract.

  Rows with no visible key (left-pad queries) are unspecified: the reference and cuDNN give the
  mean of V, the Pallas kernels 0.  ``impl`` is one of :data:`IMPLS`.  ``kv_layout="bksd"``
  takes k and v as ``[B, K, S, D]`` (the KV cache's layout); the reference and the decode
  kernel read it as it is, flash and cuDNN (prefill) get a transposed copy.

  ``scale`` (default ``head_dim ** -0.5``), ``window`` (sliding window, may be traced) and
  ``softcap`` (logit soft-capping) as in the reference; None: off.  cuDNN takes a window
  (through its mask) but no soft-capping: ``impl="cudnn"`` with ``softcap`` is an error.

  ``segment_ids`` (int ``[B, S]``, 0 for padding): packed rows, each query attending only to
  keys of its own segment (the id at the query's slot).  The Pallas path runs it on the flash
  kernels at every query length (the decode kernel has no segments; a packed call is never a
  decode step); cuDNN refuses it.
  """
  check_layout(kv_layout)
  impl = resolve_impl("attention", impl, IMPLS, AUTO)
  if impl in ("pallas", "pallas_interpret") and target_platform() == "tpu":
    interpret = impl == "pallas_interpret"
    impl = _tpu_impl(q_BTHD.shape[1], q_offset, window)
    if impl == "splash":
      return splash_attention(q_BTHD, k_BSKD, v_BSKD, kv_mask_BS, q_offset, kv_layout=kv_layout,
                              scale=scale, window=window, softcap=softcap,
                              segment_ids=segment_ids,
                              interpret=interpret)
  if impl == "cudnn" and softcap is not None:
    raise ValueError("kernels.attention='cudnn' has no logit soft-capping (Gemma 2's "
                     "attn_logit_softcapping); use kernels.attention=auto, pallas or xla")
  if impl == "cudnn" and segment_ids is not None:
    raise ValueError("kernels.attention='cudnn' has no segment ids (packed sequences, "
                     "data.pack=true); use kernels.attention=auto, pallas or xla, or set "
                     "data.pack=false")
  # Gemma's options are passed only when set, so every other call is the plain one.
  extra = {k: v for k, v in (("window", window), ("softcap", softcap),
                             ("segment_ids", segment_ids)) if v is not None}
  if impl == "xla":
    if scale is None and not extra:
      return attention_reference(q_BTHD, k_BSKD, v_BSKD, kv_mask_BS, q_offset,
                                 kv_layout=kv_layout)
    return attention_reference(q_BTHD, k_BSKD, v_BSKD, kv_mask_BS, q_offset, scale=scale,
                               kv_layout=kv_layout, **extra)
  interpret = impl == "pallas_interpret"
  if impl != "cudnn" and q_BTHD.shape[1] <= DECODE_MAX_T and segment_ids is None:
    return decode_attention(q_BTHD, k_BSKD, v_BSKD, kv_mask_BS, q_offset, interpret=interpret,
                            kv_layout=kv_layout, scale=scale, **extra)
  k_BSKD, v_BSKD = to_bskd(k_BSKD, kv_layout), to_bskd(v_BSKD, kv_layout)
  if impl == "cudnn":
    return attention_cudnn(q_BTHD, k_BSKD, v_BSKD, kv_mask_BS, q_offset, scale=scale,
                           window=window)
  return flash_attention(q_BTHD, k_BSKD, v_BSKD, kv_mask_BS, q_offset, interpret=interpret,
                         scale=scale, **extra)


def _tpu_impl(t: int, q_offset, window) -> str:
  """On a TPU target, "pallas" is jax's splash attention (training, prefill from slot 0) where
  it fits the call, and the XLA path where it does not: a decode step (T <= DECODE_MAX_T; jax's
  paged / ragged paged attention wants a paged cache and one length per row, this contiguous
  cache has an arbitrary key mask, kernels/NOTES.md; the paged cache of multi-turn episodes
  runs jax's kernel, kernels/attention/paged.py), a traced offset or window."""
  if t <= DECODE_MAX_T or splash_fits(q_offset, window) is not None:
    return "xla"
  return "splash"
