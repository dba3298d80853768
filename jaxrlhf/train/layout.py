"""A stage's state layout: one table of its roles, and the one pure function that builds its
train state and frozen parameters from that table.

Each role of a stage's spec is one :class:`RoleLayout` row: its head, whether it trains, where
its weights come from (``donors``: earlier stages' results, the first present wins; else its
Hugging Face directory; else a seeded init), its sharding rules, its LoRA settings and the
frozen base its adapters sit on, and the pool that holds it in a disaggregated run.

:func:`init_state` turns the table, a key and the weights already at hand into
``(TrainState, frozen)``.  Everything that needs the state's shape reads ``jax.eval_shape`` of
that same function (:meth:`StateLayout.abstract`): a restore (nothing allocated first), the
planner, the preflight memory check and each pool's share.  :meth:`StateLayout.init` runs it
jitted into the layout's shardings; weights it read from files are donated to it, so a
frozen 70B reference is never held twice.

LoRA is a trainability mask over a role's model: the row's ``base`` names the frozen tree the
adapters read (the reference for the policy: the base *is* the reference, one copy), and only
the adapters (and a scalar head) are the role's trained parameters.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrlhf import model as M
from jaxrlhf.config import ConfigError, LoraConfig, ModelConfig
from jaxrlhf.mesh import FROZEN_PARAM_RULES, PARAM_RULES, replicated, tree_shardings
from jaxrlhf.model import hf, lora as LORA
from jaxrlhf.model.transformer import init_params
from jaxrlhf.train.common import make_state_fn, state_shardings
from jaxrlhf.train.types import Extras, TrainState

# The roles the actor pool holds (docs/pools.md); the critic pool holds every other one.
ACTOR_ROLES = ("policy", "reference")


@dataclasses.dataclass(frozen=True)
class RoleLayout:
  """One role of a stage (module docstring).  ``key`` names the split key it initialises from
  (the reference starts from the policy's, so fresh twins are equal); ``owns_base``: a LoRA
  role whose frozen base is built from its own weights (``ROLE.base``), not a frozen role."""

  name: str
  model: ModelConfig
  head: str
  trains: bool
  donors: tuple[str, ...]
  key: str
  pool: str
  lora: Optional[LoraConfig] = None
  base: Optional[str] = None
  owns_base: bool = False

  @property
  def rules(self):
    return PARAM_RULES if self.trains else FROZEN_PARAM_RULES

  # -- shapes and shardings ------------------------------------------------------------------
  def shardings(self, mesh):
    """The role's own tree's shardings: its whole model, or a LoRA role's trained tree."""
    if self.lora is None:
      return M.param_shardings(self.model, mesh, self.head, self.rules)
    axes = LORA.trainable_axes(self.model, self.lora, self.head)
    return tree_shardings(mesh, axes, self.abstract_trainable(), PARAM_RULES)

  def abstract_trainable(self):
    """ShapeDtypeStructs of a LoRA role's trained tree (no shardings)."""
    return jax.eval_shape(lambda: {**LORA.init_adapters(self.model, self.lora, jax.random.key(0)),
                                   **_new_head(self.model, self.head)})

  def base_shardings(self, mesh):
    """Shardings of the frozen base a LoRA role builds (its model under the frozen rules,
    without a scalar head)."""
    return LORA.split_full(M.param_shardings(self.model, mesh, self.head, FROZEN_PARAM_RULES))[0]

  def origin(self, available) -> tuple[str, str]:
    """Where the weights come from, given the earlier stages' results ``available``:
    ``("stage", DONOR)``, ``("hf", PATH)`` or ``("random", "")``."""
    donor = next((d for d in self.donors if d in available), None)
    if donor is not None:
      return "stage", donor
    return ("hf", self.model.hf_path) if self.model.hf_path else ("random", "")


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """A stage's roles (:class:`RoleLayout`, trained ones first) and what its train state holds
  beside them: the optimizers, precisions and initial extras.  ``keys`` is the full stage's
  key order, so a pool's share (:meth:`share`) initialises each role from the same key."""

  stage: str
  mesh: Any
  rows: tuple[RoleLayout, ...]
  keys: tuple[str, ...]
  opt: Mapping[str, Any]
  precision: Mapping[str, Any]
  extras: Extras

  @property
  def trained(self) -> dict:
    return {r.name: r for r in self.rows if r.trains}

  @property
  def frozen(self) -> dict:
    return {r.name: r for r in self.rows if not r.trains}

  def pool(self, pool: str) -> tuple[tuple, tuple]:
    """``(trained, frozen)`` role names that ``pool`` holds."""
    return (tuple(r.name for r in self.rows if r.trains and r.pool == pool),
            tuple(r.name for r in self.rows if not r.trains and r.pool == pool))

  def share(self, trained, frozen, extras: Optional[Extras] = None) -> "StateLayout":
    """The layout of the roles named (and the frozen base of each LoRA role among
    ``trained``): one pool's share; ``extras`` replaces the stage's (a pool keeps its own
    part of the algorithm's state)."""
    keep = set(trained) | set(frozen) | {
        r.base for r in self.rows if r.name in trained and r.lora is not None}
    rows = tuple(r for r in self.rows if r.name in keep)
    return dataclasses.replace(self, rows=rows, extras=self.extras if extras is None else extras)

  # -- abstract state ------------------------------------------------------------------------
  def shardings(self, abstract: Optional[tuple] = None) -> tuple[TrainState, dict]:
    """``(state, frozen)`` shardings on the mesh."""
    state, frozen = abstract or self._shapes()
    params = {r.name: r.shardings(self.mesh) for r in self.trained.values()}
    fro = {r.name: M.param_shardings(r.model, self.mesh, r.head, FROZEN_PARAM_RULES)
           for r in self.frozen.values()}
    fro.update({r.base: r.base_shardings(self.mesh) for r in self.trained.values()
                if r.owns_base})
    return state_shardings(self.mesh, self.opt, state, params), fro

  def abstract(self) -> tuple[TrainState, dict]:
    """The train state and frozen parameters as ShapeDtypeStructs with their shardings:
    ``eval_shape`` of :func:`init_state`; allocates nothing."""
    shapes = self._shapes()
    shardings = self.shardings(shapes)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        shapes, shardings)

  def _shapes(self):
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated(self.mesh))
    return jax.eval_shape(lambda k: init_state(self, k, {}, {}), key)

  # -- concrete state ------------------------------------------------------------------------
  def init(self, key: jax.Array, given: dict, *, frozen_only: bool = False):
    """:func:`init_state` on the mesh, into :meth:`shardings`: ``given`` holds the earlier
    stages' results (role -> parameters, left as they are); weights read here from Hugging
    Face directories and PEFT adapters are donated.  ``frozen_only``: the frozen parameters
    alone and None for the state (a resume restores the state into :meth:`abstract`)."""
    origins = [r.origin(given) for r in self.rows]
    given = {d: self._onto_mesh(given[d]) for kind, d in origins if kind == "stage"}
    loaded = self._read(given, frozen_only)
    shapes = self._shapes()
    state_sh, frozen_sh = self.shardings(shapes)
    # jax gives each output the first donated input of its shape and dtype still free, in
    # flattening order: the frozen trees come first, and so do the reads they are, keyed by
    # the name they have in ``frozen``, so each frozen read is reused in place (a swap of two
    # same-shaped reads would need a temporary copy).
    feeds = {r.base if r.owns_base else r.name: r.name for r in self.rows
             if not r.trains or r.owns_base}
    reads = ({out: loaded[name] for out, name in feeds.items() if name in loaded},
             {name: t for name, t in loaded.items() if name not in feeds.values()})

    # The key as host data: it was made on one device, and the mesh may span processes.
    key_data, impl = np.asarray(jax.random.key_data(key)), jax.random.key_impl(key)

    def build(key_data, given, reads):
      key = jax.random.wrap_key_data(key_data, impl=impl)
      loaded = {**{feeds[out]: t for out, t in reads[0].items()}, **reads[1]}
      state, frozen = init_state(self, key, given, loaded)
      return frozen if frozen_only else (frozen, state)
    out_sh = frozen_sh if frozen_only else (frozen_sh, state_sh)
    with jax.set_mesh(self.mesh), warnings.catch_warnings():
      # A read that changes dtype (a bfloat16 file, a float32 master) is not reused in place,
      # which jax warns about; its buffer is freed all the same.
      warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
      out = jax.jit(build, out_shardings=out_sh, donate_argnums=(2,))(key_data, given, reads)
    return (None, out) if frozen_only else (out[1], out[0])

  def _onto_mesh(self, tree):
    """An earlier stage's result on this layout's devices: as it is when it already lies on
    them (or on the host), else moved with the same partition specs (a pool on its own
    devices, given results computed elsewhere in the process)."""
    devices = set(self.mesh.devices.flat)

    def put(x):
      if not isinstance(x, jax.Array) or set(x.sharding.device_set) == devices:
        return x  # (host arrays: the init places them)
      spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else PartitionSpec()
      return jax.device_put(x, NamedSharding(self.mesh, spec))
    return jax.tree.map(put, tree)

  def _read(self, given: dict, frozen_only: bool) -> dict:
    """The weights this init reads from files: each row's Hugging Face directory (unless a
    donor is given) and a LoRA role's ``lora.init_from``, placed in the row's shardings."""
    loaded = {}
    for r in self.rows:
      needed = not r.trains or r.owns_base or not frozen_only
      if needed and r.origin(given)[0] == "hf":
        head = "lm" if r.head == "lm+scalar" else r.head
        loaded[r.name] = hf.load_hf(r.model.hf_path, r.model, self.mesh, head, rules=r.rules)
      if r.lora is not None and r.lora.init_from and not frozen_only:
        adapters = LORA.load_peft(r.lora.init_from, r.model, r.lora,
                                  f"{self.stage}.lora.init_from")
        sh = r.shardings(self.mesh)
        loaded[f"{r.name}.adapters"] = jax.device_put(
            adapters, {"layers": sh["layers"]})
    return loaded

  # -- what the roles' parameters mean -------------------------------------------------------
  @property
  def lora(self) -> dict:
    """LoRA role -> its settings."""
    return {r.name: r.lora for r in self.rows if r.lora is not None}

  @property
  def base_keys(self) -> dict:
    """LoRA role -> where its frozen base lives in ``frozen``."""
    return {r.name: r.base for r in self.rows if r.lora is not None}


def init_state(layout: StateLayout, key: jax.Array, given: dict,
               loaded: dict) -> tuple[TrainState, dict]:
  """``(TrainState, frozen)`` of ``layout``, pure: each role's weights from its first donor in
  ``given`` (earlier stages' results), else ``loaded[ROLE]`` (read from its Hugging Face
  directory), else a fresh init from its key; a LoRA role's adapters from
  ``loaded[ROLE.adapters]`` (``lora.init_from``) or fresh (B = 0).  Trained weights become
  their precision's masters, with fresh optimizer states."""
  keys = dict(zip(layout.keys, jax.random.split(key, len(layout.keys))))
  frozen = {r.name: _weights(r, keys, given, loaded) for r in layout.frozen.values()}
  params = {}
  for r in layout.trained.values():
    if r.lora is None:
      params[r.name] = _weights(r, keys, given, loaded)
      continue
    if r.owns_base:
      frozen[r.base], head = LORA.split_full(_weights(r, keys, given, loaded))
    else:  # the base is a frozen role already built: no second copy
      head = _new_head(r.model, r.head)
    adapters = loaded.get(f"{r.name}.adapters")
    if adapters is None:
      adapters = LORA.init_adapters(r.model, r.lora, keys[r.key])
    params[r.name] = {**adapters, **head}
  for r in layout.trained.values():
    if r.lora is not None:
      frozen[r.base] = LORA.cast_base(frozen[r.base], r.lora.base_dtype)
  params = {n: layout.precision[n].to_master(p) for n, p in params.items()}
  make = make_state_fn({n: layout.opt[n] for n in params}, layout.extras, layout.precision)
  return make(params, keys["state"]), frozen


def _weights(r: RoleLayout, keys: dict, given: dict, loaded: dict) -> dict:
  """One role's whole model (its head included) per :meth:`RoleLayout.origin`."""
  kind, donor = r.origin(given)
  if kind == "stage":
    source = given[donor]
    if r.name == "value" and donor == "reward":
      # The backbone only: the reward head's scale (raw reward-model scores) has nothing to
      # do with the normalised returns a value head predicts, and starting from it made the
      # first PPO steps' advantages noise (tiny_ppo fell 82% -> 62% before recovering); a
      # zero head starts at the baseline of normalised returns.
      source = {k: v for k, v in source.items() if k != "score"}
    return convert_head(source, r.model, r.head)
  if kind == "hf" and r.name in loaded:
    source = loaded[r.name]
  else:  # a seeded init (and the shapes of a file not read: the abstract state)
    source = init_params(r.model, keys[r.key], head="lm" if r.head == "lm+scalar" else r.head)
  # A policy sharing its backbone with a value head gets a zero one.
  return convert_head(source, r.model, r.head) if r.head == "lm+scalar" else source


def _new_head(cfg: ModelConfig, head: str) -> dict:
  """A LoRA role's trained head beside adapters on a frozen role's base: a zero scalar head
  (a value model's), or nothing (an LM head stays in the base)."""
  return {"score": zero_score(cfg)} if head == "scalar" else {}


# --------------------------------------------------------------------------- the table


def build(name: str, cfg, mesh, trainable: Mapping[str, str], frozen: Mapping[str, str],
          lora: Mapping[str, LoraConfig], opt: Mapping, precision: Mapping,
          extras: Extras) -> StateLayout:
  """The layout of stage ``name``: its spec's ``trainable`` and ``frozen`` roles (role ->
  head, in the spec's order), ``lora`` the roles trained with adapters."""
  rows = []
  for r, h in list(trainable.items()) + list(frozen.items()):
    trains = r in trainable
    key = "policy" if r == "reference" and "policy" in {**trainable, **frozen} else r
    base = owns = None
    if trains and r in lora:
      base = base_key(r, cfg, frozen)
      owns = base not in frozen
    rows.append(RoleLayout(
        name=r, model=cfg.role_model(r), head=h, trains=trains, donors=donors(r, h, cfg),
        key=key, pool="actor" if r in ACTOR_ROLES else "critic",
        lora=lora.get(r) if trains else None, base=base, owns_base=bool(owns)))
  return StateLayout(stage=name, mesh=mesh, rows=tuple(rows),
                     keys=("state",) + tuple(trainable) + tuple(frozen), opt=dict(opt),
                     precision=dict(precision), extras=extras)


def donors(role: str, head: str, cfg) -> tuple[str, ...]:
  """Earlier stages' results a role starts from, first present wins: its own; the policy's
  for the reference; without a Hugging Face directory of its own, the reward model's
  backbone for the value model, and the policy's for a scalar role (a new scalar head on an
  SFT model), where the shapes agree."""
  model = cfg.role_model(role)
  out = [role] + (["policy"] if role == "reference" else [])
  if not model.hf_path:
    for donor in (["reward"] if role == "value" else []) + (
        ["policy"] if head == "scalar" else []):
      if same_backbone(cfg.role_model(donor), model):
        out.append(donor)
  return tuple(dict.fromkeys(out))


def base_key(role: str, cfg, frozen: Mapping[str, str]) -> str:
  """Where a LoRA role's frozen base lives in ``frozen``: the reference for the policy (the
  base *is* the reference: one copy), the reward model or the reference for a value model
  that would start from that backbone, else ``ROLE.base``."""
  if role == "policy" and "reference" in frozen:
    return "reference"
  value = cfg.role_model("value") if role == "value" else None
  if value is not None and not value.hf_path:
    if "reward" in frozen and same_backbone(cfg.role_model("reward"), value):
      return "reward"
    if "reference" in frozen and same_backbone(cfg.role_model("policy"), value):
      return "reference"
  return f"{role}.base"


# ------------------------------------------------------------------------------ helpers


def zero_score(cfg: ModelConfig) -> dict:
  """A scalar head that starts at zero (a value model's)."""
  dtype = jnp.dtype(cfg.param_dtype)
  return {"w": jnp.zeros((cfg.d_model,), dtype), "b": jnp.zeros((), dtype)}


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
