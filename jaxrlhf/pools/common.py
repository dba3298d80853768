"""What the actor and critic pools share: the PPO stage each builds, its slice of the roles,
stream names, message schemas, and the pieces of a pool's run (checkpointer, metrics, events).

Each pool builds the full :class:`jaxrlhf.train.ppo.PPOStage` (construction allocates
nothing) but initialises only its own roles, with the same per-role keys as the colocated
stage, so both pools start exactly where a colocated run would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import checkpoint as ckpt
from jaxrlhf.config import ConfigError, ExperimentConfig, to_dict
from jaxrlhf.train import phases, program
from jaxrlhf.train.common import init_state, put_batch, shardings_of
from jaxrlhf.train.ppo import PPOStage
from jaxrlhf.train.types import Rollout, StepCarry

STAGE = "ppo"


def check_config(cfg: ExperimentConfig) -> None:
  if not cfg.stages or cfg.stages[-1] != STAGE:
    raise ConfigError(f"--role=actor|critic runs the PPO stage in two pools; the experiment's "
                      f"stages are {list(cfg.stages)}: make 'ppo' the last stage")
  if cfg.ppo.shared_backbone:
    raise ConfigError("ppo.shared_backbone=true puts the value head on the policy, so there is "
                      "no separate value model for a critic pool; set ppo.shared_backbone=false "
                      "for --role=actor|critic")
  host = [s for s in cfg.ppo.reward.sources if s.startswith("host:")]
  if host:
    raise ConfigError(f"ppo.reward.sources {host}: host (Python) rewards are not supported by "
                      "the pools yet; use 'model' or 'rule:NAME' sources")
  p = cfg.pools
  if p.mode == "async" and p.max_staleness < 1:
    raise ConfigError(f"pools.max_staleness={p.max_staleness}: async mode needs >= 1 (the "
                      "rollouts generated ahead of the update); or use pools.mode=sync")
  if p.max_queue < 1:
    raise ConfigError(f"pools.max_queue={p.max_queue}: must be >= 1")
  if p.is_correction < 0:
    raise ConfigError(f"pools.is_correction={p.is_correction}: 0 (off) or a cap > 0")


def staleness(cfg: ExperimentConfig) -> int:
  """Rollouts the actor generates ahead of its updates (0: synchronous)."""
  return cfg.pools.max_staleness if cfg.pools.mode == "async" else 0


def stage_key(cfg: ExperimentConfig) -> jax.Array:
  """The key the colocated pipeline gives the PPO stage."""
  return jax.random.fold_in(jax.random.key(cfg.seed), list(cfg.stages).index(STAGE))


def init_roles(stage: PPOStage, key: jax.Array, roles: dict, trainable, frozen, extras: dict):
  """Like :meth:`Stage.init` for a subset of the roles: the same key per role as the full
  stage, so each pool's parameters equal the colocated run's."""
  names = ("state",) + tuple(stage.trainable) + tuple(stage.frozen())
  keys = dict(zip(names, jax.random.split(key, len(names))))
  params = {r: stage.role_params(roles, r, keys[r], head=stage.trainable[r]) for r in trainable}
  heads = stage.frozen()
  fz = {r: stage.role_params(roles, r, keys.get("policy", keys[r]) if r == "reference"
                             else keys[r], head=heads[r], frozen=True) for r in frozen}
  state = init_state(stage.mesh, params, {r: stage.opt[r] for r in trainable}, keys["state"],
                     extras)
  return state, fz


def abstract_of(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      tree)


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


def namespace(cfg: ExperimentConfig) -> str:
  return cfg.pools.namespace or f"jaxrlhf:{cfg.name}"


GROUP = {"rollouts": "critic", "scores": "actor"}


def rollout_schema(stage: PPOStage) -> dict:
  """name -> (shape, dtype) of a rollout message: the fields of
  :class:`~jaxrlhf.train.types.Rollout` as generation and the reference phase fill them, and
  the key of the update's minibatch permutations."""
  state, _ = stage.abstract_init()
  c = jax.eval_shape(lambda st, b: phases.generate(stage, {}, b, StepCarry(state=st)), state,
                     stage.abstract_batch())
  ro = c.rollout
  schema = {f.name: (tuple(getattr(ro, f.name).shape), np.dtype(getattr(ro, f.name).dtype).name)
            for f in dataclasses.fields(Rollout) if getattr(ro, f.name) is not None}
  schema["ref_logp_BN"] = schema["kl_BN"] = schema["behaviour_logp_BN"]
  schema["perm_key"] = (tuple(jax.random.key_data(jax.random.key(0)).shape), "uint32")
  return schema


def scores_schema(stage: PPOStage) -> dict:
  rows, n = stage.scfg.batch_size * stage.n, stage.N
  return {"adv_BN": ((rows, n), "float32"), "valid_B": ((rows,), "bool")}


def rollout_arrays(ro: Rollout) -> dict:
  """A rollout's fields, on the host, for the wire."""
  return to_host({f.name: getattr(ro, f.name) for f in dataclasses.fields(Rollout)})


def rollout_of(mesh, arrays: dict) -> Rollout:
  """The rollout of a message, on the mesh."""
  return Rollout(**to_device(mesh, {k: v for k, v in arrays.items() if k != "perm_key"}))


def pool_program(stage, phases, state):
  """``(frozen, batch, carry) -> carry`` of ``phases`` jitted, the carry's state donated."""
  return jax.jit(program.compose(stage, phases), donate_argnums=(2,),
                 out_shardings=StepCarry(state=shardings_of(state), metrics=None))


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


def pool_dir(workdir: str, role: str) -> str:
  return os.path.join(os.path.abspath(workdir), f"{STAGE}.{role}")


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
      self.ck = ckpt.Checkpointer(ckpt.checkpoint_dir(workdir, f"{STAGE}.{role}"),
                                  cfg.checkpoint, to_dict(cfg))
    self.directory = self.ck.directory

  def resume(self, abstract, policy, cfg):
    with _ORBAX:
      return self.ck.resume(abstract, policy, cfg)

  def save(self, step: int, state, extra: dict, metrics=None, *, force: bool = False) -> bool:
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


def save_result(workdir: str, role: str, params: dict, metrics: dict) -> None:
  with _ORBAX:
    ckpt.save_stage_result(workdir, f"{STAGE}.{role}", params, metrics)
