"""Stepping a batch of environment instances on the host: one instance per rollout row,
failures (an exception, a timeout, a result of the wrong kind) masked and counted, or raised,
and results always in row order.  Every call runs on a daemon thread under ``env.timeout_s``
(:mod:`jaxrlhf.usercode`), so a stuck environment neither hangs the run nor the exit."""

from __future__ import annotations

import copy
import math
import time
from typing import Callable, Optional

import numpy as np

from jaxrlhf.config import ConfigError
from jaxrlhf.envs.base import EnvSpec
from jaxrlhf.usercode import OK as _OK, RAISED as _RAISED, TIMEOUT as _TIMEOUT
from jaxrlhf.usercode import DaemonPool, outcome


ENV_ERROR_POLICIES = ("mask", "raise")


class EnvError(ConfigError, RuntimeError):
  """An environment failed under ``env.errors=raise``, or broke the interface (``step_batch``
  returning the wrong number of results): the message names the environment, the row, the
  method and the original exception.  A user error: one ``error:`` line at the entry point."""


# (environment, kind of failure) already reported on the console: said once per process, not
# once per runner (training and evaluation each have one).
_SAID: set[tuple[str, str]] = set()


class EnvRunner:
  """Runs ``spec.cls`` for a batch of rows.

  ``workers=0`` calls the rows one after another (on one daemon thread), ``workers=N`` in a
  pool of N daemon threads; either way a call still running after ``timeout_s`` (measured from
  when it started) fails its row.  Python cannot kill a thread, so a timed-out call keeps
  running in its thread until it returns; the thread is a daemon, so it never keeps the
  process from exiting, and the runner moves the calls still queued to a fresh pool, so one
  stuck call never blocks the rows behind it.  A class with ``step_batch`` is stepped with one
  call per batch, under the same timeout.

  ``errors="mask"``: a failed row is reported as done with reward 0.0 and ``failed=True``, and
  counted (``env/errors``: exceptions and results of the wrong kind; ``env/timeouts``); the
  first failure of each kind is printed once.  ``errors="raise"``: :class:`EnvError`.
  """

  def __init__(self, spec: EnvSpec, *, workers: int, timeout_s: float, errors: str):
    if errors not in ENV_ERROR_POLICIES:
      raise ValueError(f"env.errors={errors!r}: choose one of {', '.join(ENV_ERROR_POLICIES)}")
    if workers < 0 or not timeout_s > 0:
      raise ValueError(f"env.workers={workers} and env.timeout_s={timeout_s}: need workers >= 0 "
                       f"and timeout_s > 0")
    self.spec = spec
    self.workers = workers
    self.timeout_s = float(timeout_s)
    self.errors = errors
    self._pool: Optional[DaemonPool] = None  # made on first use
    self._envs: list = []
    self._ended: set[int] = set()  # rows whose episode ended
    self._counts = {"env/errors": 0, "env/timeouts": 0}

  # ------------------------------------------------------------------ the batch API

  def reset(self, examples: list[dict]) -> list[Optional[str]]:
    """Fresh instances, one per example (the previous ones closed first), each reset; the first
    observation per row, None for a row whose construction or reset failed."""
    self._close_envs()
    self._counts = dict.fromkeys(self._counts, 0)
    examples = [copy.deepcopy(ex) for ex in examples]  # rows may share one dict
    results = self._map(self._open, examples)
    self._envs, out = [], []
    for row, (kind, value) in enumerate(results):
      if kind == _OK and not isinstance(value[1], str):
        kind, value = _RAISED, TypeError(f"{str(value[1])[:60]!r} "
                                         f"({type(value[1]).__name__}) is not a str")
        self._fail(row, "reset", kind, value, invalid=True)
      elif kind != _OK:
        self._fail(row, "reset", kind, value)
      self._envs.append(value[0] if kind == _OK else None)
      out.append(value[1] if kind == _OK else None)
    return out

  def step(self, rows: list[int], actions: list[str]) -> list[tuple[str, float, bool, bool]]:
    """Steps the live ``rows`` with their ``actions``: ``(observation, reward, done, failed)``
    per row, in the order given.  A failed row is done, with reward 0.0 and observation ""."""
    if len(rows) != len(actions):
      raise ValueError(f"{len(rows)} rows but {len(actions)} actions")
    envs = []
    for r in rows:
      if not 0 <= r < len(self._envs) or self._envs[r] is None or r in self._ended:
        raise ValueError(f"row {r} has no live environment (failed, ended or out of range)")
      envs.append(self._envs[r])
    if not rows:
      return []
    batch = getattr(self.spec.cls, "step_batch", None)
    if batch is not None:
      ((kind, value),) = self._map(lambda _: batch(envs, list(actions)), [None])
      if kind == _OK:
        value = list(value) if isinstance(value, (list, tuple)) else value
        if not isinstance(value, list) or len(value) != len(rows):
          got = f"{len(value)} results" if isinstance(value, list) else repr(value)[:60]
          raise EnvError(f"{self.spec.where}.step_batch returned {got} for {len(rows)} rows; "
                         f"return one (observation, reward, done) per row, in order")
        results = [(_OK, v) for v in value]
      else:
        results = [(kind, value)] * len(rows)
      method = "step_batch"
    else:
      results = self._map(lambda pair: pair[0].step(pair[1]), list(zip(envs, actions)))
      method = "step"
    out = []
    for r, (kind, value) in zip(rows, results):
      if kind == _OK:
        checked = _check_step(value)
        if isinstance(checked, str):
          self._fail(r, method, _RAISED, TypeError(checked), invalid=True)
        else:
          out.append((*checked, False))
          if checked[2]:
            self._ended.add(r)
          continue
      else:
        self._fail(r, method, kind, value)
      out.append(("", 0.0, True, True))
      self._ended.add(r)
    return out

  def metrics(self) -> dict:
    """``env/errors`` and ``env/timeouts`` since the last :meth:`reset`."""
    return {k: float(v) for k, v in self._counts.items()}

  def end(self) -> None:
    """Closes the batch's environments (``close()``, where defined), counting a failure in
    :meth:`metrics`: call it once the batch's episodes are over.  The worker threads stay
    for the next batch."""
    self._close_envs()

  def close(self) -> None:
    self._close_envs()
    if self._pool is not None:
      self._pool.shutdown()
      self._pool = None

  # ------------------------------------------------------------------ internals

  def _open(self, example: dict):
    env = self.spec.cls()
    return env, env.reset(example)

  def _close_envs(self) -> None:
    for row, env in enumerate(self._envs):
      close = getattr(env, "close", None) if env is not None else None
      if close is None:
        continue
      try:
        close()
      except Exception as e:  # noqa: BLE001  (the user's code)
        self._fail(row, "close", _RAISED, e)
    self._envs, self._ended = [], set()

  def _map(self, fn: Callable, items: list) -> list[tuple[str, object]]:
    """``fn`` on each item: ``(kind, value)`` per item in order, kind ok / raised / timeout."""
    if self._pool is None:
      self._pool = DaemonPool(max(self.workers, 1), "jaxrlhf-env")
    started: list[Optional[float]] = [None] * len(items)

    def call(i):
      started[i] = time.monotonic()
      return fn(items[i])

    futures = [self._pool.submit(call, i) for i in range(len(items))]
    out = []
    for i in range(len(items)):
      while True:
        t0 = started[i]
        left = self.timeout_s if t0 is None else self.timeout_s - (time.monotonic() - t0)
        kind, value = outcome(futures[i], left)
        if kind == _TIMEOUT and started[i] is None:
          continue  # still queued behind other calls: its clock has not started
        if kind == _TIMEOUT:
          self._replace_pool(futures, call, i + 1)
        out.append((kind, value))
        break
    return out

  def _replace_pool(self, futures: list, call: Callable, first: int) -> None:
    """After a timeout (its thread stays busy): the calls from ``first`` on that have not
    started move to a fresh pool; the old pool's threads finish what they run and exit."""
    old, self._pool = self._pool, DaemonPool(max(self.workers, 1), "jaxrlhf-env")
    for j in range(first, len(futures)):
      if futures[j].cancel():
        futures[j] = self._pool.submit(call, j)
    old.shutdown()

  def _fail(self, row: int, method: str, kind: str, error, invalid: bool = False) -> None:
    if kind == _TIMEOUT:
      what = f"did not return within env.timeout_s={self.timeout_s:g} s"
      counter, said = "env/timeouts", "timeout"
    else:
      what = (f"returned a wrong result: {error}" if invalid
              else f"raised {type(error).__name__}: {error}")
      counter, said = "env/errors", ("invalid" if invalid else "raised")
    if self.errors == "raise":
      raise EnvError(f"{self.spec.where}.{method}() {what} on row {row}; fix the environment, "
                     f"or set env.errors=mask to end such episodes, drop them from the update "
                     f"and count them ({counter})") from (None if invalid else error)
    self._counts[counter] += 1
    if (self.spec.where, said) not in _SAID:
      # Masked, counted in the metrics, and said once on the console: never silent.
      _SAID.add((self.spec.where, said))
      print(f"warning: environment {self.spec.where}: {method}() {what} on row {row}; the "
            f"episode is ended and masked out of the update, and counted in {counter} (set "
            f"env.errors=raise to stop instead; said once)", flush=True)


def _check_step(value) -> "tuple[str, float, bool] | str":
  """A step result as ``(observation, reward, done)``, or what is wrong with it."""
  if not isinstance(value, (tuple, list)) or len(value) != 3:
    return f"{str(value)[:60]!r} ({type(value).__name__}) is not (observation, reward, done)"
  obs, reward, done = value
  if not isinstance(done, (bool, np.bool_)) and done not in (0, 1):
    return f"done={done!r} ({type(done).__name__}) is not a bool"
  done = bool(done)
  # Numbers and booleans (a pass/fail check: 1.0 / 0.0); strings are not parsed.
  if not isinstance(reward, (int, float, np.integer, np.floating, np.bool_)):
    return f"reward={reward!r} ({type(reward).__name__}) is not a float"
  if not math.isfinite(float(reward)):
    return f"reward={reward!r} is not finite"
  if done:
    obs = ""  # ignored
  elif not isinstance(obs, str):
    return f"observation={str(obs)[:60]!r} ({type(obs).__name__}) is not a str"
  return obs, float(reward), done
