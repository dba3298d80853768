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
  ev = stage.evaluation(frozen)(state)  # held-out pairs: the implicit reward prefers the right sum
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
  start = stage0.evaluation(frozen0)(state0)["eval/pair_accuracy"]
  stage, state, frozen, metrics = run_steps(cfg, name, mesh(), steps=25, roles=sft_policy)
  assert ("reference" in frozen) == (loss == "kto")  # SimPO and ORPO: one model in memory
  end = stage.evaluation(frozen)(state)["eval/pair_accuracy"]
  # Measured: SimPO 0.625 -> 0.719, ORPO 0.625 -> 0.734, KTO 0.0 (policy = reference: ties
  # count as wrong) -> 0.609.
  assert end > max(start + 0.05, 0.55), (loss, start, end)
  if loss == "kto":
    assert all(m["kl"] >= 0 for m in metrics)
    gap = [m["chosen_reward"] - m["rejected_reward"] for m in metrics]
    assert np.mean(gap[-5:]) > np.mean(gap[:3]) + 0.05, gap


# ----------------------------------------------------------------- the tiny experiments
# Issue 30: the README's learning figures are the median and range of six runs (seeds 0-2 x
# AVX2 / native codegen, benchmarks/learning_matrix.py), kept in jaxrlhf/learning_results.json;
# the claims (jaxrlhf/results.py CLAIMS) are what every machine must reproduce.

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from jaxrlhf import results as R  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_documented_runs_are_the_full_matrix():
  """Every experiment with claims has its six runs documented, each with every claimed
  metric (the README says in how many of them each claim held)."""
  measured = R.load_measured()
  want = {f"{s}/{isa}" for s in R.SEEDS for isa in R.ISAS}
  assert set(measured["runs"]) == set(R.CLAIMS), sorted(measured["runs"])
  for experiment, by_run in measured["runs"].items():
    assert set(by_run) == want, (experiment, sorted(by_run))
    for run, m in by_run.items():
      for metric, value, needed, rule, ok in R.check_claims(experiment, m):
        assert value == value and needed == needed, (experiment, run, metric)  # not NaN


def test_the_documented_figures_are_of_the_experiments_as_registered():
  """Changing a tiny experiment's settings without measuring the matrix again fails here."""
  from jaxrlhf import registry
  from jaxrlhf.config import to_dict
  measured = R.load_measured()
  for experiment in measured["runs"]:
    got = R.config_sha(json.loads(json.dumps(to_dict(registry.get(experiment)))))
    assert got == measured["config_sha"][experiment], (
        f"{experiment}'s settings changed since its figures in {R.MEASURED_FILE} were "
        "measured: run `python -m benchmarks.learning_matrix --write` and update docs/results.md's and README.md's "
        "results tables from `python -m benchmarks.learning_matrix --markdown`")


def test_the_results_tables_are_printed_from_the_documented_figures():
  """docs/results.md has the whole table, the README the rows that carry a claim."""
  sys.path.insert(0, ROOT)
  from benchmarks.learning_matrix import markdown
  for page, claims_only in (("docs/results.md", False), ("README.md", True)):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
      text = f.read()
    table = markdown(R.load_measured(), claims_only=claims_only)
    assert table in text, (f"{page}'s learning table differs from `python -m "
                           "benchmarks.learning_matrix --markdown`:\n" + table)


def _summary(sft, end, stage="grpo", **extra):
  return {"sft": {"eval/accuracy": sft, "steps": 200}, stage: {"eval/accuracy": end, **extra},
          f"{stage}/start": {"eval/accuracy": sft}}


def test_the_report_places_a_run_against_the_documented_range():
  measured = {"setup": {"seeds": [0, 1, 2], "isas": {"avx2": "", "native": ""}},
              "config_sha": {"tiny_grpo": "x"},
              "runs": {"tiny_grpo": {"0/avx2": {"grpo/gain": 0.20, "grpo/accuracy": 0.7},
                                     "1/avx2": {"grpo/gain": 0.30, "grpo/accuracy": 0.8}}}}
  inside = "\n".join(R.compare("tiny_grpo", None, _summary(0.5, 0.75), measured))
  assert "grpo/gain" in inside and "inside" in inside and "claim grpo/gain" in inside
  assert "behaves as documented" in inside
  above = "\n".join(R.compare("tiny_grpo", None, _summary(0.5, 0.9), measured))
  assert "above" in above and "another seed or CPU codegen" in above
  low = "\n".join(R.compare("tiny_grpo", {"name": "tiny_grpo"}, _summary(0.5, 0.6), measured))
  assert "NOT MET" in low and "met in 2 of 2 documented runs" in low
  assert "settings differ" in low  # its config's fingerprint is not "x"
  assert "no documented learning results" in R.compare("tiny_kto", None, {}, measured)[0]


def test_ppo_claim_is_the_smaller_of_ten_points_and_half_the_remaining_errors():
  near = R.check_claims("tiny_ppo", {"sft/accuracy": 0.9, "ppo/gain": 0.06,
                                     "rm/pair_accuracy": 0.9})
  assert [r[4] for r in near] == [True, True] and abs(near[1][2] - 0.05) < 1e-9
  far = R.check_claims("tiny_ppo", {"sft/accuracy": 0.6, "ppo/gain": 0.09,
                                    "rm/pair_accuracy": 0.8})
  assert [r[4] for r in far] == [False, False] and far[1][2] == 0.10


# Each runs the experiment as a newcomer would (its own process, this machine's codegen, seed
# 0) and checks the README's claims: 2-4 minutes each on an idle 2-core CPU, more under load.
@pytest.mark.slow
@pytest.mark.parametrize("experiment", sorted(R.CLAIMS))
def test_the_tiny_experiment_meets_the_readme_claims(experiment, tmp_path):
  wd = str(tmp_path / experiment)
  proc = subprocess.run([sys.executable, "-m", "jaxrlhf.main", f"--experiment={experiment}",
                         f"--workdir={wd}"], cwd=ROOT, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(os.path.join(wd, "summary.json")) as f:
    m = R.measure(json.load(f))
  report = subprocess.run([sys.executable, "-m", "jaxrlhf.report", f"--workdir={wd}"],
                          cwd=ROOT, capture_output=True, text=True)
  failed = [f"{metric} {value:.3f} < {needed:.3f} ({rule})"
            for metric, value, needed, rule, ok in R.check_claims(experiment, m) if not ok]
  assert not failed, (failed, report.stdout[-2000:])
