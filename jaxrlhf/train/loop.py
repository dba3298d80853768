"""A colocated stage's program and its checkpoints, run by the one training loop
(:class:`jaxrlhf.train.driver.Driver`): batches, the jitted step, per-step metrics (step time,
throughput, memory, MFU), and the stage's asynchronous checkpointer."""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax

from jaxrlhf.perf import compile_ahead, memory_in_use, release_host_memory
from jaxrlhf.train.common import metrics_to_host, put_batch
from jaxrlhf.train.driver import Driver, Saves
from jaxrlhf.train.program import samples_due
from jaxrlhf.train.work import step_utilisation


def prepare_step(stage, state, frozen, batch):
  """``(step_fn, compile_s)``: the stage's step, compiled (and the compiler's heap released)
  before its first call allocates its temporaries, which would otherwise land on top of that
  heap; ``compile_s`` is None for a step that compiles its own programs (the phased RL step).
  Call it under the stage's mesh, as the step will be."""
  step_fn = stage.make_step_fn(state, frozen, batch)
  return step_fn, compile_ahead(step_fn, state, frozen, batch)


class StageProgram:
  """One step of a colocated stage: its batch (a pure function of the step, so the step is
  also the data position), the jitted step (compiled ahead on first use), and the step's
  metrics: wall time (host work included; phase timers report their own parts), compile
  time, memory, throughput and, with ``work`` (:class:`jaxrlhf.train.work.StepWork`), the
  ``perf/*`` utilisation."""

  def __init__(self, stage, frozen, *, start: int, profiler=None, work=None):
    self.stage, self.frozen, self.start = stage, frozen, start
    self.profiler, self.work = profiler, work
    self.step_fn = None
    self.feeder = stage.feeder(frozen)
    self.rows: list = []  # the rollout sample rows of the last step (logging.samples_every)

  def __call__(self, state, step: int):
    stage, profiler, done = self.stage, self.profiler, step + 1
    if profiler is not None:
      profiler.before_step(stage.name, done)
    host_batch = self.feeder.batch(step)
    if "host" in host_batch and samples_due(stage.cfg.logging, done):  # an RL step's rollout
      host_batch["host"] = dataclasses.replace(host_batch["host"], samples=self.rows)
    batch = put_batch(stage.mesh, host_batch)
    with jax.set_mesh(stage.mesh):
      compile_s = None
      if self.step_fn is None:
        self.step_fn, compile_s = prepare_step(stage, state, self.frozen, batch)
      t0 = time.perf_counter()
      with profiler.annotate(done) if profiler is not None else contextlib.nullcontext():
        state, metrics = self.step_fn(state, self.frozen, batch)
      metrics = metrics_to_host(metrics)
      dt = time.perf_counter() - t0
    if step == self.start:
      release_host_memory()  # what the first step freed (its inputs' staging, dispatch caches)
    if profiler is not None:
      profiler.after_step(stage.name, done, state)
    metrics["time/step_s"] = dt
    if compile_s is not None:
      metrics["time/compile_s"] = compile_s
    metrics.update(memory_in_use())
    if "rollout/tokens" in metrics:
      metrics["throughput/tokens_per_s"] = metrics["rollout/tokens"] / dt
    if self.work is not None:
      metrics.update(step_utilisation(self.work, metrics))
    return state, metrics

  def take_samples(self) -> list[dict]:
    """The rollout sample rows of the steps since the last call."""
    rows, self.rows = self.rows, []
    return rows


class StageSaves(Saves):
  """A colocated stage's checkpoints: when ``checkpointer.due`` says (asynchronous saves),
  the stage's last step and the one that meets its target always; ``extra_fn(done)`` is the
  JSON saved beside the state (with ``target_reached`` when the stage ends early)."""

  def __init__(self, checkpointer, extra_fn, writer, name: str):
    self.ck, self.extra_fn, self.writer, self.name = checkpointer, extra_fn, writer, name
    self.said_where = False

  def _extra(self, done: int, reason: str) -> dict:
    return {**self.extra_fn(done), "target_reached": reason} if reason else self.extra_fn(done)

  def plan(self, done, state, metrics, *, force, reason):
    if not self.ck.due(done, force=force):  # every_seconds reads the clock: decided once
      return False
    metrics["checkpoint/bytes"] = float(self.ck.save_bytes(state, self._extra(done, reason)))
    if not self.said_where:  # the folder once; each save is a note on the progress line
      self.writer.message(f"{self.name}: checkpoints -> {self.ck.directory}")
      self.said_where = True
    self.writer.note(self.name, f"ckpt {done} ({metrics['checkpoint/bytes'] / 2**20:.1f} MiB)")
    return True

  def save(self, done, state, metrics, *, force, reason):
    self.ck.save_now(done, state, self._extra(done, reason), metrics)

  def stop(self, done, state, metrics):
    self.ck.save_now(done, state, self.extra_fn(done), metrics)
    self.ck.wait()
    return self.ck.directory


def run_stage(stage, state, frozen, *, writer, start_step: int = 0, checkpointer=None,
              should_stop=lambda: False, extra_fn=None, profiler=None, work=None,
              evaluation=None):
  """Trains ``stage`` from ``start_step`` (steps already done) to ``stage.steps`` with the
  one training loop (:class:`~jaxrlhf.train.driver.Driver`); returns ``(state, last_metrics,
  stopped_early, steps_done)``.  ``steps_done`` is below ``stage.steps`` when an evaluation
  met the stage's target (:meth:`Stage.target_reached`): the stage has then finished, and its
  checkpoint of that step records why (``target_reached`` in its JSON).  ``extra_fn(done)``
  is the JSON saved beside the state.  ``evaluation``: the run's
  :class:`~jaxrlhf.train.evaluate.Evaluation` of the stage (default: a new one)."""
  extra = extra_fn or (lambda done: {})
  ev = evaluation or stage.evaluation(frozen)
  saves = StageSaves(checkpointer, extra, writer, stage.name) if checkpointer is not None else (
      Saves())
  program = StageProgram(stage, frozen, start=start_step, profiler=profiler, work=work)
  driver = Driver(name=stage.name, steps=stage.steps, writer=writer, should_stop=should_stop,
                  saves=saves, max_skips=getattr(stage.scfg.optim, "max_consecutive_skips", 0),
                  skips_setting=f"{stage.name}.optim.max_consecutive_skips",
                  evaluate=ev, eval_every=lambda: ev.every, target_reached=ev.after,
                  log_every=stage.cfg.logging.every_steps,
                  samples=lambda: program.take_samples() + ev.take_samples())
  end = driver.run(program, state, start_step)
  return end.state, end.last, end.stopped, end.done
