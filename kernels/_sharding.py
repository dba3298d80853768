"""Lets XLA's SPMD partitioner run a Pallas kernel shard by shard.

A ``pallas_call`` is opaque to the partitioner: without help, a kernel whose operands are
sharded over a mesh is given the *whole* arrays on every device (an all-gather in, a slice
out) — the opposite of what a sharded trainer wants.  :func:`per_shard` wraps a function of
arrays in ``custom_partitioning`` with an einsum-like sharding rule, so batch-like dimensions
stay sharded and the function runs on each device's shard; dimensions the kernel needs whole
(sequence, head_dim, vocabulary) are listed as ``replicated`` and gathered only if they were
sharded.  A ``reduced`` dimension is summed inside the function and across its mesh axes
(``psum``), e.g. dW over the token axis.  On one device it is a no-op.
"""

from __future__ import annotations

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec


def _factors(rule: str) -> list[str]:
  seen = []
  for name in rule.replace("->", ",").replace(",", " ").split():
    if name not in seen:
      seen.append(name)
  return seen


def per_shard(fn, rule: str, *, replicated: tuple[str, ...] = (), reduced: str | None = None):
  """``fn`` wrapped so that the partitioner runs it per shard; see the module docstring.

  ``rule``: operand and result dimensions, e.g. ``"b t h d, b s h d -> b t h d"``.
  ``reduced``: a factor in the operands but not the results, summed over its mesh axes.
  """
  order = _factors(rule)
  replicated = tuple(sorted(replicated, key=order.index))  # Shardy wants them in rule order
  operand_rules = [r.split() for r in rule.split("->")[0].split(",")]
  result_rules = [r.split() for r in rule.split("->")[1].split(",")]

  def whole(mesh, dims, sharding):
    """``sharding`` with the ``replicated`` dimensions gathered.  Shardy's propagation does
    not always replicate them (an fsdp-sharded d of W reached the kernel as a shard), and
    the shardings returned here are the ones the operands are resharded to."""
    if not isinstance(sharding, NamedSharding):
      return sharding
    spec = tuple(sharding.spec) + (None,) * (len(dims) - len(sharding.spec))
    return NamedSharding(mesh, PartitionSpec(*[None if d in replicated else e
                                               for d, e in zip(dims, spec)]))

  def positional(*args):  # custom_partitioning binds arguments by signature
    return fn(*args)

  op = custom_partitioning(positional)

  def partition(mesh, arg_shapes, result_shape):
    arg_shardings = tuple(whole(mesh, dims, x.sharding)
                          for dims, x in zip(operand_rules, arg_shapes))
    result_shardings = jax.tree.map(lambda x: x.sharding, result_shape)
    flat, tree = jax.tree.flatten(result_shardings)
    result_shardings = jax.tree.unflatten(
        tree, [whole(mesh, dims, s) for dims, s in zip(result_rules, flat)])
    lower = fn
    if reduced is not None:
      axes = ()
      for dims, sharding in zip(operand_rules, arg_shardings):
        if reduced in dims and isinstance(sharding, NamedSharding):
          spec = tuple(sharding.spec) + (None,) * len(dims)
          entry = spec[dims.index(reduced)]
          axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
          break
      if axes:
        lower = lambda *args: jax.tree.map(lambda x: jax.lax.psum(x, axes), fn(*args))
      # The results hold no trace of the reduced factor: replicate them over its axes.
      result_shardings = jax.tree.map(
          lambda s: NamedSharding(mesh, PartitionSpec(*[
              None if (e in axes or (isinstance(e, tuple) and set(e) & set(axes))) else e
              for e in s.spec])), result_shardings)
    return mesh, lower, result_shardings, arg_shardings

  op.def_partition(partition=partition, sharding_rule=rule,
                   need_replication_factors=replicated,
                   reduction_factors=(reduced,) if reduced else ())
  return op
