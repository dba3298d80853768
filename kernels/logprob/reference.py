"""The obvious implementation: full logits, log-softmax, gather.  Memory O(B*T*V)."""

import jax
import jax.numpy as jnp


def logprob_entropy_reference(h_BTD, w_DV, targets_BT):
  """Returns (log p(target) [B,T], entropy [B,T]) in float32."""
  logits_BTV = jnp.einsum("btd,dv->btv", h_BTD, w_DV, preferred_element_type=jnp.float32)
  logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
  logp_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
  ent_BT = -jnp.sum(jnp.exp(logp_BTV) * logp_BTV, axis=-1)
  return logp_BT, ent_BT
