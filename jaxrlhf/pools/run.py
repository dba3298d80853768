"""``python -m jaxrlhf.main --experiment=NAME --role=actor|critic|all``: one pool of a
disaggregated RL run (PPO, GRPO...), or (``all``) both on this machine.

A pool is an ordinary JAX program on its own devices (its own mesh; one process per pool for
now — several processes under ``jax.distributed`` are refused): the stages before the RL stage (SFT, reward model) must have finished in
``--workdir`` (``--role=all`` trains them first with the normal pipeline), then the actor and
critic exchange batches through Redis.  ``--role=all`` also starts a loopback redis-server
when no Redis is configured, and stops it at the end.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time

from jaxrlhf import report
from jaxrlhf.config import ConfigError, ExperimentConfig, to_dict

ROLES = ("actor", "critic", "all")


def earlier_roles(cfg: ExperimentConfig, mesh, data, workdir: str) -> tuple[dict, dict]:
  """``(roles, inputs)``: the roles the stages before the RL stage produced, from their results in
  ``workdir``, and each stage's result id (what a pool's checkpoint records it was built on)."""
  from jaxrlhf import checkpoint as ckpt
  from jaxrlhf.train import pipeline
  roles, inputs = {}, {}
  for name in cfg.stages[:-1]:
    if not ckpt.stage_result_exists(workdir, name):
      raise ConfigError(
          f"stage {name!r} has no result in {workdir}; the pools start from it. Train the "
          f"stages before {cfg.stages[-1]} first (--role=all does), e.g. python -m jaxrlhf.main "
          f"--experiment={cfg.name} --set=stages={','.join(cfg.stages[:-1])} --workdir={workdir}")
    outcome = pipeline.load_finished(pipeline.spec.build_stage(name, cfg, mesh, data), workdir)
    roles.update(outcome.outputs)
    inputs[name] = outcome.result_id
  return roles, inputs


def run_role(cfg: ExperimentConfig, workdir: str, role: str, redis_url: str = "",
             events_path: str = "", resume: str = "latest") -> int:
  """One pool in this process; exit status."""
  from jaxrlhf.data import DataSource
  from jaxrlhf.mesh import make_mesh
  from jaxrlhf.model import hf
  from jaxrlhf.pools import common as C
  from jaxrlhf.pools import store as S
  from jaxrlhf.preemption import PreemptionHandler
  from jaxrlhf.train import pipeline
  C.check_config(cfg)
  from jaxrlhf import perf
  perf.configure_process()  # as a colocated run: allocator, then the compilation cache
  import jax
  if jax.process_count() > 1:
    raise ConfigError(f"--role={role} with {jax.process_count()} processes: a pool runs as one "
                      "process (any number of local devices) for now; multi-host pools are not "
                      "implemented (docs/pools.md)")
  url, password = S.settings(redis_url or cfg.pools.redis_url)
  # What is saved and printed from here on (config.json, checkpoints, trackers) holds the
  # address without anything secret in it.
  cfg = dataclasses.replace(cfg, pools=dataclasses.replace(cfg.pools,
                                                           redis_url=S.redact(url)))
  pipeline.quiet_library_logs()
  os.makedirs(workdir, exist_ok=True)
  mesh = make_mesh(cfg.mesh)
  cfg = hf.resolve_models(cfg, dict(mesh.shape)["tp"])
  roles, inputs = earlier_roles(cfg, mesh, DataSource(cfg.data, cfg.seed), workdir)
  log = lambda m: print(m, flush=True)  # noqa: E731
  store = S.Store(url, password, wait_s=cfg.pools.redis_wait_s, log=log)
  events = C.EventLog(events_path or None)
  print(f"{cfg.name}: {role} pool on mesh {dict(mesh.shape)}; redis at {store.where}; "
        f"mode {cfg.pools.mode}", flush=True)
  if role == "actor":
    from jaxrlhf.pools.actor import run_actor as fn
  else:
    from jaxrlhf.pools.critic import run_critic as fn
  from jaxrlhf.metrics import MetricsWriter
  steps = getattr(cfg, C.stage_name(cfg)).steps
  writer = MetricsWriter(C.pool_dir(workdir, role, cfg), cfg.logging,
                         {C.pool_name(cfg, role): steps}, config=to_dict(cfg),
                         run_name=f"{os.path.basename(os.path.abspath(workdir))}.{role}")
  try:
    with PreemptionHandler() as stop:
      out = fn(cfg, workdir, store, mesh, roles, events=events, log=log,
               should_stop=stop.should_stop, writer=writer, inputs=inputs, resume=resume)
    if out.get("done") == steps:  # the pool's trackers mark its run as finished
      writer.finish({role: {k: v for k, v in out.items() if isinstance(v, (int, float))}},
                    lambda: report.report_files(C.pool_dir(workdir, role, cfg)))
  except (S.Unreachable, S.PeerTimeout, S.StoreError) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 1
  finally:
    writer.close()
  if role == "actor" and "eval/accuracy" in out:
    start = out.get("start_eval", {}).get("eval/accuracy")
    print(f"actor: held-out exact match {start if start is not None else float('nan'):.3f} -> "
          f"{out['eval/accuracy']:.3f} after {out['done']} updates", flush=True)
  return 0


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_local_redis(directory: str, password: str, attempts: int = 5):
  """A loopback redis-server (persistence on, so a restart keeps the streams) that requires
  ``password``; returns ``(process, url)``.

  The settings go in on stdin (``redis-server -``), so the password never shows in the
  process list.  The port is picked free and the server binds it itself: if another program
  took it in between, the server exits and another port is tried.
  """
  import redis
  exe = shutil.which("redis-server")
  if exe is None:
    raise ConfigError("no Redis configured (--redis_url / $JAXRLHF_REDIS_URL) and redis-server "
                      "is not installed; install it (apt-get install redis-server) or point "
                      "--redis_url at a running server")
  for _ in range(attempts):
    port = _free_port()
    conf = (f"port {port}\nbind 127.0.0.1\ndir \"{directory}\"\nsave \"\"\nappendonly yes\n"
            f"protected-mode yes\nmaxmemory-policy noeviction\nrequirepass {password}\n")
    log = open(os.path.join(directory, "redis.log"), "a")
    # Its own session: a Ctrl-C at the terminal must not take Redis away from pools that are
    # still writing their stop checkpoints and acks; run_all stops it after them.
    proc = subprocess.Popen([exe, "-"], stdin=subprocess.PIPE, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    proc.stdin.write(conf.encode())
    proc.stdin.close()
    log.close()
    client = redis.Redis(port=port, password=password, socket_timeout=0.2,
                         socket_connect_timeout=0.2)
    for _ in range(200):
      if proc.poll() is not None:
        break  # most likely the port was taken meanwhile: try another
      try:
        if client.ping():
          return proc, f"redis://127.0.0.1:{port}/0"
      except (redis.ConnectionError, redis.TimeoutError):
        time.sleep(0.05)
    stop_process(proc, 5.0)
  raise RuntimeError(f"the local redis-server did not start ({attempts} ports tried); see "
                     f"{os.path.join(directory, 'redis.log')}")


def stop_process(proc, grace_s: float) -> None:
  """SIGTERM (a pool writes its stop checkpoint, Redis flushes its append-only file), then
  SIGKILL after ``grace_s``."""
  if proc.poll() is None:
    proc.send_signal(signal.SIGTERM)
    try:
      proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


def pool_command(base: list, role: str) -> list:
  """The command line of one pool process of ``--role=all``."""
  return [sys.executable, "-m", "jaxrlhf.main", *base, f"--role={role}"]


def run_all(cfg: ExperimentConfig, workdir: str, argv: list, redis_url: str = "",
            grace_s: float = 120.0, resume: str = "latest") -> int:
  """Earlier stages (normal pipeline), then both pools as subprocesses of this one.

  One per workdir (a lock).  SIGTERM or Ctrl-C stops both pools gracefully (each writes its
  stop checkpoint; SIGKILL only after ``grace_s``) and then the Redis server this started.
  """
  from jaxrlhf.pools import common as C
  from jaxrlhf.pools import store as S
  # Refused here once, before earlier stages train and Redis and the pools start (each pool
  # would refuse it again).
  C.check_config(cfg)
  S.check_url(redis_url or cfg.pools.redis_url or os.environ.get(S.URL_ENV, "") or
              S.DEFAULT_URL)
  os.makedirs(workdir, exist_ok=True)
  with C.PoolLock(os.path.join(workdir, "pools"), f"--role=all on {workdir}"):
    return _run_all(cfg, workdir, argv, redis_url, grace_s, resume)


def _run_all(cfg, workdir, argv, redis_url, grace_s, resume) -> int:
  from jaxrlhf.pools import store as S
  if len(cfg.stages) > 1:
    from jaxrlhf.train import pipeline
    pre = dataclasses.replace(cfg, stages=tuple(cfg.stages[:-1]))
    rc = pipeline.run(pre, workdir, resume=resume)
    if rc:
      return rc
  url = redis_url or cfg.pools.redis_url or os.environ.get(S.URL_ENV, "")
  server = None
  env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **os.environ}
  if not url:
    # In the workdir, so a rerun after a crash finds the streams the pools resume from; a
    # fresh password each start (the pools get it in their environment only).
    where = os.path.join(workdir, "redis")
    os.makedirs(where, exist_ok=True)
    password = secrets.token_hex(24)
    server, url = start_local_redis(where, password)
    env[S.PASSWORD_ENV] = password
    print(f"started redis-server at {url} (loopback, password-protected)", flush=True)
  S.settings(url)
  env[S.URL_ENV] = url
  base, skip = [], False
  for a in argv[1:]:
    if skip:
      skip = False
    elif a in ("--role", "--redis_url"):
      skip = True  # "--flag value": drop the value too
    elif not a.startswith(("--role=", "--redis_url=")):
      base.append(a)
  # Two processes on one machine's accelerators: neither may grab most of the memory up front.
  procs = {}
  stopping = []

  def on_signal(signum, frame):
    del frame
    if not stopping:
      print(f"--role=all: {signal.Signals(signum).name}; stopping both pools (stop "
            "checkpoints), then redis", file=sys.stderr, flush=True)
    stopping.append(signum)
    for q in procs.values():
      if q.poll() is None:
        q.send_signal(signal.SIGTERM)

  previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
  try:
    for role in ("critic", "actor"):
      # Their own process group: a Ctrl-C reaches them once, through on_signal.
      procs[role] = subprocess.Popen(pool_command(base, role), env=env,
                                     start_new_session=True)
    rc = 0
    t_stop = None
    while procs:
      if stopping and t_stop is None:
        t_stop = time.monotonic()
      if t_stop is not None and time.monotonic() - t_stop > grace_s:
        for q in procs.values():
          q.kill()
      for role, p in list(procs.items()):
        code = p.poll()
        if code is None:
          continue
        del procs[role]
        if code and not stopping:
          print(f"error: the {role} pool exited with status {code}; stopping the other",
                file=sys.stderr, flush=True)
          rc = code
          stopping.append(None)
          for q in procs.values():
            q.send_signal(signal.SIGTERM)
      time.sleep(0.2)
    return rc
  finally:
    for sig, h in previous.items():
      signal.signal(sig, h)
    for p in procs.values():
      stop_process(p, grace_s)
    if server is not None:
      stop_process(server, 30.0)
