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
import jax.numpy as jnp
import numpy as np
import pytest
import redis as redis_lib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from helpers import mesh  # noqa: E402
from redis_helpers import RedisServer, free_port  # noqa: E402
from jaxrlhf.config import (CheckpointConfig, ConfigError, EnvConfig, LoggingConfig,  # noqa: E402
                            KLConfig, LoraConfig, MeshConfig, OptimizerConfig, PoolsConfig, PPOConfig,
                            RewardConfig, validate)
from jaxrlhf.mesh import make_mesh  # noqa: E402
from jaxrlhf.pools import store as S  # noqa: E402
from jaxrlhf.pools import wire  # noqa: E402
from jaxrlhf.pools.store import Inbox  # noqa: E402
from jaxrlhf.pools.actor import run_actor  # noqa: E402
from jaxrlhf.pools.critic import run_critic  # noqa: E402
from jaxrlhf.data import DataSource  # noqa: E402
from jaxrlhf.pools.common import stage_key  # noqa: E402
from jaxrlhf.train.common import put_batch  # noqa: E402
from test_train import config, run_steps  # noqa: E402


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

  def write_samples(self, stage, step, rows):
    self.samples = getattr(self, "samples", []) + [{**r, "step": step} for r in rows]

  def message(self, text):
    pass

  def close(self):
    pass


def pools_config(steps=10, **pools):
  cfg = config()
  return dataclasses.replace(
      cfg, name="pools_test", stages=("ppo",), ppo=dataclasses.replace(cfg.ppo, steps=steps),
      checkpoint=CheckpointConfig(every_steps=5, keep=2, async_save=False),
      logging=LoggingConfig(console=False, sinks=("jsonl",)),
      pools=PoolsConfig(**pools))


def colocated(cfg, steps):
  """The colocated PPO stage as the pipeline runs it (same stage key); per-step metrics."""
  _, state, _, out = run_steps(cfg, "ppo", mesh(), steps=steps, key=stage_key(cfg))
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


TOL = dict(rtol=2e-4, atol=2e-5)


def assert_pools_match(recs, reference, actor_keys, critic_keys, loss):
  """Each step's metrics of both pools equal the colocated step's (``reference``, one dict per
  step); ``loss(actor, critic)``: the colocated "loss" from the pools' shares."""
  steps = list(range(1, len(reference) + 1))
  assert sorted(recs["actor"].by_step) == sorted(recs["critic"].by_step) == steps
  for step, ref in enumerate(reference, 1):
    a, c = recs["actor"].by_step[step], recs["critic"].by_step[step]
    for pool, keys in ((a, actor_keys), (c, critic_keys)):
      for k in keys:
        np.testing.assert_allclose(pool[k], ref[k], err_msg=f"step {step} {k}", **TOL)
    np.testing.assert_allclose(loss(a, c), ref["loss"], err_msg=f"step {step} loss", **TOL)


def assert_same_params(got, want):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **TOL), jax.device_get(got),
               jax.device_get(want))


def test_sync_pools_match_colocated_ppo(redis_url, tmp_path):
  cfg = pools_config(steps=10, mode="sync")
  t0 = time.time()
  state, reference = colocated(cfg, 10)
  print(f"colocated: {time.time() - t0:.1f}s")
  t0 = time.time()
  actor, critic, recs, _ = run_pools(cfg, redis_url, tmp_path)
  print(f"pools: {time.time() - t0:.1f}s")
  assert len(reference) == 10
  # The colocated loss is the sum of the two pools' shares.
  assert_pools_match(recs, reference,
                     ("policy/loss", "policy/clip_frac", "entropy/mean", "kl/mean", "grad_norm",
                      "response_length/mean"),
                     ("reward/mean", "reward/std", "value/loss", "value/explained_variance"),
                     lambda a, c: a["loss/policy"] + c["loss/value"])
  assert_same_params(actor["state"].params["policy"], state.params["policy"])
  assert_same_params(critic["state"].params["value"], state.params["value"])


def grpo_pools_config(steps=4, **pools):
  """GRPO (group advantages, no value model) with LoRA on the policy, a host (Python)
  reward and a device rule, KL to the reference (the adapters' base) in the loss."""
  cfg = pools_config(steps=steps, **pools)
  return dataclasses.replace(cfg, stages=("grpo",), grpo=dataclasses.replace(
      cfg.grpo, steps=steps, kl=dataclasses.replace(cfg.grpo.kl, coef=0.05),
      optim=dataclasses.replace(cfg.grpo.optim, lr=1e-2), lora=LoraConfig(rank=4, alpha=8.0),
      reward=RewardConfig(sources=("host:exact_match", "rule:token_accuracy"),
                          weights=(1.0, 0.5))))


def test_sync_grpo_pools_with_lora_and_a_host_reward_match_colocated(redis_url, tmp_path):
  """The pools run any RL stage: GRPO's critic holds no value model (it scores, with the
  host reward on the decoded responses, and computes group advantages), the actor trains
  LoRA adapters over the reference; in sync mode the two equal the colocated GRPO step."""
  steps = 4
  cfg = grpo_pools_config(steps=steps, mode="sync")
  cfg = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, samples=3,
                                                             samples_every=2))
  samples = []
  _, state, _, reference = run_steps(cfg, "grpo", mesh(), steps=steps, key=stage_key(cfg),
                                     samples=samples)
  actor, critic, recs, _ = run_pools(cfg, redis_url, tmp_path)
  assert critic["state"].params == {}  # no value model
  assert "lora" in actor["state"].params["policy"]["layers"]  # adapters, not full weights
  assert os.path.isdir(os.path.join(tmp_path, "grpo.actor"))
  assert len(reference) == steps
  # The host reward ran in the critic: its counts are the critic's metrics.
  assert_pools_match(recs, reference,
                     ("policy/loss", "entropy/mean", "kl/mean", "kl/loss", "grad_norm",
                      "response_length/mean"),
                     ("reward/mean", "reward/std", "reward/host_errors", "reward/host_unscored"),
                     lambda a, c: a["loss/policy"])
  assert any(recs["critic"].by_step[s]["reward/std"] > 0 for s in range(1, steps + 1))
  assert_same_params(actor["state"].params["policy"], state.params["policy"])
  # logging.samples_every: the critic, which holds the rollout and its scores, records the
  # rollout's sample rows, the colocated step's: decoded text, host-reward scores.
  rollout = [r for r in recs["critic"].samples if r["kind"] == "rollout"]
  assert [r["step"] for r in rollout] == [2, 2, 2, 4, 4, 4]
  strip = lambda rows: [{k: v for k, v in r.items() if k != "reward"} for r in rows]  # noqa: E731
  assert strip(rollout) == strip(samples)
  np.testing.assert_allclose([r["reward"] for r in rollout], [r["reward"] for r in samples],
                             **TOL)


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_a_pool_restores_into_the_abstract_state_of_its_share(algo):
  """A restarted pool restores into ``abstract_roles`` (no fresh state allocated first): the
  same tree, shapes, dtypes and shardings as the state ``init_roles`` builds, for each pool,
  with PPO's value model and with GRPO's LoRA adapters over the reference."""
  from jaxrlhf.pools import common as C
  cfg = pools_config(steps=2) if algo == "ppo" else grpo_pools_config(steps=2)
  stage = C.build_stage(cfg, mesh())
  for role, extras in (("actor", stage.initial_extras().replace(reward_stats=None)),
                       ("critic", stage.initial_extras().replace(kl=None))):
    trained, frozen_roles = C.pool_roles(stage, role)
    state, frozen = C.init_roles(stage, stage_key(cfg), {}, trained, frozen_roles, extras)
    none, frozen_alone = C.init_roles(stage, stage_key(cfg), {}, trained, frozen_roles, extras,
                                      restoring=True)
    abstract = C.abstract_roles(stage, trained, frozen_roles, extras)
    describe = lambda t: jax.tree.map(  # noqa: E731
        lambda x: (x.shape, x.dtype, x.sharding.spec), t)
    assert none is None and describe(frozen_alone) == describe(frozen), role
    assert jax.tree.structure(abstract) == jax.tree.structure(state), role
    assert describe(abstract) == describe(state), role


def test_sync_dapo_pools_with_dynamic_sampling_match_colocated(redis_url, tmp_path):
  """Dynamic sampling across pools: the actor generates the over-sampled groups, the critic
  selects the informative ones (its score program holds the select phase) and sends their
  rows with the advantages; the actor trains on those rows.  Equal to the colocated step,
  including the groups kept and the rows the critic records as samples."""
  steps = 3
  cfg = grpo_pools_config(steps=steps, mode="sync")
  cfg = dataclasses.replace(
      cfg, logging=dataclasses.replace(cfg.logging, samples=4, samples_every=1),
      grpo=dataclasses.replace(cfg.grpo, batch_size=4, dynamic_sampling=True,
                               max_oversample=1.5, clip_high=0.28))
  samples = []
  _, state, _, reference = run_steps(cfg, "grpo", mesh(), steps=steps, key=stage_key(cfg),
                                     samples=samples)
  assert reference[0]["dynamic/generated_groups"] == 6  # ceil(4 x 1.5)
  # Some groups informative, not all (measured 2, 1, 0 of 6): the selection moves rows.
  assert any(0 < r["dynamic/informative_groups"] < 6 for r in reference)
  actor, critic, recs, _ = run_pools(cfg, redis_url, tmp_path)
  assert_pools_match(recs, reference,
                     ("policy/loss", "entropy/mean", "kl/mean", "grad_norm",
                      "response_length/mean"),
                     ("reward/mean", "dynamic/informative_groups", "dynamic/kept_groups",
                      "dynamic/shortfall_groups"),
                     lambda a, c: a["loss/policy"])
  assert_same_params(actor["state"].params["policy"], state.params["policy"])
  # The samples are the selected rows, each with its own prompt.
  rollout = [r for r in recs["critic"].samples if r["kind"] == "rollout"]
  assert [r["prompt"] for r in rollout] == [r["prompt"] for r in samples]
  assert [r["response"] for r in rollout] == [r["response"] for r in samples]


@pytest.mark.parametrize("leftover", ["drop", pytest.param("continue", marks=pytest.mark.slow),
                                      pytest.param("continue_keep", marks=pytest.mark.slow)])
def test_sync_grpo_pools_with_refill_match_colocated(redis_url, tmp_path, leftover):
  """Refill (continuous batching) in the actor: its rollout carries each row's prompt index
  (``prompt_index_B``) to the critic, which scores it as any rollout and sends advantages
  only (no selected rows: that is dynamic sampling's); equal to the colocated step.  With
  partial rollouts (``continue``, and ``continue_kv=keep``), the actor's state carries the
  leftover prompts and responses (and pages) from step to step as the colocated run's does."""
  steps = 2 if leftover == "drop" else 3
  cfg = grpo_pools_config(steps=steps, mode="sync")
  cfg = dataclasses.replace(
      cfg, rollout=dataclasses.replace(cfg.rollout, refill=True,
                                       refill_leftover=leftover.split("_")[0],
                                       continue_kv="keep" if "keep" in leftover else "recompute"),
      logging=dataclasses.replace(cfg.logging, samples=4, samples_every=1))
  if leftover != "drop":  # device rewards only (carry-over refuses host ones), and half
    # the vocabulary stops a response, so groups end at different steps and some are left
    cfg = dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, max_new_tokens=8,
                                         stop_token_ids=tuple(range(12, 36))),
        grpo=dataclasses.replace(cfg.grpo, reward=RewardConfig(
            sources=("rule:token_accuracy",))))
    validate(cfg)
  samples = []
  _, state, _, reference = run_steps(cfg, "grpo", mesh(), steps=steps, key=stage_key(cfg),
                                     samples=samples)
  actor, critic, recs, _ = run_pools(cfg, redis_url, tmp_path)
  carried = ("rollout/carried_in", "rollout/carried_out", "rollout/continued_tokens")
  assert_pools_match(recs, reference,
                     ("policy/loss", "entropy/mean", "kl/mean", "grad_norm",
                      "response_length/mean", "rollout/started")
                     + (carried if leftover != "drop" else ()),
                     ("reward/mean", "reward/std"), lambda a, c: a["loss/policy"])
  assert_same_params(actor["state"].params["policy"], state.params["policy"])
  rollout = [r for r in recs["critic"].samples if r["kind"] == "rollout"]
  assert [r["prompt"] for r in rollout] == [r["prompt"] for r in samples]
  if leftover != "drop":  # responses were carried over and gone on from
    assert any(m["rollout/continued_tokens"] > 0 for m in reference), reference
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(actor["state"].extras.carry),
                 jax.device_get(state.extras.carry))


def bucketed_config(algo, steps=3):
  """``algo`` in sync pools with prompt buckets (16 prompt columns, the prompts fill 5),
  length buckets and packing; 24 of the 48 tokens stop a response, so responses end at
  different lengths and the widths vary from step to step.  GRPO also corrects the
  rollout/trainer mismatch (``off_policy=tis``: a phase of the actor's update)."""
  cfg = pools_config(steps=steps, mode="sync") if algo == "ppo" else grpo_pools_config(
      steps=steps, mode="sync")
  rollout = dataclasses.replace(cfg.rollout, max_new_tokens=8, length_buckets=4,
                                prompt_buckets=4, pack=True, stop_token_ids=tuple(range(12, 36)))
  cfg = dataclasses.replace(cfg, rollout=rollout,
                            data=dataclasses.replace(cfg.data, max_prompt_len=16),
                            model=dataclasses.replace(cfg.model, max_seq_len=24))
  if algo == "grpo":
    cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, off_policy="tis"))
  return cfg


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_sync_pools_with_buckets_and_packing_match_colocated(algo, redis_url, tmp_path):
  """The pools run prompt buckets, length buckets and packing as the colocated step does:
  the actor cuts the rollout to its bucket after generation and packs it (the reference's
  pass packed), the critic packs it again from the key the actor sent (reward, values and
  the value update packed alike), and each step equals the colocated one."""
  cfg = bucketed_config(algo)
  _, state, _, reference = run_steps(cfg, algo, mesh(), steps=3, key=stage_key(cfg))
  actor, critic, recs, _ = run_pools(cfg, redis_url, tmp_path)
  widths = [recs["actor"].by_step[s]["rollout/update_width"] for s in (1, 2, 3)]
  assert widths == [m["rollout/update_width"] for m in reference]
  assert min(widths) < 8  # the rollouts were cut
  for s in (1, 2, 3):
    a = recs["actor"].by_step[s]
    assert a["rollout/prompt_width"] == 8.0 and a["pack/rows"] == reference[s - 1]["pack/rows"]
  actor_keys = ("policy/loss", "entropy/mean", "kl/mean", "grad_norm", "response_length/mean")
  if algo == "ppo":
    assert_pools_match(recs, reference, actor_keys, ("reward/mean", "value/loss"),
                       lambda a, c: a["loss/policy"] + c["loss/value"])
    assert_same_params(critic["state"].params["value"], state.params["value"])
  else:
    assert_pools_match(recs, reference, actor_keys + ("off_policy/is_weight_mean",),
                       ("reward/mean", "reward/std"), lambda a, c: a["loss/policy"])
  assert_same_params(actor["state"].params["policy"], state.params["policy"])


def test_sync_grpo_pools_with_a_multi_turn_environment_match_colocated(redis_url, tmp_path):
  """The actor runs the episodes (decode segments between a user's environment's steps) in
  place of its generation program and sends their returns with the rollout; the critic's
  reward adds them, as the colocated step does."""
  from test_episodes import _cfg
  lengthy = ("class Lengthy:\n"
             "  stop_strings = (' ',)\n"
             "  def reset(self, example):\n"
             "    self.turn = 0\n"
             "    return example['prompt']\n"
             "  def step(self, action):  # rewards that differ between rows\n"
             "    self.turn += 1\n"
             "    return 'ok ', len(action.strip()) / 4, self.turn == 2\n")
  cfg = dataclasses.replace(
      _cfg(tmp_path, lengthy, "Lengthy"), name="pools_env", stages=("grpo",),
      checkpoint=CheckpointConfig(every_steps=5, keep=2, async_save=False),
      logging=LoggingConfig(console=False, sinks=("jsonl",)), pools=PoolsConfig(mode="sync"))
  _, state, _, reference = run_steps(cfg, "grpo", mesh(), steps=2, key=stage_key(cfg))
  actor, _, recs, _ = run_pools(cfg, redis_url, tmp_path / "run")
  assert any(m["reward/std"] > 0 for m in reference)  # the returns differ between rows
  assert_pools_match(recs, reference, ("policy/loss", "kl/mean", "response_length/mean"),
                     ("reward/mean", "reward/std"), lambda a, c: a["loss/policy"])
  for s in (1, 2):  # the episodes' own metrics, from the actor
    env = {k for k in reference[s - 1] if k.startswith("env/")}
    assert env and env <= set(recs["actor"].by_step[s])
    assert all(recs["actor"].by_step[s][k] == reference[s - 1][k] for k in env)
  assert_same_params(actor["state"].params["policy"], state.params["policy"])


# ------------------------------------------------------------------ wire, store, security


def _msg(batch=0, run="r1", **arrays):
  arrays = arrays or {"x": np.arange(6, dtype=np.float32).reshape(2, 3),
                      "m": np.array([True, False])}
  return wire.Message(kind="scores", run=run, batch=batch, step=batch, policy_version=batch,
                      producer="test", meta={"a": 1.5}, arrays=arrays)


SCHEMA = {"x": ((2, 3), "float32"), "m": ((2,), "bool")}


def test_wire_round_trip_and_rejections():
  fields = wire.encode(_msg(batch=3))
  got = wire.decode(fields, kind="scores", run="r1", schema=SCHEMA)
  assert got.batch == 3 and got.meta == {"a": 1.5}
  np.testing.assert_array_equal(got.arrays["x"], np.arange(6).reshape(2, 3))
  assert b"pickle" not in fields[b"h"] and all(k == b"h" or k.startswith(b"a:") for k in fields)

  def reason(f, **kw):
    with pytest.raises(wire.WireError) as e:
      wire.decode(f, **{"kind": "scores", "run": "r1", "schema": SCHEMA, **kw})
    return str(e.value)

  assert "foreign" in reason(fields, run="other")
  assert "'rollout'" in reason(fields, kind="rollout")
  assert "magic" in reason({b"h": b'{"magic": "x"}'})
  assert "not JSON" in reason({b"h": b"\x80\x04pickle"})
  assert "no header" in reason({b"payload": b"1"})
  assert "bytes for" in reason({**fields, b"a:x": fields[b"a:x"][:-4]})
  bad = _msg(x=np.zeros((3, 2), np.float32), m=np.array([True, False]))
  assert "this run uses" in reason(wire.encode(bad))
  with pytest.raises(wire.WireError, match="dtype"):
    wire.encode(_msg(x=np.zeros(2, np.complex64)))


def test_wire_schema_of_bucketed_runs_takes_each_bucket_shape_and_nothing_else():
  """A run with buckets sends several shapes: a message must match one of them exactly."""
  narrow = {"x": ((2, 2), "float32"), "m": ((2,), "bool")}
  got = wire.decode(wire.encode(_msg(x=np.zeros((2, 2), np.float32), m=np.ones(2, bool))),
                    kind="scores", run="r1", schema=[SCHEMA, narrow])
  assert got.arrays["x"].shape == (2, 2)
  assert wire.decode(wire.encode(_msg()), kind="scores", run="r1",
                     schema=[SCHEMA, narrow]).arrays["x"].shape == (2, 3)
  with pytest.raises(wire.WireError, match=r"float32\[2, 3\] \(nor any of its 1 other bucket"):
    wire.decode(wire.encode(_msg(x=np.zeros((2, 4), np.float32), m=np.ones(2, bool))),
                kind="scores", run="r1", schema=[SCHEMA, narrow])
  assert S.max_entry_bytes([SCHEMA, narrow]) == S.max_entry_bytes(SCHEMA)


def test_redis_address_rules(monkeypatch):
  monkeypatch.delenv(S.PASSWORD_ENV, raising=False)
  monkeypatch.delenv(S.URL_ENV, raising=False)
  assert S.settings("") == (S.DEFAULT_URL, None)
  with pytest.raises(ConfigError, match="JAXRLHF_REDIS_PASSWORD"):
    S.settings("redis://10.1.2.3:6379/0")
  with pytest.raises(ConfigError, match="not in the URL|do not put"):
    S.settings("redis://:hunter2@127.0.0.1:6379/0")
  monkeypatch.setenv(S.PASSWORD_ENV, "s3cret")
  assert S.settings("rediss://10.1.2.3:6379/0") == ("rediss://10.1.2.3:6379/0", "s3cret")
  monkeypatch.setenv(S.URL_ENV, "redis://127.0.0.2:7000/1")
  assert S.settings("")[0] == "redis://127.0.0.2:7000/1"


def test_inbox_rejects_malformed_and_foreign_entries_and_publish_is_idempotent(redis_url):
  logs, events = [], []
  store = S.Store(redis_url, wait_s=5, log=logs.append)
  stream, index = "t:run:scores", "t:run:scores:index"
  inbox = Inbox(store, stream, index, "actor", "actor-0", kind="scores", run="r1",
                schema=SCHEMA, log=logs.append, event=lambda **e: events.append(e))
  raw = redis_lib.Redis.from_url(redis_url)
  raw.xadd(stream, {"junk": "1"})  # not ours at all
  raw.xadd(stream, wire.encode(_msg(batch=0, run="someone-else")))  # foreign run
  raw.xadd(stream, {**wire.encode(_msg(batch=0)), b"a:x": b"\x00" * 5})  # truncated array
  raw.xadd(stream, wire.encode(_msg(batch=0)))  # right shape, but not published: forged
  raw.xadd(stream, wire.encode(_msg(batch=1)))  # forged as well
  with pytest.raises(S.PeerTimeout, match="batch 0"):  # all five read and dropped by now
    inbox.take(0, timeout=0.5)
  assert store.publish(stream, index, 0, wire.encode(_msg(batch=0)), group="actor",
                       max_queue=10) is S.Published.ADDED
  assert store.publish(stream, index, 0, wire.encode(_msg(batch=0)), group="actor",
                       max_queue=10) is S.Published.PRESENT  # a restarted producer: no 2nd
  assert store.publish(stream, index, 1, wire.encode(_msg(batch=1)), group="actor",
                       max_queue=10) is S.Published.ADDED
  assert inbox.take(0, timeout=10).batch == 0
  assert inbox.take(1, timeout=10).batch == 1
  reasons = [e["reason"] for e in events if e["event"] == "rejected"]
  assert len(reasons) == 5, reasons
  assert any("no header" in r for r in reasons) and any("foreign" in r for r in reasons)
  assert any("bytes for" in r for r in reasons) and any("forged" in r for r in reasons)
  assert sum("rejected" in line for line in logs) == 5
  assert any("not published" in r for r in reasons)
  # Rejected entries are acked at once; taken ones when a checkpoint covers them.
  assert raw.xpending(stream, "actor")["pending"] == 2
  inbox.ack_through(1)
  assert raw.xpending(stream, "actor")["pending"] == 0
  store.trim(stream, index, "actor")
  assert raw.xlen(stream) == 0 and raw.hlen(index) == 0


def test_trim_survives_the_consumer_acking_between_its_calls(redis_url, monkeypatch):
  # The race that once killed an actor in the fault test: the group summary still counted a
  # pending entry, the consumer acked it, and XPENDING then had no oldest entry.
  store = S.Store(redis_url, wait_s=5, log=lambda line: None)
  stream, index = "t:race", "t:race:index"
  store.ensure_group(stream, "critic")
  for b in range(3):
    store.publish(stream, index, b, wire.encode(_msg(batch=b)), group="critic", max_queue=10)
  entries = [e for e, _ in store.read(stream, "critic", "c", pending=False)]
  assert len(entries) == 3
  stale = store.group_info(stream, "critic")
  assert int(stale["pending"]) == 3
  store.ack(stream, "critic", *entries)
  monkeypatch.setattr(store, "group_info", lambda *a: stale)
  store.trim(stream, index, "critic")
  assert store.r.xlen(stream) == 0 and store.r.hlen(index) == 0


def test_publish_waits_while_the_queue_is_full(redis_url):
  logs = []
  store = S.Store(redis_url, wait_s=5, log=logs.append)
  stream, index = "t:bp", "t:bp:index"
  store.ensure_group(stream, "critic")
  for b in range(2):
    assert store.publish(stream, index, b, wire.encode(_msg(batch=b)), group="critic",
                         max_queue=2) is S.Published.ADDED
  with pytest.raises(S.PeerTimeout, match="unread"):
    store.publish(stream, index, 2, wire.encode(_msg(batch=2)), group="critic", max_queue=2,
                  wait_s=0.5)
  assert any("max_queue" in line for line in logs)
  store.read(stream, "critic", "c", pending=False)  # the consumer reads one -> room again
  assert store.publish(stream, index, 2, wire.encode(_msg(batch=2)), group="critic",
                       max_queue=2, wait_s=5) is S.Published.ADDED


def test_unreachable_redis_is_retried_then_explained():
  logs = []
  store = S.Store(f"redis://127.0.0.1:{free_port()}/0", wait_s=1.0, log=logs.append,
                  socket_timeout=0.2)
  with pytest.raises(S.Unreachable, match="Start redis-server"):
    store.get_str("x")
  assert len(logs) >= 3 and "retry" in logs[0] and "unreachable" in logs[0]


# ------------------------------------------------------------------------------ async mode


def test_async_pools_overlap_generation_with_scoring_and_learn(redis_url, tmp_path):
  from test_learning import FAST, _sft_policy
  _, sft_state, _ = _sft_policy(40)
  steps = 16
  cfg = pools_config(steps=steps, mode="async", max_staleness=1)
  cfg = dataclasses.replace(
      cfg, data=dataclasses.replace(cfg.data, eval_size=64),
      ppo=PPOConfig(steps=steps, batch_size=32, eval_every=steps, value_optim=FAST,
                    optim=OptimizerConfig(lr=2e-3, warmup_steps=0, schedule="constant"),
                    kl=KLConfig(coef=0.01), reward=RewardConfig(sources=("rule:token_accuracy",))))
  actor, critic, recs, _ = run_pools(cfg, redis_url, tmp_path,
                                     roles={"policy": sft_state.params["policy"]})
  a, c = recs["actor"].by_step, recs["critic"].by_step
  # One step off: every update after the first uses a rollout of the previous policy.
  assert [a[s]["pools/staleness"] for s in range(1, steps + 1)] == [0.0] + [1.0] * (steps - 1)
  # Overlap: a step takes less than the actor's and the critic's work one after the other.
  steady = range(4, steps + 1)
  step_s = np.median([a[s]["time/step_s"] for s in steady])
  serial = np.median([a[s]["time/actor/generate_s"] + a[s]["time/actor/update_s"]
                      + c[s]["time/critic/score_s"] + c[s]["time/critic/update_s"]
                      for s in steady])
  # ...and less than generation, the policy update and scoring in a row (what a synchronous
  # step takes, the critic's value update overlapping the actor's): scoring is hidden.
  sync_like = np.median([a[s]["time/actor/generate_s"] + a[s]["time/actor/update_s"]
                         + c[s]["time/critic/score_s"] for s in steady])
  print(f"async step {step_s:.4f}s vs actor+critic phases {serial:.4f}s, "
        f"generate+update+score {sync_like:.4f}s")
  assert step_s < serial, (step_s, serial)
  start, end = actor["start_eval"]["eval/accuracy"], actor["eval/accuracy"]
  print(f"held-out exact match {start:.3f} -> {end:.3f}")
  assert end > start + 0.02, (start, end)
  r_first = np.mean([c[s]["reward/mean"] for s in range(1, 5)])
  r_last = np.mean([c[s]["reward/mean"] for s in range(steps - 3, steps + 1)])
  assert r_last > r_first, (r_first, r_last)


# ------------------------------------------------------------------------------- planning


def test_plan_each_pool_on_its_own_cluster():
  from jaxrlhf import registry
  from jaxrlhf.config import apply_overrides
  from jaxrlhf.pools.plan import plan_pools
  cfg = registry.get("ppo70b")
  sync = plan_pools(cfg, 32, "h100", 8, "h100")
  asyn = plan_pools(apply_overrides(cfg, ["pools.mode=async"]), 32, "h100", 8, "h100")
  # The slower pool bounds the asynchronous step; the synchronous one also waits for scoring.
  assert asyn.step_seconds == max(asyn.actor.seconds, asyn.critic.seconds)
  assert sync.step_seconds > asyn.step_seconds and asyn.bound == "actor"
  assert set(sync.actor.phases) == {"generate", "reference", "update_policy"}
  assert set(sync.critic.phases) == {"reward", "values", "update_value"}
  assert asyn.usd_per_hour == pytest.approx(40 * 3.0, rel=0.5)  # 40 H100s at ~$3/h
  assert asyn.usd_per_step == pytest.approx(asyn.step_seconds * asyn.usd_per_hour / 3600)
  # More critic devices do not help an actor-bound pipeline; a bigger actor pool does.
  assert plan_pools(cfg, 32, "h100", 16, "h100").step_seconds == pytest.approx(
      sync.step_seconds, rel=0.2)
  assert plan_pools(cfg, 64, "h100", 8, "h100").step_seconds < sync.step_seconds
  # Each pool is planned on its own accelerator.
  mixed = plan_pools(cfg, 32, "h100", 8, "b200")
  assert mixed.critic.accelerator.name == "b200" and mixed.critic.seconds < sync.critic.seconds


def test_truncated_importance_correction_of_stale_rollouts():
  """``pools.is_correction=c``: the ratio is taken to the current policy and advantages are
  weighted by min(pi_current / pi_behaviour, c); a fresh rollout gets weight 1, a stale
  one its truncated weight."""
  from jaxrlhf.pools.actor import actor_programs
  from jaxrlhf.pools.common import init_roles, pool_program
  from jaxrlhf.train.ppo import PPOStage
  from jaxrlhf.train.program import compose
  from jaxrlhf.train.types import Shaped, StepCarry
  m = mesh()

  def setup(cap):
    cfg = pools_config(steps=2, mode="async", is_correction=cap)
    stage = PPOStage(cfg, m, DataSource(cfg.data, cfg.seed))
    extras = stage.initial_extras().replace(reward_stats=None)
    state, frozen = init_roles(stage, stage_key(cfg), {}, ["policy"], ["reference"], extras)
    return stage, state, frozen

  stage, state, frozen = setup(2.0)
  rollout_phases, update_phases = actor_programs(stage)
  with jax.set_mesh(m):
    c = jax.jit(compose(stage, rollout_phases[0]))(frozen, put_batch(m, stage.batch(0)),
                                                StepCarry(state=state))
    state, ro = c.state, c.rollout
    adv = jax.random.normal(jax.random.key(1), ro.behaviour_logp_BN.shape)
    shaped = Shaped(adv_BN=adv, update_mask_BN=ro.response_mask_BN)

    def upd(ro):
      # Fresh copies each time: the update donates its whole carry (state, rollout, shaped),
      # and one buffer may not be donated twice (the mask is in the rollout and in shaped).
      st, ro, sh = (jax.tree.map(jnp.copy, t) for t in (state, ro, shaped))
      out = pool_program(stage, update_phases, st)(frozen, {}, StepCarry(state=st, rollout=ro,
                                                                        shaped=sh))
      return out.metrics

    mf = upd(ro)
    stale = upd(ro.replace(behaviour_logp_BN=ro.behaviour_logp_BN - 1.0))
    ahead = upd(ro.replace(behaviour_logp_BN=ro.behaviour_logp_BN + 1.0))
  assert float(mf["pools/is_weight_mean"]) == pytest.approx(1.0, abs=1e-4)
  # Behaviour log-probs 1 nat below the current policy's: weight e > 2, truncated to 2.
  assert float(stale["pools/is_truncated_frac"]) == 1.0
  assert float(stale["pools/is_weight_mean"]) == pytest.approx(2.0, rel=1e-5)
  # 1 nat above: weight 1/e, kept as is.
  assert float(ahead["pools/is_truncated_frac"]) == 0.0
  assert float(ahead["pools/is_weight_mean"]) == pytest.approx(np.exp(-1.0), rel=1e-3)


def test_configs_the_pools_cannot_run_are_refused():
  from jaxrlhf.pools.common import check_config
  base = pools_config(steps=2)
  for changes, match in [
      ({"stages": ("ppo", "dpo")}, "make the RL stage the last"),
      ({"ppo": dataclasses.replace(base.ppo, shared_backbone=True)}, "shared_backbone"),
      ({"pools": PoolsConfig(mode="async", max_staleness=0)}, "max_staleness"),
      ({"pools": PoolsConfig(max_queue=0)}, "max_queue"),
      ({"pools": PoolsConfig(is_correction=0.5)}, r"is_correction=0.5: 0 \(off\) or a cap > 1")]:
    with pytest.raises(ConfigError, match=match):
      check_config(dataclasses.replace(base, **changes))


# ------------------------------------------------------------------------- faults, in-process


@pytest.mark.slow  # 3-6 min on 2 cores; test_pools_safety checks the same rule in seconds
def test_a_critic_stopped_during_back_pressure_never_checkpoints_past_its_scores(redis_url,
                                                                                 tmp_path):
  """Finding 1 of issue 28: a stop while the scores stream is full makes publish return
  STOPPED.  The critic must not train on that batch, count it done, checkpoint or ack past
  it: after a restart it scores the batch again and the actor gets its advantages."""
  from jaxrlhf.checkpoint import checkpoint_dir
  cfg = dataclasses.replace(pools_config(steps=3, mode="sync", peer_wait_s=60.0),
                            checkpoint=CheckpointConfig(every_steps=1, keep=5, async_save=False))
  stop = {"critic": False, "actor": False}
  meshes = {"actor": mesh(), "critic": make_mesh(MeshConfig(), jax.devices()[1:2])}
  logs, errors, out = [], [], {}

  class StopsAtBatch1(S.Store):
    def publish(self, stream, index, batch, fields, **kw):
      if batch == 1:  # as if a SIGTERM came while the actor's queue was full
        stop["critic"] = True
        return S.Published.STOPPED
      return super().publish(stream, index, batch, fields, **kw)

  def go(role, store_cls):
    try:
      store = store_cls(redis_url, wait_s=30, log=logs.append)
      fn = run_actor if role == "actor" else run_critic
      out[role] = fn(cfg, str(tmp_path), store, meshes[role], {}, log=logs.append,
                     writer=Records(), should_stop=lambda: stop[role])
    except BaseException as e:  # noqa: BLE001 - reported below
      errors.append((role, e))

  threads = {"critic": threading.Thread(target=go, args=("critic", StopsAtBatch1)),
             "actor": threading.Thread(target=go, args=("actor", S.Store))}
  for t in threads.values():
    t.start()
  threads["critic"].join(timeout=600)
  stop["actor"] = True
  threads["actor"].join(timeout=600)
  assert not errors, (errors, logs[-20:])
  assert out["critic"]["done"] == 1, out["critic"]["done"]
  saved = [int(d) for d in os.listdir(checkpoint_dir(str(tmp_path), "ppo.critic")) if d.isdigit()]
  assert max(saved) == 1, saved  # nothing saved past the unpublished batch
  # Both come back; the critic scores batch 1 again and the run finishes.
  stop.update(critic=False, actor=False)
  threads = {r: threading.Thread(target=go, args=(r, S.Store)) for r in ("critic", "actor")}
  for t in threads.values():
    t.start()
  for t in threads.values():
    t.join(timeout=600)
  assert not errors, (errors, logs[-20:])
  assert out["critic"]["done"] == out["actor"]["done"] == 3
  # Finding 4: the checkpoint records the earlier stages' results it was built on, and a
  # pool restarted on a retrained one is refused, as a colocated stage is.
  store = S.Store(redis_url, wait_s=30, log=logs.append)
  with pytest.raises(ConfigError, match="rewritten since"):
    run_critic(cfg, str(tmp_path), store, meshes["critic"], {}, log=logs.append,
               writer=Records(), inputs={"rm": "retrained"})
