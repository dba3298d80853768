"""The actor pool: generation, reference log-probs and the policy update.

Per batch id ``b`` (the RL step): generate with the current policy, add reference log-probs,
publish the rollout (``policy_version`` = updates applied so far), then — once the critic's
advantages for ``b`` arrive — train the policy on its loss term.  Both programs are the
actor's slices of the RL phase list (:func:`actor_programs`), the same phases the colocated
step composes.

With ``pools.mode=sync`` the actor waits for the advantages of ``b`` before generating
``b + 1``: the same computation as the colocated step.  With ``async`` it generates up to
``max_staleness`` batches ahead, so the critic scores ``b`` while the actor generates
``b + 1``; the PPO ratio then uses the behaviour policy's log-probs, or with
``pools.is_correction = c > 0`` the current policy's with the truncated importance weight
``min(pi_current / pi_behaviour, c)`` on the advantages (decoupled PPO).

Restart: the checkpoint holds the state after update ``done`` and ``published``; rollouts
published after it are read back from the stream (their generation's RNG step replayed), and
scores of batches the checkpoint covers are skipped — no batch lost or applied twice.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

import jax
import jax.numpy as jnp

from jaxrlhf import model as M
from jaxrlhf.algorithms.shaping import off_policy_weights
from jaxrlhf.config import ExperimentConfig
from jaxrlhf.metrics import MetricsWriter
from jaxrlhf.pools import common as C
from jaxrlhf.pools import wire
from jaxrlhf.pools.store import Store
from jaxrlhf.train import phases, pipeline, program
from jaxrlhf.train.common import put_batch, shardings_of
from jaxrlhf.train.types import Shaped, StepCarry

ROLE = "actor"


@dataclasses.dataclass(frozen=True)
class Generated:
  """A rollout the actor has published and not yet trained on: on the device, with its packed
  layouts (``rollout.pack``; else None), the policy version that sampled it and its
  generation's metrics."""

  rollout: object
  packing: object
  version: int
  metrics: dict


def is_correction(stage, frozen, batch, c: StepCarry) -> StepCarry:
  """Decoupled PPO for stale rollouts (``pools.is_correction = cap > 0``): the trust region
  around the current policy's log-probs, the lag weighted by ``min(pi_current / pi_behaviour,
  cap)`` on the advantages."""
  del batch
  # The same truncated importance weights as the colocated off-policy correction
  # (off_policy=tis), here against the policy's lag behind its stale rollouts.
  ro, sh = c.rollout, c.shaped
  prox, _ = M.token_logprobs(stage.view(c.state.params, frozen, "policy"), ro.tokens_BT,
                             ro.mask_BT,
                             cfg=stage.model_cfg("policy"), start=ro.prompt_len,
                             kernels=stage.cfg.kernels)
  prox = jax.lax.stop_gradient(prox)
  w, _, m = off_policy_weights(prox, ro.behaviour_logp_BN, sh.update_mask_BN, mode="tis",
                               cap=stage.cfg.pools.is_correction)
  metrics = {"pools/is_weight_mean": m["is_weight_mean"],
             "pools/is_truncated_frac": m["is_clipped_frac"]}
  return c.replace(shaped=sh.replace(adv_BN=sh.adv_BN * w, old_logp_BN=prox),
                   metrics={**c.metrics, **metrics})


def policy_metrics(stage, frozen, batch, c: StepCarry) -> StepCarry:
  """The colocated "loss" is the policy's share plus the critic's: name this one's apart."""
  del stage, frozen, batch
  metrics = dict(c.metrics)
  metrics["loss/policy"] = metrics.pop("loss")
  return c.replace(metrics=metrics)


def actor_programs(stage):
  """The actor's programs from the RL phase list (train/program.py): the rollout's, in order
  (generation and the reference: one program, or two with the step cut after generation for
  length buckets, packing or multi-turn episodes, :func:`jaxrlhf.train.program.cut_rollout`
  between them; the episodes then replace the first), and
  the policy update given the critic's advantages (every phase of the actor's after the
  critic's first, as one program: the actor sends nothing while it runs), with this pool's own
  phases around it."""
  listed = stage.phases(("policy",), ("policy",))
  programs = program.pool_programs(listed, ROLE, cut_at_host=program.cuts_at_host(stage) or (
      stage.episodes is not None))
  at = {id(p): i for i, p in enumerate(listed)}
  first = min(i for i, p in enumerate(listed) if p.pool == "critic" and p.name != program.HOST)
  rollout = [ps for ps in programs if at[id(ps[0])] < first]
  update = [p for ps in programs if at[id(ps[0])] > first for p in ps]
  if stage.cfg.pools.is_correction > 0:
    update = [program.Phase("is_correction", is_correction)] + update
  return rollout, update + [program.Phase("policy_metrics", policy_metrics)]


def run_actor(cfg: ExperimentConfig, workdir: str, store: Store, mesh, roles: dict, *,
              events=None, log=print, should_stop=lambda: False, consumer: str = "actor-0",
              writer=None, inputs=None, resume: str = "latest") -> dict:
  """Trains the policy of ``cfg``'s RL stage (its last) against a critic pool; returns the
  last metrics (with the final held-out evaluation).  ``inputs``: earlier stage -> the id of
  the result ``roles`` come from (a checkpoint built on other results is refused)."""
  C.check_config(cfg)
  with C.PoolLock(C.pool_dir(workdir, ROLE, cfg), f"the {ROLE} pool of {workdir}"):
    return _run_actor(cfg, workdir, store, mesh, roles, events=events, log=log,
                      should_stop=should_stop, consumer=consumer, writer=writer,
                      inputs=dict(inputs or {}), resume=resume)


def _run_actor(cfg, workdir, store, mesh, roles, *, events, log, should_stop, consumer,
               writer, inputs, resume) -> dict:
  store.check_server()
  if resume == "none":
    C.start_over(workdir, ROLE, cfg, log)
  events = events or C.EventLog(None)
  stage = C.build_stage(cfg, mesh)
  trained, frozen_roles = C.pool_roles(stage, ROLE)
  extras = stage.initial_extras().replace(reward_stats=None)  # the critic owns them
  name, steps = C.pool_name(cfg, ROLE), stage.steps
  writer = writer or MetricsWriter(C.pool_dir(workdir, ROLE, cfg), cfg.logging, {name: steps})
  with C.PoolCheckpointer(workdir, ROLE, cfg) as ck:
    restoring = ck.restoring(resume)
    state, frozen = C.init_roles(stage, C.stage_key(cfg), roles, trained, frozen_roles, extras,
                                 restoring=restoring)
    ev = stage.evaluation(frozen)
    point = ck.resume(C.abstract_roles(stage, trained, frozen_roles, extras) if restoring
                      else None, resume, cfg)
    if point is None and state is None:  # no complete checkpoint after all: a fresh start
      state = C.init_roles(stage, C.stage_key(cfg), roles, trained, frozen_roles, extras)[0]
    if point is not None:
      pipeline.check_inputs(point.extra, inputs, f"{ck.directory}/{point.step}")
      state, extra = point.state, point.extra
      run, done, published = extra["run"], extra["done"], extra["published"]
      start_eval = extra.get("start_eval", {})
      log(f"actor: resumed run {run} after update {done} ({published} rollouts published)")
      events(event="resumed", done=done, published=published, run=run)
    else:
      run, done, published = uuid.uuid4().hex[:12], 0, 0
      # As a colocated stage: before training when the spec asks, never with eval_every=0.
      start_eval = ev(state) if stage.spec.eval_at_start and stage.eval_every else {}
      # Saved before anything is published: a restart always finds this run's id.
      ck.save(0, state, {"run": run, "done": 0, "published": 0, "start_eval": start_eval,
                         "inputs": inputs}, force=True)
      events(event="started", run=run)
    streams = C.Streams(C.namespace(cfg, workdir), run)
    log(f"actor: run {run} in redis namespace {streams.ns} (pools.namespace)")
    store.set_str(streams.run_key, run)
    if not C.agree(store, streams, ROLE, C.settings_of(cfg, stage, inputs),
                   timeout=cfg.pools.peer_wait_s, should_stop=should_stop):
      return {"start_eval": start_eval, "state": state, "done": done}
    loop = ActorLoop(stage, store, streams, frozen, state, consumer=consumer, events=events,
                     log=log, should_stop=should_stop, published=published, start=done)
    saves = C.PoolSaves(ck, lambda done: {
        "run": run, "done": done, "published": loop.published, "start_eval": start_eval,
        "stage": name, "inputs": inputs}, loop.final,
        must=lambda: len(loop.inbox.unacked) >= C.MAX_UNACKED)
    with jax.set_mesh(mesh):
      end = C.driver(stage, ROLE, writer, saves, should_stop,
                     evaluation=ev).run(loop, state, done)
  state, last, done = end.state, dict(end.last), end.done
  if done == steps and stage.eval_every and "eval/accuracy" not in last:
    last.update(ev(state))
  if done == steps:
    C.save_result(workdir, ROLE, cfg, {r: stage.merged(state.params, frozen, r) for r in trained},
                  {"summary": {name: {k: v for k, v in last.items() if k.startswith("eval/")}},
                   "start_eval": start_eval, "steps": steps})
    events(event="finished", done=done)
  return {**last, "start_eval": start_eval, "state": state, "done": done}


class ActorLoop:
  """The actor's program for the training loop: per update ``done``, generate and publish
  the rollouts up to ``max_staleness`` ahead (or read back those published before a restart,
  taking the RNG step their generation took), take the critic's advantages of batch
  ``done`` and train the policy on them.  Returns ``(state, None)`` when told to stop."""

  def __init__(self, stage, store, streams, frozen, state, *, consumer, events, log,
               should_stop, published: int, start: int):
    cfg, mesh = stage.cfg, stage.mesh
    self.stage, self.store, self.frozen, self.mesh = stage, store, frozen, mesh
    self.feeder = stage.feeder(frozen)  # the run's batches, as the colocated loop reads them
    self.consumer, self.events, self.log, self.should_stop = consumer, events, log, should_stop
    self.run, self.published, self.ahead = streams.run, published, C.staleness(cfg)
    self.wait_s, self.max_queue = cfg.pools.peer_wait_s, cfg.pools.max_queue
    self.schema = C.rollout_schema(stage)
    self.widths = program.bucket_widths(stage.N, cfg.rollout.length_buckets)
    self.ro_stream, self.ro_index, self.inbox = C.exchange(
        store, streams, "rollouts", "scores", C.scores_schema(stage), consumer=consumer, log=log,
        events=events)
    rollout_phases, update_phases = actor_programs(stage)
    self.gen = [C.pool_program(stage, ps, state) for ps in rollout_phases]
    self.upd = C.pool_program(stage, update_phases, state)
    self.skip_gen = jax.jit(lambda s: s.replace(rng=jax.random.split(s.rng)[0]),
                            out_shardings=shardings_of(state), donate_argnums=(0,))
    self.inflight: dict = {}  # batch id -> Generated
    # Rollouts the checkpoint's state had already published: read back, not regenerated.
    for b in range(start, published):
      got = store.get(self.ro_stream, self.ro_index, b)
      if got is None:
        raise RuntimeError(f"actor: rollout {b} was published before the restart but is gone "
                           f"from {self.ro_stream}; the store lost data (Redis without "
                           "persistence?)")
      self.inflight[b] = self._received(got[1])
    self.t_prev = time.perf_counter()

  def final(self, done: int) -> None:
    """Everything through update ``done`` is checkpointed: acknowledge its scores, and trim
    the rollouts a restart can no longer need."""
    self.inbox.ack_through(done - 1)
    self.store.trim(self.ro_stream, self.ro_index, C.GROUP["rollouts"],
                    keep_from=self.store.entry_of(self.ro_index, done))

  def _received(self, fields) -> "Generated":
    """A rollout this run published before a restart, as its generation left it: the packed
    layouts (``rollout.pack``) planned again from its mask and the key it carries, and the
    generation's metrics from its header."""
    msg = wire.decode(fields, kind="rollout", run=self.run, schema=self.schema)
    ro = C.rollout_of(self.mesh, msg.arrays)
    packing = C.packing_of(self.stage, ro, msg.arrays["perm_key"])
    return Generated(ro, packing, msg.policy_version, C.metrics_of_meta(msg.meta))

  def _generate(self, state, b: int):
    """``(state, carry, metrics)``: batch ``b``'s rollout programs, the host's cut between
    them (:func:`jaxrlhf.train.program.cut_rollout`); with an environment (``env.name``) the
    episodes, run on the host, in place of the first (their returns the carry's host
    scores, for the critic)."""
    stage = self.stage
    host_batch = self.feeder.batch(b)
    host = host_batch.pop("host", None)
    batch = put_batch(self.mesh, host_batch)
    c, metrics = StepCarry(state=state), {}
    for i, fn in enumerate(self.gen):
      if i:
        c, got = program.cut_rollout(stage, c, widths=self.widths, pack=stage.cfg.rollout.pack)
        metrics.update(got)
      if i == 0 and stage.episodes is not None:
        c, got = stage.episodes(c.state, self.frozen, batch, c, host)
        metrics.update(got)
        continue
      c = fn(self.frozen, batch, c)
    return c.state, c, {**{k: float(v) for k, v in jax.device_get(c.metrics).items()},
                        **metrics}

  def _next_rollout(self, state, b: int, done: int):
    """``(state, Generated)`` of batch ``b``, or ``(state, None)`` when told to stop while
    the rollouts stream was full (``b`` stays unpublished)."""
    got = self.store.get(self.ro_stream, self.ro_index, b)
    if got is not None:
      # Published by this run before a restart (after its checkpoint): reuse it, and take
      # the RNG step its generation took so the run goes on as if uninterrupted.
      self.log(f"actor: rollout {b} was published before the restart; reusing it")
      self.events(event="reused", batch=b)
      return self.skip_gen(state), self._received(got[1])
    state, c, gen_metrics = self._generate(state, b)
    ro = c.rollout
    arrays = {**C.rollout_arrays(ro), "perm_key": jax.device_get(C.keys_of(state)),
              **({} if c.host_score_B is None else C.to_host({"host_score_B": c.host_score_B}))}
    meta = {"kl_coef": C.scalar(state.extras.kl.coef), **C.meta_of_metrics(gen_metrics)}
    msg = wire.Message(kind="rollout", run=self.run, batch=b, step=done, policy_version=done,
                       producer=self.consumer, meta=meta, arrays=arrays)
    added = self.store.publish(self.ro_stream, self.ro_index, b, wire.encode(msg),
                               group=C.GROUP["rollouts"], max_queue=self.max_queue,
                               should_stop=self.should_stop, wait_s=self.wait_s)
    if not added.published:  # stopped while the queue was full
      return state, None
    # PRESENT: Redis ran the publish but its reply was lost to an outage, and the retry found
    # the entry.  It is this rollout (nothing else can have published b: the read-back above
    # found none), so b counts as published.
    self.events(event="published", batch=b, policy_version=done, how=added.value)
    return state, Generated(ro, c.packing, done, gen_metrics)

  def __call__(self, state, done: int):
    if self.should_stop():
      return state, None
    t0 = time.perf_counter()
    while self.published < self.stage.steps and self.published - done <= self.ahead:
      state, got = self._next_rollout(state, self.published, done)
      if got is None:
        break
      self.inflight[self.published] = got
      self.published += 1
    t_gen = time.perf_counter() - t0
    if self.should_stop():
      return state, None
    t0 = time.perf_counter()
    scores = self.inbox.take(done, timeout=self.wait_s, should_stop=self.should_stop)
    if scores is None:
      return state, None
    t_wait = time.perf_counter() - t0
    gen = self.inflight.pop(done)
    ro, lag = gen.rollout, done - gen.version
    if lag > self.ahead:  # cannot happen by construction; a guard against a broken restart
      raise RuntimeError(f"actor: rollout {done} is {lag} updates stale (limit {self.ahead})")
    if "rows_B" in scores.arrays:  # dynamic sampling: the groups the critic selected
      ro = phases.take_rows(ro, jnp.asarray(scores.arrays["rows_B"]), self.stage.n)
    adv = scores.arrays["adv_BN"]
    if adv.shape != ro.response_mask_BN.shape:  # another width than its rollout's bucket
      raise RuntimeError(f"actor: the critic's advantages of batch {done} are {list(adv.shape)}"
                         f" but its rollout's responses {list(ro.response_mask_BN.shape)}")
    t0 = time.perf_counter()
    valid = jnp.asarray(scores.arrays["valid_B"])
    shaped = Shaped(adv_BN=jnp.asarray(adv), update_mask_BN=ro.response_mask_BN & valid[:, None])
    c = self.upd(self.frozen, {}, StepCarry(state=state, rollout=ro, shaped=shaped,
                                            packing=gen.packing))
    metrics = {**gen.metrics, **{k: float(v) for k, v in jax.device_get(c.metrics).items()}}
    now = time.perf_counter()
    self.events(event="applied", batch=done, policy_version=gen.version, scores_batch=scores.batch)
    metrics.update({"time/step_s": now - self.t_prev, "time/actor/generate_s": t_gen,
                    "time/actor/wait_s": t_wait, "time/actor/update_s": now - t0,
                    "pools/staleness": float(lag),
                    **{f"critic/{k}": v for k, v in scores.meta.items()}})
    self.t_prev = now
    return c.state, metrics
