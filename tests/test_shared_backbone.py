"""PPO with ``ppo.shared_backbone=true``: one model with an LM head and a value head, the value
loss training the shared backbone, sharded like any other step.  That it still learns is
tests/test_learning.py::test_ppo_value_loss_falls_and_reward_rises[shared_backbone]."""

import dataclasses

import jax
import numpy as np
import pytest

from helpers import mesh
from jaxrlhf.config import ConfigError, validate
from jaxrlhf.train.stage import convert_head
from test_train import config, run_steps


def shared(cfg, **ppo):
  return dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, shared_backbone=True, **ppo))


def test_one_model_two_heads_sharded_and_the_value_loss_trains_the_backbone():
  cfg = shared(config())
  _, s1, _, m1 = run_steps(cfg, "ppo", mesh())
  assert set(s1.params) == {"policy"} and set(s1.opt_state) == {"policy"}
  policy = s1.params["policy"]
  assert "score" in policy and ("unembed" in policy or cfg.model.tie_embeddings)
  assert np.isfinite(m1[0]["value/loss"]) and m1[0]["value/loss"] > 0
  # The value head was trained (it starts at zero) and the result converts back to either head.
  assert float(np.abs(jax.device_get(policy["score"]["w"])).sum()) > 0
  assert "score" not in convert_head(policy, cfg.model, "lm")
  assert "unembed" not in convert_head(policy, cfg.model, "scalar")

  # Sharded on (dp=2, tp=2), the same step.
  _, s2, _, m2 = run_steps(cfg, "ppo", mesh(dp=2, tp=2))
  for k in ("loss", "value/loss", "reward/mean", "kl/mean"):
    np.testing.assert_allclose(m2[0][k], m1[0][k], rtol=2e-4, atol=2e-5, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5),
               jax.device_get(s2.params), jax.device_get(s1.params))

  # With vf_coef=0 the backbone sees only the policy loss; with vf_coef>0 the value loss's
  # gradients change it as well (with separate models they never could).
  _, s0, _, _ = run_steps(shared(cfg, vf_coef=0.0), "ppo", mesh())
  w0 = jax.device_get(s0.params["policy"]["layers"]["w_up"])
  w1 = jax.device_get(policy["layers"]["w_up"])
  assert np.abs(w1 - w0).max() > 1e-6


def test_a_different_value_model_is_refused():
  cfg = shared(config())
  cfg = dataclasses.replace(cfg, stages=("ppo",),
                            value_model=dataclasses.replace(cfg.model, d_model=64))
  with pytest.raises(ConfigError, match="value_model must be unset"):
    validate(cfg)
