"""Compile-only devices of a real accelerator, on a host that has none: a program built for an
H100/H200/B200 or a TPU slice is compiled here by that accelerator's own compiler (XLA:GPU's
sm_90/sm_100 pipeline with Triton and PTX, XLA:TPU), so what it holds (kernels, collectives)
and what it needs (``memory_analysis()``) come from the target, not from the CPU.

Needs the ``aot`` extra (``pip install -e '.[aot]'``): the CUDA plugin wheels (no CUDA
libraries or driver are needed to compile) and libtpu.  Two facts of those plugins shape this
module:

* The CUDA plugin checks the CUDA runtime when jax starts its backends and, finding none,
  leaves itself unregistered ("topology not implemented for cuda").  With the CPU as the only
  platform (``JAX_PLATFORMS=cpu``, as the tests set, or :func:`devices` called before jax
  has started its backends) it is loaded for compiling only and the check is skipped.
* XLA:GPU needs the device's facts (SMs, shared memory, registers, compute capability) to
  compile without a device: :data:`GPUS` is our table of them, rendered as the
  ``GpuTargetConfigProto`` text the plugin takes.  XLA keeps its own specs
  (``xla/backends/gpu/target_config/specs/``); the per-SM limits here agree with them, the
  sizes come from :mod:`jaxrlhf.hardware` (vendor datasheets).

The platform is chosen here, explicitly, never from the host's default backend.  A program
traced under a mesh of these devices makes that platform's choices (kernel dispatch and dtype
upcasts read the mesh: ``kernels._backend.target_platform``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os

import numpy as np

from jaxrlhf.config import ConfigError, MeshConfig
from jaxrlhf.hardware import ACCELERATORS

GiB = 2**30
INSTALL = "pip install -e '.[aot]'"


@dataclasses.dataclass(frozen=True)
class GpuFacts:
  """What XLA:GPU needs to know of a GPU to compile for it.  Sizes per device; limits per SM
  (``core``) or per thread block.  Hopper (sm_90) and Blackwell (sm_100) share the per-SM
  limits: 228 KiB shared memory per SM of which 227 KiB per block when opted in (48 KiB
  without), 64 K registers, 2048 threads (NVIDIA CUDA C Programming Guide, *Compute
  Capabilities*, table of technical specifications)."""

  description: str  # the device name XLA reports (``device_kind``)
  compute_capability: tuple[int, int]
  sms: int
  l2_bytes: int
  clock_ghz: float  # boost clock
  shared_per_sm: int = 228 * 1024
  shared_per_block_optin: int = 227 * 1024
  shared_per_block: int = 48 * 1024
  registers_per_sm: int = 64 * 1024
  threads_per_sm: int = 2048
  fp32_lanes_per_sm: int = 128
  cudnn: tuple[int, int] = (9, 1)  # the cuDNN the cuda12 wheels of jax 0.10 ship with

  def target_config(self, memory_bytes: float, bandwidth: float) -> str:
    """The ``GpuTargetConfigProto`` text ``get_topology_desc(..., target_config=)`` takes."""
    major, minor = self.compute_capability
    info = dict(
        threads_per_block_limit=1024, threads_per_warp=32,
        shared_memory_per_block=self.shared_per_block, shared_memory_per_core=self.shared_per_sm,
        threads_per_core_limit=self.threads_per_sm, core_count=self.sms,
        fpus_per_core=self.fp32_lanes_per_sm, block_dim_limit_x=2**31 - 1,
        block_dim_limit_y=65535, block_dim_limit_z=65535, memory_bandwidth=int(bandwidth),
        l2_cache_size=self.l2_bytes, clock_rate_ghz=self.clock_ghz,
        device_memory_size=int(memory_bytes),
        shared_memory_per_block_optin=self.shared_per_block_optin,
        registers_per_core_limit=self.registers_per_sm,
        registers_per_block_limit=self.registers_per_sm)
    fields = "\n".join(f"  {k}: {v}" for k, v in info.items())
    return (f"gpu_device_info {{\n{fields}\n"
            f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
            f'platform_name: "CUDA"\n'
            f"dnn_version_info {{ major: {self.cudnn[0]} minor: {self.cudnn[1]} }}\n"
            f'device_description_str: "{self.description}"\n')


# Datasheet facts (nvidia.com H100 / H200 / HGX B200 pages, and the architecture whitepapers
# for SM counts and L2): H100 SXM5 and H200 are the same GH100 die, 132 SMs, 50 MiB L2,
# 1.98 GHz boost; B200: 148 SMs, 126 MiB L2, compute capability 10.0.  Memory size and
# bandwidth: the ``hardware.ACCELERATORS`` entries.
GPUS: dict[str, GpuFacts] = {
    "h100": GpuFacts("NVIDIA H100 80GB HBM3", (9, 0), 132, 50 * 2**20, 1.98),
    "h200": GpuFacts("NVIDIA H200", (9, 0), 132, 50 * 2**20, 1.98),
    "b200": GpuFacts("NVIDIA B200", (10, 0), 148, 126 * 2**20, 1.965),
}

# TPU slices: libtpu's topology name and the chips' layout (2-D torus for the "e" chips,
# 3-D for v4/v5p), and each chip's HBM (cloud.google.com/tpu/docs/<version>: v4 32 GiB,
# v5e 16 GiB, v5p 95 GiB, v6e 32 GiB).
TPUS: dict[str, tuple[str, int, int]] = {
    "tpu-v4": ("v4", 3, 32 * GiB),
    "tpu-v5e": ("v5e", 2, 16 * GiB),
    "tpu-v5p": ("v5p", 3, 95 * GiB),
    "tpu-v6e": ("v6e", 2, 32 * GiB),
}
_TORUS = {2: {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
              256: "16x16"},
          3: {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
              256: "4x8x8", 512: "8x8x8"}}

NAMES = (*GPUS, *TPUS)


def platform_of(accelerator: str) -> str:
  """``"gpu"`` or ``"tpu"``; a ConfigError naming the choices for an unknown name."""
  key = accelerator.strip().lower()
  if key in GPUS:
    return "gpu"
  if key in TPUS:
    return "tpu"
  raise ConfigError(f"unknown target accelerator {accelerator!r}; choose one of "
                    + ", ".join(NAMES))


def memory_bytes(accelerator: str) -> float:
  """One device's memory (what a compiled program's peak is compared with)."""
  key = accelerator.strip().lower()
  return TPUS[key][2] if platform_of(key) == "tpu" else ACCELERATORS[key].memory_bytes


def missing(accelerator: str) -> str:
  """Why ``accelerator`` cannot be compiled for here ("" when it can): the package that is
  not installed, with the command that installs it."""
  if platform_of(accelerator) == "gpu":
    have = _installed("jax_plugins.xla_cuda12") and _installed("jax_cuda12_plugin")
    what = "the CUDA plugin (jax-cuda12-plugin, jax-cuda12-pjrt)"
  else:
    have = _installed("libtpu")
    what = "libtpu"
  return "" if have else (f"compiling for {accelerator} needs {what}, which is not installed: "
                          f"{INSTALL}")


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # its parent package is missing
    return False


def devices(accelerator: str, n: int) -> list:
  """``n`` compile-only devices of ``accelerator`` (one host of up to 8 GPUs, more hosts
  beyond; a TPU slice of ``n`` chips).  ConfigError when the plugin is missing or cannot
  start, or ``n`` is not a slice libtpu knows."""
  return list(_topology(accelerator.strip().lower(), n).devices)


@functools.lru_cache(maxsize=None)
def _topology(key: str, n: int):
  platform = platform_of(key)
  why = missing(key)
  if why:
    raise ConfigError(why)
  import jax
  from jax._src import xla_bridge
  from jax.experimental import topologies
  if not xla_bridge.backends_are_initialized() and not os.environ.get("JAX_PLATFORMS"):
    # The CUDA plugin registers itself for compiling only when the CPU is the sole platform
    # (see the module docstring); decided when the backends start, so before they do.
    jax.config.update("jax_platforms", "cpu")
  if platform == "gpu":
    per_host = min(n, 8)
    if n % per_host:
      raise ConfigError(f"{n} {key} devices: more than 8 must be whole hosts of 8")
    acc = ACCELERATORS[key]
    config = GPUS[key].target_config(acc.memory_bytes, acc.hbm_bandwidth)
    try:
      return topologies.get_topology_desc(key, "cuda", topology=f"1x{n // per_host}x{per_host}",
                                          target_config=config)
    except Exception as e:  # noqa: BLE001  (the plugin's own message, made one line)
      raise ConfigError(
          f"the CUDA plugin cannot compile for {key} in this process ({str(e)[:200]}); start "
          f"jax with JAX_PLATFORMS=cpu (the plugin skips its CUDA check then)") from e
  version, dims, _ = TPUS[key]
  if n not in _TORUS[dims]:
    raise ConfigError(f"{n} {key} chips: choose one of {sorted(_TORUS[dims])}")
  return topologies.get_topology_desc(f"{version}:{_TORUS[dims][n]}", "tpu")


def mesh(accelerator: str, mesh_cfg: MeshConfig, n: int):
  """The ``dp x fsdp x tp`` mesh (:mod:`jaxrlhf.mesh`) over ``n`` compile-only devices of
  ``accelerator``: trace and ``jit(...).lower(...).compile()`` under it, on abstract arrays."""
  from jax.sharding import AxisType, Mesh
  from jaxrlhf.mesh import MESH_AXES, resolve_mesh_shape
  sizes = resolve_mesh_shape(mesh_cfg, n)
  shape = tuple(sizes[a] for a in MESH_AXES)
  return Mesh(np.asarray(devices(accelerator, n)).reshape(shape), MESH_AXES,
              axis_types=(AxisType.Auto,) * len(MESH_AXES))


def peak_bytes(compiled) -> int:
  """A compiled program's bytes per device: arguments + outputs + temporaries, less what the
  outputs alias (donated arguments), from ``memory_analysis()``."""
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)


def check_fits(compiled, accelerator: str, what: str = "the program") -> int:
  """``peak_bytes(compiled)``, or a ConfigError when it is over the device's memory.  XLA:GPU
  compiles a program over the device's memory with only a log line, so this is the check."""
  peak, have = peak_bytes(compiled), memory_bytes(accelerator)
  if peak > have:
    raise ConfigError(f"{what} needs {peak / GiB:.2f} GiB per device, over the "
                      f"{have / GiB:.1f} GiB of one {accelerator}")
  return peak
