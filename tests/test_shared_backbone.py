"""PPO with ``ppo.shared_backbone=true``: one model with an LM head and a value head, the value
loss training the shared backbone; sharded like any other step, and it still learns."""

import dataclasses

import jax
import numpy as np
import pytest

from helpers import mesh
from jaxrlhf.config import ConfigError, KLConfig, OptimizerConfig, PPOConfig, RewardConfig
from jaxrlhf.data import DataSource
from jaxrlhf.train.pipeline import stage_class
from jaxrlhf.train.stage import convert_head
from test_learning import FAST, _cfg, _sft_policy
from test_train import config, run_steps


def shared(cfg, **ppo):
  return dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, shared_backbone=True, **ppo))


def test_one_model_with_both_heads_and_no_value_role():
  cfg = shared(config())
  stage, state, _, metrics = run_steps(cfg, "ppo", mesh(), steps=1)
  assert set(state.params) == {"policy"} and set(state.opt_state) == {"policy"}
  policy = state.params["policy"]
  assert "score" in policy and ("unembed" in policy or cfg.model.tie_embeddings)
  assert np.isfinite(metrics[0]["value/loss"]) and metrics[0]["value/loss"] > 0
  # The value head was trained (it starts at zero) and the result converts back to either head.
  assert float(np.abs(jax.device_get(policy["score"]["w"])).sum()) > 0
  assert "score" not in convert_head(policy, cfg.model, "lm")
  assert "unembed" not in convert_head(policy, cfg.model, "scalar")


def test_value_loss_trains_the_shared_backbone():
  """With vf_coef=0 the backbone sees only the policy loss; with vf_coef>0 the value loss's
  gradients change it as well (with separate models they never could)."""
  base = shared(config())
  _, s0, _, _ = run_steps(shared(base, vf_coef=0.0), "ppo", mesh(), steps=1)
  _, s1, _, _ = run_steps(shared(base, vf_coef=1.0), "ppo", mesh(), steps=1)
  w0 = jax.device_get(s0.params["policy"]["layers"]["w_up"])
  w1 = jax.device_get(s1.params["policy"]["layers"]["w_up"])
  assert np.abs(w1 - w0).max() > 1e-6


def test_shared_step_on_dp2_tp2_equals_single_device():
  cfg = shared(config())
  _, s1, _, m1 = run_steps(cfg, "ppo", mesh())
  _, s2, _, m2 = run_steps(cfg, "ppo", mesh(dp=2, tp=2))
  for k in ("loss", "value/loss", "reward/mean", "kl/mean"):
    np.testing.assert_allclose(m2[0][k], m1[0][k], rtol=2e-4, atol=2e-5, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5),
               jax.device_get(s2.params), jax.device_get(s1.params))


def test_a_different_value_model_is_refused():
  cfg = shared(config())
  cfg = dataclasses.replace(cfg, value_model=dataclasses.replace(cfg.model, d_model=64))
  with pytest.raises(ConfigError, match="value_model must be unset"):
    stage_class("ppo")(cfg, mesh(), DataSource(cfg.data, cfg.seed))


def test_shared_ppo_value_loss_falls_and_reward_rises():
  _, state_sft, _ = _sft_policy(40)
  cfg = _cfg(ppo=PPOConfig(steps=20, batch_size=32, optim=OptimizerConfig(
      lr=2e-3, warmup_steps=0, schedule="constant"), value_optim=FAST, eval_every=0,
      kl=KLConfig(coef=0.01), reward=RewardConfig(sources=("rule:token_accuracy",)),
      shared_backbone=True, vf_coef=0.1))
  _, _, _, metrics = run_steps(cfg, "ppo", mesh(), steps=20,
                               roles={"policy": state_sft.params["policy"]})
  v_first = np.mean([m["value/loss"] for m in metrics[:3]])
  v_last = np.mean([m["value/loss"] for m in metrics[-3:]])
  r_first = np.mean([m["reward/mean"] for m in metrics[:5]])
  r_last = np.mean([m["reward/mean"] for m in metrics[-5:]])
  assert v_last < v_first, (v_first, v_last)
  assert r_last > r_first + 0.05, (r_first, r_last)
