"""What flows between the phases of an RL step, as typed pytrees.

Shape suffixes name the axes: ``B`` rows (prompts x samples), ``T`` prompt + response slots
(``P + N``), ``N`` response slots.  One name per concept: ``response_mask_BN`` is the mask of
generated tokens, ``update_mask_BN`` the subset that trains (rows the reward kept);
``behaviour_logp_BN`` are the log-probs of the policy that sampled the rollout.

The phases fill a :class:`StepCarry` in order (``rollout`` by generation and the reference,
``scored`` by the reward and values, ``shaped`` by reward shaping); each program of the step
(the one-program step, a timed phase, either side of a host reward, a pool's program) takes a
carry and returns it, so any cut of the phase list is a valid program.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp

from jaxrlhf.rollout import Rollout  # noqa: F401 - the one rollout type, defined with generation


@flax.struct.dataclass
class Skips:
  """Updates skipped for a non-finite loss or gradient: in a row (the training loop stops a
  stage after ``optim.max_consecutive_skips``) and in all (int32 scalars)."""

  consecutive: jax.Array
  total: jax.Array

  @classmethod
  def zeros(cls) -> "Skips":
    return cls(consecutive=jnp.zeros((), jnp.int32), total=jnp.zeros((), jnp.int32))


@flax.struct.dataclass
class Carried:
  """Refill carry-over (``rollout.refill_leftover=carry``): the prompts started but not
  trained last step, for this step's queue, in fixed ``[batch_size, ...]`` buffers (the first
  ``count`` valid)."""

  prompt: jax.Array  # int32 [G, P]
  prompt_mask: jax.Array  # bool [G, P]
  answer: jax.Array  # int32 [G, R]
  answer_mask: jax.Array  # bool [G, R]
  count: jax.Array  # int32 scalar
  # rollout.refill_leftover=continue: those groups' rows as the loop left them
  # (jaxrlhf.rollout.PARTIAL_FIELDS, [G * n, ...]), to go on from.
  partial: Optional[dict] = None

  def queue(self) -> dict:
    """The buffers as a queue's fields (:func:`jaxrlhf.rollout.carry_queue`)."""
    return {"prompt": self.prompt, "prompt_mask": self.prompt_mask, "answer": self.answer,
            "answer_mask": self.answer_mask}


@flax.struct.dataclass
class Extras:
  """The algorithm's state beside the parameters (checkpointed with them): the skip counters
  (every stage), and for RL the KL controller (``algorithms.kl.KLControllerState``), the
  running reward statistics (``rewards.RunningStats``) and the carried prompts; a field a
  stage (or a pool) does not keep is None."""

  skips: Skips
  kl: Optional[Any] = None
  reward_stats: Optional[Any] = None
  carry: Optional[Carried] = None

  # Checkpoints written before the typed extras (jaxrlhf before a83d04b, 2026-12-03) kept
  # them as a dict: the same fields, the skip counters as "skips/consecutive" and
  # "skips/total".  The two functions below read such a checkpoint (jaxrlhf.checkpoint).
  LEGACY_SKIPS = ("skips/consecutive", "skips/total")

  def legacy_layout(self) -> dict:
    """This (abstract) extras in the dict layout of those checkpoints."""
    out = {k: getattr(self, k) for k in ("kl", "reward_stats", "carry")
           if getattr(self, k) is not None}
    return {**out, "skips/consecutive": self.skips.consecutive, "skips/total": self.skips.total}

  @classmethod
  def from_legacy(cls, d: dict) -> "Extras":
    """The extras restored in :meth:`legacy_layout`, typed."""
    return cls(skips=Skips(consecutive=d["skips/consecutive"], total=d["skips/total"]),
               kl=d.get("kl"), reward_stats=d.get("reward_stats"), carry=d.get("carry"))


@flax.struct.dataclass
class TrainState:
  """Everything that determines the future of a stage (and is checkpointed).

  ``params``/``opt_state`` map each *trainable* role to its parameters / optax state; frozen
  roles (reference, reward model during RL) live outside the state and are never donated.
  ``extras`` holds the algorithm's state (:class:`Extras`).
  """

  step: jax.Array
  rng: jax.Array
  params: dict
  opt_state: dict
  extras: Extras


@flax.struct.dataclass
class Scored:
  """The reward's verdict on each row, and the value model's estimates."""

  score_B: jax.Array  # f32 raw sequence score (weighted sources, missing-EOS, guard)
  keep_B: jax.Array  # bool: rows that stay in the update
  values_BN: Optional[jax.Array] = None  # f32 value of the state before each response token


@flax.struct.dataclass
class Shaped:
  """Everything the update trains on, computed before any gradient."""

  adv_BN: jax.Array  # f32 advantages (0 outside update_mask)
  update_mask_BN: jax.Array  # bool: response tokens of kept rows
  returns_BN: Optional[jax.Array] = None  # f32 value targets (PPO)
  # The ratio's denominator when it is not the behaviour policy (decoupled PPO in the pools).
  old_logp_BN: Optional[jax.Array] = None


@flax.struct.dataclass
class UpdateBatch:
  """One minibatch of the update: the rows and what each loss term reads."""

  tokens_BT: jax.Array
  mask_BT: jax.Array
  update_mask_BN: jax.Array
  # Policy terms only (None in a value-only update):
  old_logp_BN: Optional[jax.Array] = None  # the ratio's denominator (behaviour or proximal)
  behaviour_logp_BN: Optional[jax.Array] = None  # what sampled the rollout (mismatch metric)
  ref_logp_BN: Optional[jax.Array] = None
  adv_BN: Optional[jax.Array] = None
  values_BN: Optional[jax.Array] = None
  returns_BN: Optional[jax.Array] = None
  # rollout.pack: where the minibatch's rows sit in its packed rows (a
  # jaxrlhf.train.packed.PackedRows; the forwards read it, the losses never).
  packed: Optional[Any] = None

  @property
  def prompt_len(self) -> int:
    """The prompt's columns (see :attr:`Rollout.prompt_len`)."""
    return self.tokens_BT.shape[1] - self.update_mask_BN.shape[1]


@flax.struct.dataclass
class StepCarry:
  """The state of one RL step between its phases."""

  state: TrainState
  rollout: Optional[Rollout] = None
  scored: Optional[Scored] = None
  shaped: Optional[Shaped] = None
  host_score_B: Optional[jax.Array] = None  # f32 weighted host rewards (the split point)
  kl_coef: Optional[jax.Array] = None  # set by a critic pool (the actor's controller owns it)
  # rollout.pack: the step's packed layouts (a jaxrlhf.train.packed.Packing, from the host).
  packing: Optional[Any] = None
  metrics: dict = flax.struct.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class HostInputs:
  """Host-side data of a batch (the examples behind its prompts), carried beside the device
  arrays for a host reward; :func:`jaxrlhf.train.common.put_batch` leaves it on the host and
  the programs never see it."""

  examples: tuple
  # logging.samples_every: the list this step's rollout sample rows go to (None: this step
  # records none).  The program that ran the step appends; the training loop writes them.
  samples: Optional[list] = None

  def take(self, index) -> "HostInputs":
    """The examples at ``index`` (refill: each trained group's prompt in the queue)."""
    return dataclasses.replace(self, examples=tuple(self.examples[int(i)] for i in index))
