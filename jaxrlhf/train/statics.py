"""What a training step's pure functions read, as one frozen record.

:class:`StepStatics` is built once from a stage (:attr:`jaxrlhf.train.stage.Stage.statics`)
and is all that the RL phases (train/phases.py), the algorithms' advantage functions and
loss terms, and the packed forwards (train/packed.py) are given: each role's model config,
the prompt / response / group sizes, the settings, the LoRA, precision and optimizer tables,
and the decode layout.  It holds no data, tokenizer, evaluation, episodes or host reward
functions (the stage's host side), and it cannot change: a phase can read nothing that a
step could have left behind.  How a role's parameters are read (:meth:`StepStatics.view`:
LoRA adapters over their frozen base, the float32 master as trained, its ``param_dtype``
copy to decode) lives here, for the step functions and the stages alike.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Mapping

from jaxrlhf.config import ExperimentConfig, ModelConfig
from jaxrlhf.model import lora as LORA
from jaxrlhf.train.common import update_role


def _frozen_map(d: Mapping) -> Mapping:
  return types.MappingProxyType(dict(d))


def trained_heads(roles: Mapping) -> dict:
  """Trained roles -> head, of a spec's ``role -> Role`` map."""
  return {r: x.head for r, x in roles.items() if x.trains}


def frozen_heads(roles: Mapping) -> dict:
  """Frozen roles -> head, of a spec's ``role -> Role`` map."""
  return {r: x.head for r, x in roles.items() if not x.trains}


@dataclasses.dataclass(frozen=True, eq=False)
class StepStatics:
  """The static inputs of a stage's step functions (module docstring).  Mappings are
  read-only.  ``n`` (responses per prompt), ``N`` (new tokens), ``decode_shardings``,
  ``device_sources`` (``(kind, name, weight)`` of the reward sources a step computes) and
  ``env_weight`` are an RL stage's; the defaults are a stage that generates nothing."""

  name: str
  cfg: ExperimentConfig
  scfg: Any  # the stage's settings (SFTConfig, GRPOConfig, ...)
  spec: Any  # its jaxrlhf.train.spec.AlgorithmSpec
  mesh: Any
  roles: Mapping  # role -> spec.Role (head, trains)
  lora: Mapping  # LoRA role -> its LoraConfig
  base_keys: Mapping  # LoRA role -> where its frozen base lives in ``frozen``
  precision: Mapping  # trained role -> jaxrlhf.train.precision.Precision
  opt: Mapping  # trained role -> optax transformation
  P: int  # prompt tokens
  R: int  # response (answer) tokens of the data
  eos_id: int
  pad_id: int
  n: int = 1
  N: int = 0
  decode_shardings: Any = None
  device_sources: tuple = ()
  env_weight: float = 0.0
  layout: Any = None  # the stage's jaxrlhf.train.layout.StateLayout (roles, LoRA bases, pools)

  def __post_init__(self):
    for f in ("roles", "lora", "base_keys", "precision", "opt"):
      object.__setattr__(self, f, _frozen_map(getattr(self, f)))

  # -- roles ---------------------------------------------------------------------------
  @property
  def trainable(self) -> dict:
    return trained_heads(self.roles)

  def frozen(self) -> dict:
    return frozen_heads(self.roles)

  def model_cfg(self, role: str) -> ModelConfig:
    return self.cfg.role_model(role)

  # -- how a role's parameters are read ------------------------------------------------
  def view(self, params: dict, frozen: dict, role: str, *, decode: bool = False) -> dict:
    """The parameters the model reads for ``role``: a LoRA role's adapters over its frozen
    base, a frozen role's, or a trained role's master as it is (the model casts each weight
    to ``compute_dtype`` where it uses it, so with a 16-bit ``compute_dtype`` a float32
    master computes exactly as its rounded copy would, and a loss's gradient reaches it in
    float32).  ``decode``: for generation, whose every token reads the weights again, the
    master cast to ``param_dtype`` once (``precision``; a copy that lives while decoding)."""
    if role in self.lora:
      return LORA.view(params[role], frozen[self.base_keys[role]], self.lora[role])
    if role not in params:
      return frozen[role]
    return self.precision[role].view(params[role]) if decode else params[role]

  def views(self, params: dict, frozen: dict) -> dict:
    """:meth:`view` of every role in ``params`` (a dict like ``state.params``)."""
    return {r: self.view(params, frozen, r) for r in params}

  def value_params(self, params: dict) -> dict:
    """The parameters the value head reads: the value model's, or the policy's when it
    carries the value head (a shared backbone)."""
    return params["value"] if "value" in params else params["policy"]

  def on_view(self, loss_fn, frozen: dict, role: str):
    """``loss_fn(params, batch)`` of ``role``'s model as a function of its *trained* tree (the
    master; a LoRA role's adapters and head, the base frozen, closed over)."""
    return lambda p, mb: loss_fn(self.view({role: p}, frozen, role), mb)

  def update_role(self, state, frozen: dict, role: str, loss_fn, batch: dict, n_micro: int):
    """One training step of ``role`` alone (SFT, RM, DPO, KTO): ``loss_fn(params, batch)`` of
    the model as it reads the role (:meth:`on_view`), its gradients summed over ``n_micro``
    micro-batches and applied by the role's optimizer at its precision."""
    return update_role(state, role, self.on_view(loss_fn, frozen, role), batch, n_micro,
                       self.opt[role], self.precision[role])
