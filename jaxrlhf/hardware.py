"""What an accelerator can do: peak FLOP/s, memory bandwidth, interconnect, memory, price.

Utilisation figures (MFU, bandwidth use) divide what a program achieved by these ceilings, and
the planner sizes runs with them.  The table holds vendor datasheet figures; the CPU has no
datasheet we can trust across machines, so its ceilings are *measured* once (a large fp32
matmul, an in-place scale of a large array) and marked ``measured=True``.

Conventions: FLOP/s are dense (no 2:4 sparsity) bf16 tensor-core figures per device; bandwidths
are bytes/s per device; interconnect is the device's total bidirectional NVLink / ICI
bandwidth; memory is the datasheet capacity in bytes (what a program can allocate is somewhat
less); prices are US dollars per device-hour, on demand, approximate as of mid-2025, and
change often — override with ``dataclasses.replace(acc, usd_per_hour=...)``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Optional

from jaxrlhf.config import ConfigError

GB = 1e9
TB = 1e12


@dataclasses.dataclass(frozen=True)
class Accelerator:
  name: str
  peak_flops: float  # FLOP/s per device: dense bf16 (fp32 for the measured CPU)
  hbm_bandwidth: float  # bytes/s per device
  interconnect_bandwidth: float  # bytes/s per device, all links, both directions
  interconnect: str  # e.g. "NVLink 4", "ICI 3D torus"
  memory_bytes: float  # per device
  usd_per_hour: float  # per device, on demand
  measured: bool = False  # True: ceilings measured on this machine, not from a datasheet
  note: str = ""

  def describe(self) -> str:
    origin = "measured here" if self.measured else "datasheet"
    return (f"{self.name}: {self.peak_flops / 1e12:.4g} TFLOP/s, "
            f"{self.hbm_bandwidth / GB:.4g} GB/s memory, {self.memory_bytes / GB:.4g} GB "
            f"({origin})")


ACCELERATORS: dict[str, Accelerator] = {
    # NVIDIA H100 SXM5 datasheet (nvidia.com/en-us/data-center/h100): BF16 tensor core
    # 1,979 TFLOPS *with sparsity* -> 989 dense; 80 GB HBM3 at 3.35 TB/s; NVLink 4 900 GB/s
    # (18 links x 50 GB/s, both directions).  Price: ~$3/GPU-hour, typical on-demand rate of
    # specialist GPU clouds (e.g. Lambda's 8x H100 SXM list price); hyperscalers charge 2-4x.
    "h100": Accelerator("h100", 989e12, 3.35 * TB, 900 * GB, "NVLink 4", 80 * GB, 3.00),
    # NVIDIA H200 SXM datasheet (nvidia.com/en-us/data-center/h200): same GH100 compute as
    # H100 (989 dense bf16 TFLOPS), 141 GB HBM3e at 4.8 TB/s, NVLink 4 900 GB/s.
    # Price: ~$3.50/GPU-hour, typical specialist-cloud on-demand.
    "h200": Accelerator("h200", 989e12, 4.8 * TB, 900 * GB, "NVLink 4", 141 * GB, 3.50),
    # NVIDIA HGX B200 datasheet (nvidia.com/en-us/data-center/hgx): per GPU at 1,000 W,
    # FP16/BF16 tensor core 4.5 PFLOPS with sparsity -> 2.25 dense; 180 GB HBM3e at 7.7 TB/s;
    # NVLink 5 1.8 TB/s.  Price: ~$5/GPU-hour, typical specialist-cloud on-demand (Lambda
    # list price $4.99).
    "b200": Accelerator("b200", 2250e12, 7.7 * TB, 1800 * GB, "NVLink 5", 180 * GB, 5.00),
    # Google Cloud TPU v5p (cloud.google.com/tpu/docs/v5p): 459 TFLOPS bf16 per chip,
    # 95 GiB HBM2e at 2,765 GB/s, ICI 1,200 GB/s bidirectional per chip (3D torus).
    # Price: $4.20 per chip-hour, Google Cloud on-demand list price (us-east5).
    "tpu-v5p": Accelerator("tpu-v5p", 459e12, 2765 * GB, 1200 * GB, "ICI 3D torus",
                           95 * 2**30, 4.20),
}


def get_accelerator(name: str) -> Accelerator:
  """The table entry for ``name`` ("cpu" measures this machine); raises ConfigError."""
  key = name.strip().lower()
  if key == "cpu":
    return cpu_accelerator()
  if key not in ACCELERATORS:
    valid = ", ".join(repr(k) for k in (*ACCELERATORS, "cpu"))
    raise ConfigError(f"unknown accelerator {name!r}; choose one of {valid}")
  return ACCELERATORS[key]


def detect_accelerator(device=None) -> Optional[Accelerator]:
  """The table entry matching a jax device (default: the first), the measured CPU for a CPU
  device, or None for an accelerator the table does not know."""
  import jax
  device = device if device is not None else jax.devices()[0]
  if device.platform == "cpu":
    return cpu_accelerator()
  kind = device.device_kind.lower()
  for key, token in (("h100", "h100"), ("h200", "h200"), ("b200", "b200"),
                     ("tpu-v5p", "v5p")):
    if token in kind:
      return ACCELERATORS[key]
  return None


# ------------------------------------------------------------------------------ measured


def _best_time(fn, arg, repeats: int) -> float:
  import jax
  jax.block_until_ready(fn(arg))  # compile and warm up
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(arg))
    best = min(best, time.perf_counter() - t0)
  return best


def measure_cpu_peak_flops(n: int = 1024, repeats: int = 5) -> float:
  """FLOP/s of XLA's fp32 ``[n, n] @ [n, n]`` on the first CPU device, best of ``repeats``.

  Anything else running on the cores lowers the figure; it is an achieved ceiling, not a
  theoretical one.
  """
  import jax
  import jax.numpy as jnp
  dev = jax.devices("cpu")[0]
  a = jax.device_put(jnp.full((n, n), 0.5, jnp.float32), dev)
  matmul = jax.jit(lambda x: x @ x)
  return 2.0 * n ** 3 / _best_time(matmul, a, repeats)


def measure_copy_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 5) -> float:
  """Memory bandwidth (bytes/s, read + write) of an in-place scale of an ``nbytes`` fp32
  array on the first CPU device, best of ``repeats``.

  The input buffer is donated so the output reuses it: a fresh output would measure the
  kernel's page faults, not the memory.
  """
  import jax
  import jax.numpy as jnp
  dev = jax.devices("cpu")[0]
  scale = jax.jit(lambda x: x * 0.5, donate_argnums=0)
  state = [jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), dev)]

  def step(_):
    state[0] = scale(state[0])
    return state[0]

  return 2.0 * (nbytes // 4) * 4 / _best_time(step, None, repeats)


def _host_memory_bytes() -> float:
  try:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
  except (ValueError, OSError, AttributeError):
    return float("nan")


@functools.lru_cache(maxsize=None)
def cpu_accelerator() -> Accelerator:
  """This machine's CPU as an accelerator, with peak FLOP/s and bandwidth measured (once per
  process, about a second) and marked ``measured=True``."""
  return Accelerator(
      name="cpu", peak_flops=measure_cpu_peak_flops(), hbm_bandwidth=measure_copy_bandwidth(),
      interconnect_bandwidth=float("nan"), interconnect="none",
      memory_bytes=_host_memory_bytes(), usd_per_hour=0.0, measured=True,
      note="fp32 matmul and in-place scale measured at start-up")
