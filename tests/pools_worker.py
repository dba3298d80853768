"""One pool (``--role=actor|critic``) of a tiny disaggregated PPO run in its own process,
through the real entry path (:func:`jaxrlhf.pools.run.run_role`), so
tests/test_pools_faults.py can SIGKILL it, restart it, and take Redis away under it.

The config is tests/test_pools.py's (tiny PPO, ``--steps`` steps, a checkpoint every
``--every``); what the pool did goes to ``--events`` as JSON lines.
"""

import os

if __name__ == "__main__":
  # Only as a subprocess: one CPU device, its own mesh.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=1").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from jaxrlhf.config import (CheckpointConfig, LoggingConfig, PoolsConfig)  # noqa: E402
from jaxrlhf.pools import run  # noqa: E402
from test_train import config as tiny_config  # noqa: E402


def build(steps: int, every: int, mode: str):
  cfg = tiny_config()
  return dataclasses.replace(
      cfg, name="pools_faults", stages=("ppo",),
      ppo=dataclasses.replace(cfg.ppo, steps=steps),
      checkpoint=CheckpointConfig(every_steps=every, keep=2),
      logging=LoggingConfig(console=False, sinks=("jsonl",)),
      pools=PoolsConfig(mode=mode, redis_wait_s=60.0, peer_wait_s=240.0))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--role", choices=("actor", "critic"), required=True)
  p.add_argument("--workdir", required=True)
  p.add_argument("--redis_url", required=True)
  p.add_argument("--events", required=True)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--every", type=int, default=2)
  p.add_argument("--mode", default="sync")
  args = p.parse_args()
  cfg = build(args.steps, args.every, args.mode)
  return run.run_role(cfg, args.workdir, args.role, args.redis_url, args.events)


if __name__ == "__main__":
  sys.exit(main())
