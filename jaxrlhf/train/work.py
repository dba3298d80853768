"""How much work one training step does, for MFU and bandwidth figures in the metrics.

:func:`step_flops` counts the model FLOPs of one step of a stage, phase by phase (generation,
reference log-probs, reward, values, update), with :func:`jaxrlhf.perf.decoder_flops`: the
programs scan over layers and decode in a ``while`` loop, and XLA's cost analysis counts such
loop bodies once, so its figure would be far too low.  :func:`generation_bytes` estimates the
memory traffic of decoding (parameters and KV cache read once per new token), the figure that
bounds a memory-bound phase.  :func:`step_utilisation` turns both into ``perf/*`` metrics
against the ceilings of the whole mesh (:func:`mesh_ceiling`).

Counts are for the whole global batch (all devices together).  Generation is counted at its
full length (``rollout.max_new_tokens``): decoding stops early when every row has ended, so the
generation figures are upper bounds when responses are short.  The phases after generation are
counted at the shapes each step ran (``rollout.length_buckets``' width, ``rollout.pack``'s
rows), the padding they still hold included; so are packed SFT, reward-model and DPO steps
(``data.pack``): :func:`step_shape`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional

import numpy as np

from jaxrlhf.perf import decoder_flops, utilisation


def step_flops(stage) -> dict[str, float]:
  """Model FLOPs of one step of ``stage``, by phase (``update`` for the supervised stages):
  its spec's count."""
  return stage.spec.flops(stage)


def rl_flops(stage, shape: dict | None = None) -> dict[str, float]:
  """The phases of an RL step (train/phases.py), at the shapes after generation that a step
  ran (``shape``, from its metrics: :func:`step_shape`) or, by default, the
  unpacked full width."""
  P, N, n = stage.P, stage.N, stage.n
  if shape is not None:  # rollout.prompt_buckets: the prompt's columns this step
    P = shape.get("prompt", P)
  # Generation, the reference and the reward see every generated prompt (over-sampled for
  # dynamic sampling); the update the trained batch only.
  b = stage.decode_prompts  # refill: the loop's groups (at most N steps of them)
  rows, T = b * n, P + N
  trained = stage.scfg.batch_size * n
  policy = stage.model_cfg("policy")
  frozen = stage.frozen()
  # Prefill once per prompt (logits at the last prompt token only), then N - 1 decode steps
  # over a cache of P + N - 1 slots for every sample of the group.
  gen = decoder_flops(policy, b, P, head_positions=1)
  gen += (N - 1) * decoder_flops(policy, rows, 1, P + N - 1, head_positions=1)
  out = {"generate": gen}
  head = N  # positions whose log-probs a pass computes
  if shape is not None:  # the phases after generation of a bucketed and/or packed step
    width = shape.get("width", N)
    T, head = P + width, width
    if "rows" in shape:  # packed rows: every slot's log-prob is computed
      rows = trained = shape["rows"]
      head = T - 1
  if "reference" in frozen:
    out["reference"] = decoder_flops(stage.model_cfg("reference"), rows, T, head_positions=head)
  reward = 0.0
  for role in ("reward", "guard"):
    if role in frozen:
      reward += decoder_flops(stage.model_cfg(role), rows, T, head="scalar")
  if reward:
    out["reward"] = reward
  # The update's rows per epoch (packed: each minibatch's own rows).
  upd = trained if shape is None or "update_rows" not in shape else shape["update_rows"]
  update = decoder_flops(policy, upd, T, head_positions=head, train=True,
                         lora=stage.lora.get("policy"))
  if "value" in stage.spec.terms:
    value = stage.model_cfg("value")
    out["values"] = decoder_flops(value, trained, T, head="scalar")
    update += decoder_flops(value, upd, T, head="scalar", train=True,
                            lora=stage.lora.get("value"))
  out["update"] = stage.scfg.ppo_epochs * update
  if stage.scfg.off_policy != "none":  # the trainer's log-probs of the rollout
    out["update"] += decoder_flops(policy, trained, T, head_positions=head)
  return out


def step_shape(stage, metrics: dict) -> dict | None:
  """The shapes a step ran at where they vary from step to step, from its metrics; None when
  they are the stage's fixed ones.  An RL step: the prompt bucket's width
  (``rollout/prompt_width``), the length bucket's width (``rollout/update_width``) and the
  packed rows of the batch and of one epoch of the update
  (``pack/rows``, ``pack/update_rows`` x minibatches).  A packed SFT, reward-model or DPO step:
  its rows (``pack/rows``) of the packer's row length."""
  if stage.spec.generates:
    shape = {}
    if "rollout/prompt_width" in metrics:  # a prompt bucket narrower than max_prompt_len
      shape["prompt"] = int(metrics["rollout/prompt_width"])
    if "rollout/update_width" in metrics:
      shape["width"] = int(metrics["rollout/update_width"])
    if "pack/rows" in metrics:
      shape["rows"] = int(metrics["pack/rows"])
      shape["update_rows"] = int(metrics["pack/update_rows"]) * stage.scfg.num_minibatches
    return shape or None
  if stage.spec.packs and "pack/rows" in metrics:
    return {"rows": int(metrics["pack/rows"]), "T": stage.packer.row_len}
  return None


def _work_of_step(stage, tp: int, n_devices: int, metrics: dict):
  """What :meth:`StepWork.of_step` replaces for a step at its own shapes (None: nothing)."""
  shape = step_shape(stage, metrics)
  if shape is None:
    return None
  out = {"flops": stage.spec.flops(stage, shape)}
  if "prompt" in shape:
    out["gen_bytes"] = generation_bytes(stage, tp, n_devices, prompt_len=shape["prompt"])
  return out


def _itemsize(dtype_name: str) -> int:
  import jax.numpy as jnp
  return np.dtype(jnp.dtype(dtype_name)).itemsize


def decode_token_bytes(stage, tp: int, n_devices: int, prompt_len: int | None = None) -> dict:
  """What one decode step reads from device memory, all devices together: ``weights`` (every
  parameter once per tensor-parallel group: ``n_devices / tp`` groups each hold, or gather, a
  whole copy), ``kv`` (the whole cache: attention runs over all ``P + N - 1`` slots, masked),
  ``kv_prompt`` (the prompts' part of it) and ``kv_shared`` (the cache with
  ``rollout.prefix_sharing``: a group's prompt slots read once, not once per sample, so ``P``
  per prompt plus ``N - 1`` per row).  ``prompt_len``: the prompt's columns (default
  ``data.max_prompt_len``).  Empty for stages that do not generate."""
  if not stage.spec.generates:
    return {}
  cfg = stage.model_cfg("policy")
  rows = stage.decode_prompts * stage.n
  P = stage.P if prompt_len is None else prompt_len
  per_slot = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * _itemsize(cfg.compute_dtype)
  return {"weights": float(cfg.num_params("lm") * _itemsize(cfg.param_dtype)
                           * max(n_devices // tp, 1)),
          "kv": float(rows * (P + stage.N - 1) * per_slot),
          "kv_prompt": float(rows * P * per_slot),
          "kv_shared": float((stage.decode_prompts * P + rows * (stage.N - 1)) * per_slot)}


def generation_bytes(stage, tp: int, n_devices: int, prompt_len: int | None = None) -> float:
  """Bytes read from device memory by one step's decoding, all devices together: ``N - 1``
  decode steps of :func:`decode_token_bytes` (its ``kv_shared`` with
  ``rollout.prefix_sharing``).  Activations are left out: at decode they are tiny next to
  these."""
  per = decode_token_bytes(stage, tp, n_devices, prompt_len)
  if not per:
    return math.nan
  kv = per["kv_shared"] if stage.cfg.rollout.prefix_sharing else per["kv"]
  return float((stage.N - 1) * (per["weights"] + kv))


def mesh_ceiling(accelerator, n_devices: int, n_processes: int = 1):
  """The accelerator's ceilings scaled to the whole run.

  Datasheet figures are per device, so they scale with the device count.  A *measured* CPU
  figure is the whole machine's (one XLA CPU program uses every core, whatever number of
  simulated devices the mesh has), so it scales with the number of processes (hosts) only.
  """
  scale = n_processes if accelerator.measured else n_devices
  return dataclasses.replace(accelerator, peak_flops=accelerator.peak_flops * scale,
                             hbm_bandwidth=accelerator.hbm_bandwidth * scale)


@dataclasses.dataclass(frozen=True)
class StepWork:
  """What one step of a stage does, and the ceilings it is measured against."""

  flops: dict  # phase -> model FLOPs of the global batch
  gen_bytes: float  # memory read by decoding (NaN for stages that do not generate)
  ceiling: object  # hardware.Accelerator for the whole mesh
  # metrics -> the fields that differ for the step that reported them (``flops``, and
  # ``gen_bytes`` for a prompt bucket), or None where its shapes are the fixed ones
  # (:func:`step_shape`); None: these fields always.
  shaped: Optional[Callable[[dict], dict]] = None

  @property
  def total_flops(self) -> float:
    return float(sum(self.flops.values()))

  def of_step(self, metrics: dict) -> "StepWork":
    """This work at the shapes one step reported (itself when they do not vary)."""
    if self.shaped is None:
      return self
    changes = self.shaped(metrics)
    return self if changes is None else dataclasses.replace(self, **changes, shaped=None)


def step_work(stage, accelerator, *, tp: int, n_devices: int, n_processes: int) -> StepWork:
  return StepWork(flops=step_flops(stage), gen_bytes=generation_bytes(stage, tp, n_devices),
                  ceiling=mesh_ceiling(accelerator, n_devices, n_processes),
                  shaped=functools.partial(_work_of_step, stage, tp, n_devices))


def step_utilisation(work: StepWork, metrics: dict) -> dict[str, float]:
  """``perf/*`` metrics of one step from its measured times in ``metrics``.

  ``perf/mfu`` and ``perf/flops_per_s`` use the whole step (``time/step_s``).  Where the step
  ran as timed phases (``time/phase/<name>_s``), each phase with FLOPs gets
  ``perf/<name>/mfu``, and generation gets ``perf/generate/bandwidth_util`` and
  ``perf/generate/bytes_per_s``: decoding is memory-bound, so that is its honest figure.
  """
  work = work.of_step(metrics)  # a bucketed or packed step: the shapes it ran at
  out = {"perf/flops_per_step": work.total_flops}
  out.update(utilisation(metrics["time/step_s"], work.ceiling, flops=work.total_flops))
  for phase, flops in work.flops.items():
    seconds = metrics.get(f"time/phase/{phase}_s")
    if seconds is None:
      continue
    m = utilisation(seconds, work.ceiling, flops=flops,
                    bytes_accessed=work.gen_bytes if phase == "generate" else math.nan,
                    prefix=f"perf/{phase}")
    out.update({k: v for k, v in m.items() if not k.endswith("/flops_per_s")})
  return out
