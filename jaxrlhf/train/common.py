"""What every training program shares: the train state, the optimizer, gradient accumulation,
skipping non-finite steps, and placing state and batches on the mesh."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrlhf.config import OptimizerConfig
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrlhf.mesh import batch_sharding
from jaxrlhf.model import cast_floating
from jaxrlhf.train.precision import Precision
# TrainState lives with the other typed pytrees; importing it from here still works.
from jaxrlhf.train.types import Extras, HostInputs, Skips, TrainState  # noqa: F401


# ------------------------------------------------------------------------------ optimizer


def learning_rate(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """Linear warm-up to ``lr`` then constant, cosine or linear decay to ``lr * end_lr_ratio``.

  Warm-up over ``W`` steps ramps from 0 at the first update (``warmup_start="zero"``), or runs
  step ``k`` (1-based) at ``lr * k / W`` (``"first_step"``): the first step then trains at
  ``lr / W`` rather than at 0 (a step at learning rate 0 computes a whole rollout and update
  to change nothing), and step ``W`` reaches ``lr``."""
  warm = max(0, min(cfg.warmup_steps, total_steps - 1))
  decay_steps = max(1, total_steps - warm)
  end = cfg.lr * cfg.end_lr_ratio
  if cfg.schedule == "constant":
    after = optax.constant_schedule(cfg.lr)
  elif cfg.schedule == "cosine":
    after = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.end_lr_ratio)
  else:
    after = optax.linear_schedule(cfg.lr, end, decay_steps)
  if warm == 0:
    return after
  if cfg.warmup_start == "zero":
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warm), after], [warm])
  # optax counts updates from 0: update ``count`` is step ``count + 1``.
  ramp = lambda count: cfg.lr * (count + 1) / warm  # noqa: E731
  return optax.join_schedules([ramp, after], [warm])


def make_optimizer(cfg: OptimizerConfig, total_steps: int,
                   updates_per_step: int = 1) -> optax.GradientTransformation:
  """AdamW with the schedule above, after global-norm clipping (when ``grad_clip > 0``).

  The schedule counts the stage's steps: an RL step makes ``updates_per_step`` optimizer
  updates (``ppo_epochs x num_minibatches``), and each of them runs at its step's learning
  rate, so ``warmup_steps`` and the decay mean steps, as published recipes count them."""
  parts = []
  if cfg.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(cfg.grad_clip))
  schedule = learning_rate(cfg, total_steps)
  if updates_per_step > 1:
    inner = schedule
    schedule = lambda count: inner(count // updates_per_step)  # noqa: E731
  parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay))
  return optax.chain(*parts)


# ------------------------------------------------------------------- gradients and updates


def split_micro(batch: dict, n: int) -> dict:
  """``[B, ...]`` arrays -> ``[n, B/n, ...]`` for a scan over micro-batches."""
  def split(x):
    if x.shape[0] % n:
      raise ValueError(f"batch of {x.shape[0]} does not split into {n} micro-batches; make the "
                       f"batch size a multiple of optim.grad_accum")
    return x.reshape((n, x.shape[0] // n) + x.shape[1:])
  return jax.tree.map(split, batch)


def accumulate_grads(loss_fn: Callable[[Any, dict], tuple[jax.Array, dict]], params, batch: dict,
                     n_micro: int):
  """Sum of ``loss_fn`` values and gradients over ``n_micro`` micro-batches (one ``lax.scan``).

  ``loss_fn`` must normalise by *global* counts (the whole batch), so that the sum over
  micro-batches equals the full-batch loss; metrics returned by it are averaged.  The
  gradients come back in float32, and they are summed in float32 whatever the parameters'
  dtype (a bfloat16 sum of micro-batch gradients loses the small ones).
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  f32 = lambda tree: cast_floating(tree, jnp.float32)  # noqa: E731
  if n_micro == 1:
    (loss, aux), grads = grad_fn(params, batch)
    return loss, f32(grads), aux
  micro = split_micro(batch, n_micro)

  def body(carry, mb):
    loss_sum, grad_sum = carry
    (loss, aux), grads = grad_fn(params, mb)
    return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, f32(grads))), aux

  zeros = f32(jax.tree.map(jnp.zeros_like, params))
  (loss, grads), aux = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), micro)
  return loss, grads, jax.tree.map(lambda x: jnp.mean(x, axis=0), aux)


# optax.tree.norm where it exists (newer optax deprecates optax.global_norm).
_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


def apply_update(params, opt_state, grads, loss, optimizer: optax.GradientTransformation,
                 precision: Precision = Precision(), key=None):
  """One optimizer update, skipped (params and state unchanged) if the loss or any gradient is
  not finite, or if the gradient is exactly zero.  Returns ``(params, opt_state, finite,
  grad_norm)``.  ``precision`` says how the update reaches the weights (float32 masters,
  bfloat16 rounded stochastically with ``key``, or plain bfloat16: jaxrlhf.train.precision).

  A zero gradient is a batch with no signal (an RL batch whose advantages are all zero, at
  policy = reference): AdamW would still move the weights by its decoupled weight decay and
  by the momentum of earlier batches, so the step is left out as a non-finite one is, the
  schedule and the moments included.  It is not counted as a skip (``skips/*`` count
  non-finite steps, which stop a run after ``max_consecutive_skips``)."""
  grad_norm = _global_norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  apply = finite & (grad_norm > 0)
  # Zero the gradients on a bad step so the update itself stays finite, then keep the old state.
  safe = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
  new_params, new_opt = precision.update(optimizer, params, opt_state, safe, key)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(apply, a, b), new, old)
  return keep(new_params, params), keep(new_opt, opt_state), finite, grad_norm


def update_role(state: "TrainState", role: str, loss_fn, batch: dict, n_micro: int,
                optimizer: optax.GradientTransformation, precision: Precision = Precision()):
  """One training step of a single role: accumulate gradients over ``n_micro`` micro-batches,
  apply them (or skip a non-finite step), advance the step.  Returns ``(state, metrics)``.
  ``loss_fn`` reads the role's trained tree as the model does (``Stage.on_view``); it is
  differentiated at ``precision.differentiable`` of the master."""
  master = state.params[role]
  loss, grads, aux = accumulate_grads(loss_fn, precision.differentiable(master), batch, n_micro)
  params, opt_state, finite, gnorm = apply_update(master, state.opt_state[role], grads, loss,
                                                  optimizer, precision,
                                                  rounding_key(state.rng, state.step))
  extras = count_skip(state.extras, finite)
  state = state.replace(step=state.step + 1, params={**state.params, role: params},
                        opt_state={**state.opt_state, role: opt_state}, extras=extras)
  return state, {"loss": loss, "grad_norm": gnorm, **aux, "skips/total": extras.skips.total}


def rounding_key(rng: jax.Array, step: jax.Array, index=0) -> jax.Array:
  """The stochastic rounding's key of an update (precision ``bf16_sr``): from the state's key,
  the step and the update's index within the step, so a resumed run rounds alike."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(rng, 0x5352), step), index)


def minibatch_perms(key, rows: int, num_minibatches: int, epochs: int):
  """An RL update's row order for each epoch ``[epochs, rows]``, split into minibatches by
  :func:`jaxrlhf.train.phases.epochs`: shuffled by ``fold_in(key, epoch)``, or the identity
  for one pass over the whole batch (no shuffle, no gather)."""
  if num_minibatches == 1 and epochs == 1:
    return jnp.arange(rows)[None]
  return jnp.stack([jax.random.permutation(jax.random.fold_in(key, e), rows)
                    for e in range(epochs)])


def count_skip(extras: Extras, finite: jax.Array) -> Extras:
  """Updates the consecutive / total skipped-step counters in ``extras``."""
  s = extras.skips
  return extras.replace(skips=Skips(consecutive=jnp.where(finite, 0, s.consecutive + 1),
                                    total=s.total + (~finite).astype(jnp.int32)))


# -------------------------------------------------------------------------------- placing


def put_global(x, sharding) -> jax.Array:
  """Host ``x`` (the same on every process) as one global array of ``sharding``: each process
  supplies its own shards."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def put_batch(mesh, batch: dict) -> dict:
  """Host numpy batch -> device arrays, batch dimension over the data axes; host-side inputs
  (:class:`~jaxrlhf.train.types.HostInputs`) stay as they are."""
  def put(x):
    if isinstance(x, HostInputs):
      return x
    x = np.asarray(x)
    return put_global(x, batch_sharding(mesh, x.ndim, x.shape))
  return {k: put(v) for k, v in batch.items()}


def shardings_of(tree):
  return jax.tree.map(lambda x: x.sharding, tree)


def jit_step(fn, mesh, state, frozen, batch, *, donate: bool = True):
  """``fn(state, frozen, batch) -> (state, metrics)`` jitted with explicit shardings taken from
  the placed arguments; the state is donated (updated in place)."""
  state_sh = shardings_of(state)
  return jax.jit(fn, in_shardings=(state_sh, shardings_of(frozen), shardings_of(batch)),
                 out_shardings=(state_sh, None), donate_argnums=(0,) if donate else ())


def state_shardings(mesh, optimizers: dict, abstract_state: TrainState, param_shardings: dict):
  """Shardings of a whole TrainState: each optimizer moment exactly like its parameter (so
  Adam's states stay as distributed as the weights), everything else replicated."""
  rep = NamedSharding(mesh, P())
  opt = {role: optax.tree_map_params(optimizers[role], lambda _, sh: sh,
                                     abstract_state.opt_state[role], param_shardings[role],
                                     transform_non_params=lambda _: rep)
         for role in abstract_state.opt_state}
  return TrainState(step=rep, rng=rep, params=param_shardings, opt_state=opt,
                    extras=jax.tree.map(lambda _: rep, abstract_state.extras))


def make_state_fn(optimizers: dict, extras: dict, precisions: dict | None = None):
  """``(params, key) -> TrainState`` with fresh optimizer states (moments in each role's
  ``precisions[role].moments``)."""
  precisions = precisions or {}

  def make(params, key):
    opt_state = {role: precisions.get(role, Precision()).init_moments(optimizers[role], p)
                 for role, p in params.items()}
    return TrainState(step=jnp.zeros((), jnp.int32), rng=key, params=params,
                      opt_state=opt_state, extras=extras)
  return make


def metrics_to_host(metrics: dict) -> dict[str, float]:
  return {k: float(v) for k, v in jax.device_get(metrics).items()}

