"""Packed forwards for the phases after generation (``rollout.pack``, docs/rollout.md).

A rollout row is one sequence of ``T = P + N`` slots: the prompt left-padded, the response
right-padded.  With packing, the model passes after generation (the reference's log-probs, the
reward and guard scores, the values, and the update's forward and backward) run on *packed
rows* instead: each sequence's real tokens placed first-fit into rows of ``T`` slots, several
sequences per row, attention restricted to each one and positions restarting at each
(:func:`jaxrlhf.model.forward` with segment ids).  Every per-token result is gathered back to
the rollout's ``[B, ...]`` layout, so the rest of the step (KL, rewards, advantages, GAE, the
losses and their aggregation) runs on exactly the arrays it runs on without packing: the same
step up to float rounding, for any algorithm, loss aggregation, minibatching and gradient
accumulation.

The layout is computed on the host at the step's split point (train/program.py), from the
rollout's mask: one :class:`PackedRows` for the whole batch (reference, reward, values,
off-policy correction) and one per (epoch, minibatch) of the update, each minibatch's
micro-batches packed into their own rows.  The update's shuffles are drawn there too, with
the same key and function the unpacked update uses
(:func:`jaxrlhf.train.common.minibatch_perms`).  Row counts are
bucketed (``rollout.pack_buckets``): each distinct count is compiled once.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import model as M
from jaxrlhf.data.packing import Packer
from jaxrlhf.distributed import to_host
from jaxrlhf.mesh import batch_sharding
from jaxrlhf.train.common import minibatch_perms, put_global


@flax.struct.dataclass
class PackedRows:
  """Where a (micro-)batch of ``b`` rollout rows ``[b, T]`` sits in ``R`` packed rows of ``L``
  slots.  Indices are local to the (micro-)batch: ``src_RL`` reads its flattened ``[b * T]``
  arrays, ``slot_BT`` its flattened ``[R * L]`` results."""

  src_RL: jax.Array  # int32: b * T + t of the token in each slot, -1 for padding
  segment_ids_RL: jax.Array  # int32: 1, 2, ... per sequence of a row, 0 for padding
  slot_BT: jax.Array  # int32: r * L + l of each real token of each row (0 where not real)


@flax.struct.dataclass
class Packing:
  """A step's packed layouts (:class:`~jaxrlhf.train.types.StepCarry`'s ``packing``)."""

  rows: PackedRows  # the whole batch, rows in rollout order
  update: PackedRows  # per (epoch, minibatch), stacked: [E * M, R_mb, L] and [E * M, b_mb, T]
  perms: jax.Array  # int32 [E, B]: the update's minibatch shuffles


def layout(mask_BT, order, packer: Packer) -> dict:
  """Numpy :class:`PackedRows` fields of rows ``order`` of a rollout with real tokens
  ``mask_BT`` ``[B, T]``: ``packer.groups`` contiguous ranges of ``order``, each packed into
  its own rows (``slot_BT`` follows ``order``)."""
  mask_BT = np.asarray(mask_BT, bool)
  order = np.asarray(order)
  t = mask_BT.shape[1]
  mask = mask_BT[order]
  layouts, rows = packer.place(mask.sum(axis=1))
  per = len(order) // packer.groups
  slots = (packer.groups * rows, packer.row_len)
  src, seg = np.full(slots, -1, np.int32), np.zeros(slots, np.int32)
  slot = np.zeros(mask.shape, np.int32)
  for g, rows_g in enumerate(layouts):
    for r, members in enumerate(rows_g):
      at = 0
      for k, j in enumerate(members):
        cols = np.flatnonzero(mask[g * per + j])
        span = slice(at, at + len(cols))
        src[g * rows + r, span] = j * t + cols
        seg[g * rows + r, span] = k + 1
        slot[g * per + j, cols] = r * packer.row_len + np.arange(at, span.stop)
        at = span.stop
  return {"src_RL": src, "segment_ids_RL": seg, "slot_BT": slot}


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _update_perms(rng, rows: int, num_minibatches: int, epochs: int):
  """The shuffles :func:`jaxrlhf.train.phases.epochs` will draw from the state's key ``rng``
  (the second half of its split), as one program."""
  return minibatch_perms(jax.random.split(rng)[1], rows, num_minibatches, epochs)


def plan(stage, mask_BT, rng) -> tuple[Packing, dict]:
  """The step's :class:`Packing` for a rollout with real tokens ``mask_BT`` (host numpy, the
  whole batch) and the state's key before the update (``rng``), placed on the stage's mesh;
  and its metrics.  Every process computes the same layout from the same mask and key."""
  scfg, mesh = stage.scfg, stage.mesh
  b, t = mask_BT.shape
  n_mb, epochs, ga = scfg.num_minibatches, scfg.ppo_epochs, scfg.optim.grad_accum
  shape = dict(mesh.shape)
  shards = shape.get("dp", 1) * shape.get("fsdp", 1)  # the data-parallel shards of the rows

  def packer(groups):
    # Rows in multiples of the shards where the unpacked rows split over them too.
    return Packer(row_len=t, groups=groups, buckets=stage.cfg.rollout.pack_buckets,
                  row_multiple=shards if (b // groups) % shards == 0 else 1)

  full = layout(mask_BT, np.arange(b), packer(1))
  perms = to_host(_update_perms(rng, b, n_mb, epochs)).astype(np.int32)
  per_epoch = [layout(mask_BT, perms[e], packer(n_mb * ga)) for e in range(epochs)]
  rows_epoch = max(x["src_RL"].shape[0] for x in per_epoch)  # every minibatch's together
  per_epoch = [_pad_rows(x, rows_epoch, n_mb * ga) for x in per_epoch]
  update = {k: np.stack([x[k] for x in per_epoch]).reshape(
      (epochs * n_mb, -1) + per_epoch[0][k].shape[1:]) for k in per_epoch[0]}
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  rows = PackedRows(**{k: put_global(v, batch_sharding(mesh, v.ndim, v.shape))
                       for k, v in full.items()})
  update = PackedRows(**{k: put_global(v, rep) for k, v in update.items()})
  packing = Packing(rows=rows, update=update, perms=put_global(perms, rep))
  real = float(mask_BT.sum())
  metrics = {"pack/rows": float(full["src_RL"].shape[0]),
             "pack/update_rows": float(rows_epoch // n_mb),  # per minibatch
             "pack/useful_fraction": real / full["src_RL"].size,
             # (every epoch packs the same real tokens into its own rows)
             "pack/update_useful_fraction": real / (rows_epoch * t)}
  return packing, metrics


def _pad_rows(x: dict, rows: int, groups: int) -> dict:
  """An epoch's update layout with every group grown to ``rows / groups`` rows (padding
  slots), so that the epochs stack; the local slot indices keep pointing at the same rows."""
  have = x["src_RL"].shape[0]
  if have == rows:
    return x
  old, new = have // groups, rows // groups
  grow = lambda a, fill: np.concatenate(
      [a.reshape(groups, old, -1), np.full((groups, new - old, a.shape[1]), fill, a.dtype)],
      axis=1).reshape(rows, -1)
  return {"src_RL": grow(x["src_RL"], -1), "segment_ids_RL": grow(x["segment_ids_RL"], 0),
          "slot_BT": x["slot_BT"]}


# ------------------------------------------------------------------------------- forwards


def _tokens(stage, packed: PackedRows, tokens_BT):
  """The packed rows' tokens, gathered from the rollout rows (data-parallel over the rows)."""
  src = packed.src_RL
  toks = jnp.where(src >= 0, tokens_BT.reshape(-1)[jnp.maximum(src, 0)], 0)
  return jax.lax.with_sharding_constraint(toks, batch_sharding(stage.mesh, 2, toks.shape))


def _unpack(x_RL, packed: PackedRows):
  """Per-slot results ``[R, L]`` -> the rollout layout ``[b, T]`` (0 slot where not real)."""
  return x_RL.reshape(-1)[packed.slot_BT]


def token_logprobs(stage, params, tokens_BT, mask_BT, packed, *, role: str, start: int):
  """:func:`jaxrlhf.model.token_logprobs` of the rollout rows from column ``start``: ``[b,
  T - start]`` log-probs and entropies, computed on the packed rows when ``packed`` is given
  (values where ``mask_BT`` is false are meaningless either way)."""
  cfg, kernels = stage.model_cfg(role), stage.cfg.kernels
  if packed is None:
    return M.token_logprobs(params, tokens_BT, mask_BT, cfg=cfg, start=start, kernels=kernels)
  seg = packed.segment_ids_RL
  # The LM head runs on every slot of the packed rows (prompts and padding too) and only the
  # scalars travel back: gathering the hidden states to the response positions instead would
  # move [b, N, D] between the data shards.
  lp, ent = M.token_logprobs(params, _tokens(stage, packed, tokens_BT), seg > 0, cfg=cfg,
                             start=1, kernels=kernels, segment_ids_BL=seg)
  # Slot l's token is predicted at l - 1: a leading column puts each at its own slot.
  front = lambda x: jnp.pad(x, ((0, 0), (1, 0)))
  return (_unpack(front(lp), packed)[:, start:], _unpack(front(ent), packed)[:, start:])


def token_scores(stage, params, tokens_BT, mask_BT, packed, *, role: str):
  """:func:`jaxrlhf.model.token_scores` of the rollout rows ``[b, T]`` (packed rows when
  ``packed`` is given)."""
  cfg, kernels = stage.model_cfg(role), stage.cfg.kernels
  if packed is None:
    return M.token_scores(params, tokens_BT, mask_BT, cfg=cfg, kernels=kernels)
  seg = packed.segment_ids_RL
  s = M.token_scores(params, _tokens(stage, packed, tokens_BT), seg > 0, cfg=cfg,
                     kernels=kernels, segment_ids_BL=seg)
  return _unpack(s, packed)


def sequence_scores(stage, params, tokens_BT, mask_BT, packed, *, role: str, start: int):
  """:func:`jaxrlhf.model.sequence_scores` of the rollout rows ``[b]`` (packed rows when
  ``packed`` is given, pooled in the rollout layout as without)."""
  if packed is None:
    return M.sequence_scores(params, tokens_BT, mask_BT, cfg=stage.model_cfg(role),
                             kernels=stage.cfg.kernels, start=start)
  return M.pool_scores(token_scores(stage, params, tokens_BT, mask_BT, packed, role=role),
                       mask_BT, cfg=stage.model_cfg(role), start=start)
