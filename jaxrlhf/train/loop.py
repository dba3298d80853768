"""The loop around any stage: batches, the jitted step, evaluation every K steps, metrics,
checkpoint hooks, and stopping cleanly on repeated non-finite steps or a signal."""

from __future__ import annotations

import contextlib
import time

import jax

from jaxrlhf.perf import memory_in_use
from jaxrlhf.train.common import metrics_to_host, put_batch


class TrainingError(RuntimeError):
  """The run cannot continue (e.g. too many consecutive non-finite steps)."""


def run_stage(stage, state, frozen, *, writer, start_step: int = 0, checkpointer=None,
              should_stop=lambda: False, extra_fn=None, profiler=None):
  """Trains ``stage`` from ``start_step`` to ``stage.steps``; returns ``(state, last_metrics,
  stopped_early)``."""
  step_fn = None
  last: dict = {}
  max_skips = getattr(stage.scfg.optim, "max_consecutive_skips", 0)
  for step in range(start_step, stage.steps):
    if profiler is not None:
      profiler.before_step(stage.name, step + 1)
    batch = put_batch(stage.mesh, stage.batch(step))
    with jax.set_mesh(stage.mesh):
      if step_fn is None:
        step_fn = stage.make_step_fn(state, frozen, batch)
      t0 = time.perf_counter()
      with profiler.annotate(step + 1) if profiler is not None else contextlib.nullcontext():
        new_state, metrics = step_fn(state, frozen, batch)
      metrics = metrics_to_host(metrics)
      dt = time.perf_counter() - t0
    if profiler is not None:
      profiler.after_step(stage.name, step + 1, new_state)
    consecutive = int(jax.device_get(new_state.extras["skips/consecutive"]))
    state = new_state
    # Wall time of the whole step, host work included (phase timers report their own parts).
    metrics["time/step_s"] = dt
    metrics.update(memory_in_use())
    if "rollout/tokens" in metrics:
      metrics["throughput/tokens_per_s"] = metrics["rollout/tokens"] / dt
    if max_skips and consecutive >= max_skips:
      if checkpointer is not None:
        checkpointer.save_now(step + 1, state, extra_fn(step + 1) if extra_fn else {})
      raise TrainingError(
          f"{stage.name}: {consecutive} consecutive steps had a non-finite loss or gradient "
          f"(step {step + 1}); parameters were left at the last good state"
          + (" and checkpointed" if checkpointer is not None else "")
          + ". Lower the learning rate, check the data, or raise "
          f"{stage.name}.optim.max_consecutive_skips")
    done = step + 1
    if stage.eval_every and (done % stage.eval_every == 0 or done == stage.steps):
      metrics.update(stage.evaluate(state, frozen))
    writer.write(stage.name, done, metrics)
    last = metrics
    if checkpointer is not None:
      checkpointer.maybe_save(done, state, extra_fn(done) if extra_fn else {}, metrics)
    if should_stop():
      return state, last, True
  return state, last, False


