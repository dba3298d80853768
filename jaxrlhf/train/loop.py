"""The loop around any stage: batches, the jitted step, evaluation every K steps, metrics
(step time, throughput, memory, MFU), checkpoints, and stopping cleanly on repeated non-finite
steps or a signal."""

from __future__ import annotations

import contextlib
import time

import jax

from jaxrlhf.perf import compile_ahead, memory_in_use, release_host_memory
from jaxrlhf.train.common import metrics_to_host, put_batch
from jaxrlhf.train.work import step_utilisation


class TrainingError(RuntimeError):
  """The run cannot continue (e.g. too many consecutive non-finite steps)."""


def prepare_step(stage, state, frozen, batch):
  """``(step_fn, compile_s)``: the stage's step, compiled (and the compiler's heap released)
  before its first call allocates its temporaries, which would otherwise land on top of that
  heap; ``compile_s`` is None for a step that compiles its own programs (the phased RL step).
  Call it under the stage's mesh, as the step will be."""
  step_fn = stage.make_step_fn(state, frozen, batch)
  return step_fn, compile_ahead(step_fn, state, frozen, batch)


def run_stage(stage, state, frozen, *, writer, start_step: int = 0, checkpointer=None,
              should_stop=lambda: False, extra_fn=None, profiler=None, work=None):
  """Trains ``stage`` from ``start_step`` (steps already done) to ``stage.steps``; returns
  ``(state, last_metrics, stopped_early, steps_done)``.  ``steps_done`` is below
  ``stage.steps`` when an evaluation met the stage's target (:meth:`Stage.target_reached`):
  the stage has then finished, and its checkpoint of that step records why
  (``target_reached`` in its JSON).

  Batches are a pure function of the step (``stage.batch(step)``), so ``start_step`` is also
  the data position.  After each step: evaluation when due, one metrics record, the samples of
  the evaluation and (every ``logging.samples_every`` steps) of the rollout, a checkpoint
  when due (``checkpointer.due``, then ``save_now``: asynchronous), then ``should_stop()``; when it says
  stop, a checkpoint of this step is written (``save_now``) before returning with
  ``stopped_early=True``.  ``extra_fn(done)`` is the JSON saved beside the state; ``work``
  (:class:`jaxrlhf.train.work.StepWork`) adds ``perf/*`` utilisation metrics.
  """
  step_fn = None
  last: dict = {}
  extra = extra_fn or (lambda done: {})
  max_skips = getattr(stage.scfg.optim, "max_consecutive_skips", 0)
  log_every = max(stage.cfg.logging.every_steps, 1)
  n_samples = stage.cfg.logging.samples
  samples_every = stage.cfg.logging.samples_every if n_samples else 0
  said_where = False
  for step in range(start_step, stage.steps):
    done = step + 1
    if profiler is not None:
      profiler.before_step(stage.name, done)
    # Rows of this step's rollout to record as samples (an RL stage keeps them; others
    # have no rollout and ignore it).
    stage.samples_wanted = n_samples if samples_every and done % samples_every == 0 else 0
    batch = put_batch(stage.mesh, stage.batch(step))
    with jax.set_mesh(stage.mesh):
      compile_s = None
      if step_fn is None:
        step_fn, compile_s = prepare_step(stage, state, frozen, batch)
      t0 = time.perf_counter()
      with profiler.annotate(done) if profiler is not None else contextlib.nullcontext():
        new_state, metrics = step_fn(state, frozen, batch)
      metrics = metrics_to_host(metrics)
      dt = time.perf_counter() - t0
    if step == start_step:
      release_host_memory()  # what the first step freed (its inputs' staging, dispatch caches)
    if profiler is not None:
      profiler.after_step(stage.name, done, new_state)
    consecutive = int(jax.device_get(new_state.extras["skips/consecutive"]))
    state = new_state
    # Wall time of the whole step, host work included (phase timers report their own parts).
    metrics["time/step_s"] = dt
    if compile_s is not None:
      metrics["time/compile_s"] = compile_s
    metrics.update(memory_in_use())
    if "rollout/tokens" in metrics:
      metrics["throughput/tokens_per_s"] = metrics["rollout/tokens"] / dt
    if work is not None:
      metrics.update(step_utilisation(work, metrics))
    if max_skips and consecutive >= max_skips:
      # A skipped step leaves params and optimizer states untouched (common.apply_update), so
      # this state holds those of the last finite step: the one worth keeping.
      if checkpointer is not None:
        checkpointer.save_now(done, state, extra(done))
        checkpointer.wait()
      raise TrainingError(
          f"{stage.name}: {consecutive} consecutive steps had a non-finite loss or gradient "
          f"(step {done}); parameters were left at the last good state"
          + (f" and checkpointed as step {done} in {checkpointer.directory}"
             if checkpointer is not None else "")
          + ". Lower the learning rate, check the data, or raise "
          f"{stage.name}.optim.max_consecutive_skips")
    evaluated = False
    if stage.eval_every and (done % stage.eval_every == 0 or done == stage.steps):
      metrics.update(stage.evaluate(state, frozen))
      evaluated = True
    reason = stage.target_reached(metrics) if evaluated and done < stage.steps else ""
    extra_now = {**extra(done), "target_reached": reason} if reason else extra(done)
    # The stage's last step (or the one that meets its target) is always saved: it ends there.
    # The record, with the checkpoint's size, is written before the save starts, so a crash
    # after the save never loses the step's record.
    force = bool(reason) or done == stage.steps
    save = checkpointer is not None and checkpointer.due(done, force=force)
    if save:
      metrics["checkpoint/bytes"] = float(checkpointer.save_bytes(state, extra_now))
      if not said_where:  # the folder once; each save is a note on the progress line
        writer.message(f"{stage.name}: checkpoints -> {checkpointer.directory}")
        said_where = True
      writer.note(stage.name, f"ckpt {done} ({metrics['checkpoint/bytes'] / 2**20:.1f} MiB)")
    if evaluated or done % log_every == 0 or done == stage.steps:
      writer.write(stage.name, done, metrics)
    writer.write_samples(stage.name, done, stage.take_samples())
    last = metrics
    if save:  # decided once above (every_seconds reads the clock, across hosts a collective)
      checkpointer.save_now(done, state, extra_now, metrics)
    if reason:
      writer.end_stage(stage.name)
      writer.message(f"{stage.name}: {reason} at step {done} of {stage.steps}; "
                     "the stage ends here")
      return state, last, False, done
    if should_stop() and done < stage.steps:  # after the last step the stage just finishes
      if checkpointer is not None:
        checkpointer.save_now(done, state, extra(done), metrics)
      return state, last, True, done
  return state, last, False, stage.steps

