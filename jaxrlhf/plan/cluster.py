"""The cluster a plan is for: node topology, usable memory, and the simulated devices
the programs are compiled on (set up before jax starts its backends)."""

from __future__ import annotations

import os

from jaxrlhf.config import ConfigError
from jaxrlhf.train.preflight import GB


# Node topology, which the accelerator table does not hold: devices per node sharing the
# fast interconnect, and each device's share of the network between nodes (bytes/s, one
# direction).  NVIDIA HGX/DGX H100, H200 and B200 nodes have 8 GPUs on NVSwitch and one
# 400 Gb/s ConnectX-7 InfiniBand NIC per GPU = 50 GB/s per GPU per direction (NVIDIA DGX H100
# and DGX B200 user guides, "networking").  A TPU v5p slice connects every chip by ICI (the
# 3D torus), so a whole slice counts as one node.
NODES: dict[str, tuple[int, float]] = {
    "h100": (8, 50 * GB), "h200": (8, 50 * GB), "b200": (8, 50 * GB),
    "tpu-v5p": (8960, 600 * GB),
}


# A program fits when its peak is at most this share of the device's memory: the rest is
# for the runtime, the CUDA context and fragmentation (run GPUs with
# XLA_PYTHON_CLIENT_MEM_FRACTION=.95 so JAX may use it).
USABLE_FRACTION = 0.9


def node_of(accelerator: str) -> tuple[int, float]:
  return NODES.get(accelerator, (8, 50 * GB))


def simulate_devices(n: int) -> None:
  """Makes jax start with at least ``n`` CPU devices (and only the CPU backend).  Must run
  before jax initialises its backends; afterwards it checks there are enough."""
  # Quieten the SPMD partitioner's C++ warnings (read when jax loads, so set it first).
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import jax
  from jax._src import xla_bridge
  if not xla_bridge.backends_are_initialized():
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", max(n, 1))
  have = len(jax.devices("cpu"))
  if have < n:
    raise ConfigError(
        f"planning for {n} devices needs {n} simulated CPU devices but jax already started "
        f"with {have}; run the planner in a fresh process (python -m jaxrlhf.main --plan ...)")


def enable_compile_cache() -> None:
  """The trainer's persistent XLA cache (:func:`jaxrlhf.perf.enable_compilation_cache`,
  ``JAXRLHF_COMPILATION_CACHE``): re-planning the same programs loads them instead of
  compiling.  Imported here, not at the top: planning sets up simulated devices first."""
  from jaxrlhf.perf import enable_compilation_cache
  enable_compilation_cache()
