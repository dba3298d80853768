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
from jaxrlhf.pools.store import Inbox, Store
from jaxrlhf.train import pipeline, program
from jaxrlhf.train.common import put_batch, shardings_of
from jaxrlhf.train.types import Shaped, StepCarry

ROLE = "actor"


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
  """The actor's two programs from the RL phase list (train/program.py): the rollout
  (generation, reference), and the policy update given the critic's advantages, with this
  pool's own phases around it."""
  rollout, update = program.pool_programs(stage.phases(("policy",), ("policy",)), ROLE)
  if stage.cfg.pools.is_correction > 0:
    update = [program.Phase("is_correction", is_correction)] + update
  return rollout, update + [program.Phase("policy_metrics", policy_metrics)]


def device_batch(batch: dict) -> dict:
  """A batch without its host side (the examples a host reward reads: the critic's)."""
  return {k: v for k, v in batch.items() if k != "host"}


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
  pcfg, steps, ahead = cfg.pools, stage.steps, C.staleness(cfg)
  trained, frozen_roles = C.pool_roles(stage, ROLE)
  state, frozen = C.init_roles(stage, C.stage_key(cfg), roles, trained, frozen_roles,
                               {k: v for k, v in stage.initial_extras().items()
                                if k != "reward_stats"})
  name = C.pool_name(cfg, ROLE)
  writer = writer or MetricsWriter(C.pool_dir(workdir, ROLE, cfg), cfg.logging, {name: steps})
  with C.PoolCheckpointer(workdir, ROLE, cfg) as ck:
    point = ck.resume(C.abstract_of(state), resume, cfg)
    if point is not None:
      pipeline.check_inputs(point.extra, inputs, f"{ck.directory}/{point.step}")
      state, extra = point.state, point.extra
      run, done, published = extra["run"], extra["done"], extra["published"]
      start_eval = extra.get("start_eval", {})
      log(f"actor: resumed run {run} after update {done} ({published} rollouts published)")
      events(event="resumed", done=done, published=published, run=run)
    else:
      run, done, published = uuid.uuid4().hex[:12], 0, 0
      start_eval = stage.evaluate(state, frozen)
      # Saved before anything is published: a restart always finds this run's id.
      ck.save(0, state, {"run": run, "done": 0, "published": 0, "start_eval": start_eval,
                         "inputs": inputs}, force=True)
      events(event="started", run=run)
    streams = C.Streams(C.namespace(cfg, workdir), run)
    log(f"actor: run {run} in redis namespace {streams.ns} (pools.namespace)")
    store.set_str(streams.run_key, run)
    if not C.agree(store, streams, ROLE, C.settings_of(cfg, stage, inputs),
                   timeout=pcfg.peer_wait_s, should_stop=should_stop):
      return {"start_eval": start_eval, "state": state, "done": done}
    ro_stream, ro_index = streams.stream("rollouts"), streams.index("rollouts")
    store.ensure_group(ro_stream, C.GROUP["rollouts"])
    ro_schema = C.rollout_schema(stage)
    inbox = Inbox(store, streams.stream("scores"), streams.index("scores"), C.GROUP["scores"],
                  consumer, kind="scores", run=run, schema=C.scores_schema(stage), log=log,
                  event=events)
    state_sh = shardings_of(state)
    rollout_phases, update_phases = actor_programs(stage)
    gen = C.pool_program(stage, rollout_phases, state)
    upd = C.pool_program(stage, update_phases, state)
    skip_gen = jax.jit(lambda s: s.replace(rng=jax.random.split(s.rng)[0]),
                       out_shardings=state_sh, donate_argnums=(0,))

    def extra_of():
      return {"run": run, "done": done, "published": published, "start_eval": start_eval,
              "stage": name, "inputs": inputs}

    inflight: dict = {}  # batch id -> (rollout on device, policy version)
    # Rollouts the checkpoint's state had already published: read back, not regenerated.
    for b in range(done, published):
      got = store.get(ro_stream, ro_index, b)
      if got is None:
        raise RuntimeError(f"actor: rollout {b} was published before the restart but is gone "
                           f"from {ro_stream}; the store lost data (Redis without persistence?)")
      msg = wire.decode(got[1], kind="rollout", run=run, schema=ro_schema)
      inflight[b] = (C.rollout_of(mesh, msg.arrays), msg.policy_version)
    last: dict = {}
    t_prev = time.perf_counter()
    with jax.set_mesh(mesh):
      while done < steps:
        if should_stop():
          break
        t_gen = 0.0
        while published < steps and published - done <= ahead:
          b = published
          t0 = time.perf_counter()
          got = store.get(ro_stream, ro_index, b)
          if got is not None:
            # Published by this run before a restart (after its checkpoint): reuse it, and
            # take the RNG step its generation took so the run goes on as if uninterrupted.
            msg = wire.decode(got[1], kind="rollout", run=run, schema=ro_schema)
            state = skip_gen(state)
            ro = C.rollout_of(mesh, msg.arrays)
            version = msg.policy_version
            log(f"actor: rollout {b} was published before the restart; reusing it")
            events(event="reused", batch=b)
          else:
            c = gen(frozen, put_batch(mesh, device_batch(stage.batch(b))),
                    StepCarry(state=state))
            state, ro = c.state, c.rollout
            arrays = {**C.rollout_arrays(ro), "perm_key": jax.device_get(C.keys_of(state))}
            version = done
            msg = wire.Message(kind="rollout", run=run, batch=b, step=done,
                               policy_version=version, producer=consumer,
                               meta={"kl_coef": C.scalar(state.extras["kl"].coef)},
                               arrays=arrays)
            added = store.publish(ro_stream, ro_index, b, wire.encode(msg),
                                  group=C.GROUP["rollouts"], max_queue=pcfg.max_queue,
                                  should_stop=should_stop, wait_s=pcfg.peer_wait_s)
            if not added.published:  # stopped while the queue was full: b stays unpublished
              break
            # PRESENT: Redis ran the publish but its reply was lost to an outage, and the
            # retry found the entry.  It is this rollout (nothing else can have published b:
            # the read-back above found none), so b counts as published.
            events(event="published", batch=b, policy_version=version, how=added.value)
          inflight[b] = (ro, version)
          published += 1
          t_gen += time.perf_counter() - t0
        if should_stop():
          break
        t0 = time.perf_counter()
        scores = inbox.take(done, timeout=pcfg.peer_wait_s, should_stop=should_stop)
        if scores is None:
          break
        t_wait = time.perf_counter() - t0
        ro, version = inflight.pop(done)
        lag = done - version
        if lag > ahead:  # cannot happen by construction; a guard against a broken restart
          raise RuntimeError(f"actor: rollout {done} is {lag} updates stale (limit {ahead})")
        t0 = time.perf_counter()
        valid = jnp.asarray(scores.arrays["valid_B"])
        shaped = Shaped(adv_BN=jnp.asarray(scores.arrays["adv_BN"]),
                        update_mask_BN=ro.response_mask_BN & valid[:, None])
        c = upd(frozen, {}, StepCarry(state=state, rollout=ro, shaped=shaped))
        state = c.state
        metrics = {k: float(v) for k, v in jax.device_get(c.metrics).items()}
        t_upd = time.perf_counter() - t0
        done += 1
        now = time.perf_counter()
        events(event="applied", batch=done - 1, policy_version=version, scores_batch=scores.batch)
        C.check_skips(stage, state, ROLE, done, lambda: (
            ck.save(done, state, extra_of(), metrics, force=True), inbox.ack_through(done - 1)))
        metrics.update({"time/step_s": now - t_prev, "time/actor/generate_s": t_gen,
                        "time/actor/wait_s": t_wait, "time/actor/update_s": t_upd,
                        "pools/staleness": float(lag),
                        **{f"critic/{k}": v for k, v in scores.meta.items()}})
        t_prev = now
        if stage.eval_every and (done % stage.eval_every == 0 or done == steps):
          metrics.update(stage.evaluate(state, frozen))
        writer.write(name, done, metrics)
        last = metrics
        # A checkpoint at least every MAX_UNACKED batches, whatever checkpoint.every_steps:
        # the streams hold what a restart may re-read, and this bounds it.
        if ck.save(done, state, extra_of(), metrics,
                   force=done == steps or len(inbox.unacked) >= C.MAX_UNACKED):
          inbox.ack_through(done - 1)
          store.trim(ro_stream, ro_index, C.GROUP["rollouts"],
                     keep_from=store.entry_of(ro_index, done))
    if should_stop():
      ck.save(done, state, extra_of(), last, force=True)
      inbox.ack_through(done - 1)
  if done == steps and "eval/accuracy" not in last:
    last.update(stage.evaluate(state, frozen))
  if done == steps:
    C.save_result(workdir, ROLE, cfg, {r: stage.merged(state.params, frozen, r) for r in trained},
                  {"summary": {name: {k: v for k, v in last.items() if k.startswith("eval/")}},
                   "start_eval": start_eval, "steps": steps})
    events(event="finished", done=done)
  return {**last, "start_eval": start_eval, "state": state, "done": done}
