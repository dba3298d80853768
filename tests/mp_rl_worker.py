"""One process of the two-process RL test: joins the cluster, builds a dp=2 x tp=4 mesh over
both processes' devices (the rollout's rows split between the processes) and runs two GRPO
steps in the mode of argv[4] (:func:`run`: packed forwards after generation, whose layout
is made on every host from the whole batch's mask, or a host reward, which every host computes
on the whole batch); process 0 writes the metrics.

The test starts it with XLA_FLAGS giving each process 4 simulated CPU devices."""

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp

from jaxrlhf import distributed
from jaxrlhf.config import DistributedConfig, MeshConfig
from jaxrlhf.mesh import make_mesh


def run(m, mode: str):
  """Two GRPO steps of tests/test_length_buckets.py's config on mesh ``m`` (``mode``:
  ``pack``, packed forwards; ``host``, the reward a host function's): their metrics and the
  parameters' sum of squares (a replicated scalar every process can read)."""
  from jaxrlhf.config import RewardConfig
  from test_length_buckets import config, run_steps
  cfg = config()
  cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, pack=mode == "pack"))
  if mode == "host":
    cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(
        cfg.grpo, reward=RewardConfig(sources=("host:exact_match",))))
  _, state, metrics = run_steps(cfg, m, steps=2)
  with jax.set_mesh(m):
    norm = jax.jit(lambda p: sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(p)),
                   out_shardings=jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec()))
    sq = float(jax.device_get(norm(state.params)))
  return [{k: v for k, v in x.items() if not k.startswith(("time/", "memory/"))}
          for x in metrics], sq


def main():
  port, pid, out, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
  distributed.initialize(DistributedConfig(enabled=True, coordinator_address=f"127.0.0.1:{port}",
                                           num_processes=2, process_id=pid))
  assert jax.process_count() == 2 and len(jax.devices()) == 8
  metrics, sq = run(make_mesh(MeshConfig(dp=2, tp=4)), mode)
  if pid == 0:
    with open(out, "w") as f:
      json.dump({"metrics": metrics, "params_sq": sq}, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
