"""Test set-up: 8 simulated CPU devices, so sharding is tested on real 2x4 / 2x2x2 meshes.

The flag must be set before jax initialises its backend, hence here, before any test module
imports jax.  The simulated devices are threads of one process: XLA aborts the whole process
when one of them waits more than 40 s (its default) for the others at a collective, which a
2-core machine running 8 device threads next to other work can reach without any deadlock
(one suite run aborted so, inside a trainer step on 8 devices).  Ten minutes here.

A real deadlock also met that limit (CI, tests/test_samples.py, a GRPO step on 8 devices):
XLA's CPU client runs every device's part of a program, and the dispatch of the next one, on
one pool sized to the larger of the cores and the devices, 8 threads here; with two programs
in flight the 8 threads can all hold parts waiting at collectives for a part that has no
thread left (gdb: seven devices in an all-reduce, one in another program's all-gather, 0%
CPU).  Two threads per device (``PJRT_NPROC``, read when the client starts; inherited by
the tests' subprocesses) leave room for both.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_cpu_collective_call_terminate_timeout_seconds=600").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PJRT_NPROC", "16")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)


# Every compiled program stays loaded while jax's caches hold it, and a loaded CPU
# executable maps memory regions for its code and data: about 5 for a small program, about
# 1,000 for a refill loop (tests/test_refill.py alone peaks at 34,000).  The suite in one
# process reached Linux's limit of 65,530 mappings (vm.max_map_count) at 77% of `pytest -q`,
# where XLA's next mmap failed inside a compile or a cache write and the process died (a
# segfault or an abort; the core held 65,275 mappings, NOTES.md).  So jax's caches are
# emptied after each test module, and after any test that leaves the process over half the
# limit.
_MAPS = "/proc/self/maps"
_MAPS_HIGH = 30_000


def _mappings() -> int:
  try:
    with open(_MAPS, "rb") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux
    return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  yield
  jax.clear_caches()


@pytest.fixture(autouse=True)
def _release_compiled_programs_when_mapped_high():
  yield
  if _mappings() > _MAPS_HIGH:
    jax.clear_caches()


def pytest_collection_modifyitems(config, items):
  from kernels._backend import platform_of
  if platform_of(jax.devices()[0]) != "gpu":
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
      if "gpu" in item.keywords:
        item.add_marker(skip)
