"""The device mesh (``dp`` x ``fsdp`` x ``tp``), the closed list of logical axes, and the two
rule tables that map them onto mesh axes: one for parameters, one for activations.

Every array in the project names its dimensions with logical axes from :data:`LOGICAL_AXES`;
only this file knows how those become mesh axes.  A mesh axis is dropped from a dimension it
does not divide (the dimension is replicated instead), so small models run on any mesh;
:func:`assert_sharded` catches large parameters that ended up replicated.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxrlhf.config import ConfigError, MeshConfig

MESH_AXES = ("dp", "fsdp", "tp")

# The closed list of logical axes.  Adding one means adding it to both tables below.
LOGICAL_AXES = (
    "batch",  # examples (sequences)
    "seq",  # positions in a sequence / KV-cache slots
    "embed",  # d_model
    "mlp",  # MLP hidden
    "heads",  # query heads
    "kv_heads",  # key/value heads
    "head_dim",  # per-head features
    "vocab",  # vocabulary
    "layers",  # stacked (scanned) layers
    "lora",  # a LoRA adapter's rank
)

Rules = Mapping[str, Optional[tuple[str, ...]]]

# Parameters: ZeRO-3 style over fsdp on the model dimension, Megatron style over tp.
PARAM_RULES: Rules = {
    "batch": None,
    "seq": None,
    "embed": ("fsdp",),
    "mlp": ("tp",),
    "heads": ("tp",),
    "kv_heads": ("tp",),
    "head_dim": None,
    "vocab": ("tp",),
    "layers": None,
    "lora": None,  # a LoRA adapter's rank: small, never sharded
}

# Frozen roles (reference, reward during RL) also shard over dp: they have no optimizer state,
# so spreading them over every data replica costs 1/N of their size per device.
FROZEN_PARAM_RULES: Rules = {**PARAM_RULES, "embed": ("dp", "fsdp")}

# Decoding (the RL step's generation, docs/rollout.md): weights tensor-parallel only, whole on
# every tp group (replicated over dp and fsdp), so a decoded token reads local weights instead
# of all-gathering the fsdp shards again; the KV cache follows the activations' rules.
DECODE_PARAM_RULES: Rules = {**PARAM_RULES, "embed": None}

# Activations: batch over the data axes, features over tp where the weights put them.
ACT_RULES: Rules = {
    "batch": ("dp", "fsdp"),
    "seq": None,
    "embed": None,
    "mlp": ("tp",),
    "heads": ("tp",),
    "kv_heads": ("tp",),
    "head_dim": None,
    "vocab": ("tp",),
    "layers": None,
    "lora": None,
}

for _table in (PARAM_RULES, FROZEN_PARAM_RULES, DECODE_PARAM_RULES, ACT_RULES):
  assert set(_table) == set(LOGICAL_AXES), "every rule table must cover every logical axis"


def resolve_mesh_shape(cfg: MeshConfig, n_devices: int) -> dict[str, int]:
  """Mesh axis sizes for ``n_devices``, with one -1 filled in; a clear error if it won't fit."""
  sizes = {"dp": cfg.dp, "fsdp": cfg.fsdp, "tp": cfg.tp}
  free = [k for k, v in sizes.items() if v == -1]
  if len(free) > 1:
    raise ConfigError(f"mesh: at most one axis may be -1, got {sizes}")
  for k, v in sizes.items():
    if v == 0 or v < -1:
      raise ConfigError(f"mesh.{k}={v}: sizes must be positive or -1")
  fixed = math.prod(v for v in sizes.values() if v != -1)
  if free:
    if n_devices % fixed:
      raise ConfigError(
          f"mesh {sizes}: the fixed axes multiply to {fixed}, which does not divide the "
          f"{n_devices} devices present; use axis sizes whose product divides {n_devices} "
          f"(divisors: {_divisors(n_devices)})")
    sizes[free[0]] = n_devices // fixed
  if math.prod(sizes.values()) != n_devices:
    raise ConfigError(
        f"mesh {sizes} needs {math.prod(sizes.values())} devices but {n_devices} are present; "
        f"set one axis to -1 (e.g. --set=mesh.dp=-1) or use sizes multiplying to {n_devices}")
  return sizes


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def make_mesh(cfg: MeshConfig, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """The ``dp x fsdp x tp`` mesh over ``devices`` (default: all), GSPMD-style (Auto) axes."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = resolve_mesh_shape(cfg, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  if len(devices) == len(jax.devices()):
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES,
              axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _mesh_sizes(mesh) -> dict[str, int]:
  return dict(mesh.shape)


def logical_to_spec(axes: Sequence[Optional[str]], rules: Rules, shape: Optional[Sequence[int]] = None,
                    mesh=None) -> P:
  """PartitionSpec for logical ``axes``; with ``shape`` and ``mesh``, mesh axes that do not divide
  a dimension are dropped (that part of the dimension is replicated)."""
  sizes = _mesh_sizes(mesh) if mesh is not None else None
  used: set[str] = set()
  spec = []
  for i, name in enumerate(axes):
    if name is None:
      spec.append(None)
      continue
    if name not in rules:
      raise ValueError(f"unknown logical axis {name!r}; the closed list is {LOGICAL_AXES}")
    mesh_axes = [a for a in (rules[name] or ()) if a not in used]
    if sizes is not None:
      mesh_axes = [a for a in mesh_axes if a in sizes]
      if shape is not None:
        kept, prod = [], 1
        for a in mesh_axes:
          if shape[i] % (prod * sizes[a]) == 0:
            kept.append(a)
            prod *= sizes[a]
        mesh_axes = kept
      mesh_axes = [a for a in mesh_axes if sizes[a] > 1]
    used.update(mesh_axes)
    spec.append(tuple(mesh_axes) if len(mesh_axes) > 1 else (mesh_axes[0] if mesh_axes else None))
  return P(*spec)


def tree_shardings(mesh: Mesh, axes_tree, abstract_tree, rules: Rules = PARAM_RULES):
  """NamedShardings for a tree of arrays (or ShapeDtypeStructs) with a parallel tree of axes."""
  return jax.tree.map(
      lambda ax, x: NamedSharding(mesh, logical_to_spec(ax, rules, x.shape, mesh)),
      axes_tree, abstract_tree, is_leaf=_is_axes)


def _is_axes(x) -> bool:
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def constrain(x: jax.Array, axes: Sequence[Optional[str]], rules: Rules = ACT_RULES) -> jax.Array:
  """Sharding constraint on an activation by logical axes; a no-op outside a mesh context."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, rules, x.shape, mesh))


def batch_sharding(mesh: Mesh, ndim: int, shape: Optional[Sequence[int]] = None) -> NamedSharding:
  """Sharding of a ``[batch, ...]`` input array: batch over the data axes."""
  axes = ("batch",) + (None,) * (ndim - 1)
  return NamedSharding(mesh, logical_to_spec(axes, ACT_RULES, shape, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def assert_sharded(abstract_tree, shardings_tree, *, min_bytes: int = 4 << 20, what: str = "params"):
  """Raises if any parameter of at least ``min_bytes`` is fully replicated on a mesh whose
  ``fsdp`` x ``tp`` axes could shard it (a rules table that misses a large parameter is a memory
  bug at scale).  A mesh of ``dp`` alone replicates the trained weights by design (data
  parallelism: every device holds the model, as for a 135M model on 8 GPUs); the planner's
  memory figures say whether that fits."""
  bad = []
  for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(abstract_tree),
                          jax.tree.leaves(shardings_tree)):
    nbytes = math.prod(x.shape) * np.dtype(x.dtype).itemsize
    could_shard = s.mesh.size > dict(s.mesh.shape).get("dp", 1)
    if nbytes >= min_bytes and could_shard and s.is_fully_replicated:
      bad.append(f"{jax.tree_util.keystr(path)} {tuple(x.shape)} ({nbytes / 2**20:.1f} MiB)")
  if bad:
    raise AssertionError(f"{what}: large parameters are fully replicated: " + "; ".join(bad))
