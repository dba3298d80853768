"""Disaggregated actor and critic pools over a real redis-server on 127.0.0.1.

In-process tests run the actor and the critic as two threads, each on its own CPU device (its
own mesh), talking only through Redis: synchronous mode equals the colocated PPO step, the
wire format rejects malformed and foreign entries, back-pressure holds the producer.  The
fault tests (tests/test_pools_faults.py) run the pools as real processes and kill them.
"""

import dataclasses
import os
import sys
import threading
import time

import jax
import numpy as np
import pytest
import redis as redis_lib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from helpers import mesh  # noqa: E402
from redis_helpers import RedisServer  # noqa: E402
from jaxrlhf.config import (CheckpointConfig, ConfigError, LoggingConfig,  # noqa: E402
                            MeshConfig, PoolsConfig)
from jaxrlhf.mesh import make_mesh  # noqa: E402
from jaxrlhf.pools import store as S  # noqa: E402
from jaxrlhf.pools import wire  # noqa: E402
from jaxrlhf.pools.actor import run_actor  # noqa: E402
from jaxrlhf.pools.critic import run_critic  # noqa: E402
from jaxrlhf.data import DataSource  # noqa: E402
from jaxrlhf.pools.common import stage_key  # noqa: E402
from jaxrlhf.train.common import put_batch  # noqa: E402
from jaxrlhf.train.ppo import PPOStage  # noqa: E402
from test_train import config  # noqa: E402


@pytest.fixture
def redis_url(tmp_path):
  server = RedisServer(tmp_path).start()
  try:
    yield server.url
  finally:
    server.stop()


class Records:
  """A MetricsWriter stand-in that keeps the records."""

  def __init__(self):
    self.by_step = {}

  def write(self, stage, step, metrics):
    self.by_step.setdefault(step, {}).update(metrics)

  def close(self):
    pass


def pools_config(steps=10, **pools):
  cfg = config()
  return dataclasses.replace(
      cfg, name="pools_test", stages=("ppo",), ppo=dataclasses.replace(cfg.ppo, steps=steps),
      checkpoint=CheckpointConfig(every_steps=5, keep=2, async_save=False),
      logging=LoggingConfig(console=False, tensorboard=False),
      pools=PoolsConfig(**pools))


def colocated(cfg, steps):
  """The colocated PPO stage as the pipeline runs it (same stage key); per-step metrics."""
  m = mesh()
  stage = PPOStage(cfg, m, DataSource(cfg.data, cfg.seed))
  state, frozen = stage.init(stage_key(cfg), {})
  out, fn = [], None
  for step in range(steps):
    batch = put_batch(m, stage.batch(step))
    with jax.set_mesh(m):
      fn = fn or stage.make_step_fn(state, frozen, batch)
      state, metrics = fn(state, frozen, batch)
    out.append({k: float(v) for k, v in jax.device_get(metrics).items()})
  return state, out


def run_pools(cfg, url, workdir, roles=None):
  """Actor on device 0, critic on device 1, as threads; returns (actor out, critic out, the
  two metric records)."""
  logs = []
  out, errors = {}, []
  recs = {"actor": Records(), "critic": Records()}
  meshes = {"actor": mesh(), "critic": make_mesh(MeshConfig(), jax.devices()[1:2])}
  fns = {"actor": run_actor, "critic": run_critic}

  def go(role):
    try:
      store = S.Store(url, wait_s=30, log=logs.append)
      out[role] = fns[role](cfg, str(workdir), store, meshes[role], roles or {},
                            log=logs.append, writer=recs[role],
                            should_stop=lambda: bool(errors))
    except BaseException as e:  # noqa: BLE001 - reported by the test thread
      errors.append((role, e))

  threads = [threading.Thread(target=go, args=(r,)) for r in ("critic", "actor")]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=600)
  assert not errors, (errors, logs[-20:])
  return out["actor"], out["critic"], recs, logs


def test_sync_pools_match_colocated_ppo(redis_url, tmp_path):
  cfg = pools_config(steps=10, mode="sync")
  t0 = time.time()
  state, reference = colocated(cfg, 10)
  print(f"colocated: {time.time() - t0:.1f}s")
  t0 = time.time()
  actor, critic, recs, _ = run_pools(cfg, redis_url, tmp_path)
  print(f"pools: {time.time() - t0:.1f}s")
  assert sorted(recs["actor"].by_step) == list(range(1, 11))
  assert sorted(recs["critic"].by_step) == list(range(1, 11))
  tol = dict(rtol=2e-4, atol=2e-5)
  for step, ref in enumerate(reference, 1):
    a, c = recs["actor"].by_step[step], recs["critic"].by_step[step]
    for k in ("policy/loss", "policy/clip_frac", "entropy/mean", "kl/mean", "grad_norm",
              "response_length/mean"):
      np.testing.assert_allclose(a[k], ref[k], err_msg=f"step {step} {k}", **tol)
    for k in ("reward/mean", "reward/std", "value/loss", "value/explained_variance"):
      np.testing.assert_allclose(c[k], ref[k], err_msg=f"step {step} {k}", **tol)
    # The colocated loss is the sum of the two pools' shares.
    np.testing.assert_allclose(a["loss/policy"] + c["loss/value"], ref["loss"],
                               err_msg=f"step {step} loss", **tol)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **tol),
               jax.device_get(actor["state"].params["policy"]),
               jax.device_get(state.params["policy"]))
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **tol),
               jax.device_get(critic["state"].params["value"]),
               jax.device_get(state.params["value"]))
