"""Graceful stop on SIGTERM / SIGINT: finish the step, checkpoint, exit 0.

Schedulers (Kubernetes, Slurm, spot VMs) send SIGTERM some seconds before they kill a job.
Inside :class:`PreemptionHandler` the first SIGTERM or SIGINT only sets a flag; the training loop
polls :meth:`PreemptionHandler.should_stop` after each step, writes a checkpoint, prints
:meth:`PreemptionHandler.message` and returns 0.  A second signal means "now": the process exits
at once with status 128 + signal number, without waiting for anything.

Usage in a loop::

  with PreemptionHandler() as stop:
    for step in ...:
      state, metrics = train_step(state, batch)
      if stop.should_stop():
        ckpt.maybe_save(step, state, extra=..., force=True)
        ckpt.wait()
        print(stop.message(step))
        return 0
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from typing import Optional, Sequence

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionHandler:
  """Context manager that turns the first stop signal into a polled flag (see module doc)."""

  def __init__(self, signals: Sequence[int] = DEFAULT_SIGNALS):
    self._signals = tuple(signals)
    self._previous: dict[int, object] = {}
    self._previous_wakeup_fd = -1
    self._received: Optional[int] = None
    self._socks: Optional[tuple[socket.socket, socket.socket]] = None

  # ------------------------------------------------------------------ install / uninstall

  def __enter__(self) -> "PreemptionHandler":
    if threading.current_thread() is not threading.main_thread():
      # Python lets only the main thread install handlers; a loop run from another thread
      # (a notebook worker, a test harness) keeps the default behaviour.
      print("preemption: not the main thread; SIGTERM/SIGINT keep their default behaviour",
            file=sys.stderr)
      return self
    # Python runs signal handlers in the main thread between bytecodes, which never happens
    # while that thread waits inside a long XLA computation.  The wake-up fd is written by the
    # C-level handler at once, so a watcher thread sees every signal immediately: that is what
    # lets a second signal stop a process whose main thread is busy.
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    self._socks = (reader, writer)
    self._previous_wakeup_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    for sig in self._signals:
      # The Python-level handler only replaces the default (KeyboardInterrupt / termination);
      # the watcher does the work.
      self._previous[sig] = signal.signal(sig, lambda signum, frame: None)
    threading.Thread(target=self._watch, args=(reader,), name="preemption-watcher",
                     daemon=True).start()
    return self

  def __exit__(self, *exc) -> None:
    if self._socks is None:
      return
    for sig, prev in self._previous.items():
      signal.signal(sig, prev)
    signal.set_wakeup_fd(self._previous_wakeup_fd)
    for s in self._socks:
      s.close()  # ends the watcher
    self._socks = None
    self._previous = {}

  def _watch(self, reader: socket.socket) -> None:
    while True:
      try:
        data = reader.recv(64)
      except OSError:
        return
      if not data:
        return
      for signum in data:
        if signum in self._signals:
          self._on_signal(signum)

  def _on_signal(self, signum: int) -> None:
    name = signal.Signals(signum).name
    if self._received is not None:
      # The user (or the scheduler) insists: stop without checkpointing or flushing anything
      # that could block.
      os.write(2, f"\n{name} again: exiting now without a checkpoint\n".encode())
      os._exit(128 + signum)
    self._received = signum
    os.write(2, f"\n{name} received: finishing this step, then writing a checkpoint "
                f"(send it again to exit at once)\n".encode())

  # --------------------------------------------------------------------------- queries

  @property
  def requested(self) -> bool:
    """Whether this process has received a stop signal."""
    return self._received is not None

  @property
  def signal_name(self) -> Optional[str]:
    return None if self._received is None else signal.Signals(self._received).name

  def should_stop(self) -> bool:
    """Whether the loop should checkpoint and stop now.  In a multi-process run the answer is
    agreed by all processes (the scheduler may signal only some hosts, but the checkpoint must
    be saved by all), which costs one tiny collective per call."""
    import jax  # lazy: this module is usable without jax (e.g. in a launcher)
    if jax.process_count() == 1:
      return self.requested
    import numpy as np
    from jax.experimental import multihost_utils
    flags = multihost_utils.process_allgather(np.asarray(self.requested, np.int32))
    return bool(np.any(flags))

  def message(self, step: int, where: str = "", saved: bool = True) -> str:
    """The line a loop prints when it stops for a signal (``saved``: whether a checkpoint of
    the step was written)."""
    why = self.signal_name or "a stop signal on another host"
    if not saved:
      return (f"stopped by {why} after step {step}; no checkpoint was written "
              "(checkpoint.enabled=false), so rerunning starts this stage over.")
    at = f" in {where}" if where else ""
    return (f"stopped by {why} after step {step}; checkpoint saved{at}. Rerun the same command "
            "to continue from it.")
