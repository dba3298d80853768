"""``python -m jaxrlhf.main --experiment=NAME --role=actor|critic|all``: one pool of a
disaggregated PPO run, or (``all``) both on this machine.

A pool is an ordinary JAX program on its own devices (its own mesh; one process per pool for
now — several processes under ``jax.distributed`` are refused): the stages before PPO (SFT, reward model) must have finished in
``--workdir`` (``--role=all`` trains them first with the normal pipeline), then the actor and
critic exchange batches through Redis.  ``--role=all`` also starts a loopback redis-server
when no Redis is configured, and stops it at the end.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from jaxrlhf.config import ConfigError, ExperimentConfig, to_dict

ROLES = ("actor", "critic", "all")


def earlier_roles(cfg: ExperimentConfig, mesh, data, workdir: str) -> dict:
  """The roles the stages before PPO produced, from their results in ``workdir``."""
  from jaxrlhf import checkpoint as ckpt
  from jaxrlhf.train import pipeline
  roles = {}
  for name in cfg.stages[:-1]:
    if not ckpt.stage_result_exists(workdir, name):
      raise ConfigError(
          f"stage {name!r} has no result in {workdir}; the pools start from it. Train the "
          f"stages before ppo first (--role=all does), e.g. python -m jaxrlhf.main "
          f"--experiment={cfg.name} --set=stages={','.join(cfg.stages[:-1])} --workdir={workdir}")
    roles.update(pipeline.load_finished(pipeline.spec.build_stage(name, cfg, mesh, data),
                                        workdir).outputs)
  return roles


def run_role(cfg: ExperimentConfig, workdir: str, role: str, redis_url: str = "",
             events_path: str = "") -> int:
  """One pool in this process; exit status."""
  from jaxrlhf.data import DataSource
  from jaxrlhf.mesh import make_mesh
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
  pipeline.quiet_library_logs()
  os.makedirs(workdir, exist_ok=True)
  mesh = make_mesh(cfg.mesh)
  cfg = pipeline.resolve_models(cfg, dict(mesh.shape)["tp"])
  roles = earlier_roles(cfg, mesh, DataSource(cfg.data, cfg.seed), workdir)
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
  writer = MetricsWriter(C.pool_dir(workdir, role), cfg.logging,
                         {f"{C.STAGE}.{role}": cfg.ppo.steps}, config=to_dict(cfg),
                         run_name=f"{os.path.basename(os.path.abspath(workdir))}.{role}")
  try:
    with PreemptionHandler() as stop:
      out = fn(cfg, workdir, store, mesh, roles, events=events, log=log,
               should_stop=stop.should_stop, writer=writer)
    if out.get("done") == cfg.ppo.steps:  # the pool's trackers mark its run as finished
      writer.finish({role: {k: v for k, v in out.items() if isinstance(v, (int, float))}})
  except (S.Unreachable, S.PeerTimeout) as e:
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


def start_local_redis(directory: str):
  """A loopback redis-server (persistence on, so a restart keeps the streams); returns
  ``(process, url)``."""
  exe = shutil.which("redis-server")
  if exe is None:
    raise ConfigError("no Redis configured (--redis_url / $JAXRLHF_REDIS_URL) and redis-server "
                      "is not installed; install it (apt-get install redis-server) or point "
                      "--redis_url at a running server")
  port = _free_port()
  proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", directory,
                           "--save", "", "--appendonly", "yes"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
  import redis
  for _ in range(200):
    try:
      if redis.Redis(port=port, socket_timeout=0.5).ping():
        return proc, f"redis://127.0.0.1:{port}/0"
    except redis.ConnectionError:
      time.sleep(0.05)
  proc.kill()
  raise RuntimeError("the local redis-server did not start")


def run_all(cfg: ExperimentConfig, workdir: str, argv: list, redis_url: str = "") -> int:
  """Earlier stages (normal pipeline), then both pools as subprocesses of this one."""
  from jaxrlhf.pools import store as S
  if len(cfg.stages) > 1:
    from jaxrlhf.train import pipeline
    pre = dataclasses.replace(cfg, stages=tuple(cfg.stages[:-1]))
    rc = pipeline.run(pre, workdir)
    if rc:
      return rc
  url = redis_url or cfg.pools.redis_url or os.environ.get(S.URL_ENV, "")
  server = None
  os.makedirs(workdir, exist_ok=True)
  if not url:
    # In the workdir, so a rerun after a crash finds the streams the pools resume from.
    where = os.path.join(workdir, "redis")
    os.makedirs(where, exist_ok=True)
    server, url = start_local_redis(where)
    print(f"started redis-server at {url} (loopback)", flush=True)
  S.settings(url)
  base, skip = [], False
  for a in argv[1:]:
    if skip:
      skip = False
    elif a in ("--role", "--redis_url"):
      skip = True  # "--flag value": drop the value too
    elif not a.startswith(("--role=", "--redis_url=")):
      base.append(a)
  # Two processes on one machine's accelerators: neither may grab most of the memory up front.
  env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **os.environ, S.URL_ENV: url}
  procs = {}
  try:
    for role in ("critic", "actor"):
      procs[role] = subprocess.Popen([sys.executable, "-m", "jaxrlhf.main", *base,
                                      f"--role={role}"], env=env)
    rc = 0
    while procs:
      for role, p in list(procs.items()):
        code = p.poll()
        if code is None:
          continue
        del procs[role]
        if code:
          print(f"error: the {role} pool exited with status {code}; stopping the other",
                file=sys.stderr, flush=True)
          rc = code
          for q in procs.values():
            q.send_signal(signal.SIGTERM)
      time.sleep(0.2)
    return rc
  finally:
    for p in procs.values():
      p.kill()
      p.wait()
    if server is not None:
      server.kill()
      server.wait()
