"""Evaluation on the set :meth:`DataSource.eval_source` names (held out, or said not to be):
exact-match accuracy of greedy answers, and preference-pair accuracy."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrlhf.rewards import RULES
from jaxrlhf.rollout import generate
from jaxrlhf.train.common import put_batch
from jaxrlhf.train.episodes import EnvEval


def make_evaluator(stage, role: str = "policy"):
  """How a stage that generates is evaluated: greedy episodes against the environment when
  ``env.name`` is set (success rate), else exact match of greedy answers."""
  if stage.cfg.env.name:
    return EnvEval(stage, role)
  return ExactMatchEval(stage, role)


class ExactMatchEval:
  """Greedy-decodes the evaluation prompts and scores them with the exact-match rule."""

  def __init__(self, stage, role: str = "policy"):
    self.stage = stage
    self.batch = None  # the evaluation prompts, placed on first use
    data = stage.data
    cfg = stage.cfg
    rollout = dataclasses.replace(cfg.rollout, temperature=0.0)
    model_cfg = cfg.role_model(role)
    eos, pad = data.tokenizer.eos_id, data.tokenizer.pad_id
    decode = stage.decode_layout_shardings(role)

    def accuracy(params, batch):
      if decode is not None:  # greedy decoding in the decode layout too (docs/rollout.md)
        params = jax.lax.with_sharding_constraint(params, decode)
      out = generate(params, batch["prompt"], batch["prompt_mask"], jax.random.key(0),
                     cfg=model_cfg, rollout=rollout, eos_id=eos, pad_id=pad,
                     kernels=cfg.kernels)
      score = RULES["exact_match"](out.tokens[:, -rollout.max_new_tokens:], out.response_mask,
                                   batch["answer"], batch["answer_mask"], eos_id=eos)
      return {"eval/accuracy": jnp.mean(score),
              "eval/response_length": jnp.mean(out.lengths.astype(jnp.float32))}

    self._fn = jax.jit(accuracy)

  def __call__(self, params) -> dict:
    if self.batch is None:
      data = self.stage.data
      examples = data.eval_examples("prompts")
      # A prompt without a reference answer cannot be scored (an empty answer would count an
      # empty response as right): measure the others, and say so.
      scored = [ex for ex in examples if ex.answer]
      if len(scored) < len(examples):
        note = no_answer_note(data, len(examples) - len(scored), len(examples))
        print(f"{self.stage.name}: {note}", flush=True)
      self.batch = (put_batch(self.stage.mesh, data.encoder.prompts(scored)) if scored
                    else {})
    if not self.batch:
      return {}
    with jax.set_mesh(self.stage.mesh):
      out = self._fn(params, self.batch)
    return {k: float(v) for k, v in jax.device_get(out).items()}


def no_answer_note(data, missing: int, total: int) -> str:
  """What exact match does when ``missing`` of the ``total`` evaluation prompts have no
  reference answer: scores the others, or (none has one: e.g. DPO on pairs without "answer")
  is left out, and how to get it."""
  field, _ = data.eval_source("prompts")
  where = f"data.{field}={getattr(data.cfg, field)}"
  prompts = data.eval_name("prompts", "prompts")
  if missing < total:
    return (f"{missing} of the {total} {prompts} have no \"answer\"; eval/accuracy is measured "
            f"on the other {total - missing}")
  return (f"exact match is not evaluated (no eval/accuracy): none of the {total} {prompts} "
          f"from {where} has an \"answer\" to compare the greedy response with; add "
          f"\"answer\" to its rows, or set data.prompts_eval_path=FILE (prompts with answers)")


def pair_batches(stage, n: int | None = None) -> dict:
  """The evaluation preference pairs (:meth:`DataSource.eval_source`), placed on the mesh."""
  examples = stage.data.eval_examples("pairs")
  if n is not None:
    examples = examples[:n]
  return put_batch(stage.mesh, stage.data.encoder.pairs(examples))

