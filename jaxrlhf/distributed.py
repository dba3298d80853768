"""Multi-process start-up (``jax.distributed``), called from the entry point only when asked."""

from __future__ import annotations

import os

import jax
import numpy as np

from jaxrlhf.config import DistributedConfig

# The variables JAX's own cluster auto-detection and common launchers set.
_ENV_HINTS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def wanted(cfg: DistributedConfig) -> bool:
  return cfg.enabled or bool(cfg.coordinator_address) or all(v in os.environ for v in _ENV_HINTS)


def initialize(cfg: DistributedConfig) -> None:
  """Joins the cluster described by ``cfg`` (or the JAX_* environment variables).

  Must run before anything touches a device.  On CPU, collectives across processes need
  ``gloo``, which is enabled here.
  """
  if cfg.cpu_collectives == "gloo":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs = {}
  address = cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  if address:
    kwargs["coordinator_address"] = address
  num = cfg.num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0"))
  if num:
    kwargs["num_processes"] = num
  pid = cfg.process_id if cfg.process_id >= 0 else int(os.environ.get("JAX_PROCESS_ID", "-1"))
  if pid >= 0:
    kwargs["process_id"] = pid
  jax.distributed.initialize(**kwargs)


def to_host(x: jax.Array) -> np.ndarray:
  """A device array's whole value on this host: gathered from every process when its shards
  live on several (a sharded parameter, a rollout whose rows the processes split)."""
  if x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
