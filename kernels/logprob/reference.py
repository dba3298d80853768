"""The obvious implementation: full logits, log-softmax, gather.  Memory O(B*T*V)."""

import jax
import jax.numpy as jnp


def logprob_entropy_reference(h_BTD, w_DV, targets_BT, softcap=None):
  """Returns (log p(target) [B,T], entropy [B,T]) in float32; with ``softcap``, of the logits
  ``softcap * tanh(logits / softcap)`` (Gemma 2's final soft-capping)."""
  logits_BTV = jnp.einsum("btd,dv->btv", h_BTD, w_DV, preferred_element_type=jnp.float32)
  if softcap is not None:
    logits_BTV = jnp.tanh(logits_BTV / softcap) * softcap
  logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
  logp_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
  ent_BT = -jnp.sum(jnp.exp(logp_BTV) * logp_BTV, axis=-1)
  return logp_BT, ent_BT
