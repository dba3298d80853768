"""Mixed precision of the trained weights (docs/training.md, "Mixed precision").

A model's ``param_dtype`` is how its weights are *stored* for reading: a frozen role keeps it,
and every forward pass reads it.  A trained role's weights also have to *learn*, and a
bfloat16 weight (8 significant bits) loses any update below about 0.4% of its magnitude:
at the learning rates large models are tuned with (1e-6 against weights of 1e-2) that is
nearly all of them.  So each trained role has a :class:`Precision`, from its optimizer's
``precision`` setting:

``fp32``       the train state holds float32 *master* weights and float32 Adam moments; the
               losses read the master as it is (the model casts each weight to
               ``compute_dtype`` where it uses it, so the gradient reaches the master in
               float32), generation a copy cast to ``param_dtype`` once per step (every
               decoded token reads the weights again); gradients sum in float32 over
               micro-batches.  The default.
``bf16_sr``    the weights stay in bfloat16 and each update is added in float32 and rounded
               *stochastically* back (up with probability equal to the remainder over the
               gap), keyed by the step's key: an update far below a weight's resolution still
               moves it on average, and a resumed run draws the same roundings.  Moments in
               ``moment_dtype`` (float32 unless asked).
``pure_bf16``  weights, moments and the update in ``param_dtype``: what every run did before
               this setting existed, kept as an explicit opt-in that warns once.

A float32 model trains in float32 whatever the setting says (master, copy and weights are one).
LoRA adapters (and a LoRA role's trained score head) are the trained tree of their role: they
take the same master dtype, float32 under ``fp32`` over a bfloat16 base, and the model reads
them as they are (their product is computed in float32 either way)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from jaxrlhf.config import ModelConfig, OptimizerConfig
from jaxrlhf.model import cast_floating as _cast

_F32 = jnp.dtype(jnp.float32)
_warned: set = set()


@dataclasses.dataclass(frozen=True)
class Precision:
  """How one trained role's weights are kept, read and updated (module docstring)."""

  mode: str = "fp32"
  storage: str = "float32"  # the model's param_dtype: what the forward passes read
  master: str = "float32"   # the trained tree's dtype in the train state
  moments: str = "float32"  # Adam's moments
  adapters: bool = False    # a LoRA role: the trained tree is read as it is

  @classmethod
  def of(cls, optim: OptimizerConfig, model: ModelConfig, *, adapters: bool = False,
         field: str = "optim") -> "Precision":
    """The precision of a role trained with ``optim`` on ``model`` (``field`` names the
    optimizer setting in the warning; the settings are checked by ``config.validate``)."""
    mode, storage = optim.precision, model.param_dtype
    if storage == "float32":
      return cls(mode, storage, "float32", "float32", adapters)
    if mode == "pure_bf16":
      if field not in _warned:
        _warned.add(field)
        print(f"warning: {field}.precision=pure_bf16 keeps the weights and Adam's moments in "
              f"{storage} and adds each update in {storage}: an update below ~0.4% of a weight "
              "is lost. precision=fp32 keeps float32 masters (docs/training.md, \"Mixed "
              "precision\")", flush=True)
      return cls(mode, storage, storage, storage, adapters)
    master = "float32" if mode == "fp32" else storage
    return cls(mode, storage, master, optim.moment_dtype, adapters)

  @property
  def rounds_stochastically(self) -> bool:
    return self.mode == "bf16_sr" and self.master == "bfloat16"

  def trained_bytes(self, n_params: int) -> int:
    """Bytes the train state holds for ``n_params`` trained weights: the master and Adam's
    two moments (12 per weight under fp32, 6 under pure_bf16, 10 under bf16_sr)."""
    size = lambda d: jnp.dtype(d).itemsize  # noqa: E731
    return n_params * (size(self.master) + 2 * size(self.moments))

  # -- the weights ---------------------------------------------------------------------------
  def to_master(self, tree):
    """Fresh or loaded weights (in ``param_dtype``; arrays or ShapeDtypeStructs) as the train
    state keeps them."""
    return _cast(tree, self.master)

  def view(self, tree):
    """The trained tree in ``param_dtype``: generation's copy, what a stage hands on and an
    export writes (LoRA adapters as they are).  Rounded to nearest: the master rounded."""
    return tree if self.adapters else _cast(tree, self.storage)

  def differentiable(self, tree):
    """The tree the loss is differentiated at: float32 (so each micro-batch's gradient comes
    out in float32, as the master needs it) except under ``pure_bf16``."""
    return tree if self.mode == "pure_bf16" else _cast(tree, _F32)

  # -- the optimizer -------------------------------------------------------------------------
  def init_moments(self, optimizer: optax.GradientTransformation, params):
    """Adam's state for ``params`` (moments in ``self.moments``: optax keeps them in the
    dtype of the tree it is given)."""
    return optimizer.init(_cast(params, self.moments))

  def update(self, optimizer: optax.GradientTransformation, params, opt_state, grads, key):
    """``(new_params, new_opt_state)`` after one update of ``params`` by ``grads`` (float32,
    from the accumulation).  ``key``: the stochastic rounding's (only read by ``bf16_sr``)."""
    updates, new_opt = optimizer.update(_cast(grads, self.moments), opt_state,
                                        _cast(params, self.moments))
    # Materialise the updates and new moments before they are used: otherwise XLA recomputes
    # the new moments inside the parameter update from the old ones, which the in-place moment
    # update overwrites, so it copies every moment first (benchmarks/NOTES.md, change 9).
    updates, new_opt = jax.lax.optimization_barrier((updates, new_opt))
    if self.rounds_stochastically:
      leaves, treedef = jax.tree.flatten(params)
      ups = treedef.flatten_up_to(updates)
      new = [stochastic_round(p.astype(_F32) + u.astype(_F32), jax.random.fold_in(key, i),
                              p.dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p
             for i, (p, u) in enumerate(zip(leaves, ups))]
      return jax.tree.unflatten(treedef, new), new_opt
    return optax.apply_updates(params, updates), new_opt


def stochastic_round(x: jax.Array, key: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
  """float32 ``x`` rounded to bfloat16 stochastically: a value between two neighbours rounds
  to the farther from zero with probability (its distance from the nearer-to-zero one) /
  (their gap), so the result is ``x`` in expectation.  Adds 16 random bits below bfloat16's
  mantissa and truncates; infinities and NaNs pass through."""
  if jnp.dtype(dtype) != jnp.bfloat16:
    raise ValueError(f"stochastic_round rounds float32 to bfloat16, not {jnp.dtype(dtype)}")
  x = x.astype(_F32)
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  noise = jax.random.bits(key, x.shape, jnp.uint32) >> 16
  rounded = jax.lax.bitcast_convert_type((bits + noise) & jnp.uint32(0xFFFF0000), _F32)
  # The low 16 bits are zero, so the conversion to bfloat16 is exact.
  return jnp.where(jnp.isfinite(x), rounded, x).astype(jnp.bfloat16)


def of_stage(stage_cfg, model_of, lora_roles, optim_fields: dict, stage_name: str) -> dict:
  """Role -> :class:`Precision` for every trained role of a stage: ``model_of(role)`` its
  model config, ``lora_roles`` the roles trained with adapters, ``optim_fields`` role -> the
  stage's optimizer field."""
  return {r: Precision.of(getattr(stage_cfg, f), model_of(r), adapters=r in lora_roles,
                          field=f"{stage_name}.{f}")
          for r, f in optim_fields.items()}
