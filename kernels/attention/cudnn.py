"""Attention through cuDNN's fused kernel (``jax.nn.dot_product_attention(implementation=
"cudnn")``), GPU only.

Our mask (causal by slot from ``q_offset``, and arbitrary key validity, e.g. left padding) is
not one of cuDNN's built-in mask types (those assume right padding), so it is passed as a
boolean ``[B, 1, T, S]`` mask, which jax turns into an additive bias: correct for every case,
at the cost of materialising ``B*T*S`` bias values and without cuDNN's causal block skipping.
Rows with no visible key get the mean of V, as in the reference.  cuDNN needs float16 or
bfloat16 inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels._backend import target_platform
from kernels.attention.reference import allowed_mask


def attention_cudnn(q_BTHD, k_BSKD, v_BSKD, kv_mask_BS, q_offset=0, *, scale=None,
                    window=None):
  """Causal GQA attention with a key mask on cuDNN; a ValueError when cuDNN cannot run it."""
  platform = target_platform()
  if platform != "gpu":
    raise ValueError(f"kernels.attention='cudnn' needs an NVIDIA GPU (the target is "
                     f"{platform!r}); use kernels.attention=xla")
  if q_BTHD.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"kernels.attention='cudnn' needs bfloat16 or float16 activations, got "
                     f"{q_BTHD.dtype}; set model.compute_dtype=bfloat16 or use another impl")
  mask_B1TS = allowed_mask(q_BTHD.shape[1], kv_mask_BS, q_offset, window)[:, None]
  return jax.nn.dot_product_attention(q_BTHD, k_BSKD, v_BSKD, mask=mask_B1TS, scale=scale,
                                      implementation="cudnn")
