"""One pool (``--role=actor|critic``) of a tiny disaggregated PPO (or ``--algo=grpo``) run in its own process,
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

from jaxrlhf.config import (CheckpointConfig, LoggingConfig, LoraConfig, PoolsConfig,  # noqa: E402
                            RewardConfig)
from jaxrlhf.pools import run  # noqa: E402
from test_train import config as tiny_config  # noqa: E402


def build(steps: int, every: int, mode: str, algo: str = "ppo"):
  """Tiny PPO; or (``algo=grpo``) GRPO with LoRA adapters on the policy and a host (Python)
  reward beside a device rule, async one step off when ``mode=async``."""
  cfg = tiny_config()
  cfg = dataclasses.replace(
      cfg, name="pools_faults", stages=(algo,),
      ppo=dataclasses.replace(cfg.ppo, steps=steps),
      checkpoint=CheckpointConfig(every_steps=every, keep=2),
      logging=LoggingConfig(console=False, sinks=("jsonl",)),
      pools=PoolsConfig(mode=mode, max_staleness=1 if mode == "async" else 0,
                        redis_wait_s=60.0, peer_wait_s=240.0))
  if algo == "grpo":
    cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(
        cfg.grpo, steps=steps, lora=LoraConfig(rank=4, alpha=8.0),
        reward=RewardConfig(sources=("host:exact_match", "rule:token_accuracy"),
                            weights=(1.0, 0.5))))
  return cfg


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--role", choices=("actor", "critic"), required=True)
  p.add_argument("--workdir", required=True)
  p.add_argument("--redis_url", required=True)
  p.add_argument("--events", required=True)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--every", type=int, default=2)
  p.add_argument("--mode", default="sync")
  p.add_argument("--algo", default="ppo", choices=("ppo", "grpo"))
  args = p.parse_args()
  cfg = build(args.steps, args.every, args.mode, args.algo)
  return run.run_role(cfg, args.workdir, args.role, args.redis_url, args.events)


if __name__ == "__main__":
  sys.exit(main())
