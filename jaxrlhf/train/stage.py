"""The shape every training stage shares, and how roles pass from one stage to the next.

A stage (SFT, RM, PPO, GRPO, DPO) turns the results of earlier stages (``roles``: role name ->
parameters) into a :class:`TrainState` plus frozen parameters, and supplies a pure
``step(state, frozen, batch) -> (state, metrics)`` that the loop jits once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrlhf import model as M
from jaxrlhf.model import hf
from jaxrlhf.config import ConfigError, ExperimentConfig, ModelConfig
from jaxrlhf.data import DataSource
from jaxrlhf.mesh import FROZEN_PARAM_RULES, PARAM_RULES
from jaxrlhf.train.common import TrainState, jit_step, make_optimizer


class Stage:
  """Base class: subclasses set ``name`` and implement ``init``, ``batch``, ``step``,
  ``evaluate`` and ``outputs``."""

  name = "stage"
  # Roles this stage trains (keys of state.params) and keeps frozen.
  trainable: tuple[str, ...] = ()
  frozen_roles: tuple[str, ...] = ()

  def __init__(self, cfg: ExperimentConfig, mesh, data: DataSource):
    self.cfg = cfg
    self.mesh = mesh
    self.data = data
    self.scfg = getattr(cfg, self.name)
    self.steps = self.scfg.steps
    self.eval_every = self.scfg.eval_every
    self.P = cfg.data.max_prompt_len
    self.R = cfg.data.max_response_len
    self.tok = data.tokenizer
    model_vocab = cfg.model.vocab_size
    if self.tok.vocab_size > model_vocab:
      raise ConfigError(f"the tokenizer has {self.tok.vocab_size} tokens but model.vocab_size="
                        f"{model_vocab}; set --set=model.vocab_size={self.tok.vocab_size} or more")

  # -- to implement -------------------------------------------------------------------------
  def init(self, key: jax.Array, roles: dict) -> tuple[TrainState, dict]:
    raise NotImplementedError

  def batch(self, step: int) -> dict:
    raise NotImplementedError

  def step(self, state: TrainState, frozen: dict, batch: dict):
    raise NotImplementedError

  def evaluate(self, state: TrainState, frozen: dict) -> dict:
    return {}

  def make_step_fn(self, state: TrainState, frozen: dict, batch: dict):
    """The callable the loop runs each step: by default the whole step as one jitted program
    with explicit shardings and the state donated."""
    return jit_step(self.step, self.mesh, state, frozen, batch)

  def outputs(self, state: TrainState, frozen: dict) -> dict:
    """Role parameters this stage hands to later stages."""
    return dict(state.params)

  # -- shared helpers -----------------------------------------------------------------------
  def optimizer(self, which: str = "optim"):
    return make_optimizer(getattr(self.scfg, which), self.steps)

  def role_params(self, roles: dict, role: str, key: jax.Array, *, head: str,
                  frozen: bool = False) -> dict:
    """Parameters for ``role``: from an earlier stage when present, else a conversion of the
    policy's backbone (a scalar head on an SFT model), else a fresh sharded init."""
    cfg = self.cfg.role_model(role)
    rules = FROZEN_PARAM_RULES if frozen else PARAM_RULES
    shardings = M.param_shardings(cfg, self.mesh, head, rules)
    source = roles.get(role)
    if source is None and role in ("reference",):
      source = roles.get("policy")
    if source is None and head == "scalar" and cfg == self.cfg.model and "policy" in roles:
      source = roles["policy"]
    if source is None and role == "value" and "reward" in roles and (
        self.cfg.role_model("reward") == cfg):
      source = roles["reward"]
    if source is None:
      # A Hugging Face directory (model.hf_path / reward_model.hf_path ...) or a random init.
      return hf.load_or_init(cfg, self.mesh, key, head, rules)
    return jax.device_put(convert_head(source, cfg, head), shardings)

  def model_cfg(self, role: str) -> ModelConfig:
    return self.cfg.role_model(role)


def convert_head(params: dict, cfg: ModelConfig, head: str) -> dict:
  """The same backbone with the requested head: an LM model gets a zero-initialised scalar
  head (``score``), a scalar model keeps its own; copies so the source stays usable."""
  out = {k: v for k, v in params.items() if k not in ("unembed", "score")}
  out = jax.tree.map(jnp.copy, out)
  if head == "scalar":
    if "score" in params:
      out["score"] = jax.tree.map(jnp.copy, params["score"])
    else:
      dtype = params["embed"].dtype
      out["score"] = {"w": jnp.zeros((cfg.d_model,), dtype), "b": jnp.zeros((), dtype)}
  else:
    if "unembed" in params:
      out["unembed"] = jnp.copy(params["unembed"])
    elif not cfg.tie_embeddings:
      raise ConfigError("cannot make an LM head from a scalar-head model with untied embeddings")
  return out
