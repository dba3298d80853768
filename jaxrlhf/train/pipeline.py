"""Runs an experiment's stages in order (placeholder until the training programs land:
builds the mesh and the sharded policy and runs one forward pass)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrlhf import model as M
from jaxrlhf.mesh import batch_sharding, make_mesh


def run(cfg, workdir: str, resume: str = "latest", profile_steps=None) -> int:
  del workdir, resume, profile_steps
  mesh = make_mesh(cfg.mesh)
  with jax.set_mesh(mesh):
    params = M.init_sharded(cfg.model, jax.random.key(cfg.seed), mesh)
    tokens = jnp.zeros((mesh.size, 8), jnp.int32)
    tokens = jax.device_put(tokens, batch_sharding(mesh, 2, tokens.shape))
    mask = jnp.ones_like(tokens, bool)
    h, _ = jax.jit(lambda p, t, m: M.forward(p, t, M.positions_from_mask(m), m, cfg=cfg.model))(
        params, tokens, mask)
  print(f"{cfg.name}: forward pass ok, hidden {h.shape}, mesh {dict(mesh.shape)}")
  return 0
