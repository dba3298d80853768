"""Supervised fine-tuning: masked cross-entropy on response tokens (prompt tokens too when
``sft.response_only=false``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import model as M
from jaxrlhf.algorithms import sft_loss
from jaxrlhf.config import ConfigError, SFTConfig
from jaxrlhf.perf import decoder_flops
from jaxrlhf.train import spec
from jaxrlhf.train.common import TrainState, put_batch
from jaxrlhf.train.evaluate import metric_label
from jaxrlhf.train.sequences import next_token_target, packing_metrics
from jaxrlhf.train.stage import Stage


class SFTStage(Stage):
  name = "sft"

  def batch_shapes(self):
    if self.packer is not None:
      return self.packed_shapes(self.scfg.batch_size)
    return self.sequence_shapes()

  def batch(self, step):
    examples = self.data.examples("sft", step, self.scfg.batch_size)
    return self.sequence_batch(examples, "response")

  def objective(self, batch):
    """``(loss_fn, mb)``: the loss ``(params, micro-batch) -> (loss, metrics)`` the step
    differentiates (normalised by the whole batch's target tokens) and the arrays it reads,
    padded or packed alike."""
    cfg = self.model_cfg("policy")
    target = batch["loss_mask"] if self.scfg.response_only else batch["mask"]
    target = next_token_target(target, batch)
    denom = jnp.maximum(jnp.sum(target), 1).astype(jnp.float32)

    def loss_fn(params, mb):
      logp, _ = M.token_logprobs(params, mb["tokens"], mb["mask"], cfg=cfg, start=1,
                                 kernels=self.cfg.kernels, segment_ids_BL=mb.get("segment_ids"))
      return sft_loss(logp, mb["target"], denom=denom)

    mb = {"tokens": batch["tokens"], "mask": batch["mask"], "target": target}
    if "segment_ids" in batch:
      mb["segment_ids"] = batch["segment_ids"]
    return loss_fn, mb

  def step(self, state: TrainState, frozen, batch):
    loss_fn, mb = self.objective(batch)
    state, metrics = self.update_role(state, frozen, "policy", loss_fn, mb,
                                      self.scfg.optim.grad_accum)
    return state, {**metrics, **packing_metrics(batch)}

  def evaluate(self, state, ev):
    params = self.view(state.params, ev.frozen, "policy")
    out = ev.generation(self.view(state.params, ev.frozen, "policy", decode=True))
    if self.data.task is None:  # your files: the held-out responses' loss too
      out.update(self.held_out_loss(params, ev))
    return out

  def held_out_loss(self, params, ev) -> dict:
    """``eval/loss``: the token-mean NLL of the evaluation set's SFT responses (the step's own
    loss, :meth:`objective`, on examples it does not train on when the set is held out), in
    batches of ``sft.batch_size`` encoded and placed once per run (the last one filled with
    rows whose loss mask is off, so one compiled program)."""
    batches = ev.once("held_out", self._held_out_batches)
    nll = ev.once("nll", lambda: jax.jit(self._loss_and_tokens))
    total = count = 0.0
    with jax.set_mesh(self.mesh):
      for b in batches:
        loss, tokens = jax.device_get(nll(params, b))
        total, count = total + float(loss) * float(tokens), count + float(tokens)
    return {"eval/loss": total / count} if count else {}

  def _held_out_batches(self) -> list:
    examples, n = self.data.eval_examples("sft"), self.scfg.batch_size
    out = []
    for lo in range(0, len(examples), n):
      chunk = examples[lo:lo + n]
      real = len(chunk)
      b = self.data.encoder.sequences(chunk + [chunk[-1]] * (n - real), "response")
      # The fillers train nothing: their loss mask off (and, where every real token is a
      # target, sft.response_only=false, their mask: a row of padding).
      for name in ("loss_mask",) if self.scfg.response_only else ("loss_mask", "mask"):
        b[name] = np.asarray(b[name]).copy()
        b[name][real:] = False
      out.append(put_batch(self.mesh, b))
    return out

  def _loss_and_tokens(self, params, b):
    loss_fn, mb = self.objective(b)
    loss, metrics = loss_fn(params, mb)
    return loss, metrics["tokens"]

  def target_reached(self, eval_metrics: dict) -> str:
    stop, acc = self.scfg.stop_accuracy, eval_metrics.get("eval/accuracy")
    if stop > 0 and acc is not None and acc >= stop:
      what = ("success rate (greedy episodes)" if self.cfg.env.name
              else metric_label(self.scfg))
      return (f"{self.data.eval_name('prompts', what)} {acc:.3f} reached "
              f"{stop_rule(self.scfg)}")
    return ""

  def eval_every_after(self, eval_metrics: dict, every: int) -> int:
    """Close to the target, every ``sft.stop_eval_every`` steps, so that the stage stops near
    the target rather than up to ``eval_every`` steps past it."""
    stop, acc = self.scfg.stop_accuracy, eval_metrics.get("eval/accuracy")
    dense = self.scfg.stop_eval_every
    if stop > 0 and dense > 0 and acc is not None and acc >= self.scfg.stop_eval_from * stop:
      return min(every, dense)
    return every


def stop_rule(scfg) -> str:
  return f"sft.stop_accuracy={scfg.stop_accuracy:g}" if scfg.stop_accuracy > 0 else ""


def validate(cfg, data) -> None:
  stop = cfg.sft.stop_accuracy
  if stop > 0 and data.task is None:
    # Your own data: the target is exact match on the evaluation set, so its prompts need
    # answers; without them the target could never be reached.
    examples = data.eval_examples("prompts")
    missing = sum(1 for ex in examples if not ex.answer)
    if missing:
      field, _ = data.eval_source("prompts")
      source = getattr(data.cfg, field)
      raise ConfigError(
          f"sft.stop_accuracy={stop} stops at a {data.eval_name('prompts', 'exact match')}, "
          f"but {missing} of the {len(examples)} evaluation prompts in {source} have no "
          "\"answer\"; add answers "
          "(or point data.eval_path at a file with them), or set sft.stop_accuracy=0")


def flops(stage, shape=None) -> dict:
  """The update's FLOPs over the batch's rows (``shape``: a packed step's rows and row
  length, :func:`jaxrlhf.train.work.step_shape`)."""
  rows, T = (shape["rows"], shape["T"]) if shape else (stage.scfg.batch_size, stage.P + stage.R)
  return {"update": decoder_flops(stage.model_cfg("policy"), rows, T,
                                  head_positions=T - 1, train=True,
                                  lora=stage.lora.get("policy"))}


SPEC = spec.register(spec.AlgorithmSpec(
    name="sft", config_type=SFTConfig, stage=SFTStage,
    roles=lambda cfg: {"policy": spec.Role("lm", True)}, batch="sequences", rows_per_example=1,
    flops=flops, evaluation="exact_match", eval_at_start=True, validate=validate,
    stop_rule=stop_rule, packs=True))
