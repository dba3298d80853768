"""Issue 26's algorithms as settings of the existing specs: the config checks name the field and
the fix, the reference-free preference losses drop the reference from the roles and from the
plan, and each RL setting adds its phase (and only then) with its metrics."""

import dataclasses

import pytest

from jaxrlhf import hardware, plan, registry
from jaxrlhf.config import (ConfigError, DPOConfig, ExperimentConfig, MeshConfig,
                            PoolsConfig, RewardConfig, validate)
from jaxrlhf.train import spec
from test_plan import SMALL, SMALL_SFT


def _grpo(**changes):
  cfg = registry.get("tiny_grpo")
  return dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, **changes))


@pytest.mark.parametrize("changes,match", [
    (dict(policy_loss="gspo", dual_clip=3.0), r"grpo.dual_clip=3.0: applies to "
     r"grpo.policy_loss=ppo only; set it to 0 for 'gspo'"),
    (dict(clip_low=1.0), r"grpo.clip_low=1.0: must be < 1 .* only grpo.policy_loss=cispo"),
    (dict(clip_high=-0.1), r"grpo.clip_high=-0.1: must be a number >= 0"),
    (dict(off_policy="tis", off_policy_cap=1.0), r"grpo.off_policy_cap=1.0: must be a number > 1"),
    (dict(dynamic_sampling=True, max_oversample=0.5), r"grpo.max_oversample=0.5: must be"),
    (dict(dynamic_sampling=True, num_samples=1, advantage="reinforce_pp"),
     r"grpo.num_samples=1: must be >= 2 for grpo.dynamic_sampling"),
    (dict(reward=RewardConfig(sources=("rule:exact_match",), overlong_buffer=9)),
     r"grpo.reward.overlong_buffer=9: must be in \[0, rollout.max_new_tokens=5\]"),
])
def test_bad_settings_name_the_field_and_the_fix(changes, match):
  with pytest.raises(ConfigError, match=match):
    validate(_grpo(**changes))


def test_good_settings_pass_and_off_policy_excludes_the_pools_correction():
  for name in ("tiny_gspo", "tiny_cispo", "tiny_dapo", "tiny_simpo", "tiny_orpo", "tiny_kto"):
    validate(registry.get(name))
  validate(_grpo(off_policy="seq_mis", off_policy_cap=3.0))
  cfg = dataclasses.replace(_grpo(off_policy="tis"), pools=PoolsConfig(is_correction=2.0))
  with pytest.raises(ConfigError, match=r"grpo.off_policy='tis': and pools.is_correction=2.0 "
                                        r"both correct the same lag"):
    validate(cfg)
  dpo = registry.get("tiny_simpo")
  with pytest.raises(ConfigError, match=r"dpo.reference='cache': dpo.loss='simpo' reads no "
                                        r"reference model; leave dpo.reference=step"):
    validate(dataclasses.replace(dpo, dpo=dataclasses.replace(dpo.dpo, reference="cache")))


def _pref(loss):
  return dataclasses.replace(SMALL_SFT, name="small_pref", stages=("dpo",),
                             dpo=DPOConfig(steps=10, batch_size=8, loss=loss))


def test_reference_free_losses_drop_the_reference_role():
  for loss, ref in (("sigmoid", True), ("ipo", True), ("simpo", False), ("orpo", False)):
    assert ("reference" in spec.get("dpo").roles(_pref(loss))) == ref, loss
  assert "reference" in spec.get("kto").roles(_pref("sigmoid"))


@pytest.mark.parametrize("loss,models", [("sigmoid", 2), ("simpo", 1)])
def test_reference_free_plan_holds_one_model(loss, models):
  p = plan.build_plan(_pref(loss), 2, hardware.get_accelerator("h100"), full=False,
                      mesh_cfg=MeshConfig(dp=1, fsdp=1, tp=2))
  (stage,) = p.stages
  assert len(stage.models_in_memory) == models, stage.models_in_memory
  assert any("reference" in k for k in stage.consumers) == (models == 2)


def test_phases_appear_only_when_asked():
  from jaxrlhf.train.phases import rl_phases
  names = lambda scfg: [p.name for p in rl_phases(("policy",), ("policy",), scfg)]
  base = _grpo().grpo
  assert "select" not in names(base) and "off_policy" not in names(base)
  assert names(dataclasses.replace(base, dynamic_sampling=True)).index("select") == 4
  got = names(dataclasses.replace(base, off_policy="mis"))
  assert got.index("off_policy") == got.index("shape") + 1


def test_unpaired_jsonl_for_kto_and_pairs_derived_examples(tmp_path):
  import json

  from jaxrlhf.config import DataConfig
  from jaxrlhf.data import DataSource, read_examples
  rows = [{"prompt": "1+1=", "completion": "02", "label": True, "id": 7},
          {"prompt": "1+1=", "completion": "03", "label": False}]
  path = tmp_path / "kto.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  got = read_examples(str(path), "unpaired")
  assert [(e.completion, e.label) for e in got] == [("02", True), ("03", False)]
  assert got[0].record() == {"prompt": "1+1=", "answer": "", "completion": "02", "label": True,
                             "id": 7}
  (tmp_path / "bad.jsonl").write_text(json.dumps({**rows[0], "label": "yes"}) + "\n")
  with pytest.raises(ConfigError, match=r'bad.jsonl:1: field "label" is .*not true or false'):
    read_examples(str(tmp_path / "bad.jsonl"), "unpaired")
  cfg = DataConfig(task="jsonl", unpaired_path=str(path), max_prompt_len=8, max_response_len=4)
  src = DataSource(cfg)
  b = src.encoder.unpaired(src.examples("unpaired", 0, 4))
  assert b["completion"].shape == (4, 12) and b["label"].dtype == bool
  # Without a file: each pair's two sides, the chosen one desirable.
  add = DataSource(DataConfig(max_prompt_len=8, max_response_len=5))
  ex = add.examples("unpaired", 0, 6)
  pairs = add.examples("pairs", 0, 3)
  assert [e.label for e in ex] == [True, False] * 3
  assert [e.completion for e in ex[::2]] == [p.chosen for p in pairs]
  assert [e.completion for e in ex[1::2]] == [p.rejected for p in pairs]


def test_kto_checks():
  cfg = registry.get("tiny_kto")
  bad = dataclasses.replace(cfg, kto=dataclasses.replace(
      cfg.kto, optim=dataclasses.replace(cfg.kto.optim, grad_accum=2)))
  with pytest.raises(ConfigError, match=r"kto.optim.grad_accum=2: must be 1 for KTO"):
    validate(bad)


@pytest.mark.slow  # 71 s on 2 shared cores: one program per timing group
def test_dynamic_sampling_and_off_policy_run_as_timed_phases():
  """The new phases compose like the others: a timed step (each group its own program) runs
  the over-sampled generation, the selection and the correction, with their counts."""
  from helpers import mesh
  from test_train import config, run_steps
  cfg = config()
  cfg = dataclasses.replace(
      cfg, logging=dataclasses.replace(cfg.logging, phase_timing=True),
      grpo=dataclasses.replace(cfg.grpo, batch_size=4, num_samples=4, dynamic_sampling=True,
                               max_oversample=1.5, off_policy="seq_tis",
                               reward=RewardConfig(sources=("rule:token_accuracy",),
                                                   overlong_buffer=2)))
  stage, state, frozen, (m,) = run_steps(cfg, "grpo", mesh(), steps=1)
  assert stage.batch_shapes()["prompt"][0][0] == 6  # ceil(4 x 1.5) prompts generated
  assert m["dynamic/generated_groups"] == 6 and m["dynamic/kept_groups"] <= 4
  assert m["dynamic/kept_groups"] + m["dynamic/shortfall_groups"] == 4
  assert {"time/phase/select_s", "off_policy/is_weight_mean"} <= set(m), sorted(m)


def test_dpo_sft_weight_adds_the_chosen_token_nll_and_is_refused_with_orpo():
  """RPO: ``dpo.sft_weight`` x the chosen side's per-token NLL on top of the DPO loss (its
  gradient too); ORPO has its own SFT term, so the two are refused together."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxrlhf.algorithms import dpo_loss
  from jaxrlhf.train.dpo import preference_loss
  pc, pr = jnp.asarray([-3.0, -5.0]), jnp.asarray([-4.0, -2.0])
  rc, rr = jnp.asarray([-3.5, -4.0]), jnp.asarray([-3.0, -2.5])
  # Chosen responses of 3 and 1 tokens after a 2-token prompt.
  b = {"chosen_loss_mask": jnp.asarray([[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]], bool),
       "rejected_loss_mask": jnp.asarray([[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]], bool)}
  scfg = DPOConfig(beta=0.2, sft_weight=0.5)
  base, _ = dpo_loss(pc, pr, rc, rr, beta=0.2)
  loss, m = preference_loss(scfg, pc, pr, rc, rr, b)
  nll = (3.0 + 5.0) / 4  # 4 chosen tokens
  np.testing.assert_allclose(m["nll"], nll, rtol=1e-6)
  np.testing.assert_allclose(loss, base + 0.5 * nll, rtol=1e-6)
  g = jax.grad(lambda x: preference_loss(scfg, x, pr, rc, rr, b)[0])(pc)
  g0 = jax.grad(lambda x: dpo_loss(x, pr, rc, rr, beta=0.2)[0])(pc)
  np.testing.assert_allclose(g, g0 - 0.5 / 4, rtol=1e-6)
  cfg = _pref("orpo")
  with pytest.raises(ConfigError, match=r"dpo.sft_weight.*dpo.loss=orpo has its own SFT term"):
    validate(dataclasses.replace(cfg, dpo=dataclasses.replace(cfg.dpo, sft_weight=1.0)))


@pytest.mark.parametrize("value", [0.5, 0.9, -0.1, float("nan")])
def test_dpo_label_smoothing_outside_its_range_is_refused(value):
  """cDPO's label smoothing is the chance a pair's label is wrong: at 0.5 or more the loss
  would prefer the rejected side (or ignore every pair); a NaN would poison it."""
  cfg = _pref("cdpo")
  with pytest.raises(ConfigError, match=r"dpo.label_smoothing=.*must be in \[0, 0.5\)"):
    validate(dataclasses.replace(cfg, dpo=dataclasses.replace(cfg.dpo, label_smoothing=value)))
  validate(dataclasses.replace(cfg, dpo=dataclasses.replace(cfg.dpo, label_smoothing=0.1)))
