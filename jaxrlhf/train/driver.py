"""One training loop for every run: a colocated stage and each pool of a disaggregated one.

A :class:`Driver` runs a *program* — ``program(state, step) -> (state, metrics)``, one step of
training (``metrics`` None: it was told to stop before the step was done, and ``state`` is
what to checkpoint) — from a start step to the stage's last, and does everything around it once: stopping after ``max_consecutive_skips``
non-finite updates in a row (with a checkpoint of the last good state first), evaluation
every ``eval_every`` steps and at the last, ending early when an evaluation meets the stage's
target, the metrics record (every ``logging.every_steps``, and whenever there is an
evaluation), the samples, checkpoints when due (and always at the last step), and stopping
cleanly when ``should_stop()`` says so.

What a run does per step is its program: the colocated stage's jitted step
(:class:`jaxrlhf.train.loop.StageProgram`), the actor pool's generate-publish-update and the
critic pool's take-score-publish-update (:mod:`jaxrlhf.pools`).  Where its checkpoints go is
its :class:`Saves`: the colocated stage's asynchronous checkpointer, or a pool's synchronous
one that acknowledges the streams' entries once a checkpoint covers them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax


class TrainingError(RuntimeError):
  """The run cannot continue (e.g. too many consecutive non-finite steps)."""


class Saves:
  """Where a driver's checkpoints go (the default saves nothing)."""

  def plan(self, done: int, state, metrics: dict, *, force: bool, reason: str) -> bool:
    """Whether step ``done`` is saved (``force``: the last step, or one that met its target;
    ``reason``: why the stage ends there, or ""); may add ``checkpoint/*`` to ``metrics``
    (written before the save starts, so a crash after it never loses the step's record)."""
    del done, state, metrics, force, reason
    return False

  def save(self, done: int, state, metrics: dict, *, force: bool, reason: str) -> None:
    """The save :meth:`plan` decided on (with the same ``force`` and ``reason``), after the
    step's record is written."""

  def stop(self, done: int, state, metrics: Optional[dict]) -> str:
    """A checkpoint of ``state`` now, complete on return (before the run stops or fails);
    returns where it went, for a message ("" when checkpointing is off)."""
    del done, state, metrics
    return ""


@dataclasses.dataclass(frozen=True)
class Ending:
  """How a driver's run ended: the last state and metrics, whether it was stopped
  (``should_stop``) before its last step, and the steps done (below the last when an
  evaluation met the stage's target)."""

  state: object
  last: dict
  stopped: bool
  done: int


@dataclasses.dataclass
class Driver:
  """The loop around a program (module docstring).

  ``name`` labels the metrics and messages (``ppo``, ``grpo.actor``); ``skips_setting`` is the
  setting a run of non-finite steps names (``ppo.optim.max_consecutive_skips``).
  ``evaluate(state) -> metrics`` is None for a program without evaluation (a critic pool);
  ``eval_every`` an int or a function read after each step (an SFT stage near its target
  evaluates more often);
  ``target_reached(metrics) -> reason`` ends the stage early; ``samples()`` returns the sample
  rows gathered since the last call.
  """

  name: str
  steps: int
  writer: object
  should_stop: Callable[[], bool] = lambda: False
  saves: Saves = dataclasses.field(default_factory=Saves)
  max_skips: int = 0
  skips_setting: str = ""
  evaluate: Optional[Callable] = None
  eval_every: int | Callable[[], int] = 0
  target_reached: Callable[[dict], str] = lambda metrics: ""
  log_every: int = 1
  samples: Optional[Callable[[], list]] = None

  def run(self, program, state, start: int = 0) -> Ending:
    """Runs ``program`` from ``start`` (steps already done) to :attr:`steps`."""
    last: dict = {}
    for step in range(start, self.steps):
      done = step + 1
      state, metrics = program(state, step)
      if metrics is None:  # told to stop while it waited (for a peer, or a full queue)
        self.saves.stop(step, state, last)
        return Ending(state, last, True, step)
      self._check_skips(done, state)
      evaluated = self._evaluate(done, state, metrics)
      reason = self.target_reached(metrics) if evaluated and done < self.steps else ""
      force = bool(reason) or done == self.steps
      save = self.saves.plan(done, state, metrics, force=force, reason=reason)
      if evaluated or done % max(self.log_every, 1) == 0 or done == self.steps:
        self.writer.write(self.name, done, metrics)
      if self.samples is not None:
        self.writer.write_samples(self.name, done, self.samples())
      last = metrics
      if save:
        self.saves.save(done, state, metrics, force=force, reason=reason)
      if reason:
        self.writer.end_stage(self.name)
        self.writer.message(f"{self.name}: {reason} at step {done} of {self.steps}; "
                            "the stage ends here")
        return Ending(state, last, False, done)
      if self.should_stop() and done < self.steps:  # after the last step the run just ends
        self.saves.stop(done, state, metrics)
        return Ending(state, last, True, done)
    return Ending(state, last, False, self.steps)

  def _check_skips(self, done: int, state) -> None:
    if not self.max_skips:
      return
    consecutive = int(jax.device_get(state.extras.skips.consecutive))
    if consecutive < self.max_skips:
      return
    # A skipped step leaves params and optimizer states untouched (common.apply_update), so
    # this state holds those of the last finite step: the one worth keeping.
    where = self.saves.stop(done, state, None)
    raise TrainingError(
        f"{self.name}: {consecutive} consecutive steps had a non-finite loss or gradient "
        f"(step {done}); parameters were left at the last good state"
        + (f" and checkpointed as step {done} in {where}" if where else "")
        + f". Lower the learning rate, check the data, or raise {self.skips_setting}")

  def _evaluate(self, done: int, state, metrics: dict) -> bool:
    every = self.eval_every() if callable(self.eval_every) else self.eval_every
    if self.evaluate is None or not every:
      return False
    if done % every and done != self.steps:
      return False
    metrics.update(self.evaluate(state))
    return True
