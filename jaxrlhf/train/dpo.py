"""The preference losses on pairs: DPO and its variants (policy vs frozen reference; reference
log-probs computed inside the step, ``dpo.reference=step``, or once per distinct pair and
cached, ``=cache``), and the reference-free SimPO and ORPO, whose spec has no reference role
(one model in memory).  KTO, on unpaired examples, is its own spec (train/kto.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import model as M
from jaxrlhf.algorithms import dpo_loss, orpo_loss, simpo_loss
from jaxrlhf.config import DPOConfig
from jaxrlhf.perf import decoder_flops
from jaxrlhf.train import spec
from jaxrlhf.train.common import put_batch
from jaxrlhf.data.examples import as_text
from jaxrlhf.train.evaluate import GenerationEval, pair_batches
from jaxrlhf.train.sequences import (packing_metrics, pair_logp_sums, pair_response_lengths,
                                     pair_rows)
from jaxrlhf.train.stage import Feeder, Stage


class DPOStage(Stage):
  name = "dpo"

  def __init__(self, cfg, mesh, data):
    super().__init__(cfg, mesh, data)
    cfg = self.model_cfg("policy")
    kernels = self.cfg.kernels

    def seq_logps(params, b):
      """Summed response log-probs of chosen and rejected: two ``[B]`` arrays."""
      tokens, mask, _, segment_ids = pair_rows(b)
      logp, _ = M.token_logprobs(params, tokens, mask, cfg=cfg, start=1, kernels=kernels,
                                 segment_ids_BL=segment_ids)
      return pair_logp_sums(logp, b)

    self.seq_logps = seq_logps
    self.pref_loss = functools.partial(preference_loss, self.scfg)
    self.reference_logps = jax.jit(seq_logps)  # the cached reference's pass (CachedReference)

    def eval_fn(policy, reference, b):
      """The preference metrics of the evaluation pairs, and each pair's summed log-probs
      (policy chosen / rejected, reference chosen / rejected) for the sample rows."""
      pc, pr = seq_logps(policy, b)
      rc, rr = seq_logps(reference, b) if reference is not None else (pc * 0, pr * 0)
      return self.pref_loss(pc, pr, rc, rr, b)[1], (pc, pr, rc, rr)

    self._eval = jax.jit(eval_fn)

  def feeder(self, frozen):
    return CachedReference(self, frozen) if self.scfg.reference == "cache" else (
        super().feeder(frozen))

  def generation_eval(self):
    return GenerationEval(self)

  def batch_shapes(self):
    if self.packer is not None:
      shapes = self.packed_shapes(2 * self.scfg.batch_size)
    else:
      shapes = {**self.sequence_shapes("chosen"), **self.sequence_shapes("rejected")}
    if self.scfg.reference == "cache":
      b = self.scfg.batch_size
      shapes.update(ref_chosen=((b,), jnp.float32), ref_rejected=((b,), jnp.float32))
    return shapes

  def examples(self, step):
    return self.data.examples("pairs", step, self.scfg.batch_size)

  def batch(self, step):
    """The step's preference pairs (with ``dpo.reference=cache`` the run's
    :class:`CachedReference` adds the reference's log-probs)."""
    return self.pair_batch(self.examples(step))

  def step(self, state, frozen, batch):
    n_micro = self.scfg.optim.grad_accum
    mb = dict(batch)
    if "ref_chosen" not in batch and self.scfg.needs_reference:
      mb["ref_chosen"], mb["ref_rejected"] = self.seq_logps(frozen["reference"], batch)

    def loss_fn(params, b):
      pc, pr = self.seq_logps(params, b)
      loss, metrics = self.pref_loss(pc, pr, b.get("ref_chosen"), b.get("ref_rejected"), b)
      return loss / n_micro, metrics

    state, metrics = self.update_role(state, frozen, "policy", loss_fn, mb, n_micro)
    return state, {**metrics, **packing_metrics(batch)}

  def evaluate(self, state, ev):
    pairs = ev.once("pairs", lambda: pair_batches(self))
    policy = self.view(state.params, ev.frozen, "policy")
    with jax.set_mesh(self.mesh):
      m, logps = jax.device_get(self._eval(policy, ev.frozen.get("reference"), pairs))
    out = {"eval/pair_accuracy": float(m["pref_accuracy"]),
           "eval/reward_margin": float(m["reward_margin"])}
    out.update(ev.generation(self.view(state.params, ev.frozen, "policy", decode=True)))
    ev.rows = self.pair_samples(logps)
    return out

  def pair_samples(self, logps) -> list[dict]:
    """The first ``logging.samples`` evaluation pairs as sample rows, from the evaluation's
    per-pair summed log-probs ``(pc, pr, rc, rr)``: each side's implicit reward, ``beta`` x
    (policy - reference) (the policy's alone for the reference-free losses), and their margin
    as the row's ``reward``."""
    pc, pr, rc, rr = logps
    beta = self.scfg.beta
    rows = []
    for i, ex in enumerate(self.data.eval_examples("pairs")[:self.cfg.logging.samples]):
      chosen, rejected = beta * float(pc[i] - rc[i]), beta * float(pr[i] - rr[i])
      rows.append({"kind": "eval_pairs", "prompt": as_text(ex.prompt),
                   "chosen": as_text(ex.chosen), "rejected": as_text(ex.rejected),
                   "reward": chosen - rejected, "chosen_reward": chosen,
                   "rejected_reward": rejected})
    return rows


class CachedReference(Feeder):
  """``dpo.reference=cache``: each step's pairs with the frozen reference's summed log-probs
  of both sides (``ref_chosen``, ``ref_rejected``), computed the first time a pair is seen
  and kept for the run: the reference never changes, so later epochs over the same pairs
  skip its forward pass."""

  def __init__(self, stage, frozen):
    super().__init__(stage, frozen)
    self.cache: dict = {}

  def batch(self, step):
    stage = self.stage
    examples = stage.examples(step)
    batch = stage.pair_batch(examples)
    keys = [(e.prompt, e.chosen, e.rejected) for e in examples]
    if any(k not in self.cache for k in keys):
      with jax.set_mesh(stage.mesh):
        rc, rr = jax.device_get(stage.reference_logps(self.frozen["reference"],
                                                      put_batch(stage.mesh, batch)))
      for i, k in enumerate(keys):
        self.cache.setdefault(k, (rc[i], rr[i]))
    return {**batch, "ref_chosen": np.array([self.cache[k][0] for k in keys], np.float32),
            "ref_rejected": np.array([self.cache[k][1] for k in keys], np.float32)}


def preference_loss(scfg, pc_B, pr_B, rc_B, rr_B, b):
  """``dpo.loss`` on a batch of pairs from the summed response log-probs of the policy (and
  of the reference, None for the reference-free losses): ``(loss, metrics)``, the metrics
  always holding ``pref_accuracy`` and ``reward_margin`` (of the loss's implicit rewards)."""
  lc_B, lr_B = pair_response_lengths(b)
  if scfg.loss == "simpo":
    loss, metrics = simpo_loss(pc_B, pr_B, lc_B, lr_B, beta=scfg.beta, gamma=scfg.simpo_gamma)
  elif scfg.loss == "orpo":
    return orpo_loss(pc_B, pr_B, lc_B, lr_B, beta=scfg.beta)  # has its own SFT term
  else:
    loss, metrics = dpo_loss(pc_B, pr_B, rc_B, rr_B, beta=scfg.beta, loss_type=scfg.loss,
                             label_smoothing=scfg.label_smoothing)
  if scfg.sft_weight:
    # RPO (Pang et al. 2024): + weight x the chosen responses' per-token NLL, which keeps
    # the chosen answer likely while the margin grows (plain DPO may lower both sides).
    nll = -jnp.sum(pc_B) / jnp.maximum(jnp.sum(lc_B), 1).astype(jnp.float32)
    loss = loss + scfg.sft_weight * nll
    metrics = {**metrics, "nll": jax.lax.stop_gradient(nll)}
  return loss, metrics


def flops(stage, shape=None) -> dict:
  """Both sides of every pair, the reference's pass too when it runs in the step (``shape``:
  a packed step's rows and row length)."""
  cfg = stage.model_cfg("policy")
  rows, T = (shape["rows"], shape["T"]) if shape else (2 * stage.scfg.batch_size,
                                                       stage.P + stage.R)
  out = {"update": decoder_flops(cfg, rows, T, head_positions=T - 1, train=True,
                                lora=stage.lora.get("policy"))}
  if stage.scfg.reference == "step" and stage.scfg.needs_reference:
    out["reference"] = decoder_flops(cfg, rows, T, head_positions=T - 1)
  return out


SPEC = spec.register(spec.AlgorithmSpec(
    name="dpo", config_type=DPOConfig, stage=DPOStage,
    roles=lambda cfg: {"policy": spec.Role("lm", True),
                       **({"reference": spec.Role("lm", False)} if cfg.dpo.needs_reference
                          else {})},
    batch="pairs", rows_per_example=2, flops=flops, evaluation="pairs+exact_match",
    eval_at_start=True, packs=True))
