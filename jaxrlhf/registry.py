"""The experiment registry, and loading the user's own Python files.

``experiments/NAME.py`` files register builders here when the package is imported; a user's
file outside the repository (``--experiment=path/to/my_experiment.py``) registers its own the
same way, and ``host:path/to/file.py:function`` reward sources are read with the same loader.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from typing import Callable

from jaxrlhf.config import ConfigError, ExperimentConfig

_REGISTRY: dict[str, Callable[[], ExperimentConfig]] = {}


def register(name: str):
  """Decorator: ``@register("tiny_ppo") def build() -> ExperimentConfig``."""

  def deco(fn: Callable[[], ExperimentConfig]):
    if name in _REGISTRY:
      raise ValueError(f"experiment {name!r} is registered twice")
    _REGISTRY[name] = fn
    return fn

  return deco


def names() -> list[str]:
  _load()
  return sorted(_REGISTRY)


def get(name: str) -> ExperimentConfig:
  _load()
  if name not in _REGISTRY:
    raise ConfigError(f"unknown experiment {name!r}; valid: {', '.join(sorted(_REGISTRY))} "
                      f"(or give the path of your own file: --experiment=path/to/my_exp.py)")
  cfg = _build(name, _REGISTRY[name])
  return cfg if cfg.name == name else dataclasses.replace(cfg, name=name)


def _build(name: str, fn: Callable[[], ExperimentConfig]) -> ExperimentConfig:
  """Calls the builder of experiment ``name``.  A user's builder (from a file loaded by
  :func:`load_python_file`) that raises, or any builder returning something else than an
  ExperimentConfig, is a ConfigError naming the file, the line and the fix; a built-in
  builder's exception is a bug and keeps its traceback."""
  path = getattr(getattr(fn, "__code__", None), "co_filename", "") or "?"
  user = getattr(fn, "__module__", "").startswith(_USER_PREFIX)
  where = f"experiment {name!r} ({path}:{getattr(fn, '__name__', 'build')})"
  if user:
    try:
      cfg = fn()
    except ConfigError:
      raise
    except Exception as e:  # noqa: BLE001  (the user's code)
      line = user_frame(e, path)
      if isinstance(e, dataclasses.FrozenInstanceError):
        raise ConfigError(
            f"{where} failed{line}: {e} (configs are frozen); build a changed copy instead, "
            f"e.g. cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, "
            f"num_samples=4)), or change fields on the command line with --set") from None
      raise ConfigError(f"{where} failed{line}: {type(e).__name__}: {e}; fix the function "
                        f"(run `python {path}` to see the whole traceback)") from None
  else:
    cfg = fn()
  if not isinstance(cfg, ExperimentConfig):
    raise ConfigError(f"{where} returned {type(cfg).__name__} {str(cfg)[:60]!r}, not an "
                      f"ExperimentConfig; return jaxrlhf.config.ExperimentConfig(...) (or a "
                      f"registered one changed with dataclasses.replace)")
  return cfg


def is_path(experiment: str) -> bool:
  """Whether ``--experiment`` names a user's file rather than a registered experiment."""
  return experiment.endswith(".py")


def experiments_in_file(path: str) -> list[str]:
  """Loads the user's file ``path`` (which calls :func:`register`) and returns the names it
  registered, in order.  A file loaded before registers nothing new and returns its names
  again."""
  _load()
  before = list(_REGISTRY)
  module = load_python_file(path, "--experiment")
  added = [n for n in _REGISTRY if n not in before]
  if not added:
    added = list(getattr(module, "_jaxrlhf_experiments", ()))
  if not added:
    raise ConfigError(f"--experiment={path}: the file registers no experiment; decorate a "
                      f"function returning an ExperimentConfig with "
                      f"@jaxrlhf.registry.register(\"my_experiment\")")
  module._jaxrlhf_experiments = tuple(added)
  return added


def resolve(experiment: str) -> ExperimentConfig:
  """``--experiment``: a registered name, or a user's ``.py`` file registering exactly one
  experiment (or several, then ``path.py:NAME`` picks one)."""
  path, _, pick = experiment.partition(".py:")
  if pick:
    path += ".py"
  elif not is_path(experiment):
    return get(experiment)
  added = experiments_in_file(path)
  if pick:
    if pick not in added:
      raise ConfigError(f"--experiment={experiment}: {path} registers {', '.join(added)}, not "
                        f"{pick!r}")
    return get(pick)
  if len(added) > 1:
    raise ConfigError(f"--experiment={experiment}: the file registers {len(added)} experiments "
                      f"({', '.join(added)}); pick one with --experiment={path}:NAME")
  return get(added[0])


# -------------------------------------------------------------------- the user's own files

_FILES: dict[str, object] = {}  # real path -> module, so a file is executed once per process

_USER_PREFIX = "jaxrlhf_user."  # the module names of users' files


def user_frame(exc: BaseException, path: str) -> str:
  """`` at file.py:LINE in FUNC``: the deepest frame of ``exc`` inside the user's file
  ``path`` (or "" when the traceback never entered it)."""
  real = os.path.realpath(path)
  hits = [f for f in traceback.extract_tb(exc.__traceback__)
          if os.path.realpath(f.filename) == real]
  return f" at {path}:{hits[-1].lineno} in {hits[-1].name}" if hits else ""


def load_python_file(path: str, what: str):
  """Executes the user's Python file ``path`` as a module (once per process) and returns it.
  ``what`` names the setting that gave the path, for errors (e.g. ``--experiment``)."""
  if not os.path.exists(path):
    raise ConfigError(f"{what}: {path}: file not found (relative paths start at the current "
                      f"folder, {os.getcwd()})")
  if not os.path.isfile(path):
    raise ConfigError(f"{what}: {path} is not a file; give the path of a .py file")
  real = os.path.realpath(path)
  if real in _FILES:
    return _FILES[real]
  stem = os.path.splitext(os.path.basename(path))[0]
  name = f"{_USER_PREFIX}{stem}_{hashlib.sha1(real.encode()).hexdigest()[:8]}"
  spec = importlib.util.spec_from_file_location(name, real)
  module = importlib.util.module_from_spec(spec)
  # Registered before it runs, as an import would be: dataclasses and pickling look it up.
  sys.modules[name] = module
  folder = os.path.dirname(real)
  added_path = folder not in sys.path
  if added_path:  # so the file can import its neighbours, as `python file.py` would allow
    sys.path.insert(0, folder)
  try:
    spec.loader.exec_module(module)
  except ConfigError:
    del sys.modules[name]
    raise
  except BaseException as e:  # noqa: BLE001  (SyntaxError, ImportError, anything it raises)
    del sys.modules[name]
    if isinstance(e, KeyboardInterrupt):
      raise
    if isinstance(e, SyntaxError):
      where = f" at {path}:{e.lineno}"
    else:
      where = user_frame(e, path)
    raise ConfigError(f"{what}: {path} failed to load{where}: {type(e).__name__}: {e}; fix the "
                      f"file (run `python {path}` to see the whole traceback)") from None
  finally:
    if added_path:
      sys.path.remove(folder)
  _FILES[real] = module
  return module


def load_target(target: str, what: str, form: str):
  """The module of a ``path/to/file.py`` or ``package.module`` target (the part before the
  last ':' of a setting such as ``host:my_reward.py:score``); ``form`` is how the setting is
  written, for the error (e.g. ``path/to/file.py:Class or package.module:Class``)."""
  if target.endswith(".py"):
    return load_python_file(target, what)
  if "/" in target or os.sep in target:
    raise ConfigError(f"{what}: {target} is not a .py file nor a module name; write {form}")
  return import_module(target, what, form.split(" or ")[0])


def signature_refusing(fn, *args) -> str:
  """``fn``'s signature as text when it cannot be called with ``args`` (checked without
  calling it), else "" (also when it has no signature to read: the first call will tell)."""
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return ""
  try:
    sig.bind(*args)
  except TypeError:
    return str(sig)
  return ""


def import_module(name: str, what: str, file_form: str = "path/to/file.py:function"):
  """``importlib.import_module`` with errors that name ``what`` and the fix (``file_form``:
  how to give a file instead)."""
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError as e:
    if e.name and name.startswith(e.name):
      raise ConfigError(f"{what}: no module named {e.name!r}; install the package that provides "
                        f"it, or add its folder to PYTHONPATH (or give a file: "
                        f"{file_form})") from None
    raise ConfigError(f"{what}: importing {name} failed: {e}") from None
  except Exception as e:  # noqa: BLE001  (whatever the module raises on import)
    raise ConfigError(f"{what}: importing {name} failed: {type(e).__name__}: {e}") from None


def _load():
  import experiments  # noqa: F401  (importing the package registers every experiment)
