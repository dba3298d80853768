"""The pools' defences, one mechanism at a time, against a real redis-server on 127.0.0.1
(issue 28): a publish whose reply an outage ate, a stop during back-pressure, entries no
decoder may crash on, credentials that must never show, a wrong password, an out-of-memory
or evicting Redis, a second process on one pool folder, runs that share a Redis.  Fast (no
model is compiled); the end-to-end fault and chaos tests are tests/test_pools_faults.py.
"""

import dataclasses
import json
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest
import redis as redis_lib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from redis_helpers import RedisServer  # noqa: E402
from jaxrlhf.config import ConfigError, GRPOConfig, PoolsConfig, validate  # noqa: E402
from jaxrlhf.pools import common as C  # noqa: E402
from jaxrlhf.pools import run as R  # noqa: E402
from jaxrlhf.pools import store as S  # noqa: E402
from jaxrlhf.pools import wire  # noqa: E402
from jaxrlhf.pools.store import Inbox, Published  # noqa: E402

SCHEMA = {"x": ((2, 3), "float32"), "m": ((2,), "bool")}


def _msg(batch=0, run="r1", **arrays):
  arrays = arrays or {"x": np.arange(6, dtype=np.float32).reshape(2, 3),
                      "m": np.array([True, False])}
  return wire.Message(kind="scores", run=run, batch=batch, step=batch, policy_version=batch,
                      producer="test", meta={"a": 1.5}, arrays=arrays)


@pytest.fixture
def server(tmp_path):
  s = RedisServer(tmp_path).start()
  try:
    yield s
  finally:
    s.stop()


# --------------------------------------------------------------- the clean-run failure


def test_a_publish_whose_reply_was_lost_is_published_not_stopped(server):
  """The fault test's lost batch: Redis ran the publish script, was killed before its reply
  left, and the retry found the batch already indexed.  That used to read as "stopped during
  back-pressure", so the actor never counted batch b as published (and died on the scores
  of a rollout it no longer held)."""
  logs = []
  store = S.Store(server.url, wait_s=5, log=logs.append)
  real = store._publish
  lost = []

  def runs_then_drops(*a, **kw):
    out = real(*a, **kw)
    if not lost:
      lost.append(out)
      raise redis_lib.ConnectionError("Connection closed by server.")
    return out

  store._publish = runs_then_drops
  store.ensure_group("t:s", "critic")
  got = store.publish("t:s", "t:s:index", 0, wire.encode(_msg()), group="critic", max_queue=4)
  assert got is Published.PRESENT and got.published, got
  assert store.r.xlen("t:s") == 1  # once, not twice
  assert any("reachable again" in line for line in logs)


def test_a_stop_during_back_pressure_publishes_nothing(server):
  store = S.Store(server.url, wait_s=5, log=lambda line: None)
  store.ensure_group("t:s", "actor")
  assert store.publish("t:s", "t:s:index", 0, wire.encode(_msg()), group="actor",
                       max_queue=1) is Published.ADDED
  got = store.publish("t:s", "t:s:index", 1, wire.encode(_msg(batch=1)), group="actor",
                      max_queue=1, should_stop=lambda: True)
  assert got is Published.STOPPED and not got.published
  assert store.r.xlen("t:s") == 1 and store.r.hget("t:s:index", "1") is None


# ------------------------------------------------------------------- malformed entries


def _fuzz_entries(rng):
  good = wire.encode(_msg())
  header = json.loads(good[b"h"])
  yield {b"h": b"[" * 50_000 + b"]" * 50_000}  # RecursionError in json
  yield {b"h": (b'{"a":' * 3000) + b"1" + b"}" * 3000}
  bad_name = dict(header, arrays=[{"name": "\ud800", "dtype": "float32", "shape": [1]}])
  yield {b"h": json.dumps(bad_name).encode()}  # UnicodeEncodeError on 'a:NAME'
  yield {b"h": json.dumps(dict(header, arrays=[{"name": "x", "dtype": "float32",
                                                 "shape": [10 ** 12, 10 ** 12]}])).encode()}
  yield {b"h": json.dumps(dict(header, meta=[1, 2])).encode()}
  yield {b"h": json.dumps(dict(header, batch=2 ** 80)).encode(), **{k: v for k, v in
                                                                     good.items() if k != b"h"}}
  yield {b"h": json.dumps(dict(header, arrays=[{"name": f"n{i}", "dtype": "bool", "shape": []}
                                                for i in range(1000)])).encode()}
  yield {b"h": b'{"magic": "jaxrlhf-pools", "version": NaN}'}
  for _ in range(200):
    raw = bytearray(good[b"h"])
    for _ in range(rng.randrange(1, 8)):
      raw[rng.randrange(len(raw))] = rng.randrange(256)
    yield {**good, b"h": bytes(raw)}


def test_no_entry_makes_decode_raise_anything_but_a_wire_error():
  rng = random.Random(0)
  n = 0
  for fields in _fuzz_entries(rng):
    try:
      wire.decode(fields, kind="scores", run="r1", schema=SCHEMA)
    except wire.WireError:
      n += 1
  assert n >= 200


def test_a_malformed_entry_is_rejected_and_acked_not_a_crash_on_every_restart(server):
  events = []
  store = S.Store(server.url, wait_s=5, log=lambda line: None)
  stream, index = "t:run:scores", "t:run:scores:index"
  raw = redis_lib.Redis.from_url(server.url)
  inbox = Inbox(store, stream, index, "actor", "actor-0", kind="scores", run="r1",
                schema=SCHEMA, event=lambda **e: events.append(e), log=lambda line: None)
  bad = list(_fuzz_entries(random.Random(1)))[:8]
  for fields in bad:
    raw.xadd(stream, fields)
  raw.xadd(stream, {b"h": wire.encode(_msg())[b"h"], b"a:x": b"\0" * 10_000_000})  # too big
  with pytest.raises(S.PeerTimeout):
    inbox.take(0, timeout=1.0)
  assert sum(e["event"] == "rejected" for e in events) == len(bad) + 1
  assert any("bytes; a scores" in e.get("reason", "") for e in events)
  assert raw.xpending(stream, "actor")["pending"] == 0  # acked: a restart never sees them
  # Reads ask for no more than fit the byte budget at the largest genuine entry's size.
  small = Inbox(store, stream, index, "actor", "actor-1", kind="scores", run="r1",
                schema=SCHEMA, read_bytes=1)
  assert small.count == 1 and inbox.count == 16


def test_the_restart_re_read_is_paged(server):
  store = S.Store(server.url, wait_s=5, log=lambda line: None)
  store.ensure_group("t:p", "g")
  for b in range(40):
    store.r.xadd("t:p", {"b": b})
  assert len(store.read("t:p", "g", "c", pending=False, count=40)) == 40
  calls = []
  real = store.r.xreadgroup
  store.r.xreadgroup = lambda *a, **kw: calls.append(kw.get("count")) or real(*a, **kw)
  got = store.read("t:p", "g", "c", pending=True, count=16, block_ms=1)
  assert len(got) == 40 and max(c for c in calls) == 16 and len(calls) >= 3


# ----------------------------------------------------------------------------- security


def test_credentials_in_urls_are_refused_and_never_shown(monkeypatch):
  monkeypatch.delenv(S.PASSWORD_ENV, raising=False)
  for url in ("redis://127.0.0.1:6379/0?password=hunter2",
              "redis://127.0.0.1:6379/0?db=1&PASSWORD=hunter2",
              "redis://:hunter2@127.0.0.1:6379/0",
              "rediss://user:hunter2@10.1.2.3:6379/0"):
    with pytest.raises(ConfigError) as e:
      S.settings(url)
    assert "hunter2" not in str(e.value) and "JAXRLHF_REDIS_PASSWORD" in str(e.value), url
  with pytest.raises(ConfigError) as e:  # off the machine, no password: named, redacted
    S.settings("redis://10.1.2.3:6379/0?ssl_ca_certs=/etc/secret-ca.pem")
  assert "secret-ca" not in str(e.value) and "10.1.2.3" in str(e.value)
  assert S.redact("redis://u:p@h:1/0?password=x&db=2") == "redis://h:1/0?password=***&db=***"


def test_off_machine_redis_needs_tls(monkeypatch):
  monkeypatch.setenv(S.PASSWORD_ENV, "s3cret")
  with pytest.raises(ConfigError, match="rediss://"):
    S.settings("redis://10.1.2.3:6379/0")
  assert S.settings("rediss://10.1.2.3:6379/0") == ("rediss://10.1.2.3:6379/0", "s3cret")
  assert S.settings("redis://127.0.0.1:6379/0")[0] == "redis://127.0.0.1:6379/0"


def test_a_wrong_password_is_an_error_at_once(tmp_path):
  server = RedisServer(tmp_path, password="right-one").start()
  try:
    t0 = time.monotonic()
    store = S.Store(server.url, "wrong-one", wait_s=300, log=lambda line: None)
    with pytest.raises(S.StoreError, match="JAXRLHF_REDIS_PASSWORD") as e:
      store.get_str("x")
    assert time.monotonic() - t0 < 5 and "wrong-one" not in str(e.value)
    with pytest.raises(S.StoreError, match="authentication"):
      S.Store(server.url, None, wait_s=300, log=lambda line: None).get_str("x")
  finally:
    server.stop()


def test_the_local_redis_of_role_all_has_a_password_and_survives_a_taken_port(tmp_path,
                                                                              monkeypatch):
  import socket
  taken = socket.socket()
  taken.bind(("127.0.0.1", 0))
  taken.listen(1)
  ports = iter([taken.getsockname()[1]])
  real = R._free_port
  monkeypatch.setattr(R, "_free_port", lambda: next(ports, None) or real())
  proc, url = R.start_local_redis(str(tmp_path), "pw-123")
  try:
    assert str(taken.getsockname()[1]) not in url
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(redis_lib.AuthenticationError):
      redis_lib.Redis(port=port).ping()
    assert redis_lib.Redis(port=port, password="pw-123").ping()
    cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read()
    assert b"pw-123" not in cmdline  # not in the process list
  finally:
    R.stop_process(proc, 10)
    taken.close()


# ------------------------------------------------------------------------- Redis memory


def test_out_of_memory_is_named_and_evicting_policies_are_refused(server):
  store = S.Store(server.url, wait_s=5, log=lambda line: None)
  store.check_server()  # noeviction: fine
  store.r.config_set("maxmemory", "2mb")
  store.ensure_group("t:m", "critic")
  with pytest.raises(S.StoreError, match="maxmemory") as e:
    for b in range(100):
      store.publish("t:m", "t:m:index", b, {"h": b"x" * 200_000}, group="critic",
                    max_queue=1000)
  assert "noeviction" in str(e.value)
  store.r.config_set("maxmemory", "0")
  store.r.config_set("maxmemory-policy", "allkeys-lru")
  with pytest.raises(S.StoreError, match="allkeys-lru"):
    store.check_server()


def test_an_evicted_index_is_reported_not_read_as_forgery(server, monkeypatch):
  store = S.Store(server.url, wait_s=5, log=lambda line: None)
  stream, index = "t:e", "t:e:index"
  inbox = Inbox(store, stream, index, "actor", "a", kind="scores", run="r1", schema=SCHEMA,
                log=lambda line: None)
  store.publish(stream, index, 0, wire.encode(_msg()), group="actor", max_queue=4)
  store.r.delete(index)  # what an allkeys-* eviction does
  monkeypatch.setattr(store, "evicted", lambda: 1)
  with pytest.raises(S.StoreError, match="evicted"):
    inbox.take(0, timeout=2)


# ----------------------------------------------------------------- settings and folders


def test_settings_that_can_deadlock_or_divide_by_zero_are_refused():
  from test_pools import pools_config
  base = pools_config(steps=2)
  with pytest.raises(ConfigError, match="deadlock"):
    C.check_config(dataclasses.replace(base, pools=PoolsConfig(mode="async", max_staleness=5,
                                                               max_queue=2)))
  C.check_config(dataclasses.replace(base, pools=PoolsConfig(mode="async", max_staleness=4,
                                                             max_queue=2)))
  for eps in (0.0, -1e-6, float("nan")):
    cfg = dataclasses.replace(base, stages=("grpo",), grpo=GRPOConfig(std_eps=eps))
    with pytest.raises(ConfigError, match="grpo.std_eps"):
      validate(cfg)


def test_one_process_per_pool_folder(tmp_path):
  with C.PoolLock(str(tmp_path / "ppo.actor"), "the actor pool"):
    with pytest.raises(ConfigError, match=f"pid {os.getpid()}"):
      with C.PoolLock(str(tmp_path / "ppo.actor"), "the actor pool"):
        pass
    code = ("import sys; from jaxrlhf.pools.common import PoolLock\n"
            f"PoolLock({str(tmp_path / 'ppo.actor')!r}, 'x').__enter__()")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert other.returncode != 0 and "already running" in other.stderr
  with C.PoolLock(str(tmp_path / "ppo.actor"), "the actor pool"):  # released
    pass


def test_each_run_has_its_own_namespace(tmp_path):
  from test_pools import pools_config
  cfg = pools_config(steps=2)
  a, b = C.namespace(cfg, str(tmp_path / "seed0")), C.namespace(cfg, str(tmp_path / "seed1"))
  assert a != b and a.startswith("jaxrlhf:pools_test:")
  assert C.namespace(cfg, str(tmp_path / "seed0")) == a
  named = dataclasses.replace(cfg, pools=PoolsConfig(namespace="sweep:7"))
  assert C.namespace(named, "x") == C.namespace(named, "y") == "sweep:7"


def test_pools_that_disagree_on_a_setting_stop_before_consuming(server):
  store = S.Store(server.url, wait_s=5, log=lambda line: None)
  streams = C.Streams("t", "run1")
  mine = {"ppo": {"kl": {"coef": 0.1}, "reward": {"weights": [1.0]}}, "seed": 0}
  theirs = {"ppo": {"kl": {"coef": 0.2}, "reward": {"weights": [1.0]}}, "seed": 0}
  store.set_str(streams.stream("settings:critic"), json.dumps(theirs))
  with pytest.raises(ConfigError, match=r"ppo\.kl\.coef: actor 0.1, critic 0.2"):
    C.agree(store, streams, "actor", mine, timeout=2, should_stop=lambda: False)
  store.set_str(streams.stream("settings:critic"), json.dumps(mine))
  assert C.agree(store, streams, "actor", mine, timeout=2, should_stop=lambda: False)
  other = C.Streams("t", "run2")
  assert not C.agree(store, other, "actor", mine, timeout=5, should_stop=lambda: True)


def test_a_pool_agrees_with_itself_and_a_changed_setting_is_named(server):
  from helpers import mesh
  from jaxrlhf.data import DataSource
  from jaxrlhf.train.ppo import PPOStage
  from test_pools import pools_config
  cfg = pools_config(steps=2)
  stage = PPOStage(cfg, mesh(), DataSource(cfg.data, cfg.seed))
  mine = C.settings_of(cfg, stage, {"rm": "abc"})
  assert "redis_url" not in json.dumps(mine) and mine["inputs"] == {"rm": "abc"}
  store = S.Store(server.url, wait_s=5, log=lambda line: None)
  streams = C.Streams("t", "self")
  store.set_str(streams.stream("settings:critic"), json.dumps(mine))
  assert C.agree(store, streams, "actor", mine, timeout=2, should_stop=lambda: False)
  heavier = dataclasses.replace(cfg, ppo=dataclasses.replace(
      cfg.ppo, reward=dataclasses.replace(cfg.ppo.reward, weights=(1.0, 2.0))))
  theirs = C.settings_of(heavier, stage, {"rm": "abc"})
  store.set_str(streams.stream("settings:critic"), json.dumps(theirs))
  with pytest.raises(ConfigError, match="ppo.reward.weights"):
    C.agree(store, streams, "actor", mine, timeout=2, should_stop=lambda: False)


# ----------------------------------------------------------- stopping, resuming, skipping


def test_repeated_non_finite_updates_stop_a_pool_after_a_checkpoint():
  """A pool runs the colocated stage's training loop: after max_consecutive_skips non-finite
  updates in a row it checkpoints (and acknowledges what that covers), then stops with the
  setting to change."""
  import types
  import jax.numpy as jnp
  from jaxrlhf.train.driver import TrainingError
  from test_pools import Records
  stage = types.SimpleNamespace(
      name="ppo", steps=10, eval_every=0, target_reached=lambda m: "",
      scfg=types.SimpleNamespace(optim=types.SimpleNamespace(max_consecutive_skips=3)),
      cfg=types.SimpleNamespace(logging=types.SimpleNamespace(every_steps=1)))
  saved, acked = [], []

  class Checkpointer:
    enabled, directory = True, "/ckpt/ppo.critic"

    def save(self, step, state, extra, metrics=None, *, force=False):
      if force:
        saved.append(step)
      return force

  counts = iter([0, 2, 3])

  def program(state, step):
    skips = types.SimpleNamespace(consecutive=jnp.int32(next(counts)))
    return types.SimpleNamespace(extras=types.SimpleNamespace(skips=skips)), {
        "loss": float("nan")}

  writer = Records()
  saves = C.PoolSaves(Checkpointer(), lambda done: {"done": done}, acked.append)
  loop = C.driver(stage, "critic", writer, saves, lambda: False)
  with pytest.raises(TrainingError, match=r"ppo.critic: 3 consecutive steps had a non-finite "
                     r"loss or gradient \(step 3\).*checkpointed as step 3 in "
                     r"/ckpt/ppo.critic.*raise ppo.optim.max_consecutive_skips"):
    loop.run(program, None, 0)
  assert saved == [3] and acked == [3] and sorted(writer.by_step) == [1, 2]


def test_the_critic_never_publishes_a_non_finite_advantage():
  import jax.numpy as jnp
  from jaxrlhf.pools.critic import finite_scores
  adv = jnp.array([[1.0, 2.0], [jnp.nan, 0.0], [0.5, jnp.inf], [3.0, 4.0]])
  keep = jnp.array([True, True, True, False])
  score = jnp.array([0.1, 0.2, 0.3, 0.4])
  out, valid, bad = finite_scores(adv, keep, score)
  assert bad == 2 and bool(jnp.all(jnp.isfinite(out)))
  assert valid.tolist() == [True, False, False, False]
  assert out.tolist() == [[1.0, 2.0], [0.0, 0.0], [0.0, 0.0], [3.0, 4.0]]


def test_resume_none_moves_a_pools_checkpoints_aside(tmp_path):
  from jaxrlhf import checkpoint as ckpt
  from jaxrlhf.train import pipeline
  work = str(tmp_path)
  for role in ("actor", "critic"):
    os.makedirs(ckpt.checkpoint_dir(work, f"ppo.{role}") + "/3")
    os.makedirs(ckpt.stage_result_dir(work, f"ppo.{role}"))
  lines = []
  from test_pools import pools_config
  C.start_over(work, "actor", pools_config(steps=2), lines.append)
  assert not os.path.exists(ckpt.checkpoint_dir(work, "ppo.actor"))
  assert not os.path.exists(ckpt.stage_result_dir(work, "ppo.actor"))
  assert os.path.exists(ckpt.checkpoint_dir(work, "ppo.critic")) and "moved aside" in lines[0]
  pipeline.start_over(work, ("ppo",))  # a colocated --resume=none: both pool folders go
  assert not os.path.exists(os.path.join(work, "ppo.critic"))
  assert any(d.startswith("ppo.critic.replaced-") for d in os.listdir(work))


CHILD = r"""
import os, signal, sys, time, redis
role = sys.argv[1]
r = redis.Redis.from_url(os.environ["JAXRLHF_REDIS_URL"],
                         password=os.environ["JAXRLHF_REDIS_PASSWORD"])
r.set("up:" + role, "1")
open(os.path.join(sys.argv[2], role + ".up"), "w").close()
def stop(signum, frame):
  r.set("stopped:" + role, "1")  # Redis must still be up while the pools stop
  open(os.path.join(sys.argv[2], role + ".stopped"), "w").write(signal.Signals(signum).name)
  sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
  time.sleep(0.05)
"""

PARENT = r"""
import dataclasses, sys
sys.path.insert(0, {here!r})
from jaxrlhf.pools import run as R
from test_pools import pools_config
R.pool_command = lambda base, role: [sys.executable, "-c", {child!r}, role, {work!r}]
cfg = dataclasses.replace(pools_config(steps=2), stages=("ppo",))
sys.exit(R.run_all(cfg, {work!r}, ["main"], grace_s=20))
"""


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_role_all_stops_both_pools_gracefully_then_its_redis(tmp_path, how):
  import signal
  work = str(tmp_path / "w")
  os.makedirs(work)
  env = {k: v for k, v in os.environ.items() if k not in (S.URL_ENV, S.PASSWORD_ENV)}
  parent = subprocess.Popen([sys.executable, "-c", PARENT.format(here=HERE, child=CHILD,
                                                                 work=work)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own group, as at a terminal
  url = None
  t0 = time.time()
  while time.time() - t0 < 60 and url is None:
    line = parent.stdout.readline()
    if "started redis-server at" in line:
      url = line.split(" at ")[1].split()[0]
  assert url, "no redis started"
  port = int(url.rsplit(":", 1)[1].split("/")[0])
  with pytest.raises(redis_lib.AuthenticationError):  # a password nobody was told
    redis_lib.Redis(port=port).ping()
  if how == "SIGTERM":
    # A second --role=all on the same workdir is refused while this one runs.
    second = subprocess.run([sys.executable, "-c", PARENT.format(here=HERE, child=CHILD,
                                                                 work=work)],
                            env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode != 0 and f"pid {parent.pid}" in second.stderr + second.stdout
  t0 = time.time()
  while time.time() - t0 < 60:  # both children up
    if all(os.path.exists(os.path.join(work, f"{r}.up")) for r in ("actor", "critic")):
      break
    time.sleep(0.1)
  if how == "SIGTERM":
    parent.send_signal(signal.SIGTERM)
  else:  # a terminal's Ctrl-C: SIGINT to the foreground process group
    os.killpg(parent.pid, signal.SIGINT)
  rest = parent.communicate(timeout=60)[0]
  assert parent.returncode == 0, rest
  for role in ("actor", "critic"):
    with open(os.path.join(work, f"{role}.stopped")) as f:
      assert f.read() == "SIGTERM"
  with pytest.raises(redis_lib.ConnectionError):  # its redis is gone too
    redis_lib.Redis(port=port, socket_timeout=1).ping()


def test_with_checkpointing_off_every_applied_batch_is_final(tmp_path):
  """So the pools ack and trim after every batch: nothing is ever re-read, and the streams
  stay bounded (with checkpointing on, a checkpoint comes at least every MAX_UNACKED)."""
  from jaxrlhf.config import CheckpointConfig
  from test_pools import pools_config
  cfg = dataclasses.replace(pools_config(steps=2), checkpoint=CheckpointConfig(enabled=False))
  with C.PoolCheckpointer(str(tmp_path), "critic", cfg) as ck:
    assert ck.save(1, None, {"done": 1})
  assert 1 <= C.MAX_UNACKED <= 64
