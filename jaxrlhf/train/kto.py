"""KTO on unpaired examples (``data.unpaired_path``: prompt, completion, desirable label; or each
preference pair's two sides): policy vs frozen reference, the KL reference point estimated on
the batch (algorithms/losses.py).  Evaluated on held-out pairs (the implicit reward
``beta (pi - ref)`` of the chosen side above the rejected's) and by greedy exact match."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrlhf import model as M
from jaxrlhf.algorithms import kto_loss, preference_metrics
from jaxrlhf.config import ConfigError, KTOConfig
from jaxrlhf.perf import decoder_flops
from jaxrlhf.train import spec
from jaxrlhf.train.evaluate import GenerationEval, pair_batches
from jaxrlhf.train.stage import Stage, stack_pairs


class KTOStage(Stage):
  name = "kto"

  def __init__(self, cfg, mesh, data):
    super().__init__(cfg, mesh, data)
    mcfg, kernels = self.model_cfg("policy"), self.cfg.kernels

    def seq_logps(params, tokens, mask, loss_mask):
      """Summed response log-probs per row, ``[B]``."""
      logp, _ = M.token_logprobs(params, tokens, mask, cfg=mcfg, start=1, kernels=kernels)
      return jnp.sum(jnp.where(loss_mask[:, 1:], logp, 0.0), axis=-1)

    self.seq_logps = seq_logps

    def eval_fn(policy, reference, b):
      tokens, mask, loss_mask = stack_pairs(b)
      n = b["chosen"].shape[0]
      logr = seq_logps(policy, tokens, mask, loss_mask) - seq_logps(reference, tokens, mask,
                                                                     loss_mask)
      r = self.scfg.beta * logr
      return preference_metrics(jnp.float32(0.0), r[:n], r[n:], jnp.ones((n,), bool))

    self._eval = jax.jit(eval_fn)

  def generation_eval(self):
    return GenerationEval(self)

  def batch_shapes(self):
    shapes = self.sequence_shapes("completion")
    shapes["label"] = ((self.scfg.batch_size,), jnp.bool_)
    return shapes

  def batch(self, step):
    return self.data.encoder.unpaired(self.data.examples("unpaired", step, self.scfg.batch_size))

  def step(self, state, frozen, batch):
    seq = lambda p, b: self.seq_logps(p, b["completion"], b["completion_mask"],
                                      b["completion_loss_mask"])
    mb = {**batch, "ref": seq(frozen["reference"], batch)}
    scfg = self.scfg  # kto.optim.grad_accum is 1 (KTOConfig.check): z0 is the batch's

    def loss_fn(params, b):
      return kto_loss(seq(params, b), b["ref"], b["label"], beta=scfg.beta,
                      desirable_weight=scfg.desirable_weight,
                      undesirable_weight=scfg.undesirable_weight)

    return self.update_role(state, frozen, "policy", loss_fn, mb, 1)

  def evaluate(self, state, ev):
    pairs = ev.once("pairs", lambda: pair_batches(self))
    with jax.set_mesh(self.mesh):
      m = jax.device_get(self._eval(self.view(state.params, ev.frozen, "policy"),
                                    ev.frozen["reference"], pairs))
    out = {"eval/pair_accuracy": float(m["pref_accuracy"]),
           "eval/reward_margin": float(m["reward_margin"])}
    out.update(ev.generation(self.view(state.params, ev.frozen, "policy", decode=True)))
    return out


def flops(stage) -> dict:
  T = stage.P + stage.R
  cfg, b = stage.model_cfg("policy"), stage.scfg.batch_size
  return {"update": decoder_flops(cfg, b, T, head_positions=T - 1, train=True,
                                  lora=stage.lora.get("policy")),
          "reference": decoder_flops(cfg, b, T, head_positions=T - 1)}


def validate(cfg, data) -> None:
  """KTO evaluates held-out *pairs*: an unpaired file alone has none."""
  d = cfg.data
  if d.task == "jsonl" and not (d.pairs_path or d.pairs_eval_path or d.eval_path):
    raise ConfigError("kto evaluates preference accuracy on held-out pairs, but no pairs are "
                      "given; set --set=data.pairs_eval_path=FILE (JSONL {\"prompt\", "
                      "\"chosen\", \"rejected\"}) or train from data.pairs_path")


SPEC = spec.register(spec.AlgorithmSpec(
    name="kto", config_type=KTOConfig, stage=KTOStage,
    roles=lambda cfg: {"policy": spec.Role("lm", True), "reference": spec.Role("lm", False)},
    batch="unpaired", rows_per_example=1, flops=flops, evaluation="pairs+exact_match",
    eval_at_start=True, validate=validate))
