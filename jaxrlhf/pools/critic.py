"""The critic pool: reward model (+ guard), value model, reward normalisation, GAE advantages
and the value update.

Per batch id ``b``, in order: take the actor's rollout, score it (:meth:`RLStage.phase_reward`,
:meth:`RLStage.phase_values`), normalise rewards with the running statistics this pool owns,
compute advantages (:meth:`PPOStage.advantages` with the KL coefficient the rollout carries),
publish them, then train the value model on the rollout (:meth:`PPOStage.value_loss_terms`
through the colocated minibatch scan, with the permutation key the actor sent — in sync mode
the very key the actor's update uses, so minibatches match the colocated step).

Restart: the checkpoint holds the state after batch ``done``; rollouts after it are still
unacknowledged in the stream and are processed again (their scores, already published, are
not published twice).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxrlhf.config import ExperimentConfig
from jaxrlhf.data import DataSource
from jaxrlhf.metrics import MetricsWriter
from jaxrlhf.pools import common as C
from jaxrlhf.pools import wire
from jaxrlhf.pools.store import Inbox, Store
from jaxrlhf.train.common import put_batch, shardings_of
from jaxrlhf.train.ppo import PPOStage

ROLE = "critic"


class CriticStage(PPOStage):
  """PPO whose update trains the value model alone.

  :meth:`RLStage._epochs` reports the optimizer role named ``policy`` (grad norm, the
  log-prob mismatch), so the value parameters ride in that slot during the scan
  (:meth:`value_update`), with the value optimizer.
  """

  def __init__(self, cfg, mesh, data):
    super().__init__(cfg, mesh, data)
    self.opt = {**self.opt, "policy": self.opt["value"]}

  def losses(self, params, mb, *, denom, n_seq, kl_coef):
    loss, metrics = self.value_loss_terms({"value": params["policy"]}, mb, denom=denom)
    return loss, {**metrics, "_mismatch": jnp.zeros((), jnp.float32)}

  def score(self, state, frozen, batch, ro, kl_coef):
    """Everything of ``RLStage.phase_update`` before the policy update: returns advantages,
    the valid rows, the value-update data, the new reward statistics and metrics."""
    scored, rmetrics = self.phase_reward(frozen, batch, ro)
    ro = {**ro, **scored, **self.phase_values(state, ro)}
    adv, extra, update_mask, _, stats, metrics = self.shape_rewards(state, ro, kl_coef)
    valid = scored["keep"] & jnp.isfinite(scored["score"])
    data = {"tokens": ro["tokens"], "mask": ro["mask"], "resp_mask": update_mask, **extra}
    return adv.astype(jnp.float32), valid, data, stats, {**metrics, **rmetrics}

  def value_update(self, state, data, perm_key, stats):
    view = state.replace(rng=jax.random.wrap_key_data(perm_key),
                         params={"policy": state.params["value"]},
                         opt_state={"policy": state.opt_state["value"]})
    view, m = self._epochs(view, data, jnp.zeros((), jnp.float32))
    state = state.replace(step=state.step + 1, params={"value": view.params["policy"]},
                          opt_state={"value": view.opt_state["policy"]},
                          extras={**view.extras, "reward_stats": stats})
    metrics = {"value/loss": m["value/loss"],
               "value/explained_variance": m["value/explained_variance"],
               "loss/value": m["loss"], "value/grad_norm": m["grad_norm"],
               "skips/total": state.extras["skips/total"]}
    return state, metrics


def run_critic(cfg: ExperimentConfig, workdir: str, store: Store, mesh, roles: dict, *,
               events=None, log=print, should_stop=lambda: False, consumer: str = "critic-0",
               writer=None) -> dict:
  """Scores the actor's rollouts and trains the value model until the PPO stage's last
  step; returns the last metrics."""
  C.check_config(cfg)
  events = events or C.EventLog(None)
  stage = CriticStage(cfg, mesh, DataSource(cfg.data, cfg.seed))
  pcfg, steps = cfg.pools, stage.steps
  frozen_roles = [r for r in stage.frozen() if r != "reference"]
  extras = {k: v for k, v in stage.initial_extras().items() if k != "kl"}
  state, frozen = C.init_roles(stage, C.stage_key(cfg), roles, ["value"], frozen_roles, extras)
  fresh = state
  name = f"{C.STAGE}.{ROLE}"
  writer = writer or MetricsWriter(C.pool_dir(workdir, ROLE), cfg.logging, {name: steps})
  ns = C.namespace(cfg)
  run_key = C.Streams(ns, "").run_key
  run = C.wait_for(f"the actor to start a run (key {run_key} on redis at {store.where})",
                   lambda: store.get_str(run_key), pcfg.peer_wait_s, should_stop)
  if run is None:
    return {}
  with C.PoolCheckpointer(workdir, ROLE, cfg) as ck:
    point = ck.resume(C.abstract_of(state), "latest", cfg)
    done = 0
    if point is not None and point.extra.get("run") != run:
      log(f"critic: the checkpoints in {ck.directory} belong to run {point.extra.get('run')}, "
          f"the actor is on run {run}; starting over")
      ck.resume(C.abstract_of(state), "none", cfg)
      point = None
    if point is not None:
      state, done = point.state, point.extra["done"]
      log(f"critic: resumed run {run} after batch {done}")
      events(event="resumed", done=done, run=run)
    else:
      state = fresh
      events(event="started", run=run)
    del fresh
    streams = C.Streams(ns, run)
    sc_stream, sc_index = streams.stream("scores"), streams.index("scores")
    store.ensure_group(sc_stream, C.GROUP["scores"])
    last_check = [time.monotonic()]

    def check_run():
      # The actor started a new run (its workdir was wiped): this critic's work is void.
      if time.monotonic() - last_check[0] > 2.0:
        last_check[0] = time.monotonic()
        now = store.get_str(run_key)
        if now != run:
          raise RuntimeError(f"critic: the actor moved from run {run} to {now}; restart the "
                             "critic to follow it")

    inbox = Inbox(store, streams.stream("rollouts"), streams.index("rollouts"),
                  C.GROUP["rollouts"], consumer, kind="rollout", run=run,
                  schema=C.rollout_schema(stage), log=log, event=events)
    state_sh = shardings_of(state)
    score = jax.jit(stage.score)
    upd = jax.jit(stage.value_update, out_shardings=(state_sh, None), donate_argnums=(0,))
    last: dict = {}
    t_prev = time.perf_counter()
    with jax.set_mesh(mesh):
      while done < steps:
        t0 = time.perf_counter()
        msg = inbox.take(done, timeout=pcfg.peer_wait_s, should_stop=should_stop,
                         idle=check_run)
        if msg is None:
          break
        t_wait = time.perf_counter() - t0
        t0 = time.perf_counter()
        ro = C.to_device(mesh, msg.arrays)
        batch = put_batch(mesh, stage.batch(msg.batch))
        adv, valid, data, stats, smetrics = score(state, frozen, batch, ro,
                                                  jnp.float32(msg.meta["kl_coef"]))
        smetrics = {k: float(v) for k, v in jax.device_get(smetrics).items()}
        out = wire.Message(kind="scores", run=run, batch=msg.batch, step=done,
                           policy_version=msg.policy_version, producer=consumer,
                           meta=smetrics, arrays=C.to_host({"adv": adv, "valid": valid}))
        added = store.publish(sc_stream, sc_index, msg.batch, wire.encode(out),
                              group=C.GROUP["scores"], max_queue=pcfg.max_queue,
                              should_stop=should_stop, wait_s=pcfg.peer_wait_s)
        events(event="scored", batch=msg.batch, published=added)
        t_score = time.perf_counter() - t0
        t0 = time.perf_counter()
        state, vmetrics = upd(state, data, jnp.asarray(msg.arrays["perm_key"]), stats)
        vmetrics = {k: float(v) for k, v in jax.device_get(vmetrics).items()}
        t_upd = time.perf_counter() - t0
        done += 1
        now = time.perf_counter()
        events(event="applied", batch=msg.batch, policy_version=msg.policy_version)
        metrics = {**smetrics, **vmetrics, "time/step_s": now - t_prev,
                   "time/critic/wait_s": t_wait, "time/critic/score_s": t_score,
                   "time/critic/update_s": t_upd}
        t_prev = now
        writer.write(name, done, metrics)
        last = metrics
        extra = {"run": run, "done": done, "stage": name}
        if ck.save(done, state, extra, metrics, force=done == steps):
          inbox.ack_through(done - 1)
          store.trim(sc_stream, sc_index, C.GROUP["scores"])
    if should_stop() and done < steps:
      ck.save(done, state, {"run": run, "done": done, "stage": name}, last, force=True)
      inbox.ack_through(done - 1)
  if done == steps:
    C.save_result(workdir, ROLE, {"value": state.params["value"]}, {"summary": {}, "steps": steps})
    events(event="finished", done=done)
  return {**last, "state": state, "done": done}
