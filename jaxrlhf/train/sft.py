"""Supervised fine-tuning: masked cross-entropy on response tokens (prompt tokens too when
``sft.response_only=false``)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxrlhf import model as M
from jaxrlhf.algorithms import sft_loss
from jaxrlhf.config import ConfigError
from jaxrlhf.train.common import TrainState, update_role
from jaxrlhf.train.evaluate import ExactMatchEval
from jaxrlhf.train.stage import Stage


class SFTStage(Stage):
  name = "sft"
  trainable = {"policy": "lm"}

  def __init__(self, cfg, mesh, data):
    super().__init__(cfg, mesh, data)
    self.evaluator = ExactMatchEval(self)
    stop = self.scfg.stop_accuracy
    if not 0.0 <= stop <= 1.0:
      raise ConfigError(f"sft.stop_accuracy={stop}: must be in [0, 1] (0 trains all sft.steps)")
    if stop > 0 and self.eval_every <= 0:
      raise ConfigError(f"sft.stop_accuracy={stop} is checked at evaluations, but "
                        f"sft.eval_every={self.eval_every}; set --set=sft.eval_every=10 (or any "
                        "positive number of steps)")
    if stop > 0 and data.task is None:
      # Your own data: the target is held-out exact match, so the evaluation prompts need
      # answers; without them the target could never be reached.
      examples = data.eval_examples("prompts")
      missing = sum(1 for ex in examples if not ex.answer)
      if missing:
        source = data.cfg.eval_path or data.cfg.prompts_path
        raise ConfigError(
            f"sft.stop_accuracy={stop} stops at a held-out exact match, but {missing} of the "
            f"{len(examples)} evaluation prompts in {source} have no \"answer\"; add answers "
            "(or point data.eval_path at a file with them), or set sft.stop_accuracy=0")

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
    return update_role(state, "policy", loss_fn, mb, self.scfg.optim.grad_accum,
                       self.opt["policy"])

  def evaluate(self, state, frozen):
    return self.evaluator(state.params["policy"])

  def stop_rule(self) -> str:
    stop = self.scfg.stop_accuracy
    return f"sft.stop_accuracy={stop:g}" if stop > 0 else ""

  def target_reached(self, eval_metrics: dict) -> str:
    stop, acc = self.scfg.stop_accuracy, eval_metrics.get("eval/accuracy")
    if stop > 0 and acc is not None and acc >= stop:
      return f"held-out exact match {acc:.3f} reached {self.stop_rule()}"
    return ""
