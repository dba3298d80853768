"""The experiment registry: ``experiments/NAME.py`` files register builders here."""

from __future__ import annotations

import dataclasses
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
    raise ConfigError(f"unknown experiment {name!r}; valid: {', '.join(sorted(_REGISTRY))}")
  cfg = _REGISTRY[name]()
  return cfg if cfg.name == name else dataclasses.replace(cfg, name=name)


def _load():
  import experiments  # noqa: F401  (importing the package registers every experiment)
