"""Lets XLA's SPMD partitioner run a Pallas kernel shard by shard.

A ``pallas_call`` is opaque to the partitioner: without help, a kernel whose operands are
sharded over a mesh is given the *whole* arrays on every device (an all-gather in, a slice
out) — the opposite of what a sharded trainer wants.  :func:`per_shard` wraps a function of
arrays in ``custom_partitioning`` with an einsum-like sharding rule, so batch-like dimensions
stay sharded and the function runs on each device's shard; dimensions the kernel needs whole
(sequence, head_dim, vocabulary) are listed as ``replicated`` and gathered only if they were
sharded.  A ``reduced`` dimension is summed inside the function and across its mesh axes
(``psum``), e.g. dW over the token axis.  On one device it is a no-op.

On TPU, ``custom_partitioning`` does not compile: libtpu finds no partitioner for its custom
call ("Custom emitter for CustomSPMDPartitioning not found", jax issue #38196, on real TPUs
and on the compile-only ones alike).  There the same rule runs as a ``shard_map`` instead,
whose specs cannot wait for the partitioner's propagation: each factor named in
:data:`MANUAL_AXES` is split over its mesh axes (those of the mesh that divide it), the
activations' own layout (``jaxrlhf.mesh.ACT_RULES``: batch over the data axes, KV heads over
tp), so a kernel called on activations laid out by the model's rules needs no resharding;
every other factor is whole on every device.
"""

from __future__ import annotations

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from kernels._backend import target_platform

# The factors the shard_map path (TPU) splits, and over which mesh axes, in order: tokens and
# sequences over the data axes, KV heads over tp (jaxrlhf.mesh.ACT_RULES's "batch" and
# "kv_heads").  A factor missing here, or an axis missing from the mesh, is not split.
MANUAL_AXES = {"n": ("dp", "fsdp"), "b": ("dp", "fsdp"), "k": ("tp",)}
# Factors split exactly as another is, whatever the operands' order: "r", a paged pool's
# pages when they lie row by row (each data shard's rows hold its part of the pool).
LINKED_AXES = {"r": "b"}


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
  operand_rules, result_rules = _rules(rule)

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

  manual = per_shard_manual(fn, rule, replicated=replicated, reduced=reduced)

  def call(*args):
    return manual(*args) if target_platform() == "tpu" else op(*args)

  return call


def _rules(rule: str) -> tuple[list[list[str]], list[list[str]]]:
  return ([r.split() for r in rule.split("->")[0].split(",")],
          [r.split() for r in rule.split("->")[1].split(",")])


def per_shard_manual(fn, rule: str, *, replicated: tuple[str, ...] = (),
                     reduced: str | None = None):
  """``fn`` run per shard by a ``shard_map`` over the mesh in context (no mesh, or one device:
  ``fn`` itself), split as :data:`MANUAL_AXES` says; the same ``rule`` language as
  :func:`per_shard`.  Unlike ``custom_partitioning`` it is differentiable and ``fn`` may
  close over constants; what it cannot do is follow the operands' own shardings, so operands
  laid out otherwise are resharded to it."""
  operand_rules, result_rules = _rules(rule)

  def call(*args):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
      return fn(*args)
    return _shard_mapped(fn, mesh, operand_rules, result_rules, replicated, reduced, args)

  return call


def _manual_specs(mesh, operand_rules, replicated, args) -> dict[str, tuple[str, ...]]:
  """Factor -> the mesh axes it is split over on the shard_map path: those of
  :data:`MANUAL_AXES` in the mesh, of size > 1, whose product divides the factor's size, each
  axis used once; a factor of :data:`LINKED_AXES` takes its partner's."""
  sizes, used, out = dict(mesh.shape), set(), {}
  for dims, x in zip(operand_rules, args):
    for dim, n in zip(dims, x.shape):
      if dim in out or dim in replicated or dim not in MANUAL_AXES:
        continue
      kept, prod = [], 1
      for axis in MANUAL_AXES[dim]:
        if axis in sizes and axis not in used and sizes[axis] > 1 and n % (prod * sizes[axis]) == 0:
          kept.append(axis)
          prod *= sizes[axis]
      used.update(kept)
      out[dim] = tuple(kept)
  for dims in operand_rules:
    for dim in dims:
      if dim in LINKED_AXES and dim not in replicated:
        out[dim] = out.get(LINKED_AXES[dim], ())
  return out


def _spec(dims, factor_axes) -> PartitionSpec:
  entries = []
  for d in dims:
    axes = factor_axes.get(d, ())
    entries.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
  return PartitionSpec(*entries)


def _shard_mapped(fn, mesh, operand_rules, result_rules, replicated, reduced, args):
  """``fn(*args)`` as a ``shard_map`` over ``mesh`` with the specs of :func:`_manual_specs`
  (the TPU path, see the module docstring); a ``reduced`` factor is ``psum``med."""
  factor_axes = _manual_specs(mesh, operand_rules, replicated, args)
  in_specs = tuple(_spec(dims, factor_axes) for dims in operand_rules)
  out_specs = [_spec(dims, factor_axes) for dims in result_rules]
  summed = factor_axes.get(reduced, ()) if reduced else ()

  def local(*xs):
    out = fn(*xs)
    return jax.tree.map(lambda y: jax.lax.psum(y, summed), out) if summed else out

  out_struct = jax.eval_shape(fn, *args)
  if not isinstance(out_struct, (tuple, list)):
    out_specs = out_specs[0]
  else:
    out_specs = type(out_struct)(out_specs)
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)(*args)
