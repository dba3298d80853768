"""DPO on preference pairs: policy vs frozen reference; reference log-probs computed inside
the step (``dpo.reference=step``) or once per distinct pair and cached (``=cache``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import model as M
from jaxrlhf.algorithms import dpo_loss
from jaxrlhf.config import DPOConfig
from jaxrlhf.perf import decoder_flops
from jaxrlhf.train import spec
from jaxrlhf.train.common import put_batch, update_role
from jaxrlhf.train.evaluate import ExactMatchEval, pair_batches
from jaxrlhf.train.stage import Stage, stack_pairs


class DPOStage(Stage):
  name = "dpo"

  def __init__(self, cfg, mesh, data):
    super().__init__(cfg, mesh, data)
    cfg = self.model_cfg("policy")
    kernels = self.cfg.kernels

    def seq_logps(params, b):
      """Summed response log-probs of chosen and rejected: two ``[B]`` arrays."""
      tokens, mask, loss_mask = stack_pairs(b)
      logp, _ = M.token_logprobs(params, tokens, mask, cfg=cfg, start=1, kernels=kernels)
      s = jnp.sum(jnp.where(loss_mask[:, 1:], logp, 0.0), axis=-1)
      n = b["chosen"].shape[0]
      return s[:n], s[n:]

    self.seq_logps = seq_logps
    self._ref = jax.jit(seq_logps)
    self._cache: dict = {}
    self._eval_pairs = None
    self.evaluator = ExactMatchEval(self)

    def eval_fn(policy, reference, b):
      rc, rr = seq_logps(reference, b)
      pc, pr = seq_logps(policy, b)
      return dpo_loss(pc, pr, rc, rr, beta=self.scfg.beta, loss_type=self.scfg.loss,
                      label_smoothing=self.scfg.label_smoothing)[1]

    self._eval = jax.jit(eval_fn)

  def init(self, key, roles):
    state, frozen = super().init(key, roles)
    self.frozen_ref = frozen["reference"]  # for dpo.reference=cache
    return state, frozen

  def batch_shapes(self):
    shapes = {**self.sequence_shapes("chosen"), **self.sequence_shapes("rejected")}
    if self.scfg.reference == "cache":
      b = self.scfg.batch_size
      shapes.update(ref_chosen=((b,), jnp.float32), ref_rejected=((b,), jnp.float32))
    return shapes

  def batch(self, step):
    examples = self.data.examples("pairs", step, self.scfg.batch_size)
    batch = self.data.encoder.pairs(examples)
    if self.scfg.reference == "cache":
      batch.update(self._cached_reference(examples, batch))
    return batch

  def _cached_reference(self, examples, batch) -> dict:
    keys = [(e.prompt, e.chosen, e.rejected) for e in examples]
    missing = [i for i, k in enumerate(keys) if k not in self._cache]
    if missing:
      with jax.set_mesh(self.mesh):
        rc, rr = jax.device_get(self._ref(self.frozen_ref, put_batch(self.mesh, batch)))
      for i in missing:
        self._cache[keys[i]] = (rc[i], rr[i])
    return {"ref_chosen": np.array([self._cache[k][0] for k in keys], np.float32),
            "ref_rejected": np.array([self._cache[k][1] for k in keys], np.float32)}

  def step(self, state, frozen, batch):
    if "ref_chosen" in batch:
      ref_c, ref_r = batch["ref_chosen"], batch["ref_rejected"]
    else:
      ref_c, ref_r = self.seq_logps(frozen["reference"], batch)
    n_micro = self.scfg.optim.grad_accum
    mb = {**batch, "ref_chosen": ref_c, "ref_rejected": ref_r}

    def loss_fn(params, b):
      pc, pr = self.seq_logps(params, b)
      loss, metrics = dpo_loss(pc, pr, b["ref_chosen"], b["ref_rejected"], beta=self.scfg.beta,
                               loss_type=self.scfg.loss,
                               label_smoothing=self.scfg.label_smoothing)
      return loss / n_micro, metrics

    return update_role(state, "policy", loss_fn, mb, n_micro, self.opt["policy"])

  def evaluate(self, state, frozen):
    if self._eval_pairs is None:
      self._eval_pairs = pair_batches(self)
    with jax.set_mesh(self.mesh):
      m = jax.device_get(self._eval(state.params["policy"], frozen["reference"],
                                    self._eval_pairs))
    out = {"eval/pair_accuracy": float(m["pref_accuracy"]),
           "eval/reward_margin": float(m["reward_margin"])}
    out.update(self.evaluator(state.params["policy"]))
    return out


def flops(stage) -> dict:
  T = stage.P + stage.R
  cfg, b = stage.model_cfg("policy"), stage.scfg.batch_size
  out = {"update": decoder_flops(cfg, 2 * b, T, head_positions=T - 1, train=True)}
  if stage.scfg.reference == "step":
    out["reference"] = decoder_flops(cfg, 2 * b, T, head_positions=T - 1)
  return out


SPEC = spec.register(spec.AlgorithmSpec(
    name="dpo", config_type=DPOConfig, stage=DPOStage,
    roles=lambda cfg: {"policy": spec.Role("lm", True), "reference": spec.Role("lm", False)},
    batch="pairs", rows_per_example=2, flops=flops, evaluation="pairs+exact_match",
    eval_at_start=True))
