"""Length buckets for the phases after generation (rollout.length_buckets, issue 25): the
reference, reward, values and update run on the rollout cut to its longest response, rounded
up to a bucket, and give the same step as the full width; each width is compiled once; the
settings they cannot honour are refused."""

import dataclasses

import jax
import numpy as np
import pytest

from helpers import mesh, set_lengths, with_length_model
from jaxrlhf.config import (ConfigError, DataConfig, ExperimentConfig, GRPOConfig,
                            ModelConfig, OptimizerConfig, PPOConfig, RewardConfig,
                            RolloutConfig, validate)
from jaxrlhf.data import DataSource
from jaxrlhf.train import program
from jaxrlhf.train.common import put_batch
from jaxrlhf.train.spec import build_stage

MODEL = ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    mlp_dim=64, max_seq_len=24)
DATA = DataConfig(task="addition", digits=1, max_prompt_len=5, max_response_len=3, eval_size=8)
OPT = OptimizerConfig(lr=1e-3, warmup_steps=0, schedule="constant", eps=1e-3)
N = 16
# One response length per prompt (the policy is benchmarks/lengths.py's decoder: a prompt's
# last token sets it): step 0's responses end within 5 of the 16 slots (the width-8 bucket),
# step 1's within 9 (width 12), step 2's back in width 8.
STOP_AT = [np.asarray([1, 5, 2, 3], np.int32), np.asarray([9, 2, 4, 1], np.int32),
           np.asarray([2, 2, 6, 1], np.int32)]


def config(algo="grpo", buckets=0, refill=False, leftover="drop", **kw):
  rollout = RolloutConfig(max_new_tokens=N, length_buckets=buckets, refill=refill,
                          refill_leftover=leftover)
  if algo == "grpo":
    section = GRPOConfig(steps=3, batch_size=2 if refill else 4, num_samples=4, optim=OPT,
                         eval_every=0, reward=RewardConfig(sources=("rule:exact_match",)), **kw)
  else:
    section = PPOConfig(steps=3, batch_size=4, num_samples=2, optim=OPT, eval_every=0,
                        num_minibatches=2, ppo_epochs=2,
                        reward=RewardConfig(sources=("rule:exact_match",)), **kw)
  return ExperimentConfig(model=MODEL, data=DATA, rollout=rollout, stages=(algo,),
                          **{algo: section})


def run_steps(cfg, m, algo="grpo", steps=3):
  stage = build_stage(algo, cfg, m, DataSource(cfg.data, cfg.seed))
  state, frozen = stage.init(jax.random.key(0), {})
  state, frozen, levels = with_length_model(stage, state, frozen, N)
  out, fn = [], None
  for step in range(steps):
    batch = stage.batch(step)
    lengths = np.resize(STOP_AT[step], batch["prompt"].shape[0])
    batch = put_batch(m, set_lengths(batch, levels, lengths))
    with jax.set_mesh(m):
      fn = fn or stage.make_step_fn(state, frozen, batch)
      state, metrics = fn(state, frozen, batch)
    out.append({k: float(v) for k, v in jax.device_get(metrics).items()})
  return fn, state, out


def _same(a, b, rtol=2e-5, atol=1e-6):
  (_, s1, m1), (_, s2, m2) = a, b
  for step, (x, y) in enumerate(zip(m1, m2)):
    for k in x:
      if k.startswith(("time/", "memory/")) or k == "rollout/update_width":
        continue
      np.testing.assert_allclose(y[k], x[k], rtol=rtol, atol=atol, err_msg=f"step {step} {k}")
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=rtol, atol=atol),
               jax.device_get(s1.params), jax.device_get(s2.params))


def test_bucket_widths():
  assert program.bucket_widths(128, 0) == ()
  assert program.bucket_widths(128, 4) == (32, 64, 96, 128)
  assert program.bucket_widths(10, 3) == (4, 8, 10)
  assert program.bucket_widths(5, 5) == (1, 2, 3, 4, 5)


def test_trim_keeps_every_real_token_an_episode_row_holds():
  """The width holds the last real token of any row, an observation after the last action
  included (an episode's mask covers observations, its response mask the actions only)."""
  import jax.numpy as jnp
  from jaxrlhf.train.types import Rollout
  P_, N_ = 3, 16
  mask = np.zeros((2, P_ + N_), bool)
  mask[:, :P_] = True
  mask[0, P_:P_ + 4] = True  # row 0: a 4-token response
  mask[1, P_:P_ + 9] = True  # row 1: an action (2 tokens) and an observation (7)
  resp = mask[:, P_:].copy()
  resp[1, 2:] = False
  ro = Rollout(tokens_BT=jnp.arange(2 * (P_ + N_)).reshape(2, -1), mask_BT=jnp.asarray(mask),
               response_mask_BN=jnp.asarray(resp), behaviour_logp_BN=jnp.ones((2, N_)),
               lengths_B=jnp.asarray([4, 9]), finished_B=jnp.ones((2,), bool))
  cut, width = program.trim_rollout(ro, program.bucket_widths(N_, 4))
  assert width == 12  # 9 used slots: the third bucket of 4
  assert cut.tokens_BT.shape == (2, P_ + 12) and cut.behaviour_logp_BN.shape == (2, 12)
  np.testing.assert_array_equal(cut.tokens_BT, np.asarray(ro.tokens_BT)[:, :P_ + 12])
  np.testing.assert_array_equal(cut.mask_BT, mask[:, :P_ + 12])
  np.testing.assert_array_equal(cut.lengths_B, [4, 9])  # per-row fields stay whole
  same, width = program.trim_rollout(ro, program.bucket_widths(N_, 2))
  assert width == 16 and same is ro  # the full width: nothing to cut


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_bucketed_steps_equal_full_width_and_compile_once_per_width(algo):
  """Three steps (GRPO: group advantages and the KL in the loss; PPO: values, GAE, two
  epochs of two minibatches) with buckets of 4 slots equal the full 16-slot steps: metrics and
  parameters to float rounding.  Widths 8, 12, 8: the update compiles twice, not thrice."""
  full = run_steps(config(algo), mesh(), algo)
  cut = run_steps(config(algo, buckets=4), mesh(), algo)
  assert [m["rollout/update_width"] for m in cut[2]] == [8.0, 12.0, 8.0]
  assert all("rollout/update_width" not in m for m in full[2])
  _same(full, cut)
  assert cut[0].jitted["after_host"]._cache_size() == 2


@pytest.mark.parametrize("leftover", ["drop", pytest.param("carry", marks=pytest.mark.slow)])
def test_bucketed_refill_step_on_dp2_tp2_equals_full_width_on_one_device(leftover):
  """Refill's batches are the short groups: cut to their width on a dp=2 x tp=2 mesh, the
  step equals the full-width step on one device (with carry-over too: the carried answers
  travel in the rollout uncut)."""
  full = run_steps(config(refill=True, leftover=leftover), mesh(), steps=2)
  cut = run_steps(config(buckets=4, refill=True, leftover=leftover), mesh(dp=2, tp=2), steps=2)
  assert all(m["rollout/update_width"] < N for m in cut[2])
  _same(full, cut, rtol=2e-4, atol=2e-5)


def test_out_of_range_buckets_are_refused_with_the_fix():
  with pytest.raises(ConfigError, match=r"rollout.length_buckets.*\[0, rollout.max_new_tokens"):
    validate(config(buckets=N + 1))
  # The pools take them (tests/test_pools.py, buckets and packing).
  from jaxrlhf.pools import common
  common.check_config(dataclasses.replace(config("ppo", buckets=4), stages=("ppo",)))
