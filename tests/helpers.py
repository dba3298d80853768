"""Small shared helpers for tests: tiny configs and meshes."""

import jax
import jax.numpy as jnp

from jaxrlhf.config import MeshConfig, ModelConfig
from jaxrlhf.mesh import make_mesh

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   mlp_dim=64, max_seq_len=32)


def mesh(dp=1, fsdp=1, tp=1):
  n = dp * fsdp * tp
  return make_mesh(MeshConfig(dp=dp, fsdp=fsdp, tp=tp), jax.devices()[:n])


def ragged_batch(key, batch, length, vocab, min_len=2):
  """Left-padded random tokens with a validity mask (row i has a random length >= min_len)."""
  k1, k2 = jax.random.split(key)
  tokens = jax.random.randint(k1, (batch, length), 1, vocab)
  lens = jax.random.randint(k2, (batch,), min_len, length + 1)
  mask = jnp.arange(length)[None, :] >= (length - lens)[:, None]
  return jnp.where(mask, tokens, 0), mask
