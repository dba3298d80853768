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
from jaxrlhf.model import hf, lora as LORA
from jaxrlhf.config import ConfigError, ExperimentConfig, ModelConfig
from jaxrlhf.data import DataSource
from jaxrlhf.data.packing import Packer, interleave_pairs
from jaxrlhf.mesh import (DECODE_PARAM_RULES, FROZEN_PARAM_RULES, PARAM_RULES, batch_sharding,
                          replicated, tree_shardings)
from jaxrlhf.train import precision as PREC, spec
from jaxrlhf.train.sequences import pair_rows
from jaxrlhf.train.evaluate import Evaluation, eval_metric, make_evaluator
from jaxrlhf.train.statics import StepStatics, frozen_heads, trained_heads
from jaxrlhf.train.common import (TrainState, init_state, jit_step, make_optimizer,
                                  make_state_fn, shardings_of, state_shardings)
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
    # Roles trained with adapters (``STAGE.lora``) -> their LoRA settings, and where each one's
    # frozen base lives in ``frozen``: the reference for the policy (the base *is* the
    # reference: one copy), the reward model for a value model on the same backbone, else
    # ``ROLE.base``.
    lo = self.scfg.lora
    self.lora = {r: lo for r in self.trainable if lo.rank and r in lo.roles}
    self.base_keys = {r: self._base_key(r) for r in self.lora}
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

  def generation_eval(self):
    """The greedy-generation evaluator of an :class:`Evaluation`: greedy answers scored by
    ``STAGE.eval_reward`` (episodes with ``env.name``) when the spec's ``evaluation`` includes
    ``exact_match``, else None."""
    return make_evaluator(self) if "exact_match" in self.spec.evaluation else None

  # -- shared machinery ---------------------------------------------------------------------
  def init(self, key: jax.Array, roles: dict, *, only: tuple | None = None,
           extras: Extras | None = None,
           frozen_only: bool = False) -> tuple[TrainState | None, dict]:
    """Parameters of every role (from earlier stages, a Hugging Face directory, or fresh) on
    the mesh, and the train state around the trainable ones.  ``only=(trained, frozen)``
    builds a subset (one pool of a disaggregated run), each role from the same key as the
    whole stage's, plus the frozen base of each LoRA role it trains; ``extras`` then replaces
    :meth:`initial_extras` (a pool keeps its own share of the algorithm's state).
    ``frozen_only``: the frozen roles (LoRA bases included) alone, and None for the state: a
    resume restores the state into :meth:`abstract_init`'s, so none is allocated to be
    thrown away."""
    keys = dict(zip(("state",) + tuple(self.trainable) + tuple(self.frozen()),
                    jax.random.split(key, 1 + len(self.trainable) + len(self.frozen()))))
    trained, wanted = only or (tuple(self.trainable), tuple(self.frozen()))
    wanted = set(wanted) | {self.base_keys[r] for r in trained if r in self.lora}
    # The reference starts from the same weights as the policy when both are fresh.
    frozen = {r: self.role_params(roles, r, keys.get("policy", keys[r]) if r == "reference"
                                  else keys[r], head=h, frozen=True)
              for r, h in self.frozen().items() if r in wanted}
    params = {}
    for r, h in self.trainable.items():
      if r not in trained:
        continue
      if r not in self.lora:
        if not frozen_only:
          params[r] = self.role_params(roles, r, keys[r], head=h)
        continue
      bk = self.base_keys[r]
      if bk in frozen:  # the base is a frozen role already loaded: no second copy
        head = {"score": zero_score(self.model_cfg(r))} if h == "scalar" else {}
      else:
        base, head = LORA.split_full(self.role_params(roles, r, keys[r], head=h))
        frozen[bk] = jax.device_put(base, self.base_shardings(r))
      if not frozen_only:
        params[r] = self.lora_params(r, keys[r], head)
    for r, bk in self.base_keys.items():
      if r in trained:
        frozen[bk] = LORA.cast_base(frozen[bk], self.lora[r].base_dtype)
    if frozen_only:
      return None, frozen
    params = {r: self.precision[r].to_master(p) for r, p in params.items()}
    state = init_state(self.mesh, params, {r: self.opt[r] for r in trained}, keys["state"],
                       self.initial_extras() if extras is None else extras, self.precision)
    return state, frozen

  def abstract_init(self, *, only: tuple | None = None,
                    extras: Extras | None = None) -> tuple[TrainState, dict]:
    """The train state and frozen parameters as ShapeDtypeStructs with their shardings on the
    mesh; allocates nothing.  ``only`` and ``extras`` as for :meth:`init` (one pool's
    share)."""
    def role(r, head, rules):
      cfg = self.cfg.role_model(r)
      sh = M.param_shardings(cfg, self.mesh, head, rules)
      return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          M.abstract_params(cfg, head), sh)
    trained, wanted = only or (tuple(self.trainable), tuple(self.frozen()))
    wanted = set(wanted) | {self.base_keys[r] for r in trained if r in self.lora}
    frozen = {r: role(r, h, FROZEN_PARAM_RULES) for r, h in self.frozen().items()
              if r in wanted}
    params = {}
    for r, h in self.trainable.items():
      if r not in trained:
        continue
      if r not in self.lora:
        params[r] = role(r, h, PARAM_RULES)
        continue
      bk = self.base_keys[r]
      if bk not in frozen:
        frozen[bk] = LORA.split_full(role(r, h, FROZEN_PARAM_RULES))[0]
      params[r] = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                               self.abstract_trainable(r), self.trainable_shardings(r))
    for r, bk in self.base_keys.items():
      if r in trained:
        frozen[bk] = LORA.cast_base(frozen[bk], self.lora[r].base_dtype)
    params = {r: self.precision[r].to_master(p) for r, p in params.items()}
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated(self.mesh))
    opt = {r: self.opt[r] for r in trained}
    make = make_state_fn(opt, self.initial_extras() if extras is None else extras,
                         self.precision)
    shapes = jax.eval_shape(make, params, key)
    shardings = state_shardings(self.mesh, opt, shapes, shardings_of(params))
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         shapes, shardings)
    return state, frozen

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
  def _base_key(self, role: str) -> str:
    """Where a LoRA role's frozen base lives in ``frozen`` (see ``__init__``)."""
    frozen = self.frozen()
    if role == "policy" and "reference" in frozen:
      return "reference"
    value = self.model_cfg("value") if role == "value" else None
    if value is not None and not value.hf_path:
      # The backbone the value model would start from (Stage.role_params): the reward
      # model's, else the policy's, which is the reference's.
      if "reward" in frozen and same_backbone(self.model_cfg("reward"), value):
        return "reward"
      if "reference" in frozen and same_backbone(self.model_cfg("policy"), value):
        return "reference"
    return f"{role}.base"

  def lora_params(self, role: str, key: jax.Array, head: dict) -> dict:
    """A LoRA role's trainable tree on the mesh: adapters (fresh, B = 0, or from
    ``lora.init_from``) and the trained scalar head, if any."""
    cfg, lo = self.model_cfg(role), self.lora[role]
    if lo.init_from:
      adapters = LORA.load_peft(lo.init_from, cfg, lo, f"{self.name}.lora.init_from")
    else:
      adapters = LORA.init_adapters(cfg, lo, key)
    return jax.device_put({**adapters, **head}, self.trainable_shardings(role))

  def abstract_trainable(self, role: str):
    """ShapeDtypeStructs of a LoRA role's trainable tree (no shardings)."""
    cfg, lo = self.model_cfg(role), self.lora[role]
    return jax.eval_shape(lambda: {
        **LORA.init_adapters(cfg, lo, jax.random.key(0)),
        **({"score": zero_score(cfg)} if self.trainable[role] == "scalar" else {})})

  def trainable_shardings(self, role: str):
    cfg, lo = self.model_cfg(role), self.lora[role]
    axes = LORA.trainable_axes(cfg, lo, self.trainable[role])
    return tree_shardings(self.mesh, axes, self.abstract_trainable(role), PARAM_RULES)

  def base_shardings(self, role: str):
    cfg, head = self.model_cfg(role), self.trainable[role]
    return LORA.split_full(M.param_shardings(cfg, self.mesh, head, FROZEN_PARAM_RULES))[0]

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
  def role_params(self, roles: dict, role: str, key: jax.Array, *, head: str,
                  frozen: bool = False) -> dict:
    """Parameters for ``role``, from the first that applies: an earlier stage's result for
    this role; the policy's weights for the reference; the role's own Hugging Face directory;
    the reward model's backbone for the value model, or the policy's for a scalar role (a
    new scalar head on an SFT model), when the shapes agree; else a fresh sharded init."""
    cfg = self.cfg.role_model(role)
    rules = FROZEN_PARAM_RULES if frozen else PARAM_RULES
    shardings = M.param_shardings(cfg, self.mesh, head, rules)
    source = roles.get(role)
    if source is None and role == "reference":
      source = roles.get("policy")
    if source is None and not cfg.hf_path:
      donors = (["reward"] if role == "value" else []) + (["policy"] if head == "scalar" else [])
      for donor in donors:
        if donor in roles and same_backbone(self.cfg.role_model(donor), cfg):
          source = roles[donor]
          if role == "value":
            # The backbone only: the reward head's scale (raw reward-model scores) has nothing
            # to do with the normalised returns a value head predicts, and starting from it
            # made the first PPO steps' advantages noise (tiny_ppo fell 82% -> 62% before
            # recovering); a zero head starts at the baseline of normalised returns.
            source = {k: v for k, v in source.items() if k != "score"}
          break
    if source is None:
      # A Hugging Face directory (model.hf_path / reward_model.hf_path ...) or a random init.
      if head != "lm+scalar":
        return hf.load_or_init(cfg, self.mesh, key, head, rules)
      source = hf.load_or_init(cfg, self.mesh, key, "lm", rules)  # + a zero value head below
    return jax.device_put(convert_head(source, cfg, head), shardings)

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


def zero_score(cfg: ModelConfig) -> dict:
  """A scalar head that starts at zero (a value model's)."""
  dtype = jnp.dtype(cfg.param_dtype)
  return {"w": jnp.zeros((cfg.d_model,), dtype), "b": jnp.zeros((), dtype)}


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


def same_backbone(a: ModelConfig, b: ModelConfig) -> bool:
  """Whether two model configs have parameters of the same shapes (head aside)."""
  return M.param_shapes(a, "scalar") == M.param_shapes(b, "scalar") and (
      a.param_dtype == b.param_dtype)


def convert_head(params: dict, cfg: ModelConfig, head: str) -> dict:
  """The same backbone with the requested head(s): ``"lm"`` keeps or restores the unembedding,
  ``"scalar"`` keeps the model's score head or adds a zero-initialised one, ``"lm+scalar"``
  (a policy sharing its backbone with the value head) does both.  Copies, so the source stays
  usable."""
  out = {k: v for k, v in params.items() if k not in ("unembed", "score")}
  out = jax.tree.map(jnp.copy, out)
  if head in ("scalar", "lm+scalar"):
    if "score" in params:
      out["score"] = jax.tree.map(jnp.copy, params["score"])
    else:
      dtype = params["embed"].dtype
      out["score"] = {"w": jnp.zeros((cfg.d_model,), dtype), "b": jnp.zeros((), dtype)}
  if head in ("lm", "lm+scalar"):
    if "unembed" in params:
      out["unembed"] = jnp.copy(params["unembed"])
    elif not cfg.tie_embeddings:
      raise ConfigError("cannot make an LM head from a scalar-head model with untied embeddings")
  return out
