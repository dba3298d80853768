"""Fault tests of the disaggregated pools, with real processes and a real redis-server: the
critic and the actor are SIGKILLed mid-run and restarted, and Redis is stopped and brought
back (appendonly, so the streams survive).  The run completes, and each pool's surviving
history applies every batch id exactly once, each update with the scores of its own batch.

Each pool is tests/pools_worker.py in a subprocess (one CPU device each); they share a
persistent compilation cache (``$JAXRLHF_COMPILATION_CACHE``, turned on by each pool process
itself), so restarts do not compile again.
"""

import os
import signal
import subprocess
import sys
import time


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from helpers import read_events  # noqa: E402
from redis_helpers import RedisServer  # noqa: E402

STEPS = 10


class Pool:
  def __init__(self, role, workdir, url, cache, n):
    self.role = role
    self.events_path = os.path.join(workdir, f"{role}.events")
    self.out_path = os.path.join(workdir, f"{role}.{n}.out")
    # The trainer's own setting: a pool process turns the cache on itself (run_role).
    env = {**os.environ, "PYTHONPATH": ROOT, "JAXRLHF_COMPILATION_CACHE": cache}
    for name in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR",
                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
      env.pop(name, None)
    self._out = open(self.out_path, "w")
    self.proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "pools_worker.py"), f"--role={role}",
         f"--workdir={workdir}", f"--redis_url={url}", f"--events={self.events_path}",
         f"--steps={STEPS}", "--every=2"],
        stdout=self._out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

  def output(self):
    with open(self.out_path) as f:
      return f.read()

  def events(self):
    return read_events(self.events_path)

  def wait_applied(self, batch, timeout=240):
    t0 = time.time()
    while time.time() - t0 < timeout:
      if any(e["event"] == "applied" and e["batch"] >= batch for e in self.events()):
        return
      assert self.proc.poll() is None, self.output()[-3000:]
      time.sleep(0.05)
    raise AssertionError(f"{self.role} never applied batch {batch}:\n{self.output()[-3000:]}")

  def kill(self):
    self.proc.send_signal(signal.SIGKILL)
    self.proc.wait(timeout=30)
    self._out.close()

  def finish(self, timeout=300):
    try:
      self.proc.wait(timeout=timeout)
    finally:
      self._out.close()
    assert self.proc.returncode == 0, self.output()[-3000:]

  def stop(self):
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait(timeout=30)
    self._out.close()


def lineage(events):
  """The applied batches of the state that survived: a restart from a checkpoint after
  ``done`` updates drops what the killed process applied after it."""
  out = []
  for e in events:
    if e["event"] == "started":
      out = []
    elif e["event"] == "resumed":
      assert e["done"] <= len(out)
      out = out[:e["done"]]
    elif e["event"] == "applied":
      out.append(e)
  return out


def test_pools_survive_killed_pools_and_a_redis_outage(tmp_path):
  server = RedisServer(tmp_path, appendonly=True).start()
  cache = str(tmp_path / "jit_cache")
  work = str(tmp_path / "run")
  os.makedirs(work)
  n = iter(range(100))
  pools = {}
  try:
    pools["critic"] = Pool("critic", work, server.url, cache, next(n))
    pools["actor"] = Pool("actor", work, server.url, cache, next(n))
    # 1. The critic dies between checkpoints (every 2 batches) and comes back.
    pools["critic"].wait_applied(2)
    pools["critic"].kill()
    # The pool processes filled the compilation cache they were pointed at (run_role turns it on).
    assert os.path.isdir(cache) and len(os.listdir(cache)) >= 4, os.listdir(cache)
    pools["critic"] = Pool("critic", work, server.url, cache, next(n))
    # 2. The actor dies between checkpoints and comes back.
    pools["actor"].wait_applied(4)
    pools["actor"].kill()
    pools["actor"] = Pool("actor", work, server.url, cache, next(n))
    # 3. Redis goes away for two seconds.
    pools["actor"].wait_applied(6)
    server.stop()
    time.sleep(2.0)
    server.start()
    for p in pools.values():
      p.finish()
    out = {r: p.output() for r, p in pools.items()}
  finally:
    for p in pools.values():
      p.stop()
    server.stop()

  for role in ("actor", "critic"):
    events = read_events(os.path.join(work, f"{role}.events"))
    kept = lineage(events)
    assert [e["batch"] for e in kept] == list(range(STEPS)), (role, kept)
    assert sum(e["event"] == "resumed" for e in events) == 1, role
    assert events[-1]["event"] == "finished"
  actor_events = read_events(os.path.join(work, "actor.events"))
  assert all(e["scores_batch"] == e["batch"] for e in lineage(actor_events))
  # Every rollout was generated and published once: a restarted actor reuses, never repeats.
  published = [e["batch"] for e in actor_events if e["event"] == "published"]
  assert sorted(published) == list(range(STEPS)), published
  # The outage was waited out with a clear message, and the pools said when Redis came back.
  joined = out["actor"] + out["critic"]
  assert "unreachable" in joined and "reachable again" in joined, joined[-3000:]
