"""Test set-up: 8 simulated CPU devices, so sharding is tested on real 2x4 / 2x2x2 meshes.

The flag must be set before jax initialises its backend, hence here, before any test module
imports jax.  The simulated devices are threads of one process: XLA aborts the whole process
when one of them waits more than 40 s (its default) for the others at a collective, which a
2-core machine running 8 device threads next to other work can reach without any deadlock
(one suite run aborted so, inside a trainer step on 8 devices).  Ten minutes here.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_cpu_collective_call_terminate_timeout_seconds=600").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() != "gpu":
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
      if "gpu" in item.keywords:
        item.add_marker(skip)
