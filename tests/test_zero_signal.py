"""Zero signal moves nothing: at policy = reference the KL and its gradient are exactly 0, and
an RL step whose advantages are all zero leaves every weight (and the optimizer) as it was."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import mesh
from jaxrlhf.config import KLConfig, RewardConfig
from jaxrlhf.train.common import apply_update
from test_train import MODEL, OPT, config, run_steps

# Every reward 0 (a source weighted 0): GRPO's group advantages are then all exactly 0.
NO_REWARD = RewardConfig(sources=("rule:exact_match",), weights=(0.0,))


def _rl(cfg, name, **changes):
  return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **changes)})


def _same(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(jax.device_get(a)),
                                                   jax.tree.leaves(jax.device_get(b))))


# Minibatches, micro-batches, bf16 compute with remat and packing each run the update's
# forward at other shapes than the reference phase's: before the KL's reference side was
# computed inside the update, each gave a KL gradient of ~1e-8 here (1e-6 on a real model).
@pytest.mark.parametrize("variant", ["minibatches", "bf16_remat_accum", "packed"])
def test_grpo_at_policy_equal_reference_has_zero_kl_and_leaves_the_weights(variant):
  opt = dataclasses.replace(OPT, weight_decay=0.1)  # AdamW's decay would move them too
  cfg = _rl(config(), "grpo", reward=NO_REWARD, num_minibatches=4, optim=opt)
  if variant == "bf16_remat_accum":
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(MODEL, compute_dtype="bfloat16",
                                                             remat="full"))
    cfg = _rl(cfg, "grpo", num_minibatches=2, optim=dataclasses.replace(opt, grad_accum=2))
  if variant == "packed":
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, pack=True))
  stage, state, _, out = run_steps(cfg, "grpo", mesh())
  m = out[0]
  assert stage.scfg.kl.placement == "loss" and stage.scfg.kl.estimator == "k3"
  assert m["kl/mean"] == 0.0 and m["kl/seq_sum"] == 0.0 and m["kl/loss"] == 0.0
  # The advantages are all 0, so the KL is the loss's only gradient.
  assert m["grad_norm"] == 0.0 and m["loss"] == 0.0
  assert m["skips/zero_grad"] == 1.0 and m["skips/total"] == 0.0
  start, _ = stage.init(jax.random.key(0), {})
  assert _same(state.params, start.params), "a step with no signal moved the weights"
  assert _same(state.opt_state, start.opt_state)


@pytest.mark.parametrize("placement", ["reward", "loss"])
def test_ppo_at_policy_equal_reference_has_zero_kl(placement):
  """PPO's KL in the reward (k1) reads the policy's teacher-forced log-probs, not the
  sampler's: exactly 0 at the start (the value baseline still moves the policy)."""
  # One minibatch of one epoch: with more, the first minibatch's update (the value baseline
  # gives non-zero advantages) makes the policy differ from the reference for the next.
  cfg = _rl(config(), "ppo", kl=KLConfig(coef=0.1, placement=placement,
                                         estimator="k1" if placement == "reward" else "k3"),
            num_minibatches=1, ppo_epochs=1)
  _, _, _, out = run_steps(cfg, "ppo", mesh())
  m = out[0]
  assert m["kl/mean"] == 0.0 and m["kl/seq_sum"] == 0.0
  if placement == "loss":
    assert m["kl/loss"] == 0.0


def test_a_zero_gradient_leaves_adamw_momentum_and_decay_unapplied():
  """Mid-run (moments non-zero), a zero gradient is no step: neither the moments nor the
  decoupled weight decay move the weights, and the optimizer's state and schedule stay."""
  params = {"w": jnp.arange(1.0, 5.0)}
  opt = optax.adamw(1e-2, weight_decay=0.1)
  state = opt.init(params)
  params, state, _, _ = apply_update(params, state, {"w": jnp.ones(4)}, jnp.float32(1.0), opt)
  new_params, new_state, finite, norm = apply_update(params, state, {"w": jnp.zeros(4)},
                                                     jnp.float32(0.0), opt)
  assert bool(finite) and float(norm) == 0.0
  assert _same(new_params, params) and _same(new_state, state)
  # A non-zero gradient is applied as before.
  moved, _, _, _ = apply_update(params, state, {"w": jnp.full(4, 1e-3)}, jnp.float32(0.0), opt)
  assert not np.array_equal(moved["w"], params["w"])


def test_the_real_model_at_policy_equal_reference_does_not_move(tmp_path):
  """On SmolLM2-135M (30 layers) the update's differentiated forward and a plain forward of
  the same weights differ by ~1e-6 per token even in the same program: the KL's reference
  side is the policy's own log-probs while the weights are equal, so a step with no reward
  signal has a gradient of exactly 0 and leaves all 134.5M weights as they were."""
  from helpers import real_model
  from jaxrlhf.config import DataConfig, ModelConfig, RolloutConfig
  from jaxrlhf.model import hf
  smol, why = real_model()
  if smol is None:
    pytest.skip(why)
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"prompt": "2+2=", "answer": "4"}\n{"prompt": "3+5=", "answer": "8"}\n')
  model = hf.config_from_hf(smol, ModelConfig(remat="none"))
  # The smoke run's row width (prompts of 64 + 16 new tokens): at the smallest widths XLA
  # happened to compile the two forwards alike.
  cfg = config(model=model, rollout=RolloutConfig(max_new_tokens=16),
               data=DataConfig(task="jsonl", tokenizer=smol, prompts_path=str(prompts),
                               max_prompt_len=64, max_response_len=16))
  cfg = _rl(cfg, "grpo", reward=NO_REWARD, batch_size=2, num_samples=4, num_minibatches=1)
  stage, state, frozen, out = run_steps(cfg, "grpo", mesh())
  m = out[0]
  assert m["kl/mean"] == 0.0 and m["kl/loss"] == 0.0
  assert m["grad_norm"] == 0.0 and m["skips/zero_grad"] == 1.0
  assert _same(state.params["policy"], frozen["reference"])
