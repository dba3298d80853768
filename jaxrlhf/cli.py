"""The error boundary every command shares (``python -m jaxrlhf.main``, ``jaxrlhf.export``,
``jaxrlhf.model.hf.prepare``): a user's mistake is one ``error:`` line and an exit status, never
a traceback; an unexpected exception keeps its traceback (that is a bug report).  And the
argument parser of the commands beside ``main`` (jaxrlhf.console names them)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from jaxrlhf.config import ConfigError


# Set by jaxrlhf.console so a subcommand's usage lines name ``jaxrlhf SUB``.
_console_names: dict[str, str] = {}


def argument_parser(prog: str, description: str) -> argparse.ArgumentParser:
  """The parser of ``python -m PROG`` (export, report, prepare).  argparse, not absl: absl's
  global flag registry would clash with ``jaxrlhf.main``'s flags (``--workdir``) when both
  modules are imported in one process (tests, notebooks)."""
  return argparse.ArgumentParser(prog=_console_names.get(prog, f"python -m {prog}"),
                                 description=description)


def say_error(message: str) -> None:
  """``error: MESSAGE`` on one line of stderr, whatever line breaks the message (a user's own
  exception text quoted in it) held."""
  print(f"error: {' '.join(str(message).split())}", file=sys.stderr)


def guarded(fn: Callable[[], int], os_hint: str = "") -> int:
  """``fn()``'s exit status, with a :class:`ConfigError` (its subclasses ``HFError``,
  ``EnvError`` included) as one line and status 2, and a refusal of the file system
  (``OSError``: full disk, missing or read-only folder) as its cause, path and ``os_hint``
  and status 1."""
  try:
    return fn() or 0
  except ConfigError as e:
    say_error(str(e))
    return 2
  except OSError as e:
    where = f": {e.filename}" if getattr(e, "filename", None) else ""
    say_error(f"{e.strerror or e}{where}{'; ' + os_hint if os_hint else ''}")
    return 1
