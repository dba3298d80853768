"""What an algorithm is, declared once: :class:`AlgorithmSpec` and the registry of them.

The pipeline, the FLOP count, the planner, the pools and the entry point read a stage's spec
instead of branching on its name (tests/test_layering.py fails on any comparison with, or
lookup table keyed by, a registered name outside the registry and the algorithms' modules);
the config checks live on each algorithm's config type (``check``, called by
:func:`jaxrlhf.config.validate`).  Adding an algorithm takes:

- its settings: a :class:`jaxrlhf.config.StageConfig` subclass in ``jaxrlhf/config/stages.py``
  (its ``check``, and ``eval_data``: the held-out data it reads), a field of that type on
  :class:`jaxrlhf.config.ExperimentConfig` named as the stage, and the name in
  :data:`jaxrlhf.config.Stage`;
- its spec and its math: a module under ``jaxrlhf/train/`` that calls :func:`register`,
  listed in ``jaxrlhf/train/__init__.py``.

tests/test_layering.py checks that each registered spec has all of these.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from jaxrlhf.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Role:
  """A model the algorithm uses: its head (``lm``, ``scalar``, ``lm+scalar``) and whether the
  stage trains it (else it is frozen and lives outside the train state)."""

  head: str
  trains: bool


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
  """One algorithm, declaratively.

  - ``roles(cfg)``: role -> :class:`Role` for this experiment's settings (e.g. PPO's shared
    backbone puts the value head on the policy; a KL coefficient of 0 needs no reference).
  - ``batch``: what a batch holds: ``sequences`` (prompt + response), ``pairs`` (chosen and
    rejected), ``prompts`` (generation); ``rows_per_example`` rows each in the forward pass;
    ``packs``: ``data.pack=true`` packs its batches (several sequences per row,
    :mod:`jaxrlhf.data.packing`).
  - ``validate(cfg, data)``: the checks that need the data (answers for rule rewards ...);
    the config-only checks are ``config_type.check``.
  - ``flops(stage)``: model FLOPs of one step by phase (MFU, the planner).
  - ``evaluation``: ``exact_match`` (greedy answers), ``pairs`` (preference accuracy), or
    both; ``eval_at_start``: the held-out figure before training goes into the summary.
  - ``stop_rule(scfg)``: the setting that may end the stage before its steps ("" if none).
  - RL algorithms (``generates``): ``advantages(statics, carry, score_B, kl_BN, kl_coef,
    update_mask_BN) -> (adv_BN, returns_BN or None)`` and ``terms``: loss term -> function
    ``(statics, params, minibatch, *, denom, n_seq, kl_coef) -> (loss, metrics)``, each
    reading the parameters of the role of the same name (the pools train each term in its
    own pool).  ``statics`` is the step's :class:`~jaxrlhf.train.statics.StepStatics`, as
    for every phase: what a step function may read, never the stage.
  """

  name: str
  config_type: type
  stage: Callable  # (cfg, mesh, data) -> Stage
  roles: Callable  # (cfg) -> dict[str, Role]
  batch: str
  rows_per_example: int
  flops: Callable
  evaluation: str
  eval_at_start: bool
  validate: Callable = lambda cfg, data: None
  stop_rule: Callable = lambda scfg: ""
  packs: bool = False
  generates: bool = False
  advantages: Optional[Callable] = None
  terms: dict = dataclasses.field(default_factory=dict)


_SPECS: dict[str, AlgorithmSpec] = {}


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
  if spec.name in _SPECS:
    raise ValueError(f"algorithm {spec.name!r} is registered twice")
  _SPECS[spec.name] = spec
  return spec


def get(name: str) -> AlgorithmSpec:
  try:
    return _SPECS[name]
  except KeyError:
    raise ValueError(f"unknown stage {name!r}; known: {', '.join(_SPECS)}") from None


def names() -> tuple[str, ...]:
  return tuple(_SPECS)


def check_packing(cfg) -> None:
  """``data.pack=true`` must reach a stage that packs: otherwise the setting would do nothing."""
  if cfg.data.pack and not any(get(name).packs for name in cfg.stages):
    packers = ", ".join(n for n in names() if get(n).packs)
    raise ConfigError(f"data.pack=true, but none of the stages ({', '.join(cfg.stages)}) packs "
                      f"its batches (packing applies to {packers}); set data.pack=false")


def build_stage(name: str, cfg, mesh, data):
  """The stage object of ``name`` (construction allocates nothing)."""
  return get(name).stage(cfg, mesh, data)
