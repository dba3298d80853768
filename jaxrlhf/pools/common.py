"""What the actor and critic pools share: the RL stage each builds, its slice of the roles,
stream names, message schemas, and the pieces of a pool's run (checkpointer, metrics, events).

The pools run the experiment's last stage, any algorithm whose spec generates (PPO, GRPO and
its variants).  Each pool builds the full stage (construction allocates nothing) but
initialises only its own roles, with the same per-role keys as the colocated stage, so both
pools start exactly where a colocated run would.  Which roles live in which pool is the
stage's layout's (:func:`pool_roles`); which loss terms and phases run where is read from
its spec and phase list, and so is what cannot cross the two (:func:`check_config`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import threading
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import checkpoint as ckpt
from jaxrlhf import distributed
from jaxrlhf.config import ConfigError, ExperimentConfig, to_dict
from jaxrlhf.pools.store import Inbox
from jaxrlhf.train import packed, phases, program, spec
from jaxrlhf.train.common import put_batch
from jaxrlhf.train.driver import Driver, Saves
from jaxrlhf.train.types import Rollout, StepCarry

# The loss term the actor trains (the policy's, where the rollouts are generated); every
# other term (a value model's) trains beside the reward model.
ACTOR_TERM = "policy"


def stage_name(cfg: ExperimentConfig) -> str:
  """The stage the pools run: the experiment's last."""
  return cfg.stages[-1] if cfg.stages else ""


def build_stage(cfg: ExperimentConfig, mesh):
  """The full stage the pools split (construction allocates nothing)."""
  from jaxrlhf.data import DataSource
  return spec.build_stage(stage_name(cfg), cfg, mesh, DataSource(cfg.data, cfg.seed))


def pool_roles(stage, role: str) -> tuple[tuple, tuple]:
  """``(trained, frozen)`` roles of one pool of ``stage``, from its layout
  (:meth:`jaxrlhf.train.layout.StateLayout.pool`): the actor trains the policy and holds the
  reference; the critic trains every other role (the value model; none for GRPO) and holds
  the reward model and guard."""
  return stage.layout.pool(role)


def check_config(cfg: ExperimentConfig) -> None:
  """The experiment can run in two pools, or a ConfigError naming the setting and the fix.
  The algorithm's limits come from its spec: every loss term must train a model of its own
  (a term sharing another's parameters cannot be split between pools).  Every phase crosses
  them (dynamic sampling's selection runs in the critic, the actor takes the rows it chose),
  and so does every rollout setting (environments, buckets, packing: docs/pools.md)."""
  name = stage_name(cfg)
  rl = [n for n in spec.names() if spec.get(n).generates]
  if name not in rl:
    raise ConfigError(f"--role=actor|critic runs an RL stage ({', '.join(rl)}) in two pools; "
                      f"the experiment's stages are {list(cfg.stages)}: make the RL stage the "
                      "last")
  al = spec.get(name)
  roles = al.roles(cfg)
  shared = [t for t in al.terms if t != ACTOR_TERM and t not in roles]
  if shared:
    knob = f"{name}.shared_backbone"
    raise ConfigError(f"{name}: the {', '.join(shared)} loss term trains the policy's own "
                      f"parameters ({knob}=true puts its head on the policy), so there is no "
                      f"separate model for the critic pool; set {knob}=false for "
                      "--role=actor|critic")
  p = cfg.pools
  if p.mode == "async" and p.max_staleness < 1:
    raise ConfigError(f"pools.max_staleness={p.max_staleness}: async mode needs >= 1 (the "
                      "rollouts generated ahead of the update); or use pools.mode=sync")
  if p.max_queue < 1:
    raise ConfigError(f"pools.max_queue={p.max_queue}: must be >= 1")
  if p.mode == "async" and p.max_staleness >= 2 * p.max_queue + 1:
    # The actor publishes up to max_staleness rollouts ahead and blocks on a full rollouts
    # stream while the critic blocks on a full scores stream it is not reading: with room
    # for only 2 x max_queue entries in flight, the two wait on each other.
    raise ConfigError(f"pools.max_staleness={p.max_staleness} with pools.max_queue="
                      f"{p.max_queue} can deadlock (both streams full, both pools waiting); "
                      f"set pools.max_queue >= {p.max_staleness // 2 + 1} or lower "
                      "pools.max_staleness")
  if p.is_correction < 0 or 0 < p.is_correction <= 1:
    raise ConfigError(f"pools.is_correction={p.is_correction}: 0 (off) or a cap > 1 (e.g. 2), "
                      "like {rl}.off_policy_cap: a cap at or below 1 would shrink the advantages "
                      "of rollouts that are not stale at all")


class PoolSaves(Saves):
  """A pool's checkpoints for the training loop (:class:`jaxrlhf.train.driver.Driver`):
  every save complete on disk before ``on_final(done)`` acknowledges (and trims) the stream
  entries it covers; a save at least every ``MAX_UNACKED`` entries taken (``must()``),
  whatever ``checkpoint.every_steps``, so the streams stay bounded."""

  def __init__(self, ck: "PoolCheckpointer", extra_of, on_final, must=lambda: False):
    self.ck, self.extra_of, self.on_final, self.must = ck, extra_of, on_final, must

  def plan(self, done, state, metrics, *, force, reason):
    return True  # the checkpointer decides (every_steps), after the step's record

  def save(self, done, state, metrics, *, force, reason):
    if self.ck.save(done, state, self.extra_of(done), metrics, force=force or self.must()):
      self.on_final(done)

  def stop(self, done, state, metrics):
    self.ck.save(done, state, self.extra_of(done), metrics, force=True)
    self.on_final(done)
    return self.ck.directory if self.ck.enabled else ""


def driver(stage, role: str, writer, saves: PoolSaves, should_stop, *, evaluation=None,
           samples=None) -> Driver:
  """The training loop of one pool: the colocated stage's, named ``STAGE.ROLE``;
  ``evaluation`` (the actor's :class:`~jaxrlhf.train.evaluate.Evaluation`) evaluates, and
  its samples follow ``samples()``'s."""
  if evaluation is not None:
    own = samples or (lambda: [])
    samples = lambda: own() + evaluation.take_samples()  # noqa: E731
  return Driver(name=f"{stage.name}.{role}", steps=stage.steps, writer=writer,
                should_stop=should_stop, saves=saves,
                max_skips=stage.scfg.optim.max_consecutive_skips,
                skips_setting=f"{stage.name}.optim.max_consecutive_skips",
                evaluate=evaluation,
                eval_every=(lambda: evaluation.every) if evaluation is not None else 0,
                target_reached=evaluation.after if evaluation is not None else (
                    lambda metrics: ""),
                log_every=stage.cfg.logging.every_steps, samples=samples)


def staleness(cfg: ExperimentConfig) -> int:
  """Rollouts the actor generates ahead of its updates (0: synchronous)."""
  return cfg.pools.max_staleness if cfg.pools.mode == "async" else 0


def stage_key(cfg: ExperimentConfig) -> jax.Array:
  """The key the colocated pipeline gives the pools' stage."""
  return jax.random.fold_in(jax.random.key(cfg.seed), list(cfg.stages).index(stage_name(cfg)))


def init_roles(stage, key: jax.Array, roles: dict, trainable, frozen, extras, *,
               restoring: bool = False):
  """:meth:`Stage.init` of one pool's roles (and the frozen base of a LoRA role it trains):
  the same key per role as the full stage, so each pool's parameters equal the colocated
  run's.  ``restoring``: the frozen roles alone, and None for the state: a restart restores
  the state into :func:`abstract_roles`, so none is allocated to be thrown away."""
  return stage.init(key, roles, only=(tuple(trainable), tuple(frozen)), extras=extras,
                    frozen_only=restoring)


def abstract_roles(stage, trainable, frozen, extras):
  """The abstract train state of one pool's share (:func:`init_roles`'s, allocating
  nothing)."""
  return stage.abstract_init(only=(tuple(trainable), tuple(frozen)), extras=extras)[0]


@dataclasses.dataclass(frozen=True)
class Streams:
  """Redis key names of one run."""

  ns: str
  run: str

  @property
  def run_key(self) -> str:  # the run the actor is on; the critic follows it
    return f"{self.ns}:run"

  def stream(self, name: str) -> str:
    return f"{self.ns}:{self.run}:{name}"

  def index(self, name: str) -> str:
    return f"{self.ns}:{self.run}:{name}:index"


def namespace(cfg: ExperimentConfig, workdir: str) -> str:
  """``pools.namespace``, else one per run: the experiment and a hash of the workdir's
  absolute path, so two runs of one experiment (a seed sweep) on a shared Redis never share
  keys.  Pools whose workdirs are mounted at different paths must set ``pools.namespace``."""
  if cfg.pools.namespace:
    return cfg.pools.namespace
  digest = hashlib.sha256(os.path.abspath(workdir).encode()).hexdigest()[:12]
  return f"jaxrlhf:{cfg.name}:{digest}"


def settings_of(cfg: ExperimentConfig, stage, inputs: dict) -> dict:
  """Everything both pools read and must agree on: the message shapes (and their buckets),
  the stage's and the rollout's settings (reward sources and weights, KL, batch sizes,
  packing), the data, the seed, the pools' mode, and the
  earlier stages' results they start from.  No addresses or credentials."""
  d = to_dict(cfg)
  shapes = {k: [list(v[0]), v[1]] for k, v in {**rollout_schema(stage)[0],
                                                **scores_schema(stage)[0]}.items()}
  out = {"shapes": shapes, "buckets": bucket_shapes(stage), "rollout": d["rollout"],
         stage.name: d[stage.name], "data": d["data"], "seed": cfg.seed,
         "stages": list(cfg.stages),
         "pools": {k: d["pools"][k] for k in ("mode", "max_staleness", "is_correction")},
         "inputs": dict(inputs)}
  return json.loads(json.dumps(out))  # as the other pool reads it back (tuples are lists)


def agree(store, streams, role: str, mine: dict, *, timeout: float, should_stop) -> bool:
  """Publishes this pool's settings under the run's keys, waits for the other pool's and
  raises :class:`ConfigError` naming every setting that differs — before either consumes an
  entry, so a mismatch is never a stream of rejected (and lost) genuine batches.  False if
  told to stop first."""
  other = "critic" if role == "actor" else "actor"
  store.set_str(streams.stream(f"settings:{role}"), json.dumps(mine, sort_keys=True))
  raw = wait_for(f"the {other} pool's settings ({streams.stream('settings:' + other)})",
                 lambda: store.get_str(streams.stream(f"settings:{other}")), timeout,
                 should_stop)
  if raw is None:
    return False
  theirs = json.loads(raw)
  diff = sorted(_differences(mine, theirs))
  if diff:
    shown = "; ".join(f"{k}: {role} {a!r}, {other} {b!r}"[:300] for k, a, b in diff[:8])
    raise ConfigError(f"the actor and critic pools of run {streams.run} disagree on "
                      f"{len(diff)} setting(s): {shown}. Start both pools with the same "
                      f"experiment, --set overrides and workdir")
  return True


def _differences(a, b, prefix=""):
  if isinstance(a, dict) and isinstance(b, dict):
    for k in sorted(set(a) | set(b)):
      yield from _differences(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
  elif a != b:
    yield prefix, a, b


class PoolLock:
  """An exclusive lock on a folder (``flock`` on ``FOLDER/lock``, released by the kernel when
  the process dies): one process per pool folder, and one ``--role=all`` per workdir."""

  def __init__(self, folder: str, what: str):
    os.makedirs(folder, exist_ok=True)
    self.path, self.what = os.path.join(folder, "lock"), what
    self.fd = None

  def __enter__(self):
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
      os.close(fd)
      raise ConfigError(f"{self.what} is already running (pid {holder} holds {self.path}); "
                        f"stop it first, or use another --workdir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    self.fd = fd
    return self

  def __exit__(self, *exc):
    os.close(self.fd)  # closing the descriptor releases the lock
    self.fd = None


GROUP = {"rollouts": "critic", "scores": "actor"}
KIND = {"rollouts": "rollout", "scores": "scores"}  # the wire kind of each stream's messages
# Most entries a pool leaves unacknowledged (taken, not yet covered by a checkpoint) before it
# checkpoints regardless of checkpoint.every_steps: with trimming after each checkpoint, each
# stream then holds at most MAX_UNACKED + max_queue (+ max_staleness) entries.
MAX_UNACKED = 32


def exchange(store, streams: Streams, out: str, into: str, schema: dict, *, consumer: str, log,
             events):
  """One pool's two streams: ``(stream, index)`` of the one it publishes (``out``, its
  consumer group made), and an :class:`~jaxrlhf.pools.store.Inbox` over the other pool's
  (``into``), whose messages must match ``schema``."""
  stream, index = streams.stream(out), streams.index(out)
  store.ensure_group(stream, GROUP[out])
  inbox = Inbox(store, streams.stream(into), streams.index(into), GROUP[into], consumer,
                kind=KIND[into], run=streams.run, schema=schema, log=log, event=events)
  return stream, index, inbox


def bucket_shapes(stage) -> list[tuple[int, int]]:
  """The (prompt, response) widths a rollout may have on the wire: the full width first, then
  every other pair of a prompt bucket (``rollout.prompt_buckets``) and a length bucket
  (``rollout.length_buckets``, the actor's cut: :func:`jaxrlhf.train.program.cut_rollout`)."""
  prompts = stage.prompt_widths or (stage.P,)
  responses = program.bucket_widths(stage.N, stage.cfg.rollout.length_buckets) or (stage.N,)
  full = (stage.P, stage.N)
  return [full] + [(p, n) for p in prompts for n in responses if (p, n) != full]


def _at_width(shapes: dict, p: int, n: int) -> dict:
  """A schema (name -> (shape, dtype)) with ``_BT`` arrays ``p + n`` and ``_BN`` arrays ``n``
  columns wide."""
  def width(name, shape):
    if name.endswith("_BT"):
      return (shape[0], p + n)
    return (shape[0], n) if name.endswith("_BN") else shape
  return {k: (width(k, shape), dtype) for k, (shape, dtype) in shapes.items()}


def rollout_schema(stage) -> list[dict]:
  """The shapes a rollout message may take, one map (name -> (shape, dtype)) per
  :func:`bucket_shapes`: the fields of :class:`~jaxrlhf.rollout.Rollout` as generation and
  the reference phase fill them, and the key of the update's minibatch permutations."""
  state, frozen = stage.abstract_init()
  c = jax.eval_shape(lambda st, fz, b: phases.generate(stage.statics, fz, b, StepCarry(state=st)),
                     state, frozen, stage.abstract_batch())
  ro = c.rollout
  schema = {f.name: (tuple(getattr(ro, f.name).shape), np.dtype(getattr(ro, f.name).dtype).name)
            for f in dataclasses.fields(Rollout) if getattr(ro, f.name) is not None}
  schema["ref_logp_BN"] = schema["kl_BN"] = schema["behaviour_logp_BN"]
  schema["perm_key"] = (tuple(jax.random.key_data(jax.random.key(0)).shape), "uint32")
  if stage.episodes is not None:  # env.name: each turn's reward, and the weighted returns
    rows = schema["lengths_B"][0]
    schema["turn_rewards_BN"] = (rows + schema["behaviour_logp_BN"][0][1:], "float32")
    schema["host_score_B"] = (rows, "float32")
  return [_at_width(schema, p, n) for p, n in bucket_shapes(stage)]


def scores_schema(stage) -> list[dict]:
  """The shapes a scores message may take (one map per response width); with dynamic
  sampling, also the generated rows the critic selected for the update (``rows_B``)."""
  rows = stage.scfg.batch_size * stage.n
  widths = sorted({n for _, n in bucket_shapes(stage)}, key=lambda n: n != stage.N)
  selected = {"rows_B": ((rows,), "int32")} if selects_rows(stage) else {}
  return [{"adv_BN": ((rows, n), "float32"), "valid_B": ((rows,), "bool"), **selected}
          for n in widths]


def selects_rows(stage) -> bool:
  """Whether the critic chooses the rows the actor trains on (dynamic sampling's ``select``
  phase, in the critic's score program): its scores then carry them (``rows_B``)."""
  return bool(getattr(stage.scfg, "dynamic_sampling", False))


def packing_of(stage, ro: Rollout, perm_key):
  """The packed layouts (``rollout.pack``) of a rollout from the other pool, or of one read
  back: planned, as its generation planned them, from its mask and the key it carries
  (``perm_key``, raw key data); None without packing."""
  if not stage.cfg.rollout.pack:
    return None
  key = jax.random.wrap_key_data(jnp.asarray(perm_key))
  return packed.plan(stage, distributed.to_host(ro.mask_BT), key)[0]


# A rollout message's header carries its generation's metrics (prompt bucket, refill counts,
# packing) under this prefix, beside the KL coefficient: a rollout read back after a restart
# reports them as when it was generated.
_METRIC = "metric:"


def meta_of_metrics(metrics: dict) -> dict:
  return {_METRIC + k: float(v) for k, v in metrics.items()}


def metrics_of_meta(meta: dict) -> dict:
  return {k[len(_METRIC):]: v for k, v in meta.items() if k.startswith(_METRIC)}


def rollout_arrays(ro: Rollout) -> dict:
  """A rollout's fields, on the host, for the wire."""
  return to_host({f.name: getattr(ro, f.name) for f in dataclasses.fields(Rollout)
                  if getattr(ro, f.name) is not None})


_ROLLOUT_FIELDS = frozenset(f.name for f in dataclasses.fields(Rollout))


def rollout_of(mesh, arrays: dict) -> Rollout:
  """The rollout of a message, on the mesh."""
  return Rollout(**to_device(mesh, {k: v for k, v in arrays.items() if k in _ROLLOUT_FIELDS}))


def host_scores_of(mesh, arrays: dict):
  """The host scores a rollout message carries (an environment's weighted returns), on the
  mesh, or None."""
  if "host_score_B" not in arrays:
    return None
  return to_device(mesh, {"s": arrays["host_score_B"]})["s"]


# A pool's program: its phases jitted like a phased step's (the carry's state donated).
pool_program = program.jit_phases


def to_host(tree: dict) -> dict:
  return {k: np.asarray(v) for k, v in jax.device_get(tree).items()}


def to_device(mesh, arrays: dict) -> dict:
  """Message arrays onto the mesh, batch dimension over the data axes (keys replicated)."""
  rows = {k: v for k, v in arrays.items() if k != "perm_key"}
  out = put_batch(mesh, rows)
  return out


class EventLog:
  """JSON lines of what a pool did (``published``, ``applied``, ``resumed``, ``rejected``
  ...), for tests and post-mortems; ``path=None`` keeps nothing."""

  def __init__(self, path: Optional[str]):
    self.path = path

  def __call__(self, **event) -> None:
    if self.path is None:
      return
    event["time"] = time.time()
    with open(self.path, "a") as f:
      f.write(json.dumps(event) + "\n")
      f.flush()


def pool_name(cfg: ExperimentConfig, role: str) -> str:
  """A pool's name: its folder in the workdir, and its stage in the metrics (``ppo.actor``)."""
  return f"{stage_name(cfg)}.{role}"


def pool_dir(workdir: str, role: str, cfg: ExperimentConfig) -> str:
  return os.path.join(os.path.abspath(workdir), pool_name(cfg, role))


def wait_for(what: str, fn: Callable[[], object], timeout: float,
             should_stop: Callable[[], bool] = lambda: False, poll: float = 0.05):
  t0 = time.monotonic()
  while True:
    v = fn()
    if v is not None or should_stop():
      return v
    if time.monotonic() - t0 > timeout:
      raise TimeoutError(f"waited {timeout:.0f}s for {what}")
    time.sleep(poll)


def scalar(x) -> float:
  return float(np.asarray(jax.device_get(x)))


def keys_of(state) -> jnp.ndarray:
  """The RNG key the update (:func:`jaxrlhf.train.phases.epochs`) on ``state`` draws its
  minibatch permutations from (it splits it), as raw key data for the wire."""
  return jax.random.key_data(state.rng)


# orbax keeps process-wide state that two checkpoint managers saving at the same moment from
# two threads trip over; a pool is normally a process of its own, but tests run both pools
# as threads of one process.
_ORBAX = threading.Lock()


class PoolCheckpointer:
  """The pool's :class:`jaxrlhf.checkpoint.Checkpointer`; every save is complete on disk when
  :meth:`save` returns (a pool acknowledges messages only then)."""

  def __init__(self, workdir: str, role: str, cfg: ExperimentConfig):
    with _ORBAX:
      self.ck = ckpt.Checkpointer(ckpt.checkpoint_dir(workdir, pool_name(cfg, role)),
                                  cfg.checkpoint, to_dict(cfg))
    self.directory = self.ck.directory
    self.enabled = cfg.checkpoint.enabled

  def resume(self, abstract, policy, cfg):
    with _ORBAX:
      return self.ck.resume(abstract, policy, cfg)

  def restoring(self, policy) -> bool:
    """Whether ``--resume=policy`` will restore a checkpoint of this pool."""
    with _ORBAX:
      return policy != "none" and bool(self.ck.all_steps())

  def save(self, step: int, state, extra: dict, metrics=None, *, force: bool = False) -> bool:
    """Whether everything applied up to ``step`` is now final: saved, or (checkpointing off)
    never to be restored, so the caller may ack and trim through it at once — the streams
    stay bounded whatever the checkpoint cadence."""
    if not self.enabled:
      return True
    with _ORBAX:
      saved = self.ck.maybe_save(step, state, extra, metrics, force=force)
      if saved:
        self.ck.wait()
      return saved

  def close(self):
    with _ORBAX:
      self.ck.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def start_over(workdir: str, role: str, cfg: ExperimentConfig, log) -> None:
  """``--resume=none`` for one pool: its checkpoints and result moved aside (never deleted)."""
  name = pool_name(cfg, role)
  with _ORBAX:
    moved = [ckpt._move_aside(p, "replaced") for p in (ckpt.checkpoint_dir(workdir, name),
                                                       ckpt.stage_result_dir(workdir, name))]
  moved = [m for m in moved if m]
  if moved:
    log(f"--resume=none: the {role} pool starts over; moved aside: {', '.join(moved)}")


def save_result(workdir: str, role: str, cfg: ExperimentConfig, params: dict,
                metrics: dict) -> None:
  with _ORBAX:
    ckpt.save_stage_result(workdir, pool_name(cfg, role), params, metrics)
