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
# In-process trainer runs (pipeline.run -> perf.configure_process) turn on jax's persistent
# compilation cache for the rest of the pytest process.  Two clean-clone suite runs died in
# its executable serialisation (a segfault in put_executable_and_time while caching
# tests/test_rollout.py's refill program, 2026-12-05, NOTES.md), which the same test with
# the cache on in a fresh process does not do.  This process never writes the cache; the
# tests' own subprocesses keep theirs (their environment).
jax.config.update("jax_enable_compilation_cache", False)


def pytest_collection_modifyitems(config, items):
  from kernels._backend import platform_of
  if platform_of(jax.devices()[0]) != "gpu":
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
      if "gpu" in item.keywords:
        item.add_marker(skip)
