"""Short learning tests with fixed seeds: each algorithm measurably improves what it optimises.

A tiny model on 1-digit addition (fixed-width, e.g. ``3+4=07``); SFT is kept short so that the
RL stages start weak and have room to improve.
"""

import dataclasses

import numpy as np
import pytest

from helpers import mesh
from jaxrlhf.config import (DPOConfig, GRPOConfig, KLConfig, KTOConfig, OptimizerConfig, PPOConfig,
                            RewardConfig)
from test_train import OPT, config, run_steps

FAST = OptimizerConfig(lr=3e-3, warmup_steps=0, schedule="constant")


def _cfg(**changes):
  cfg = config(**changes)
  return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_size=64))


def _sft_policy(steps=40):
  cfg = _cfg()
  cfg = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, steps=steps, batch_size=64,
                                                         optim=FAST))
  stage, state, frozen, metrics = run_steps(cfg, "sft", mesh(), steps=steps)
  return stage, state, metrics


def test_sft_loss_falls():
  _, _, metrics = _sft_policy(40)
  first = np.mean([m["loss"] for m in metrics[:5]])
  last = np.mean([m["loss"] for m in metrics[-5:]])
  assert last < 0.6 * first, (first, last)


def test_dpo_raises_preference_margin_and_accuracy():
  cfg = _cfg(dpo=DPOConfig(steps=25, batch_size=16, beta=0.1, optim=FAST, eval_every=0))
  stage, state, frozen, metrics = run_steps(cfg, "dpo", mesh(), steps=25)
  first = np.mean([m["reward_margin"] for m in metrics[:3]])
  last = np.mean([m["reward_margin"] for m in metrics[-5:]])
  assert last > first + 0.1, (first, last)
  ev = stage.evaluate(state, frozen)  # held-out pairs: the implicit reward prefers the right sum
  assert ev["eval/pair_accuracy"] > 0.7 and ev["eval/reward_margin"] > 0.1, ev


def test_grpo_raises_mean_rule_reward():
  stage_sft, state_sft, _ = _sft_policy(40)
  roles = {"policy": state_sft.params["policy"]}
  cfg = _cfg(grpo=GRPOConfig(steps=20, batch_size=8, num_samples=8, optim=OPT, eval_every=0,
                             kl=KLConfig(coef=0.0, estimator="k3", placement="loss"),
                             reward=RewardConfig(sources=("rule:token_accuracy",))))
  cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(
      cfg.grpo, optim=OptimizerConfig(lr=2e-3, warmup_steps=0, schedule="constant")))
  stage, state, frozen, metrics = run_steps(cfg, "grpo", mesh(), steps=20, roles=roles)
  first = np.mean([m["reward/mean"] for m in metrics[:5]])
  last = np.mean([m["reward/mean"] for m in metrics[-5:]])
  assert last > first + 0.05, (first, last)


@pytest.mark.parametrize("shared", [False, True], ids=["separate_value_model", "shared_backbone"])
def test_ppo_value_loss_falls_and_reward_rises(shared):
  stage_sft, state_sft, _ = _sft_policy(40)
  roles = {"policy": state_sft.params["policy"]}
  # A shared backbone takes the value loss's gradients too: a smaller vf_coef keeps them from
  # swamping the policy's.
  cfg = _cfg(ppo=PPOConfig(steps=20, batch_size=32, optim=OptimizerConfig(
      lr=2e-3, warmup_steps=0, schedule="constant"), value_optim=FAST, eval_every=0,
      kl=KLConfig(coef=0.01), reward=RewardConfig(sources=("rule:token_accuracy",)),
      shared_backbone=shared, vf_coef=0.1 if shared else PPOConfig.vf_coef))
  stage, state, frozen, metrics = run_steps(cfg, "ppo", mesh(), steps=20, roles=roles)
  v_first = np.mean([m["value/loss"] for m in metrics[:3]])
  v_last = np.mean([m["value/loss"] for m in metrics[-3:]])
  r_first = np.mean([m["reward/mean"] for m in metrics[:5]])
  r_last = np.mean([m["reward/mean"] for m in metrics[-5:]])
  assert v_last < v_first, (v_first, v_last)
  assert r_last > r_first + 0.05, (r_first, r_last)


# Issue 26: each new policy loss / RL setting raises the rule reward from the same short SFT,
# and each new preference loss raises its margin and held-out pair accuracy.
RL_VARIANTS = {
    "gspo": dict(policy_loss="gspo", clip_low=3e-4, clip_high=4e-4,
                 loss_agg="seq_mean_token_mean"),
    "gspo_token": dict(policy_loss="gspo_token", clip_low=3e-4, clip_high=4e-4,
                       loss_agg="seq_mean_token_mean"),
    "cispo": dict(policy_loss="cispo", clip_low=1.0, clip_high=0.28, num_minibatches=2),
    # DAPO: clip-higher, token-level aggregation, dynamic sampling, overlong shaping, no KL.
    "dapo": dict(clip_high=0.28, dynamic_sampling=True, max_oversample=2.0,
                 reward=RewardConfig(sources=("rule:token_accuracy",), overlong_buffer=1,
                                     overlong_penalty=0.5)),
    "tis": dict(off_policy="tis", num_minibatches=2),
    "seq_mis": dict(off_policy="seq_mis", off_policy_cap=3.0, num_minibatches=2),
}


# 40-77 s each on 2 shared CPU cores (load 9): slow.
@pytest.mark.slow
@pytest.mark.parametrize("variant", list(RL_VARIANTS))
def test_new_rl_settings_raise_mean_rule_reward(variant):
  stage_sft, state_sft, _ = _sft_policy(40)
  roles = {"policy": state_sft.params["policy"]}
  base = GRPOConfig(steps=20, batch_size=8, num_samples=8, eval_every=0,
                    kl=KLConfig(coef=0.0, estimator="k3", placement="loss"),
                    reward=RewardConfig(sources=("rule:token_accuracy",)),
                    optim=OptimizerConfig(lr=2e-3, warmup_steps=0, schedule="constant"))
  cfg = _cfg(grpo=dataclasses.replace(base, **RL_VARIANTS[variant]))
  stage, state, frozen, metrics = run_steps(cfg, "grpo", mesh(), steps=20, roles=roles)
  first = np.mean([m["reward/mean"] for m in metrics[:5]])
  last = np.mean([m["reward/mean"] for m in metrics[-5:]])
  assert last > first + 0.05, (variant, first, last)
  if variant == "dapo":
    assert all(m["dynamic/generated_groups"] == 16 for m in metrics)
    assert all(m["dynamic/kept_groups"] + m["dynamic/shortfall_groups"] == 8 for m in metrics)
  if "off_policy" in RL_VARIANTS[variant]:
    assert all(np.isfinite(m["off_policy/is_weight_mean"]) for m in metrics)


@pytest.fixture(scope="module")
def sft_policy():
  return {"policy": _sft_policy(40)[1].params["policy"]}


# Reference-free losses from a random start barely separate the held-out pairs in 25 steps
# (SimPO 0.56, ORPO 0.59): from the short SFT's policy, as in the tiny experiments, they do.
@pytest.mark.slow  # 43-71 s each on 2 shared CPU cores
@pytest.mark.parametrize("loss,beta", [("simpo", 2.0), ("orpo", 1.0), ("kto", 0.1)])
def test_new_preference_losses_raise_pair_accuracy_over_their_sft_start(loss, beta, sft_policy):
  if loss == "kto":
    name, cfg = "kto", _cfg(kto=KTOConfig(steps=25, batch_size=32, beta=beta, optim=FAST,
                                          eval_every=0))
  else:
    name, cfg = "dpo", _cfg(dpo=DPOConfig(steps=25, batch_size=16, beta=beta, loss=loss,
                                          simpo_gamma=0.5, optim=FAST, eval_every=0))
  stage0, state0, frozen0, _ = run_steps(cfg, name, mesh(), steps=0, roles=sft_policy)
  start = stage0.evaluate(state0, frozen0)["eval/pair_accuracy"]
  stage, state, frozen, metrics = run_steps(cfg, name, mesh(), steps=25, roles=sft_policy)
  assert ("reference" in frozen) == (loss == "kto")  # SimPO and ORPO: one model in memory
  end = stage.evaluate(state, frozen)["eval/pair_accuracy"]
  # Measured: SimPO 0.625 -> 0.719, ORPO 0.625 -> 0.734, KTO 0.0 (policy = reference: ties
  # count as wrong) -> 0.609.
  assert end > max(start + 0.05, 0.55), (loss, start, end)
  if loss == "kto":
    assert all(m["kl"] >= 0 for m in metrics)
    gap = [m["chosen_reward"] - m["rejected_reward"] for m in metrics]
    assert np.mean(gap[-5:]) > np.mean(gap[:3]) + 0.05, gap
