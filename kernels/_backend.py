"""Shared by the kernel folders: choosing an implementation by backend, and small helpers the
Pallas kernels use (a transposing dot with float32 accumulation, padded sizes, the compiler
parameters of the target).

Choice policy, one place for every op:
  * ``"auto"`` picks the op's entry in its ``auto`` table for the target platform
    (:func:`target_platform`: the devices of the mesh the program is traced under):
    Pallas on GPU and TPU, the XLA path on CPU.
  * ``"pallas"`` needs a GPU or a TPU; each has its own kernels (Triton on GPU, Mosaic or
    jax's own TPU ops on TPU: ``kernels/NOTES.md``).  On the CPU it fails with a message
    naming the fix.
  * ``"pallas_interpret"`` runs the same Pallas kernels in the Pallas interpreter on any backend
    (the TPU kernels when the target is a TPU, the Triton ones otherwise).  It is slow and
    meant for tests and debugging, so it is only ever used when asked for.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu


def target_platform() -> str:
  """The platform of the program being traced ("cpu", "gpu", "tpu"): the devices of the mesh
  in context (``jax.set_mesh``, as every step, evaluation and plan is traced), so a program
  compiled for other devices than the host's (the planner's, compile-only GPU or TPU
  devices) makes that platform's choices, not the host's.  With no mesh set (a bare call in a
  test or benchmark) a jit compiles for the device it places its arguments on, which is the
  target there: ``jax_default_device`` when set (``jax.default_device(...)``), else the first
  device; every step, evaluation and plan of the trainer is traced under its mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else getattr(mesh, "abstract_device", None)
  if device is not None:
    return platform_of(device)
  default = jax.config.jax_default_device  # a device, a platform name, or None
  if isinstance(default, str):
    return platform_of_name(default)
  return platform_of(default if default is not None else jax.devices()[0])


def platform_of(device) -> str:
  """A device's platform as the kernels choose by it: "cpu", "gpu" (CUDA or ROCm) or "tpu"."""
  return platform_of_name(device.platform)


def platform_of_name(platform: str) -> str:
  return "gpu" if platform in ("cuda", "rocm") else platform


def resolve_impl(op: str, impl: str, valid: tuple[str, ...], auto: dict[str, str],
                 platform: str | None = None) -> str:
  """The implementation to run for ``impl`` on ``platform`` (default: the target's,
  :func:`target_platform`), or a ValueError naming the choices."""
  if impl not in valid:
    choices = ", ".join(repr(v) for v in valid)
    raise ValueError(f"kernels.{op}={impl!r} is not valid; choose one of {choices}")
  backend = platform or target_platform()
  if impl == "auto":
    return auto.get(backend, "xla")
  if impl == "pallas" and backend not in ("gpu", "tpu"):
    raise ValueError(
        f"kernels.{op}='pallas' needs a GPU or a TPU (this backend is {backend!r}): the Pallas "
        f"kernels are compiled through Triton or Mosaic.  Use kernels.{op}=xla, or "
        f"kernels.{op}=pallas_interpret to run the kernel in the Pallas interpreter (slow; for "
        f"debugging).")
  return impl


def triton_params(num_warps: int, num_stages: int):
  """The Triton kernels' compiler parameters, or Mosaic's defaults when the target is a TPU:
  a Triton parameters object reaching Mosaic's lowering fails there as a bare
  AssertionError.  (The Triton kernels themselves do not lower under Mosaic, see
  ``kernels/NOTES.md``; with these the error is Mosaic's own, naming the operation.)"""
  if target_platform() == "tpu":
    return pltpu.CompilerParams()
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
  """2-D matmul with float32 accumulation; the transposes are folded into the contraction
  (Triton's ``tl.dot`` takes them for free, a materialised ``.T`` would not)."""
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def padded(n: int, minimum: int = 16) -> int:
  """The next power of two >= ``n`` and >= ``minimum``: Triton blocks are powers of two, and
  ``tl.dot`` needs at least 16 along each dimension."""
  p = minimum
  while p < n:
    p *= 2
  return p


def cdiv(a, b: int):
  """Ceiling division that also works on traced non-negative int32 scalars inside kernels."""
  if isinstance(a, int):
    return -(-a // b)
  return jax.lax.div(a + (b - 1), b)
