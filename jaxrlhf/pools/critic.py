"""The critic pool: reward model (+ guard) and host rewards, reward normalisation, the
algorithm's advantages, and the update of any model trained beside them (PPO's value model;
GRPO has none).

Per batch id ``b``, in order: take the actor's rollout, score it (host reward functions on
its decoded responses, then the reward phase), normalise rewards with the running statistics
this pool owns and compute advantages (with the KL coefficient the rollout carries), publish
them, then train the critic's roles on their loss terms with the permutation key the actor
sent (in sync mode the very key the actor's update uses, so minibatches match the colocated
step).  Both programs are the critic's slices of the RL phase list (:func:`critic_programs`),
the same phases the colocated step composes.

Restart: the checkpoint holds the state after batch ``done``; rollouts after it are still
unacknowledged in the stream and are processed again (their scores, already published, are
not published twice).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxrlhf.config import ExperimentConfig
from jaxrlhf.metrics import MetricsWriter
from jaxrlhf.pools import common as C
from jaxrlhf.pools import wire
from jaxrlhf.pools.store import Store
from jaxrlhf.train import pipeline, program
from jaxrlhf.train.common import put_batch
from jaxrlhf.train import phases
from jaxrlhf.train.types import StepCarry

ROLE = "critic"


def critic_metrics(stage, frozen, batch, c: StepCarry) -> StepCarry:
  """The critic's step: the step counter, and its update's metrics (if it trains a role)
  named apart from the actor's (the colocated "loss" is the sum of the two pools' shares)."""
  del frozen, batch
  state = c.state.replace(step=c.state.step + 1)
  m = c.metrics
  trained, _ = C.pool_roles(stage, ROLE)
  metrics = {k: v for k, v in m.items() if k.startswith(tuple(f"{r}/" for r in trained))}
  if trained:
    metrics.update({f"loss/{trained[0]}": m["loss"], f"{trained[0]}/grad_norm": m["grad_norm"]})
  metrics["skips/total"] = state.extras.skips.total
  return c.replace(state=state, metrics=metrics)


def finite_scores(adv_BN, keep_B, score_B):
  """``(adv, valid, rows dropped)`` as they leave this pool: a row whose score or any
  advantage is not finite is marked invalid (the actor's update masks it) and its advantages
  sent as zeros — never a NaN on the wire."""
  finite_B = jnp.all(jnp.isfinite(adv_BN), axis=-1)
  valid_B = keep_B & jnp.isfinite(score_B) & finite_B
  adv = jnp.where(finite_B[:, None], adv_BN, 0.0).astype(jnp.float32)
  return adv, valid_B, int(jax.device_get(jnp.sum(~finite_B)))


def critic_programs(stage):
  """The critic's two programs from the RL phase list (train/program.py): scoring (reward,
  values, reward shaping), then the update of its roles (none for GRPO), with this pool's
  bookkeeping after it."""
  trained, _ = C.pool_roles(stage, ROLE)
  listed = [p for p in phases.rl_phases(trained, trained, stage.scfg)
            if trained or p.name != "train"]
  score, *update = program.pool_programs(listed, ROLE)
  return score, [p for prog in update for p in prog] + [
      program.Phase("critic_metrics", critic_metrics)]


def run_critic(cfg: ExperimentConfig, workdir: str, store: Store, mesh, roles: dict, *,
               events=None, log=print, should_stop=lambda: False, consumer: str = "critic-0",
               writer=None, inputs=None, resume: str = "latest") -> dict:
  """Scores the actor's rollouts and trains the critic's roles until the RL stage's last
  step; returns the last metrics.  ``inputs`` as for :func:`jaxrlhf.pools.actor.run_actor`."""
  C.check_config(cfg)
  with C.PoolLock(C.pool_dir(workdir, ROLE, cfg), f"the {ROLE} pool of {workdir}"):
    while True:
      try:
        return _run_critic(cfg, workdir, store, mesh, roles, events=events, log=log,
                           should_stop=should_stop, consumer=consumer, writer=writer,
                           inputs=dict(inputs or {}), resume=resume)
      except RunChanged as e:
        # The actor started over (killed before its first checkpoint, or its workdir was
        # wiped): this critic's work on the old run is void; follow the new one from its start.
        log(f"critic: {e}; following it")
        resume = "latest"  # the old run's checkpoints are set aside by the run check


class RunChanged(RuntimeError):
  """The actor moved to another run while this critic was on one."""


def _run_critic(cfg, workdir, store, mesh, roles, *, events, log, should_stop, consumer,
                writer, inputs, resume) -> dict:
  store.check_server()
  if resume == "none":
    C.start_over(workdir, ROLE, cfg, log)
  events = events or C.EventLog(None)
  stage = C.build_stage(cfg, mesh)
  trained, frozen_roles = C.pool_roles(stage, ROLE)
  name, steps = C.pool_name(cfg, ROLE), stage.steps
  if "reward" in frozen_roles and "reward" not in roles and not cfg.role_model("reward").hf_path:
    # As the colocated stage warns (RLStage.init): scores from random weights are noise.
    log(f"warning: {name} uses a reward model but no earlier stage trained one; it "
        "starts from random weights (add an 'rm' stage or set reward_model.hf_path)")
  extras = stage.initial_extras().replace(kl=None)  # the actor's controller owns it
  writer = writer or MetricsWriter(C.pool_dir(workdir, ROLE, cfg), cfg.logging, {name: steps})
  ns = C.namespace(cfg, workdir)
  run_key = C.Streams(ns, "").run_key
  log(f"critic: redis namespace {ns} (pools.namespace)")
  run = C.wait_for(f"the actor to start a run (key {run_key} on redis at {store.where})",
                   lambda: store.get_str(run_key), cfg.pools.peer_wait_s, should_stop)
  if run is None:
    return {}
  with C.PoolCheckpointer(workdir, ROLE, cfg) as ck:
    restoring = ck.restoring(resume)
    state, frozen = C.init_roles(stage, C.stage_key(cfg), roles, trained, frozen_roles,
                                 extras, restoring=restoring)
    point = ck.resume(C.abstract_roles(stage, trained, frozen_roles, extras) if restoring
                      else None, resume, cfg)
    done = 0
    if point is not None and point.extra.get("run") != run:
      log(f"critic: the checkpoints in {ck.directory} belong to run {point.extra.get('run')}, "
          f"the actor is on run {run}; starting over")
      ck.resume(None, "none", cfg)
      point = None
    if point is not None:
      pipeline.check_inputs(point.extra, inputs, f"{ck.directory}/{point.step}")
      state, done = point.state, point.extra["done"]
      log(f"critic: resumed run {run} after batch {done}")
      events(event="resumed", done=done, run=run)
    else:
      if state is None:  # nothing restored after all (another run's checkpoints): build it
        state = C.init_roles(stage, C.stage_key(cfg), roles, trained, frozen_roles, extras)[0]
      events(event="started", run=run)
    streams = C.Streams(ns, run)
    if not C.agree(store, streams, ROLE, C.settings_of(cfg, stage, inputs),
                   timeout=cfg.pools.peer_wait_s, should_stop=should_stop):
      return {"state": state, "done": done}
    loop = CriticLoop(stage, store, streams, frozen, state, run_key=run_key, consumer=consumer,
                      events=events, log=log, should_stop=should_stop)
    saves = C.PoolSaves(ck, lambda done: {"run": run, "done": done, "stage": name,
                                          "inputs": inputs}, loop.final,
                        must=lambda: len(loop.inbox.unacked) >= C.MAX_UNACKED)
    with jax.set_mesh(mesh):
      end = C.driver(stage, ROLE, writer, saves, should_stop,
                     samples=loop.take_samples).run(loop, state, done)
  state, done = end.state, end.done
  if done == steps:
    if trained:  # GRPO's critic trains nothing: it has no result to hand on
      C.save_result(workdir, ROLE, cfg, {r: stage.merged(state.params, frozen, r) for r in trained},
                    {"summary": {}, "steps": steps})
    events(event="finished", done=done)
  return {**end.last, "state": state, "done": done}


class CriticLoop:
  """The critic's program for the training loop: per batch ``done``, take the actor's
  rollout, score it (host rewards first), publish the advantages, then train the critic's
  roles.  Returns ``(state, None)`` when told to stop before the scores went out (the
  rollout stays unacknowledged, so a restart scores it again); raises :class:`RunChanged`
  when the actor has moved to another run."""

  def __init__(self, stage, store, streams, frozen, state, *, run_key, consumer, events, log,
               should_stop):
    self.stage, self.store, self.frozen, self.mesh = stage, store, frozen, stage.mesh
    self.feeder = stage.feeder(frozen)  # the run's batches, as the colocated loop reads them
    self.run, self.run_key, self.consumer = streams.run, run_key, consumer
    self.events, self.log, self.should_stop = events, log, should_stop
    self.wait_s, self.max_queue = stage.cfg.pools.peer_wait_s, stage.cfg.pools.max_queue
    self.sc_stream, self.sc_index, self.inbox = C.exchange(
        store, streams, "scores", "rollouts", C.rollout_schema(stage), consumer=consumer,
        log=log, events=events)
    score_phases, update_phases = critic_programs(stage)
    self.score = C.pool_program(stage, score_phases, state)
    self.upd = C.pool_program(stage, update_phases, state)
    self.last_check = time.monotonic()
    self.t_prev = time.perf_counter()
    self.rows: list = []  # rollout sample rows (logging.samples_every): tokens and scores meet here

  def take_samples(self) -> list[dict]:
    rows, self.rows = self.rows, []
    return rows

  def final(self, done: int) -> None:
    """Everything through batch ``done`` is checkpointed: acknowledge its rollouts, and trim
    the scores the actor has read."""
    self.inbox.ack_through(done - 1)
    self.store.trim(self.sc_stream, self.sc_index, C.GROUP["scores"])

  def _check_run(self) -> None:
    # The actor started a new run (its workdir was wiped): this critic's work is void.
    if time.monotonic() - self.last_check > 2.0:
      self.last_check = time.monotonic()
      now = self.store.get_str(self.run_key)
      if now != self.run:
        raise RunChanged(f"the actor moved from run {self.run} to {now}")

  def _scored(self, state, msg):
    """``(carry after the score program, device batch, its metrics, host inputs)`` of a
    rollout message."""
    stage = self.stage
    host_batch = self.feeder.batch(msg.batch)
    host = host_batch.pop("host", None)  # the examples behind the prompts (host rewards)
    batch = put_batch(self.mesh, host_batch)
    # The update's minibatches follow the actor's key: in sync mode the very permutation the
    # colocated step draws.
    perm_key = jax.random.wrap_key_data(jnp.asarray(msg.arrays["perm_key"]))
    ro = C.rollout_of(self.mesh, msg.arrays)
    # rollout.pack: the packed layouts the actor planned for this rollout, planned again.
    c = StepCarry(state=state.replace(rng=perm_key), rollout=ro,
                  kl_coef=jnp.float32(msg.meta["kl_coef"]),
                  packing=C.packing_of(stage, ro, msg.arrays["perm_key"]),
                  host_score_B=C.host_scores_of(self.mesh, msg.arrays))
    hmetrics = {}
    if stage.host_sources:
      c, hmetrics = program.host_reward(stage, c, host, stage.host_scores)
    c = self.score(self.frozen, batch, c)
    return c, batch, {**{k: float(v) for k, v in jax.device_get(c.metrics).items()},
                      **hmetrics}, host

  def __call__(self, state, done: int):
    t0 = time.perf_counter()
    msg = self.inbox.take(done, timeout=self.wait_s, should_stop=self.should_stop,
                          idle=self._check_run)
    if msg is None:
      return state, None
    t_wait = time.perf_counter() - t0
    t0 = time.perf_counter()
    c, batch, smetrics, host = self._scored(state, msg)
    adv, valid, bad = finite_scores(c.shaped.adv_BN, c.scored.keep_B, c.scored.score_B)
    if bad:
      self.log(f"critic: batch {msg.batch}: {bad} rows with non-finite advantages sent as "
               "invalid (masked out of the policy update)")
      self.events(event="nonfinite_advantages", batch=msg.batch, rows=bad)
    arrays = {"adv_BN": adv, "valid_B": valid}
    if C.selects_rows(self.stage):  # dynamic sampling: the groups it trains on
      arrays["rows_B"] = phases.selected_rows(c.rollout, self.stage.n)
    out = wire.Message(kind="scores", run=self.run, batch=msg.batch, step=done,
                       policy_version=msg.policy_version, producer=self.consumer, meta=smetrics,
                       arrays=C.to_host(arrays))
    added = self.store.publish(self.sc_stream, self.sc_index, msg.batch, wire.encode(out),
                               group=C.GROUP["scores"], max_queue=self.max_queue,
                               should_stop=self.should_stop, wait_s=self.wait_s)
    if not added.published:
      # Stopped while the actor's queue was full: the scores of this batch are not in the
      # stream, so neither the update nor the position may move past it (a checkpoint
      # covering it would leave the actor waiting for them forever).  Its rollout stays
      # unacked (the stop checkpoint acks through done - 1), so a restart reads it again.
      return state, None
    self.events(event="scored", batch=msg.batch, published=added.value)
    if host is not None and program.samples_due(self.stage.cfg.logging, done + 1):
      self.rows = program.rollout_samples(self.stage, c, host)
    t_score = time.perf_counter() - t0
    t0 = time.perf_counter()
    c = self.upd(self.frozen, batch, c.replace(metrics={}))
    vmetrics = {k: float(v) for k, v in jax.device_get(c.metrics).items()}
    now = time.perf_counter()
    self.events(event="applied", batch=msg.batch, policy_version=msg.policy_version)
    metrics = {**smetrics, **vmetrics, "time/step_s": now - self.t_prev,
               "time/critic/wait_s": t_wait, "time/critic/score_s": t_score,
               "time/critic/update_s": now - t0}
    self.t_prev = now
    return c.state, metrics
