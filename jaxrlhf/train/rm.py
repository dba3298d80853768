"""Reward-model training on preference pairs (Bradley-Terry), scalar head at the last token."""

from __future__ import annotations

import jax

from jaxrlhf import model as M
from jaxrlhf.algorithms import bradley_terry_loss
from jaxrlhf.config import RMConfig
from jaxrlhf.perf import decoder_flops
from jaxrlhf.train import spec
from jaxrlhf.train.evaluate import pair_batches
from jaxrlhf.train.sequences import (is_packed, packing_metrics, pair_rows, pooled_scores,
                                     split_pairs)
from jaxrlhf.train.stage import Stage


class RMStage(Stage):
  name = "rm"

  def __init__(self, cfg, mesh, data):
    super().__init__(cfg, mesh, data)
    cfg = self.model_cfg("reward")
    kernels = self.cfg.kernels

    def pair_scores(params, b):
      tokens, mask, _, segment_ids = pair_rows(b)
      if is_packed(b):
        s = pooled_scores(M.token_scores(params, tokens, mask, cfg=cfg, kernels=kernels,
                                         segment_ids_BL=segment_ids), b, cfg.score_pool)
      else:
        s = M.sequence_scores(params, tokens, mask, cfg=cfg, kernels=kernels, start=self.P)
      return split_pairs(s, b)

    self.pair_scores = pair_scores
    self._eval = jax.jit(lambda p, b: bradley_terry_loss(*pair_scores(p, b))[1])

  def batch_shapes(self):
    if self.packer is not None:
      return self.packed_shapes(2 * self.scfg.batch_size)
    return {**self.sequence_shapes("chosen"), **self.sequence_shapes("rejected")}

  def batch(self, step):
    return self.pair_batch(self.data.examples("pairs", step, self.scfg.batch_size))

  def step(self, state, frozen, batch):
    n_micro = self.scfg.optim.grad_accum

    def loss_fn(params, mb):
      loss, metrics = bradley_terry_loss(*self.pair_scores(params, mb))
      return loss / n_micro, metrics

    state, metrics = self.update_role(state, frozen, "reward", loss_fn, batch, n_micro)
    return state, {**metrics, **packing_metrics(batch)}

  def evaluate(self, state, ev):
    pairs = ev.once("pairs", lambda: pair_batches(self))
    with jax.set_mesh(self.mesh):
      m = jax.device_get(self._eval(self.view(state.params, ev.frozen, "reward"), pairs))
    return {"eval/pair_accuracy": float(m["accuracy"])}


def flops(stage, shape=None) -> dict:
  """Both sides of every pair (``shape``: a packed step's rows and row length)."""
  rows, T = (shape["rows"], shape["T"]) if shape else (2 * stage.scfg.batch_size,
                                                       stage.P + stage.R)
  return {"update": decoder_flops(stage.model_cfg("reward"), rows, T,
                                  head="scalar", train=True, lora=stage.lora.get("reward"))}


SPEC = spec.register(spec.AlgorithmSpec(
    name="rm", config_type=RMConfig, stage=RMStage,
    roles=lambda cfg: {"reward": spec.Role("scalar", True)}, batch="pairs", rows_per_example=2,
    flops=flops, evaluation="pairs", eval_at_start=False, packs=True))
