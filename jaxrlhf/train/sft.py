"""Supervised fine-tuning: masked cross-entropy on response tokens (prompt tokens too when
``sft.response_only=false``)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxrlhf import model as M
from jaxrlhf.algorithms import sft_loss
from jaxrlhf.train.common import TrainState, accumulate_grads, apply_update, count_skip
from jaxrlhf.train.evaluate import ExactMatchEval
from jaxrlhf.train.stage import Stage


class SFTStage(Stage):
  name = "sft"
  trainable = {"policy": "lm"}

  def __init__(self, cfg, mesh, data):
    super().__init__(cfg, mesh, data)
    self.evaluator = ExactMatchEval(self)

  def batch_shapes(self):
    return self.sequence_shapes()

  def batch(self, step):
    examples = self.data.examples("sft", step, self.scfg.batch_size)
    return self.data.encoder.sequences(examples, "response")

  def step(self, state: TrainState, frozen, batch):
    cfg = self.model_cfg("policy")
    target = batch["loss_mask"] if self.scfg.response_only else batch["mask"]
    target = target[:, 1:] & batch["mask"][:, :-1]
    denom = jnp.maximum(jnp.sum(target), 1).astype(jnp.float32)

    def loss_fn(params, mb):
      logp, _ = M.token_logprobs(params, mb["tokens"], mb["mask"], cfg=cfg, start=1,
                                 kernels=self.cfg.kernels)
      return sft_loss(logp, mb["target"], denom=denom)

    mb = {"tokens": batch["tokens"], "mask": batch["mask"], "target": target}
    loss, grads, aux = accumulate_grads(loss_fn, state.params["policy"], mb,
                                        self.scfg.optim.grad_accum)
    params, opt_state, finite, gnorm = apply_update(state.params["policy"],
                                                    state.opt_state["policy"], grads, loss,
                                                    self.opt["policy"])
    state = state.replace(step=state.step + 1, params={"policy": params},
                          opt_state={"policy": opt_state},
                          extras=count_skip(state.extras, finite))
    return state, {"loss": loss, "grad_norm": gnorm, **aux,
                   "skips/total": state.extras["skips/total"]}

  def evaluate(self, state, frozen):
    return self.evaluator(state.params["policy"])
