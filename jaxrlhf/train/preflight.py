"""The wrong-machine guard: before anything is allocated, stop a run whose devices cannot
even hold its parameters and optimizer states; and the byte counts it (and the planner) use."""

from __future__ import annotations

import dataclasses
import math

from jaxrlhf import hardware
from jaxrlhf.config import ConfigError, ExperimentConfig, ModelConfig


GB = 1e9


def leaf_bytes(x) -> int:
  """Bytes one device holds of an abstract array (its shard under its sharding)."""
  import jax
  import numpy as np
  shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else (
      x.shape)
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    itemsize = 8
  else:
    itemsize = np.dtype(x.dtype).itemsize
  return int(math.prod(shape)) * itemsize


def tree_bytes(tree) -> int:
  import jax
  return sum(leaf_bytes(x) for x in jax.tree.leaves(tree))


def dtype_bytes(name: str) -> int:
  return {"float32": 4, "bfloat16": 2, "float16": 2}[name]


def param_bytes(m: ModelConfig, head: str) -> float:
  return m.num_params(head) * dtype_bytes(m.param_dtype)


def gb(x: float) -> str:
  return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x / GB:.1f}"


def state_bytes(cfg: ExperimentConfig) -> float:
  """Bytes of every stage's parameters and AdamW states in total (the largest stage), before
  any sharding: what the devices must hold between them at least."""
  import jax
  from jaxrlhf.train.spec import build_stage
  from jaxrlhf.data import DataSource
  data = DataSource(cfg.data, cfg.seed)
  best = 0.0
  for name in cfg.stages:
    stage = build_stage(name, cfg, None, data)
    total = 0.0
    for r in stage.layout.rows:
      if not r.trains:
        total += param_bytes(r.model, r.head)
      elif r.lora is None:  # master weights and Adam's two moments, in their precision's dtypes
        total += stage.precision[r.name].trained_bytes(r.model.num_params(r.head))
      else:  # LoRA: adapters x 3, and the base once (unless it is a frozen role above)
        total += stage.precision[r.name].trained_bytes(sum(
            x.size for x in jax.tree.leaves(r.abstract_trainable())))
        total += param_bytes(r.model, r.head) if r.owns_base else 0.0
    best = max(best, total)
  return best


def device_capacity(devices) -> tuple[float, str]:
  """Bytes one device can hold, and where the figure comes from: the allocator's limit on
  a GPU/TPU, the accelerator table when the runtime keeps no statistics, and on the CPU the
  host's memory shared by all its (simulated) devices."""
  d = devices[0]
  if d.platform == "cpu":
    total = hardware._host_memory_bytes()
    return total / len(devices), f"host memory {gb(total)} GB shared by {len(devices)} " \
                                 f"cpu device{'s' if len(devices) > 1 else ''}"
  stats = d.memory_stats() if hasattr(d, "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    return float(stats["bytes_limit"]), f"{d.device_kind} allocator limit"
  acc = hardware.detect_accelerator(d)
  if acc is not None:
    return acc.memory_bytes, f"{acc.name} datasheet"
  return math.inf, "unknown"


def states_per_device(cfg: ExperimentConfig, mesh) -> tuple[float, str]:
  """The largest stage's parameter and AdamW-moment bytes on one device of ``mesh`` (moments
  sharded like their parameters), and which stage that is.  Analytic: no compile, nothing
  allocated."""
  import jax
  from jaxrlhf import model as M
  from jaxrlhf.data import DataSource
  from jaxrlhf.mesh import FROZEN_PARAM_RULES, PARAM_RULES
  from jaxrlhf.train.spec import build_stage
  data = DataSource(cfg.data, cfg.seed)
  best, where = 0.0, ""
  for name in cfg.stages:
    stage = build_stage(name, cfg, mesh, data)
    if stage.lora:  # adapters, their moments and the frozen bases, as the stage lays them out
      state, frozen = stage.abstract_init()
      total = tree_bytes((state.params, state.opt_state, frozen))
      if total > best:
        best, where = total, name
      continue
    roles = [(r, h, PARAM_RULES, 3) for r, h in stage.trainable.items()]
    roles += [(r, h, FROZEN_PARAM_RULES, 1) for r, h in stage.frozen().items()]
    total = 0.0
    for role, head, rules, copies in roles:
      m = cfg.role_model(role)
      shardings = M.param_shardings(m, mesh, head, rules, check=False)
      shapes = M.abstract_params(m, head)
      total += copies * sum(leaf_bytes(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s))
                            for x, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)))
    if total > best:
      best, where = total, name
  return best, where


def preflight(cfg: ExperimentConfig) -> None:
  """Stops a run, before anything is allocated, when the devices present cannot even hold the
  experiment's parameters and optimizer states (a lower bound on what it needs: activations
  come on top).  Takes milliseconds for small models and well under a second at 70B; raises
  ConfigError with what is needed against what is present and the --plan commands."""
  import jax
  from jaxrlhf.mesh import make_mesh, resolve_mesh_shape
  devices = jax.devices()
  n = len(devices)
  capacity, source = device_capacity(devices)
  try:
    resolve_mesh_shape(cfg.mesh, n)
    mesh = make_mesh(cfg.mesh, devices)
    need, stage = states_per_device(cfg, mesh)
    how = f"on mesh {dict(mesh.shape)}"
  except ConfigError:  # the mesh does not fit these devices: assume perfect sharding
    need_total = state_bytes(cfg)
    need, stage, how = need_total / n, cfg.stages[-1], "even if perfectly sharded"
  if need <= capacity:
    return
  mesh_text = ",".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg.mesh).items())
  raise ConfigError(
      f"{cfg.name} cannot run on these devices: its {stage} stage's parameters and optimizer "
      f"states alone need {gb(need)} GB per device ({n} {devices[0].platform} "
      f"device{'s' if n > 1 else ''} present, {how}), but a device holds "
      f"{gb(capacity)} GB ({source}); activations come on top. It is sized for "
      f"{cfg.plan.devices} x {cfg.plan.accelerator} (mesh {mesh_text}). Size it without "
      f"allocating anything:\n"
      f"  python -m jaxrlhf.main --experiment={cfg.name} --plan "
      f"--devices={cfg.plan.devices} --accelerator={cfg.plan.accelerator}\n"
      f"  python -m jaxrlhf.main --experiment={cfg.name} --plan_search "
      f"--accelerator={cfg.plan.accelerator}")
