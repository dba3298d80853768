"""Sharded initialisation from the abstract state: ``eval_shape`` -> shardings ->
``jit(out_shardings)``, so no device ever holds a full copy of the parameters."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrlhf.config import ModelConfig
from jaxrlhf.mesh import PARAM_RULES, Rules, assert_sharded, tree_shardings
from jaxrlhf.model.transformer import init_params, param_axes


def abstract_params(cfg: ModelConfig, head: str = "lm"):
  """ShapeDtypeStructs of the parameters; allocates nothing."""
  return jax.eval_shape(functools.partial(init_params, cfg, head=head), jax.random.key(0))


def cast_floating(tree, dtype):
  """``tree`` with its floating leaves in ``dtype`` (integer leaves, and leaves already in
  it, as they are): arrays, or ``jax.ShapeDtypeStruct`` (their shardings kept)."""
  dt = jnp.dtype(dtype)

  def one(x):
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dt:
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, dt, sharding=x.sharding)
    return x.astype(dt)
  return jax.tree.map(one, tree)


def param_shardings(cfg: ModelConfig, mesh, head: str = "lm", rules: Rules = PARAM_RULES,
                    check: bool = True):
  """NamedShardings of the parameters on ``mesh``; with ``check``, asserts every large
  parameter is sharded."""
  abstract = abstract_params(cfg, head)
  shardings = tree_shardings(mesh, param_axes(cfg, head), abstract, rules)
  if check:
    assert_sharded(abstract, shardings)
  return shardings


def init_sharded(cfg: ModelConfig, key: jax.Array, mesh, head: str = "lm",
                 rules: Rules = PARAM_RULES):
  """Parameters initialised directly into their shardings on ``mesh``."""
  shardings = param_shardings(cfg, mesh, head, rules)
  return jax.jit(functools.partial(init_params, cfg, head=head), out_shardings=shardings)(key)
