"""Test set-up: 8 simulated CPU devices, so sharding is tested on real 2x4 / 2x2x2 meshes.

The flag must be set before jax initialises its backend, hence here, before any test module
imports jax.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
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
