"""The shape every training stage shares, and how roles pass from one stage to the next.

A stage (SFT, RM, PPO, GRPO, DPO) turns the results of earlier stages (``roles``: role name ->
parameters) into a :class:`TrainState` plus frozen parameters, and supplies a pure
``step(state, frozen, batch) -> (state, metrics)`` that the loop jits once.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from jaxrlhf import model as M
from jaxrlhf.model import lora as LORA
from jaxrlhf.config import ConfigError, ExperimentConfig, ModelConfig
from jaxrlhf.data import DataSource
from jaxrlhf.data.packing import Packer, interleave_pairs
from jaxrlhf.mesh import (DECODE_PARAM_RULES, PARAM_RULES, batch_sharding,
                          tree_shardings)
from jaxrlhf.train import layout as LAYOUT, precision as PREC, spec
from jaxrlhf.train.layout import StateLayout, convert_head, same_backbone, zero_score  # noqa: F401
from jaxrlhf.train.sequences import pair_rows
from jaxrlhf.train.evaluate import Evaluation, eval_metric, make_evaluator
from jaxrlhf.train.statics import StepStatics, frozen_heads, trained_heads
from jaxrlhf.train.common import (TrainState, jit_step, make_optimizer)
from jaxrlhf.train.types import Extras, Skips


class Stage:
  """Base class.  Subclasses set ``name`` (their :class:`~jaxrlhf.train.spec.AlgorithmSpec`
  says which roles they use) and implement ``batch``, ``batch_shapes`` and ``step`` (and
  usually ``evaluate``).

  Construction allocates nothing (configs, optimizers, closures), so the planner can lower a
  stage's step on abstract arrays; :meth:`init` allocates the parameters on the mesh.
  """

  name = "stage"
  # The optimizer config field of each trained role.
  optim_fields: dict = {"policy": "optim", "value": "value_optim", "reward": "optim"}

  def __init__(self, cfg: ExperimentConfig, mesh, data: DataSource):
    self.spec = spec.get(self.name)
    self.roles = self.spec.roles(cfg)
    # Trained roles -> head ("lm", "scalar" or "lm+scalar").
    self.trainable = trained_heads(self.roles)
    self.cfg = cfg
    self.mesh = mesh
    self.data = data
    self.scfg = getattr(cfg, self.name)
    self.steps = self.scfg.steps
    self.eval_every = self.scfg.eval_every
    self.P = cfg.data.max_prompt_len
    self.R = cfg.data.max_response_len
    self.tok = data.tokenizer
    check_vocabulary(cfg, self.tok, self.roles)
    # Every trained role updates once per minibatch and epoch of a step (RL), else once.
    updates = getattr(self.scfg, "ppo_epochs", 1) * getattr(self.scfg, "num_minibatches", 1)
    self.opt = {role: make_optimizer(getattr(self.scfg, self.optim_fields[role]), self.steps,
                                     updates)
                for role in self.trainable}
    # Roles trained with adapters (``STAGE.lora``) -> their LoRA settings (where each one's
    # frozen base lives: the layout's, :attr:`base_keys`).
    lo = self.scfg.lora
    self.lora = {r: lo for r in self.trainable if lo.rank and r in lo.roles}
    # How each trained role's weights are kept and updated (float32 masters by default).
    self.precision = PREC.of_stage(self.scfg, self.model_cfg, self.lora,
                                   {r: self.optim_fields[r] for r in self.trainable}, self.name)
    self.packer = make_packer(cfg.data, mesh, self.tok.pad_id, self.scfg.optim.grad_accum) if (
        cfg.data.pack and self.spec.packs) else None
    if "exact_match" in self.spec.evaluation:
      eval_metric(self)  # a STAGE.eval_reward that names nothing usable: refused here

  # -- to implement -------------------------------------------------------------------------
  def stop_rule(self) -> str:
    """The setting that may end the stage before ``steps`` (e.g. ``sft.stop_accuracy=0.8``),
    or "" when it always trains them all; the planner then calls ``steps`` a budget."""
    return self.spec.stop_rule(self.scfg)

  def target_reached(self, eval_metrics: dict) -> str:
    """After an evaluation: why the stage ends here although steps remain (e.g. its held-out
    accuracy reached the configured target), or "" to go on."""
    return ""

  def eval_every_after(self, eval_metrics: dict, every: int) -> int:
    """After an evaluation: steps between evaluations from here on (``every`` until now)."""
    return every

  def frozen(self) -> dict:
    """Frozen roles -> head (the spec's roles that this stage does not train)."""
    return frozen_heads(self.roles)

  def initial_extras(self) -> Extras:
    return Extras(skips=Skips.zeros())

  def batch(self, step: int) -> dict:
    raise NotImplementedError

  def batch_shapes(self) -> dict:
    """``name -> (shape, dtype)`` of the global batch (for planning without data)."""
    raise NotImplementedError

  def step(self, state: TrainState, frozen: dict, batch: dict):
    raise NotImplementedError

  def evaluate(self, state: TrainState, ev: Evaluation) -> dict:
    """The ``eval/*`` metrics of ``state``; ``ev`` (:class:`Evaluation`) holds the frozen
    roles, what this run's evaluations make once, and takes the sample rows."""
    return {}

  def feeder(self, frozen: dict) -> "Feeder":
    """A run's batches of this stage (:class:`Feeder`)."""
    return Feeder(self, frozen)

  def evaluation(self, frozen: dict) -> Evaluation:
    """A run's evaluation of this stage (host side: caches, samples, cadence)."""
    return Evaluation(self, frozen)

  def close(self) -> None:
    """Releases what the stage holds outside the process's memory once it is done training
    (an environment's worker threads); nothing for most stages."""

  def generation_eval(self):
    """The greedy-generation evaluator of an :class:`Evaluation`: greedy answers scored by
    ``STAGE.eval_reward`` (episodes with ``env.name``) when the spec's ``evaluation`` includes
    ``exact_match``, else None."""
    return make_evaluator(self) if "exact_match" in self.spec.evaluation else None

  # -- shared machinery ---------------------------------------------------------------------
  @functools.cached_property
  def layout(self) -> StateLayout:
    """The stage's roles and state (:class:`~jaxrlhf.train.layout.StateLayout`), built on first
    use, after construction."""
    return LAYOUT.build(self.name, self.cfg, self.mesh, self.trainable, self.frozen(), self.lora,
                        self.opt, self.precision, self.initial_extras())

  @property
  def base_keys(self) -> dict:
    """LoRA role -> where its frozen base lives in ``frozen``: the reference for the policy
    (the base *is* the reference: one copy), the reward model for a value model on the same
    backbone, else ``ROLE.base`` (:func:`jaxrlhf.train.layout.base_key`)."""
    return self.layout.base_keys

  def _share(self, only, extras) -> StateLayout:
    return self.layout if only is None and extras is None else self.layout.share(
        *(only or (tuple(self.trainable), tuple(self.frozen()))), extras=extras)

  def init(self, key: jax.Array, roles: dict, *, only: tuple | None = None,
           extras: Extras | None = None,
           frozen_only: bool = False) -> tuple[TrainState | None, dict]:
    """Parameters of every role (from earlier stages' results ``roles``, a Hugging Face
    directory, or fresh) on the mesh, and the train state around the trainable ones
    (:meth:`StateLayout.init <jaxrlhf.train.layout.StateLayout.init>`).  ``only=(trained,
    frozen)`` builds a subset (one pool of a disaggregated run), each role from the same key
    as the whole stage's, plus the frozen base of each LoRA role it trains; ``extras`` then
    replaces :meth:`initial_extras` (a pool keeps its own share of the algorithm's state).
    ``frozen_only``: the frozen roles (LoRA bases included) alone, and None for the state: a
    resume restores the state into :meth:`abstract_init`'s, so none is allocated to be
    thrown away."""
    return self._share(only, extras).init(key, roles, frozen_only=frozen_only)

  def abstract_init(self, *, only: tuple | None = None,
                    extras: Extras | None = None) -> tuple[TrainState, dict]:
    """The train state and frozen parameters as ShapeDtypeStructs with their shardings on the
    mesh (``eval_shape`` of the same init); allocates nothing.  ``only`` and ``extras`` as for
    :meth:`init` (one pool's share)."""
    return self._share(only, extras).abstract()

  def abstract_batch(self) -> dict:
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(self.mesh, len(shape),
                                                                           shape))
            for k, (shape, dtype) in self.batch_shapes().items()}

  def make_step_fn(self, state: TrainState, frozen: dict, batch: dict):
    """The callable the loop runs each step: by default the whole step as one jitted program
    with explicit shardings and the state donated."""
    return jit_step(self.step, self.mesh, state, frozen, batch)

  def outputs(self, state: TrainState, frozen: dict) -> dict:
    """Role parameters this stage hands to later stages (a LoRA role's adapters merged into
    its base: the next stage's starting point, and its reference)."""
    return {r: self.merged(state.params, frozen, r) for r in state.params}

  def abstract_outputs(self) -> dict:
    """ShapeDtypeStructs (with shardings) of what :meth:`outputs` hands on, role by role."""
    out = {}
    for r in self.outputs_roles():
      cfg, head = self.model_cfg(r), self.trainable[r]
      sh = M.param_shardings(cfg, self.mesh, head, PARAM_RULES)
      out[r] = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            M.abstract_params(cfg, head), sh)
    return out

  def outputs_roles(self) -> tuple:
    return tuple(self.trainable)

  # -- LoRA ---------------------------------------------------------------------------------
  def abstract_trainable(self, role: str):
    """ShapeDtypeStructs of a LoRA role's trainable tree (no shardings)."""
    return self.layout.trained[role].abstract_trainable()

  def trainable_shardings(self, role: str):
    return self.layout.trained[role].shardings(self.mesh)

  def base_shardings(self, role: str):
    return self.layout.trained[role].base_shardings(self.mesh)

  @functools.cached_property
  def statics(self) -> StepStatics:
    """What this stage's step functions read (:class:`~jaxrlhf.train.statics.StepStatics`),
    built on first use, after construction."""
    rl = dict(n=self.n, N=self.N, decode_shardings=self.decode_shardings,
              device_sources=tuple(self.device_sources),
              env_weight=self.env_weight) if self.spec.generates else {}
    return StepStatics(name=self.name, cfg=self.cfg, scfg=self.scfg, spec=self.spec,
                       mesh=self.mesh, roles=self.roles, lora=self.lora,
                       base_keys=self.base_keys, precision=self.precision, opt=self.opt,
                       layout=self.layout,
                       P=self.P, R=self.R, eos_id=self.tok.eos_id, pad_id=self.tok.pad_id,
                       **rl)

  def view(self, params: dict, frozen: dict, role: str, *, decode: bool = False) -> dict:
    """:meth:`StepStatics.view <jaxrlhf.train.statics.StepStatics.view>`."""
    return self.statics.view(params, frozen, role, decode=decode)

  def update_role(self, state: TrainState, frozen: dict, role: str, loss_fn, batch: dict,
                  n_micro: int):
    """:meth:`StepStatics.update_role <jaxrlhf.train.statics.StepStatics.update_role>`."""
    return self.statics.update_role(state, frozen, role, loss_fn, batch, n_micro)

  def export_adapters(self, state: TrainState, directory: str) -> dict:
    """Each LoRA role's adapters in PEFT's layout under ``directory/ROLE``; returns role ->
    path (empty without LoRA)."""
    out = {}
    for r, lo in self.lora.items():
      out[r] = LORA.export_peft(state.params[r], self.model_cfg(r), lo,
                                os.path.join(directory, r), base_model=self.model_cfg(r).hf_path)
    return out

  def merged(self, params: dict, frozen: dict, role: str) -> dict:
    """``role``'s whole model as plain weights (adapters merged, in ``param_dtype``)."""
    if role not in self.lora:
      return self.precision[role].view(params[role])
    return LORA.merge(params[role], frozen[self.base_keys[role]], self.lora[role],
                      self.model_cfg(role).param_dtype)

  def sequence_batch(self, examples, field: str) -> dict:
    """Prompt + ``field`` of each example (SFT), padded or packed (``data.pack``)."""
    batch = self.data.encoder.sequences(examples, field)
    return self.packer.pack(**batch) if self.packer is not None else batch

  def pair_batch(self, examples) -> dict:
    """Preference pairs (RM, DPO), padded (``chosen*``, ``rejected*``) or packed (one set of
    rows, sequence ``2i`` pair ``i``'s chosen side and ``2i + 1`` its rejected side)."""
    enc = self.data.encoder
    if self.packer is None:
      return enc.pairs(examples)
    return self.packer.pack(**interleave_pairs(enc.sequences(examples, "chosen"),
                                               enc.sequences(examples, "rejected")))

  def packed_shapes(self, n_sequences: int) -> dict:
    """Shapes of a packed batch at its largest bucket (what the planner and memory checks
    see): every sequence alone in its row."""
    rows = (self.packer.max_rows(n_sequences), self.packer.row_len)
    return {"tokens": (rows, jnp.int32), "mask": (rows, jnp.bool_),
            "loss_mask": (rows, jnp.bool_), "segment_ids": (rows, jnp.int32),
            "sequence_ids": (rows, jnp.int32), "sequence_lengths": ((n_sequences,), jnp.int32)}

  def sequence_shapes(self, side: str = "") -> dict:
    """Shapes of prompt|response sequences: ``tokens, mask, loss_mask``, or for one side of a
    preference pair ``SIDE, SIDE_mask, SIDE_loss_mask``."""
    b, length = self.scfg.batch_size, self.P + self.R
    pre = f"{side}_" if side else ""
    return {side or "tokens": ((b, length), jnp.int32), f"{pre}mask": ((b, length), jnp.bool_),
            f"{pre}loss_mask": ((b, length), jnp.bool_)}

  # -- shared helpers -----------------------------------------------------------------------
  def decode_layout_shardings(self, role: str = "policy"):
    """The shardings ``role`` generates in (``rollout.decode_layout``, docs/rollout.md), or
    None when they are its training shardings (``train``, a mesh without fsdp, or no mesh):
    generation then reads the parameters as they are."""
    if self.mesh is None or self.cfg.rollout.decode_layout == "train":
      return None
    cfg, head = self.model_cfg(role), self.trainable.get(role, "lm")
    decode = M.param_shardings(cfg, self.mesh, head, DECODE_PARAM_RULES, check=False)
    train = M.param_shardings(cfg, self.mesh, head, PARAM_RULES, check=False)
    if role in self.lora:  # the view: the base as frozen, the adapters as trained
      base = self.base_shardings(role)
      train = {**base, "layers": {**base["layers"], "lora": self.trainable_shardings(role)[
          "layers"]["lora"]}}
      ad = tree_shardings(self.mesh, LORA.trainable_axes(cfg, self.lora[role], "lm"),
                          self.abstract_trainable(role), DECODE_PARAM_RULES)
      decode = {**decode, "layers": {**decode["layers"], "lora": ad["layers"]["lora"]}}
    same = all(a.spec == b.spec for a, b in zip(jax.tree.leaves(decode), jax.tree.leaves(train)))
    return None if same else decode

  def model_cfg(self, role: str) -> ModelConfig:
    return self.cfg.role_model(role)


class Feeder:
  """A run's batches of a stage, host side: :meth:`batch` of a step, a pure function of the
  step (so the step is also the data position).  The stage's own :meth:`Stage.batch` unless
  its batches need the run's frozen roles (DPO's ``dpo.reference=cache``: each pair's
  reference log-probs, computed once per pair); what such a feeder keeps lives with the run,
  never on the stage."""

  def __init__(self, stage: Stage, frozen: dict):
    self.stage, self.frozen = stage, frozen

  def batch(self, step: int) -> dict:
    return self.stage.batch(step)


_ROLE_FIELDS = {"policy": "model", "reference": "model", "reward": "reward_model",
                "value": "value_model", "guard": "guard_model"}


def check_vocabulary(cfg: ExperimentConfig, tok, roles) -> None:
  """A ConfigError when the tokenizer has more ids than a role's model has embeddings (an id
  past the end would read another row, or nothing): names the tokenizer, the model folder or
  field, and a fix that works (with ``hf_path`` the vocabulary comes from the checkpoint's
  config.json, so no setting can raise it)."""
  n = tok.vocab_size
  checked = set()
  for role in roles:
    field = _ROLE_FIELDS.get(role, "model")
    m = cfg.role_model(role)
    if getattr(cfg, field) is None:
      field = "model"  # the role shares the policy's model
    real = m.unpadded_vocab_size or m.vocab_size
    if field in checked or n <= real:
      continue
    checked.add(field)
    tokenizer = f"data.tokenizer={cfg.data.tokenizer!r}"
    if m.hf_path:
      raise ConfigError(
          f"{tokenizer} has {n} tokens, more than the {real} of the model in "
          f"{field}.hf_path={m.hf_path!r} (vocab_size in its config.json): the model has no "
          f"embedding for ids {real} and up; use the tokenizer saved with that model "
          f"(--set=data.tokenizer={m.hf_path}), or a model trained with this tokenizer")
    raise ConfigError(f"{tokenizer} has {n} tokens but {field}.vocab_size={real}; set "
                      f"--set={field}.vocab_size={n} or more, or use the tokenizer this model "
                      f"was built for")


def make_packer(d, mesh, pad_id: int, grad_accum: int) -> Packer:
  """The packing of a stage's batches from ``data.pack_*`` (``d``: the DataConfig): each
  micro-batch packed into its own rows, rows in multiples of the data-parallel shards."""
  shape = {} if mesh is None else dict(mesh.shape)
  return Packer(row_len=d.pack_length or d.max_prompt_len + d.max_response_len,
                groups=grad_accum, row_multiple=shape.get("dp", 1) * shape.get("fsdp", 1),
                buckets=d.pack_buckets, pad_id=pad_id)


def stack_pairs(b: dict):
  """``(tokens, mask, loss_mask)`` with every chosen row then every rejected row, so one forward
  pass scores both sides of each preference pair; split results with ``[:n]`` / ``[n:]``
  (a padded pair batch: :func:`jaxrlhf.train.sequences.pair_rows` takes either layout)."""
  return pair_rows(b)[:3]
