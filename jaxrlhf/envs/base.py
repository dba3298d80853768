"""The environment interface (:class:`Env`), the registry of built-in environments, and
resolving ``env.name`` to a checked :class:`EnvSpec`."""

from __future__ import annotations

import dataclasses

from jaxrlhf import registry
from jaxrlhf.config import ConfigError


class Env:
  """One episode of a multi-turn environment; the runner makes one instance per rollout row,
  constructed with no arguments.  Subclassing is optional: any class with ``reset`` and
  ``step`` will do.

  - ``reset(example)``: ``example`` is the data row (``Example.record()``: "prompt", "answer"
    and every other field); returns the first observation, the prompt text.
  - ``step(action)``: ``action`` is the policy's action decoded by the tokenizer, including
    the stop string that ended it (EOS is not in it); returns ``(observation, reward, done)``.
    The observation is appended to the context as it is (text format), so it carries its own
    separators; it is ignored when ``done``.  The episode's return is the sum of its rewards.
  - ``close()`` (optional): called before the runner's next ``reset`` and at its ``close``.
  - ``stop_strings``: strings that end an action besides EOS, e.g. ``("</calc>",)``.
  - ``step_batch(envs, actions)`` (optional classmethod): steps many rows at once, returning
    one ``(observation, reward, done)`` per row, in order; without it the runner steps each row.
  """

  stop_strings: tuple[str, ...] = ()

  def reset(self, example: dict) -> str:
    raise NotImplementedError

  def step(self, action: str) -> tuple[str, float, bool]:
    raise NotImplementedError

  def close(self) -> None:
    pass


ENVS: dict[str, type] = {}


ENV_INTERFACE = ("a class constructed with no arguments, with reset(self, example: dict) -> str "
                 "and step(self, action: str) -> (observation: str, reward: float, done: bool)")


def register_env(name: str):
  """Decorator adding an environment class to :data:`ENVS` (``env.name=NAME``)."""

  def deco(cls):
    if name in ENVS:
      raise ValueError(f"environment {name!r} is registered twice")
    ENVS[name] = cls
    return cls

  return deco


@dataclasses.dataclass(frozen=True)
class EnvSpec:
  """A resolved ``env.name``: the class, how messages name it, and its stop strings."""

  cls: type
  where: str  # "calc_env.py:Calc", "pkg.mod:Calc" or "environment 'calculator'"
  stop_strings: tuple[str, ...] = ()


def _check_class(cls, what: str, where: str) -> tuple[str, ...]:
  """The checks every environment class gets; returns its stop strings as a tuple."""
  if not isinstance(cls, type):
    raise ConfigError(f"{what}: {where} is a {type(cls).__name__}, not a class; it must be "
                      f"{ENV_INTERFACE}")
  for method in ("reset", "step"):
    if not callable(getattr(cls, method, None)):
      raise ConfigError(f"{what}: {where} has no {method}() method; an environment is "
                        f"{ENV_INTERFACE}")
  sig = registry.signature_refusing(cls)
  if sig:
    raise ConfigError(f"{what}: {where}{sig} cannot be constructed with no arguments (one "
                      f"instance is made per rollout row); give its arguments defaults, or "
                      f"read them from the example in reset()")
  stops = getattr(cls, "stop_strings", ())
  if isinstance(stops, str) or not isinstance(stops, (tuple, list)):
    raise ConfigError(f"{what}: {where}.stop_strings is {stops!r}; write a tuple of strings, "
                      f"e.g. stop_strings = (\"</calc>\",)")
  for s in stops:
    if not isinstance(s, str) or not s:
      raise ConfigError(f"{what}: {where}.stop_strings holds {s!r}; each stop string must be a "
                        f"non-empty str")
  return tuple(stops)


def resolve_env(spec: str, setting: str = "env.name") -> EnvSpec:
  """Turns a registered name, ``path/to/file.py:Class`` or ``package.module:Class`` into a
  checked :class:`EnvSpec`; raises ConfigError naming ``setting``, the file or module, the
  class and the fix (file not found, no such class, not a class, no reset/step, a class that
  cannot be constructed with no arguments, a bad stop string)."""
  what = f"{setting}={spec}"
  if not spec:
    raise ConfigError(f"{setting} is empty: no environment to resolve; write a built-in "
                      f"({', '.join(sorted(ENVS))}), path/to/file.py:Class or "
                      f"package.module:Class")
  if ":" not in spec:
    if spec not in ENVS:
      raise ConfigError(f"{what}: no environment {spec!r} is registered (registered: "
                        f"{', '.join(sorted(ENVS))}); for your own class write "
                        f"path/to/file.py:Class or package.module:Class")
    where = f"environment {spec!r}"
    return EnvSpec(ENVS[spec], where, _check_class(ENVS[spec], what, where))
  target, _, name = spec.rpartition(":")
  if not name.isidentifier():
    raise ConfigError(f"{what}: {name!r} is not a class name; write path/to/file.py:Class or "
                      f"package.module:Class")
  module = registry.load_target(target, what, "path/to/file.py:Class or package.module:Class")
  where = f"{target}:{name}"
  if not hasattr(module, name):
    defined = sorted(n for n, v in vars(module).items()
                     if isinstance(v, type) and not n.startswith("_")
                     and getattr(v, "__module__", None) == module.__name__)
    raise ConfigError(f"{what}: {target} defines no {name!r}"
                      + (f" (its classes: {', '.join(defined)})" if defined else "")
                      + f"; define the environment class there ({ENV_INTERFACE}), or fix the "
                        f"name after the last ':'")
  cls = getattr(module, name)
  return EnvSpec(cls, where, _check_class(cls, what, where))
