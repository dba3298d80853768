"""Running the user's code inside a step (host rewards, environments) under a time limit.

Each call runs on a daemon thread and is waited for at most its limit.  Python cannot stop a
thread, so a call still running at its limit is abandoned: it runs on until it returns, but
as a daemon thread it never keeps the process from exiting (the threads of
``concurrent.futures.ThreadPoolExecutor`` are joined at exit, so one stuck call would hold
the process forever).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Callable


OK, RAISED, TIMEOUT = "ok", "raised", "timeout"


class DaemonPool:
  """``n`` daemon threads taking calls from one queue, in the order submitted.

  :meth:`submit` returns a ``concurrent.futures.Future`` (cancellable while queued);
  :meth:`shutdown` lets the idle threads exit, and a thread busy with an abandoned call exits
  when that call returns."""

  def __init__(self, n: int, name: str = "jaxrlhf-user"):
    if n < 1:
      raise ValueError(f"a pool needs at least one thread, not {n}")
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._n = n
    for i in range(n):
      threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

  def _work(self) -> None:
    while True:
      item = self._queue.get()
      if item is None:
        return
      future, fn, args = item
      if not future.set_running_or_notify_cancel():
        continue  # cancelled while queued
      try:
        result = fn(*args)
      except BaseException as e:  # noqa: BLE001  (the user's code: handed to the waiter)
        future.set_exception(e)
      else:
        future.set_result(result)

  def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._queue.put((future, fn, args))
    return future

  def shutdown(self) -> None:
    for _ in range(self._n):
      self._queue.put(None)


def outcome(future: concurrent.futures.Future, timeout_s: float) -> tuple[str, object]:
  """``(kind, value)`` of a submitted call, waiting at most ``timeout_s``: ``(OK, result)``,
  ``(RAISED, exception)`` or ``(TIMEOUT, None)`` (the call is still running: abandoned)."""
  try:
    return OK, future.result(timeout=max(timeout_s, 0.0))
  except concurrent.futures.TimeoutError as e:
    if future.done():  # the call itself raised TimeoutError
      return RAISED, e
    return TIMEOUT, None
  except Exception as e:  # noqa: BLE001  (the user's code)
    return RAISED, e


def call(fn: Callable, timeout_s: float, *args) -> tuple[str, object]:
  """``fn(*args)`` on a fresh daemon thread, waited for at most ``timeout_s`` seconds:
  ``(OK, result)``, ``(RAISED, exception)``, or ``(TIMEOUT, None)`` with the call abandoned."""
  pool = DaemonPool(1, getattr(fn, "__name__", "call"))
  future = pool.submit(fn, *args)
  pool.shutdown()  # its thread exits after this one call (when the call returns)
  return outcome(future, timeout_s)
