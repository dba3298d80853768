"""Prompt buckets (rollout.prompt_buckets, issue 37): each batch's left-padded prompts are cut
to its longest prompt rounded up to a bucket, and the RL step and the evaluation on them equal
the ones at data.max_prompt_len; the work accounting counts the columns a step ran; settings
that cannot be honoured are refused."""

import dataclasses

import jax
import numpy as np
import pytest

from helpers import mesh
from jaxrlhf.config import ConfigError, validate
from jaxrlhf.data import DataSource
from jaxrlhf.train import program
from jaxrlhf.train.spec import build_stage
from jaxrlhf.train.work import rl_flops, step_shape
from test_length_buckets import config as lb_config
from test_length_buckets import run_steps

P = 16  # the addition prompts take 5 columns: bucket 8 of (4, 8, 12, 16)


def config(algo="grpo", buckets=0, **kw):
  cfg = lb_config(algo, **kw)
  return dataclasses.replace(
      cfg, data=dataclasses.replace(cfg.data, max_prompt_len=P),
      model=dataclasses.replace(cfg.model, max_seq_len=P + cfg.rollout.max_new_tokens),
      rollout=dataclasses.replace(cfg.rollout, prompt_buckets=buckets))


def test_trim_cuts_padding_columns_only():
  prompt = np.zeros((2, 8), np.int32)
  mask = np.zeros((2, 8), bool)
  prompt[0, -3:], mask[0, -3:] = [1, 2, 3], True
  prompt[1, -5:], mask[1, -5:] = [4, 5, 6, 7, 8], True
  batch = {"prompt": prompt, "prompt_mask": mask, "answer": np.ones((2, 3), np.int32)}
  cut = program.trim_prompts(batch, program.bucket_widths(8, 4))
  assert cut["prompt"].shape == (2, 6) and cut["prompt_mask"].shape == (2, 6)
  np.testing.assert_array_equal(cut["prompt"], prompt[:, 2:])
  assert cut["prompt_mask"].sum() == mask.sum() and cut["answer"] is batch["answer"]
  full = {**batch, "prompt_mask": np.ones((2, 8), bool)}
  assert program.trim_prompts(full, program.bucket_widths(8, 4)) is full  # nothing to cut
  assert program.trim_prompts(batch, ()) is batch  # off


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_bucketed_prompts_give_the_full_width_step(algo):
  """Three steps (GRPO: the KL in the loss; PPO: values and GAE read from the prompt's last
  column, two epochs of two minibatches) on prompts cut from 16 columns to 8 equal the
  16-column steps, metrics and parameters to float rounding: the same tokens sampled, the
  same scores, the same update."""
  full = run_steps(config(algo), mesh(), algo)
  cut = run_steps(config(algo, buckets=4), mesh(), algo)
  assert all("rollout/prompt_width" not in m for m in full[2])
  assert [m["rollout/prompt_width"] for m in cut[2]] == [8.0] * 3
  for step, (x, y) in enumerate(zip(full[2], cut[2])):
    assert y.keys() - x.keys() == {"rollout/prompt_width"}
    for k in x:
      if k.startswith(("time/", "memory/")) or k == "rollout/prompt_width":
        continue
      np.testing.assert_allclose(y[k], x[k], rtol=2e-5, atol=1e-6, err_msg=f"step {step} {k}")
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=2e-5, atol=1e-6),
               jax.device_get(full[1].params), jax.device_get(cut[1].params))


def test_the_work_of_a_bucketed_step_counts_its_columns():
  cfg = config(buckets=4)
  stage = build_stage("grpo", cfg, mesh(), DataSource(cfg.data, cfg.seed))
  assert step_shape(stage, {}) is None  # the full width reports no bucket
  shape = step_shape(stage, {"rollout/prompt_width": 8.0})
  assert shape == {"prompt": 8}
  full, cut = rl_flops(stage), rl_flops(stage, shape)
  for phase in full:  # every phase runs on 8 fewer columns of each row
    assert cut[phase] < full[phase], phase
  # The step's work follows its metrics: FLOPs and the decode's bytes (a shorter KV cache).
  import functools
  from jaxrlhf.train import work as W
  whole = W.StepWork(flops=full, gen_bytes=W.generation_bytes(stage, 1, 1), ceiling=None,
                     shaped=functools.partial(W._work_of_step, stage, 1, 1))
  assert whole.of_step({}) is whole
  bucketed = whole.of_step({"rollout/prompt_width": 8.0})
  assert bucketed.flops == cut and bucketed.gen_bytes < whole.gen_bytes


def test_bucketed_evaluation_equals_full_width():
  """The evaluation's greedy answers (and so its figures) are the same on cut prompts."""
  outs = []
  for buckets in (0, 4):
    cfg = config(buckets=buckets)
    stage = build_stage("grpo", cfg, mesh(), DataSource(cfg.data, cfg.seed))
    state, frozen = stage.init(jax.random.key(0), {})
    ev = stage.evaluation(frozen)
    outs.append((ev(state), ev.generation.samples))
    assert ev.generation.widths == ((4, 8, 12, 16) if buckets else ())
  (m0, s0), (m1, s1) = outs
  assert len(s0) == 8
  assert m0.keys() == m1.keys()
  for k in m0:
    if not k.startswith("time/"):
      np.testing.assert_allclose(m1[k], m0[k], rtol=1e-6, err_msg=k)
  assert [s["response"] for s in s0] == [s["response"] for s in s1]


def test_out_of_range_buckets_are_refused_with_the_fix():
  with pytest.raises(ConfigError, match=r"rollout.prompt_buckets.*\[0, data.max_prompt_len=16"):
    validate(config(buckets=P + 1))
  # The pools take them (tests/test_pools.py, buckets and packing).
  from jaxrlhf.pools import common
  common.check_config(dataclasses.replace(config("ppo", buckets=4), stages=("ppo",)))
